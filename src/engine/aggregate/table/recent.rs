//! [`Recent`]: the last `cap` entries put, by key, oldest forgotten first.
//!
//! The gate keeps the results of the call ids it decided, hundreds of
//! thousands deep and touched once or twice per call. The entries sit in
//! a ring in the order they were put (written in sequence, so cheap to
//! write), and the index is a table of 4-byte positions into it: about 5
//! bytes per entry, so a lookup's one random access mostly stays in the
//! cache (why not a hash map and a queue: `BENCHMARKS.md`, "the gate's
//! profile").

use std::hash::{BuildHasher, Hash};

use hashbrown::HashTable;

/// One place of the ring: the key's hash, the key and its value.
#[derive(Debug)]
struct Place<K, V> {
    hash: u64,
    key: K,
    value: V,
}

/// The last `cap` entries put, found by key; putting one more forgets the
/// oldest (see the module).
#[derive(Debug)]
pub struct Recent<K, V> {
    /// Positions in `ring`, by the hash of their key.
    index: HashTable<u32>,
    ring: Vec<Place<K, V>>,
    /// Where the next entry goes once the ring is full.
    next: usize,
    cap: usize,
    hasher: foldhash::fast::RandomState,
}

impl<K: Hash + Eq, V> Recent<K, V> {
    /// An empty memory of at most `cap` entries (at least one; at most
    /// `u32::MAX`).
    pub fn new(cap: usize) -> Self {
        Recent {
            index: HashTable::new(),
            ring: Vec::new(),
            next: 0,
            cap: cap.clamp(1, u32::MAX as usize),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    /// The hash a key is filed under here.
    pub fn hash_of<Q: Hash + ?Sized>(&self, key: &Q) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Entries held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.ring.len()
    }

    /// The value put under `key`.
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.get_hashed(self.hash_of(key), key)
    }

    /// [`Recent::get`] with the key's [`Recent::hash_of`] known.
    pub fn get_hashed<Q>(&self, hash: u64, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Eq + ?Sized,
    {
        let ring = &self.ring;
        let i = self.index.find(hash, |&i| {
            let place = &ring[i as usize];
            place.hash == hash && place.key.borrow() == key
        })?;
        Some(&ring[*i as usize].value)
    }

    /// Puts `value` under `key` (which must not be held already: the
    /// caller looked), forgetting the oldest entry when `cap` are held;
    /// returns the entry forgotten.
    #[cfg(test)]
    pub fn put(&mut self, key: K, value: V) -> Option<(K, V)> {
        self.put_hashed(self.hash_of(&key), key, value)
    }

    /// [`Recent::put`] with the key's [`Recent::hash_of`] known.
    pub fn put_hashed(&mut self, hash: u64, key: K, value: V) -> Option<(K, V)> {
        debug_assert_eq!(hash, self.hash_of(&key), "the key's hash");
        debug_assert!(self.get(&key).is_none(), "put twice");
        let place = Place { hash, key, value };
        let (i, forgotten) = if self.ring.len() < self.cap {
            self.ring.push(place);
            (self.ring.len() - 1, None)
        } else {
            let i = self.next;
            self.next = (i + 1) % self.cap;
            let old = std::mem::replace(&mut self.ring[i], place);
            if let Ok(e) = self.index.find_entry(old.hash, |&j| j as usize == i) {
                e.remove();
            }
            (i, Some((old.key, old.value)))
        };
        let ring = &self.ring;
        self.index
            .insert_unique(hash, i as u32, |&j| ring[j as usize].hash);
        forgotten
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, VecDeque};

    #[test]
    fn the_oldest_are_forgotten_first() {
        let mut r: Recent<String, u32> = Recent::new(3);
        for i in 0..3 {
            assert!(r.put(format!("k{i}"), i).is_none());
        }
        assert_eq!(r.put("k3".into(), 3), Some(("k0".into(), 0)));
        assert_eq!(r.get("k0"), None);
        assert_eq!(r.get("k1"), Some(&1));
        assert_eq!(r.len(), 3);
        assert_eq!(r.put("k4".into(), 4), Some(("k1".into(), 1)));
        assert_eq!((r.get("k3"), r.get("k4")), (Some(&3), Some(&4)));
    }

    /// Random puts and lookups agree with a map and a queue of keys, the
    /// layout this replaced.
    #[test]
    fn random_use_agrees_with_a_map_and_a_queue() {
        let cap = 37;
        let mut r: Recent<u64, u64> = Recent::new(cap);
        let mut map: HashMap<u64, u64> = HashMap::new();
        let mut order: VecDeque<u64> = VecDeque::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 101;
            if x.is_multiple_of(3) {
                assert_eq!(r.get(&key), map.get(&key), "step {step}");
            } else if !map.contains_key(&key) {
                let want = if order.len() == cap {
                    let old = order.pop_front().expect("full");
                    map.remove(&old).map(|v| (old, v))
                } else {
                    None
                };
                order.push_back(key);
                map.insert(key, step);
                assert_eq!(r.put(key, step), want, "step {step}");
            }
            assert_eq!(r.len(), map.len(), "step {step}");
        }
    }
}

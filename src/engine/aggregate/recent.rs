//! [`Recent`]: the last `cap` entries put, by key, oldest forgotten first.
//!
//! The gate keeps two such memories, each hundreds of thousands of entries
//! deep and touched once or twice per call: the results of the call ids it
//! decided and the reserves spent of counters past their time. Kept as a
//! hash map plus a queue of keys, each call cost a random access into a
//! table of 10 to 30 MB and a copy of its key. Here the entries sit in a
//! ring in the order they were put (written in sequence, so cheap to
//! write), and the index is a table of 4-byte positions into it: about
//! 5 bytes per entry, so a lookup's one random access mostly stays in the
//! cache.

use std::hash::{BuildHasher, Hash};

use hashbrown::HashTable;

/// One place of the ring: the key's hash, and the entry unless it was
/// taken out (a hole until the ring comes round to it).
#[derive(Debug)]
struct Place<K, V> {
    hash: u64,
    entry: Option<(K, V)>,
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
    live: usize,
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
            live: 0,
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
        self.live
    }

    /// Nothing held.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// The position of `key` (hashed to `hash`) in the ring.
    fn position<Q>(&self, hash: u64, key: &Q) -> Option<usize>
    where
        K: std::borrow::Borrow<Q>,
        Q: Eq + ?Sized,
    {
        let ring = &self.ring;
        self.index
            .find(hash, |&i| matches(&ring[i as usize], hash, key))
            .map(|&i| i as usize)
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
        if self.live == 0 {
            return None;
        }
        let i = self.position(hash, key)?;
        self.ring[i].entry.as_ref().map(|(_, v)| v)
    }

    /// Takes `key`'s entry out.
    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if self.live == 0 {
            return None;
        }
        let hash = self.hash_of(key);
        let ring = &self.ring;
        let found = self
            .index
            .find_entry(hash, |&i| matches(&ring[i as usize], hash, key))
            .ok()?;
        let (i, _) = found.remove();
        self.live -= 1;
        self.ring[i as usize].entry.take().map(|(_, v)| v)
    }

    /// Puts `value` under `key` (which must not be held already: the
    /// caller looked), forgetting the oldest entry when `cap` are held;
    /// returns the entry forgotten.
    pub fn put(&mut self, key: K, value: V) -> Option<(K, V)> {
        self.put_hashed(self.hash_of(&key), key, value)
    }

    /// [`Recent::put`] with the key's [`Recent::hash_of`] known.
    pub fn put_hashed(&mut self, hash: u64, key: K, value: V) -> Option<(K, V)> {
        debug_assert_eq!(hash, self.hash_of(&key), "the key's hash");
        debug_assert!(self.get(&key).is_none(), "put twice");
        let place = Place {
            hash,
            entry: Some((key, value)),
        };
        let (i, forgotten) = if self.ring.len() < self.cap {
            self.ring.push(place);
            (self.ring.len() - 1, None)
        } else {
            let i = self.next;
            self.next = (i + 1) % self.cap;
            let old = std::mem::replace(&mut self.ring[i], place);
            if old.entry.is_some() {
                self.unindex(old.hash, i);
            }
            (i, old.entry)
        };
        let ring = &self.ring;
        self.index
            .insert_unique(hash, i as u32, |&j| ring[j as usize].hash);
        self.live += 1;
        forgotten
    }

    /// Forgets the oldest entry held (holes skipped), returning it.
    #[cfg(test)]
    pub fn forget_oldest(&mut self) -> Option<(K, V)> {
        let n = self.ring.len();
        // (The oldest place is `next` once the ring is full, 0 before.)
        let start = if n < self.cap { 0 } else { self.next };
        for step in 0..n {
            let i = (start + step) % n;
            if let Some(entry) = self.ring[i].entry.take() {
                self.unindex(self.ring[i].hash, i);
                return Some(entry);
            }
        }
        None
    }

    /// Drops place `i` (hashed to `hash`) from the index: its entry is
    /// gone.
    fn unindex(&mut self, hash: u64, i: usize) {
        if let Ok(e) = self.index.find_entry(hash, |&j| j as usize == i) {
            e.remove();
        }
        self.live -= 1;
    }
}

/// `place` holds `key` (hashed to `hash`).
fn matches<K, V, Q>(place: &Place<K, V>, hash: u64, key: &Q) -> bool
where
    K: std::borrow::Borrow<Q>,
    Q: Eq + ?Sized,
{
    place.hash == hash && place.entry.as_ref().is_some_and(|(k, _)| k.borrow() == key)
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
        // A hole (taken out) is not forgotten again.
        assert_eq!(r.remove("k1"), Some(1));
        assert_eq!(r.len(), 2);
        assert_eq!(r.put("k4".into(), 4), None, "k1's place was a hole");
        assert_eq!(r.put("k5".into(), 5), Some(("k2".into(), 2)));
        assert_eq!(r.forget_oldest(), Some(("k3".into(), 3)));
        assert_eq!(r.get("k3"), None);
        assert_eq!((r.get("k4"), r.get("k5")), (Some(&4), Some(&5)));
    }

    /// Random puts, lookups and removals agree with a map and a queue of
    /// keys, the layout this replaced.
    #[test]
    fn random_use_agrees_with_a_map_and_a_queue() {
        let cap = 37;
        let mut r: Recent<u64, u64> = Recent::new(cap);
        // Key -> (value, its place); the places in order.
        let mut map: HashMap<u64, (u64, u64)> = HashMap::new();
        let mut order: VecDeque<(u64, u64)> = VecDeque::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 101;
            match x % 4 {
                0 => {
                    let want = map.remove(&key).map(|(v, _)| v);
                    assert_eq!(r.remove(&key), want, "step {step}");
                }
                1 => {
                    let want = map.get(&key).map(|(v, _)| v);
                    assert_eq!(r.get(&key), want, "step {step}");
                }
                _ if !map.contains_key(&key) => {
                    // The queue keeps the places of entries taken out (the
                    // ring's holes): popping one forgets nothing.
                    let want = if order.len() == cap {
                        let (old, place) = order.pop_front().expect("full");
                        match map.get(&old) {
                            Some(&(v, p)) if p == place => {
                                map.remove(&old);
                                Some((old, v))
                            }
                            _ => None,
                        }
                    } else {
                        None
                    };
                    order.push_back((key, step));
                    map.insert(key, (step, step));
                    assert_eq!(r.put(key, step), want, "step {step}");
                }
                _ => {}
            }
            assert_eq!(r.len(), map.len(), "step {step}");
        }
    }
}

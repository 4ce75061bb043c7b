//! Counters grouped by bucket: [`Buckets`] (the live counters of the gate
//! and of the in-process ledger) and [`SpentBuckets`] (the reserves spent
//! in counters past their time).
//!
//! A callee rule starts a counter for most calls (most callees are called
//! once in a bucket), and drops it `3 W + grace` later. Grouped by (rule,
//! window, bucket; why not one map of every counter: `BENCHMARKS.md`,
//! "the gate's profile"), a call's counter is
//! found in its bucket's table (the current bucket's, mostly: small and
//! warm), and a bucket's counters are dropped together: the table is
//! moved, or walked in order, never searched.

use std::collections::{BTreeMap, VecDeque};
use std::hash::{Hash, Hasher};

use compact_str::CompactString;
use hashbrown::hash_map::{Entry, EntryRef};
use hashbrown::{Equivalent, HashMap};

use super::table::Slab;
use super::CounterId;

/// A hash map with the hasher the gate uses.
pub(super) type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The counters of one bucket, by key (the callee; empty for a global
/// rule).
pub(super) type Counters<V> = Map<CompactString, V>;

/// One rule's window in one bucket: a [`CounterId`] without its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BucketId {
    rule: CompactString,
    window_ms: i64,
    bucket: i64,
}

impl BucketId {
    fn of(id: &CounterId) -> Self {
        BucketId {
            rule: id.rule.clone(),
            window_ms: id.window_ms,
            bucket: id.bucket,
        }
    }

    /// When (event time) the bucket ends.
    pub(super) fn end(&self) -> i64 {
        self.bucket.saturating_add(1).saturating_mul(self.window_ms)
    }
}

/// Hashes a bucket, the same for [`BucketId`] and [`BucketOf`]: by its
/// window and number only (rules of one window share hashes, and are told
/// apart by name: the rule's name is not hashed on every call).
fn hash_bucket<H: Hasher>(window_ms: i64, bucket: i64, state: &mut H) {
    window_ms.hash(state);
    bucket.hash(state);
}

impl Hash for BucketId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        hash_bucket(self.window_ms, self.bucket, state);
    }
}

/// The bucket of a counter, looked up without building a [`BucketId`].
struct BucketOf<'a>(&'a CounterId);

impl Hash for BucketOf<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        hash_bucket(self.0.window_ms, self.0.bucket, state);
    }
}

impl Equivalent<BucketId> for BucketOf<'_> {
    fn equivalent(&self, b: &BucketId) -> bool {
        self.0.bucket == b.bucket && self.0.window_ms == b.window_ms && self.0.rule == b.rule
    }
}

/// A live bucket: its counters, and whether it was kept past its time.
#[derive(Debug)]
struct Bucket<V> {
    counters: Counters<V>,
    kept: bool,
}

/// A bucket taken out when its time came.
#[derive(Debug)]
pub(super) struct Due<V> {
    /// When it was due (event time).
    pub at: i64,
    pub id: BucketId,
    pub counters: Counters<V>,
    /// It was kept past its time once already ([`Buckets::keep_longer`]).
    pub kept: bool,
}

/// Live counters by bucket, each bucket dropped when the newest event
/// time passes the time set when its first counter came.
#[derive(Debug)]
pub(super) struct Buckets<V> {
    live: Map<BucketId, Bucket<V>>,
    /// Buckets by the event time they are due at.
    due: BTreeMap<i64, Vec<BucketId>>,
    /// How many counters each rule's (name, window) last bucket taken out
    /// held: a new bucket of the rule is made that size.
    sizes: Map<(CompactString, i64), usize>,
}

impl<V> Default for Buckets<V> {
    fn default() -> Self {
        Buckets {
            live: Map::default(),
            due: BTreeMap::new(),
            sizes: Map::default(),
        }
    }
}

impl<V> Buckets<V> {
    /// The counter `id`.
    pub(super) fn get(&self, id: &CounterId) -> Option<&V> {
        self.live.get(&BucketOf(id))?.counters.get(id.key.as_str())
    }

    /// The counter `id`, to change.
    pub(super) fn get_mut(&mut self, id: &CounterId) -> Option<&mut V> {
        self.live
            .get_mut(&BucketOf(id))?
            .counters
            .get_mut(id.key.as_str())
    }

    /// Whether the counter `id` is here.
    pub(super) fn contains(&self, id: &CounterId) -> bool {
        self.get(id).is_some()
    }

    /// The counters of `id`'s bucket; a bucket new here is due at `due_at`
    /// and sized as the rule's last bucket taken out (a rule's buckets
    /// most often resemble each other). One lookup.
    fn bucket_mut(&mut self, id: &CounterId, due_at: i64) -> &mut Counters<V> {
        let bucket = match self.live.entry_ref(&BucketOf(id)) {
            EntryRef::Occupied(o) => o.into_mut(),
            EntryRef::Vacant(v) => {
                let bucket = BucketId::of(id);
                self.due.entry(due_at).or_default().push(bucket.clone());
                let size = self
                    .sizes
                    .get(&(bucket.rule.clone(), bucket.window_ms))
                    .copied()
                    .unwrap_or(0);
                let counters = Counters::with_capacity_and_hasher(size, Default::default());
                v.insert_with_key(
                    bucket,
                    Bucket {
                        counters,
                        kept: false,
                    },
                )
            }
        };
        &mut bucket.counters
    }

    /// The counter `id`, made by `make` if it is not here (a bucket new
    /// here is due at `due_at`).
    pub(super) fn get_or_insert_with(
        &mut self,
        id: &CounterId,
        due_at: i64,
        make: impl FnOnce() -> V,
    ) -> &mut V {
        let key = id.key.as_str();
        match self.bucket_mut(id, due_at).entry_ref(key) {
            EntryRef::Occupied(o) => o.into_mut(),
            EntryRef::Vacant(v) => v.insert_with_key(key.into(), make()),
        }
    }

    /// The counter `id`, or the one `make` gives when it is not here (none:
    /// nothing is put in). A bucket new here is due at `due_at` (and made
    /// even when `make` gives none).
    pub(super) fn get_or_try_insert(
        &mut self,
        id: &CounterId,
        due_at: i64,
        make: impl FnOnce() -> Option<V>,
    ) -> Option<&mut V> {
        let key = id.key.as_str();
        match self.bucket_mut(id, due_at).entry_ref(key) {
            EntryRef::Occupied(o) => Some(o.into_mut()),
            EntryRef::Vacant(v) => Some(v.insert_with_key(key.into(), make()?)),
        }
    }

    /// Puts the counter `id` in (over any it replaces; a bucket new here
    /// is due at `due_at`).
    pub(super) fn insert(&mut self, id: &CounterId, due_at: i64, value: V) {
        self.bucket_mut(id, due_at).insert(id.key.clone(), value);
    }

    /// Takes out the earliest bucket due before `now`, if any.
    pub(super) fn pop_due(&mut self, now: i64) -> Option<Due<V>> {
        loop {
            let mut first = self.due.first_entry()?;
            let at = *first.key();
            if at >= now {
                return None;
            }
            let Some(id) = first.get_mut().pop() else {
                first.remove();
                continue;
            };
            if first.get().is_empty() {
                first.remove();
            }
            if let Some(b) = self.live.remove(&id) {
                if !b.kept {
                    self.sizes
                        .insert((id.rule.clone(), id.window_ms), b.counters.len());
                }
                return Some(Due {
                    at,
                    id,
                    counters: b.counters,
                    kept: b.kept,
                });
            }
        }
    }

    /// Puts back counters of a bucket taken out, due again at `due_at`
    /// (and marked kept: the next time, all go).
    pub(super) fn keep_longer(&mut self, id: BucketId, counters: Counters<V>, due_at: i64) {
        self.due.entry(due_at).or_default().push(id.clone());
        self.live.insert(
            id,
            Bucket {
                counters,
                kept: true,
            },
        );
    }

    /// Every counter held.
    #[cfg(test)]
    pub(super) fn values(&self) -> impl Iterator<Item = &V> {
        self.live.values().flat_map(|b| b.counters.values())
    }
}

/// The reserve of a counter past its time: how much was taken, and how
/// much of it is left unspent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Spent {
    pub reserve: u64,
    pub left: u64,
}

/// The reserves spent in counters past their time, by bucket: at most
/// `cap` counters, the oldest buckets forgotten first, whole. A bucket's
/// table is the live counters' table, moved (its keys are not hashed
/// again), its values places in `places`.
#[derive(Debug)]
pub(super) struct SpentBuckets {
    buckets: Map<BucketId, Counters<usize>>,
    places: Slab<Spent>,
    /// In the order they came.
    order: VecDeque<BucketId>,
    len: usize,
    cap: usize,
}

impl SpentBuckets {
    /// An empty memory of at most `cap` counters.
    pub(super) fn new(cap: usize) -> Self {
        SpentBuckets {
            buckets: Map::default(),
            places: Slab::default(),
            order: VecDeque::new(),
            len: 0,
            cap,
        }
    }

    /// Nothing held.
    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps the reserves of a bucket's counters past their time, given
    /// as the live counters' table (its values places there: `spent`
    /// gives each one's reserve and frees it); returns the end of the
    /// latest bucket forgotten to make room, if any was. The table is
    /// kept as it is, its values changed in place: no key is hashed
    /// again (unless the bucket was kept before: then they join it).
    pub(super) fn keep(
        &mut self,
        id: BucketId,
        mut counters: Counters<usize>,
        mut spent: impl FnMut(usize) -> Spent,
    ) -> Option<i64> {
        for at in counters.values_mut() {
            *at = self.places.put(spent(*at));
        }
        let added = counters.len();
        match self.buckets.entry(id) {
            Entry::Occupied(o) => {
                let table = o.into_mut();
                for (key, at) in counters {
                    if let Some(old) = table.insert(key, at) {
                        self.places.free(old);
                        self.len -= 1;
                    }
                }
            }
            Entry::Vacant(v) => {
                self.order.push_back(v.key().clone());
                v.insert(counters);
            }
        }
        self.len += added;
        let mut forgot = None;
        while self.len > self.cap {
            let Some(end) = self.forget_oldest() else {
                break;
            };
            forgot = Some(forgot.map_or(end, |f: i64| f.max(end)));
        }
        forgot
    }

    /// The reserve spent in counter `id`.
    pub(super) fn get(&self, id: &CounterId) -> Option<&Spent> {
        if self.len == 0 {
            return None;
        }
        let at = self.buckets.get(&BucketOf(id))?.get(id.key.as_str())?;
        Some(self.places.get(*at))
    }

    /// Takes the reserve spent in counter `id` out (it is back among the
    /// live counters).
    pub(super) fn remove(&mut self, id: &CounterId) -> Option<Spent> {
        if self.len == 0 {
            return None;
        }
        let at = self
            .buckets
            .get_mut(&BucketOf(id))?
            .remove(id.key.as_str())?;
        self.len -= 1;
        self.places.free(at);
        Some(*self.places.get(at))
    }

    /// Forgets the oldest bucket; returns its end if it still held a
    /// counter (one whose counters all came back forgets nothing).
    pub(super) fn forget_oldest(&mut self) -> Option<i64> {
        loop {
            let id = self.order.pop_front()?;
            let Some(counters) = self.buckets.remove(&id) else {
                continue;
            };
            self.len -= counters.len();
            counters.values().for_each(|&at| self.places.free(at));
            if !counters.is_empty() {
                return Some(id.end());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(rule: &str, key: &str, bucket: i64) -> CounterId {
        CounterId {
            rule: rule.into(),
            window_ms: 1_000,
            key: key.into(),
            bucket,
        }
    }

    #[test]
    fn counters_are_found_by_bucket_and_key_and_dropped_by_bucket() {
        let mut b: Buckets<u64> = Buckets::default();
        b.insert(&id("r", "a", 1), 4_000, 1);
        b.insert(&id("r", "b", 1), 9_999, 2);
        b.insert(&id("r", "a", 2), 5_000, 3);
        b.insert(&id("s", "a", 1), 4_000, 4);
        *b.get_or_insert_with(&id("r", "a", 1), 0, || 0) += 10;
        assert_eq!(b.get(&id("r", "a", 1)), Some(&11));
        assert_eq!(b.get(&id("r", "b", 1)), Some(&2), "due when its bucket is");
        assert!(!b.contains(&id("r", "c", 1)));
        assert!(b.pop_due(4_000).is_none(), "due before now only");
        let mut first: Vec<(String, i64)> = Vec::new();
        while let Some(d) = b.pop_due(4_001) {
            assert_eq!(d.at, 4_000);
            for k in d.counters.keys() {
                first.push((format!("{}:{k}", d.id.rule), d.id.bucket));
            }
        }
        first.sort();
        assert_eq!(
            first,
            vec![
                ("r:a".to_string(), 1),
                ("r:b".to_string(), 1),
                ("s:a".to_string(), 1)
            ]
        );
        assert_eq!(b.values().copied().collect::<Vec<_>>(), vec![3]);
        let d = b.pop_due(i64::MAX).expect("bucket 2");
        assert_eq!(d.id.end(), 3_000);
        b.keep_longer(d.id, d.counters, 6_000);
        assert_eq!(b.get(&id("r", "a", 2)), Some(&3));
        let d = b.pop_due(i64::MAX).expect("kept");
        assert!(d.kept && d.at == 6_000);
        assert!(b.pop_due(i64::MAX).is_none());
    }

    #[test]
    fn a_counter_is_made_only_when_absent_and_only_if_make_gives_one() {
        let mut b: Buckets<u64> = Buckets::default();
        assert_eq!(b.get_or_try_insert(&id("r", "a", 1), 4_000, || None), None);
        assert!(!b.contains(&id("r", "a", 1)), "none given: nothing put");
        assert_eq!(
            b.get_or_try_insert(&id("r", "a", 1), 4_000, || Some(7)),
            Some(&mut 7)
        );
        let mut called = false;
        *b.get_or_try_insert(&id("r", "a", 1), 4_000, || {
            called = true;
            Some(0)
        })
        .unwrap() += 1;
        assert!(!called, "a counter here is not made again");
        assert_eq!(b.get(&id("r", "a", 1)), Some(&8));
        // A bucket of the rule after one taken out is made its size.
        for k in 0..100 {
            b.insert(&id("r", &format!("k{k}"), 1), 4_000, k);
        }
        assert_eq!(b.pop_due(4_001).map(|d| d.counters.len()), Some(101));
        b.insert(&id("r", "a", 5), 9_000, 1);
        let made = b.live.get(&BucketOf(&id("r", "a", 5))).unwrap();
        assert!(
            made.counters.capacity() >= 101,
            "{}",
            made.counters.capacity()
        );
    }

    #[test]
    fn spent_reserves_are_forgotten_a_bucket_at_a_time_oldest_first() {
        let s = |reserve| Spent { reserve, left: 0 };
        // (A live table's values are places; here the reserve itself.)
        let table = |keys: &[(&str, usize)]| -> Counters<usize> {
            keys.iter().map(|&(k, at)| (k.into(), at)).collect()
        };
        let spent = |at: usize| s(at as u64);
        let mut m = SpentBuckets::new(3);
        let b1 = BucketId::of(&id("r", "", 1));
        let b2 = BucketId::of(&id("r", "", 2));
        assert_eq!(
            m.keep(b1.clone(), table(&[("a", 1), ("b", 2)]), spent),
            None
        );
        assert_eq!(m.get(&id("r", "b", 1)), Some(&s(2)));
        assert_eq!(m.remove(&id("r", "a", 1)), Some(s(1)));
        assert_eq!(m.keep(b2, table(&[("a", 3), ("c", 4)]), spent), None);
        assert_eq!(m.get(&id("r", "c", 2)), Some(&s(4)));
        assert_eq!(m.places.made(), 3, "a freed place is used again");
        // Back again, and more: past 3, bucket 1 goes whole.
        assert_eq!(m.keep(b1, table(&[("a", 5)]), spent), Some(2_000));
        assert!(m.get(&id("r", "b", 1)).is_none());
        assert_eq!(m.get(&id("r", "c", 2)), Some(&s(4)));
        assert_eq!(m.forget_oldest(), Some(3_000));
        assert!(m.is_empty() && m.forget_oldest().is_none());
    }
}

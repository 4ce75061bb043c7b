//! What [`Gate::plan`](super::Gate::plan) keeps of a batch for its
//! [`Gate::decide`](super::Gate::decide): the call ids as it checked them
//! ([`Checked`]), the batch's counters with their places in the gate's
//! slab, and which counter each call counts in for each rule. Decide then
//! neither builds a call's counters again nor looks them up.

use std::hash::BuildHasher;
use std::sync::Arc;

use compact_str::CompactString;
use hashbrown::HashTable;

use super::table::Recent;
use super::CounterId;
use crate::engine::event::{Aggregated, CallEvent};
use crate::engine::rules::RuleSet;

/// A call a rule does not count (or a batch not kept).
const NONE: usize = usize::MAX;

/// One counter the batch counts in.
#[derive(Debug)]
pub(super) struct Need {
    /// The rule's index.
    pub rule: usize,
    pub id: CounterId,
    /// The batch's calls counted in it (before decide).
    pub calls: u64,
    /// Its place in the gate's slab, once known (plan finds the counters
    /// held; those leased for the first time get one when settled, and
    /// decide looks them up once).
    pub place: Option<usize>,
}

/// A batch as planned.
#[derive(Debug)]
pub(super) struct Planned {
    pub checked: Checked,
    pub needs: Vec<Need>,
    /// `needs` by rule, key and bucket (found without building their
    /// [`CounterId`]s).
    index: HashTable<usize>,
    hasher: foldhash::fast::RandomState,
    /// Per call and rule (`j * rules + i`): the index in `needs`, or
    /// [`NONE`]. Empty when the batch is not kept ([`Checked::fits`] is
    /// false then).
    of_call: Vec<usize>,
    rules: usize,
    /// The rule set's version: decide uses the plan only with the same.
    version: CompactString,
}

impl Planned {
    /// An empty plan of `checked`'s batch of `calls` calls under `rules`,
    /// room made for `most` counters.
    pub fn new(checked: Checked, calls: usize, rules: &RuleSet, most: usize) -> Self {
        let (version, rules) = (rules.version().into(), rules.rules.len());
        let cells = if checked.kept() {
            calls.saturating_mul(rules)
        } else {
            0
        };
        Planned {
            checked,
            needs: Vec::with_capacity(most),
            index: HashTable::with_capacity(most),
            hasher: Default::default(),
            of_call: vec![NONE; cells],
            rules,
            version,
        }
    }

    fn hash(&self, i: usize, key: &str, bucket: i64) -> u64 {
        self.hasher.hash_one((i, key, bucket))
    }

    /// The index in `needs` of rule `i`'s counter of `key` in `bucket`
    /// (`hash` its [`Planned::hash`]), if the batch counts in it.
    fn find(&self, hash: u64, i: usize, key: &str, bucket: i64) -> Option<usize> {
        let needs = &self.needs;
        self.index
            .find(hash, |&k| {
                let n = &needs[k];
                n.rule == i && n.id.bucket == bucket && n.id.key == key
            })
            .copied()
    }

    /// Counts a call in rule `i`'s counter of `key` in `bucket` (`id`
    /// builds it, if it is new to the batch); returns its index in
    /// `needs`.
    pub fn count(
        &mut self,
        i: usize,
        key: &str,
        bucket: i64,
        id: impl FnOnce() -> CounterId,
    ) -> usize {
        let hash = self.hash(i, key, bucket);
        if let Some(k) = self.find(hash, i, key, bucket) {
            self.needs[k].calls += 1;
            return k;
        }
        self.needs.push(Need {
            rule: i,
            id: id(),
            calls: 1,
            place: None,
        });
        let k = self.needs.len() - 1;
        let (needs, hasher) = (&self.needs, &self.hasher);
        // (Rehashing on growth: the same hash as `Planned::hash`.)
        self.index.insert_unique(hash, k, |&k| {
            let n = &needs[k];
            hasher.hash_one((n.rule, n.id.key.as_str(), n.id.bucket))
        });
        k
    }

    /// The batch counts in rule `i`'s counter of `key` in `bucket`.
    pub fn has(&self, i: usize, key: &str, bucket: i64) -> bool {
        self.find(self.hash(i, key, bucket), i, key, bucket)
            .is_some()
    }

    /// Call `j` counts in need `k` for rule `i`.
    pub fn note(&mut self, j: usize, i: usize, k: usize) {
        if let Some(cell) = self.of_call.get_mut(j * self.rules + i) {
            *cell = k;
        }
    }

    /// The need call `j` counts in for rule `i`, if any.
    pub fn need_of(&self, j: usize, i: usize) -> Option<usize> {
        match self.of_call.get(j * self.rules + i) {
            Some(&k) if k != NONE => Some(k),
            _ => None,
        }
    }

    /// The plan holds for deciding `events` under a rule set of `version`
    /// with `rules` rules, `decided` batches decided before.
    pub fn fits(&self, events: &[CallEvent], rules: usize, version: &str, decided: u64) -> bool {
        self.checked.decided == decided
            && self.checked.fits(events)
            && self.rules == rules
            && self.version == version
    }
}

// The call ids, as checked: the gate remembers hundreds of thousands of
// ids, and a lookup there is its dearest step; kept from plan to decide,
// each call is looked up once (when planned) rather than twice, and
// hashed once.

/// The results of the call ids the gate decided ([`super::REMEMBERED_IDS`]).
pub(super) type Remembered = Recent<CompactString, Arc<[Aggregated]>>;

/// Batches larger than this are not kept for decide (offline logs decided
/// in one go): each call is looked up again there, as it was.
const KEPT_MOST: usize = 1 << 16;

/// What plan found of one call's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Seen {
    /// Neither remembered nor earlier in the batch: decided afresh.
    New,
    /// Earlier in the batch (decide finds it remembered by then).
    Again,
    /// Remembered when planned: decided before.
    Known,
}

/// A batch's call ids, checked against the remembered ones.
#[derive(Debug)]
pub(super) struct Checked {
    /// The batch: length, first and last call ids.
    len: usize,
    first: Option<CompactString>,
    last: Option<CompactString>,
    /// Per call (when `kept`): what was found, and its id's hash.
    seen: Vec<Seen>,
    hashes: Vec<u64>,
    kept: bool,
    /// The gate's batches decided when it was planned.
    pub decided: u64,
}

impl Checked {
    /// Checks `events`' ids against `remembered`, with `decided` batches
    /// decided so far.
    pub fn new(events: &[CallEvent], remembered: &Remembered, decided: u64) -> Self {
        let kept = events.len() <= KEPT_MOST;
        let room = if kept { events.len() } else { 0 };
        let mut seen = Vec::with_capacity(events.len());
        let mut hashes = Vec::with_capacity(room);
        // (Ids first seen in this batch, with their hashes.)
        let mut ids: HashTable<(u64, usize)> = HashTable::with_capacity(room);
        for (j, ev) in events.iter().enumerate() {
            let hash = remembered.hash_of(&ev.call_id);
            let s = if remembered.get_hashed(hash, &ev.call_id).is_some() {
                Seen::Known
            } else if !kept {
                Seen::New
            } else if ids
                .find(hash, |&(_, k)| events[k].call_id == ev.call_id)
                .is_some()
            {
                Seen::Again
            } else {
                ids.insert_unique(hash, (hash, j), |&(h, _)| h);
                Seen::New
            };
            seen.push(s);
            if kept {
                hashes.push(hash);
            }
        }
        Checked {
            len: events.len(),
            first: events.first().map(|e| e.call_id.clone()),
            last: events.last().map(|e| e.call_id.clone()),
            seen,
            hashes,
            kept,
            decided,
        }
    }

    /// Call `j` was decided before (its id remembered).
    pub fn known(&self, j: usize) -> bool {
        self.seen[j] == Seen::Known
    }

    /// Kept for decide (the batch is not too large).
    pub fn kept(&self) -> bool {
        self.kept
    }

    /// Kept for decide, and checked for `events`.
    pub fn fits(&self, events: &[CallEvent]) -> bool {
        self.kept
            && self.len == events.len()
            && self.first.as_ref() == events.first().map(|e| &e.call_id)
            && self.last.as_ref() == events.last().map(|e| &e.call_id)
    }

    /// Call `j`'s id hash, and whether it may be remembered by now (else
    /// it is not: no lookup needed). Only when [`Checked::fits`].
    pub fn for_decide(&self, j: usize) -> (u64, bool) {
        (self.hashes[j], self.seen[j] != Seen::New)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str) -> CallEvent {
        CallEvent {
            call_id: id.into(),
            caller: "+34600000001".into(),
            ..CallEvent::default()
        }
    }

    #[test]
    fn ids_are_new_again_or_known() {
        let mut remembered: Remembered = Recent::new(8);
        remembered.put("old".into(), Arc::from(Vec::new()));
        let batch: Vec<CallEvent> = ["a", "old", "b", "a", "old"]
            .into_iter()
            .map(call)
            .collect();
        let c = Checked::new(&batch, &remembered, 0);
        let seen: Vec<Seen> = (0..batch.len()).map(|j| c.seen[j]).collect();
        use Seen::*;
        assert_eq!(seen, [New, Known, New, Again, Known]);
        assert!(c.fits(&batch));
        assert!(!c.fits(&batch[1..]), "another batch");
        let (hash, look) = c.for_decide(3);
        assert_eq!((hash, look), (remembered.hash_of("a"), true));
        assert!(!c.for_decide(2).1, "b: new, not looked up");
    }
}

//! What [`Gate::plan`](super::Gate::plan) keeps of a batch for its
//! [`Gate::decide`](super::Gate::decide): the call ids as it checked them
//! ([`Checked`]), the batch's counters with their places in the gate's
//! slab, and which counter each call counts in for each rule. Decide then
//! neither builds a call's counters again nor looks them up.

use std::hash::BuildHasher;

use compact_str::CompactString;
use hashbrown::HashTable;

use super::checked::Checked;
use super::CounterId;
use crate::engine::event::CallEvent;
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

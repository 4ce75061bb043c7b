//! Rules keyed by caller and callee: one window per (caller, callee) pair,
//! kept with the caller's state (in Redis under the caller's hash tag), so
//! it stays exact and in the caller's partition.
//!
//! A pair is created by the first call to its callee that the rule sees,
//! and holds the state of the rule's kind for the calls to that callee
//! alone, with the caller's horizons. Its `latest` is the time of the
//! latest call to it that the rule saw. A pair whose `latest` is at or
//! below the horizon is dropped; past `max_distinct_callees` pairs, the
//! one with the lowest (latest, callee) is dropped at the end of the call
//! (a later call to it starts afresh: it can only count lower).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use compact_str::CompactString;
use foldhash::HashMap;

use super::{Approx, Tat};

/// The state of one (caller, callee) pair for one rule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pair {
    /// The latest call time to the callee the rule saw.
    pub latest: i64,
    /// sliding: recorded times, sorted.
    pub log: VecDeque<i64>,
    /// fixed: live buckets and their counts.
    pub fixed: BTreeMap<i64, u64>,
    /// sliding-approx: the counters.
    pub approx: Approx,
    /// token-bucket: the theoretical arrival time.
    pub tat: Option<Tat>,
}

/// A rule's pairs for one caller.
#[derive(Debug, Clone, Default)]
pub struct Pairs {
    map: HashMap<CompactString, Pair>,
    by_latest: BTreeSet<(i64, CompactString)>,
}

impl Pairs {
    /// How many pairs are kept.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// The pair of `callee`, created if missing, its `latest` raised to `t`.
    pub fn touch(&mut self, callee: &str, t: i64) -> &mut Pair {
        let key = CompactString::from(callee);
        let old = self.map.get(callee).map(|p| p.latest);
        match old {
            Some(l) if l >= t => {}
            Some(l) => {
                self.by_latest.remove(&(l, key.clone()));
                self.by_latest.insert((t, key.clone()));
            }
            None => {
                self.by_latest.insert((t, key.clone()));
            }
        }
        let pair = self.map.entry(key).or_insert_with(|| Pair {
            latest: t,
            ..Pair::default()
        });
        pair.latest = pair.latest.max(t);
        pair
    }

    /// The pair of `callee`, if kept.
    pub fn get(&self, callee: &str) -> Option<&Pair> {
        self.map.get(callee)
    }

    /// Drops pairs whose latest call is at or below `horizon`, and in the
    /// others what `trim` drops.
    pub fn trim(&mut self, horizon: i64, mut trim: impl FnMut(&mut Pair)) {
        while self.by_latest.first().is_some_and(|(l, _)| *l <= horizon) {
            if let Some((_, c)) = self.by_latest.pop_first() {
                self.map.remove(&c);
            }
        }
        self.map.values_mut().for_each(&mut trim);
    }

    /// Drops the pairs with the lowest (latest, callee) past `cap`.
    pub fn cap(&mut self, cap: u64) {
        while self.map.len() as u64 > cap {
            let Some((_, c)) = self.by_latest.pop_first() else {
                break;
            };
            self.map.remove(&c);
        }
    }

    /// The pairs by callee, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&CompactString, &Pair)> {
        self.map.iter()
    }

    /// Puts back a pair read from a packed state.
    pub fn restore(&mut self, callee: &str, pair: Pair) {
        self.by_latest.insert((pair.latest, callee.into()));
        self.map.insert(callee.into(), pair);
    }

    /// Approximate bytes held.
    pub fn approx_bytes(&self) -> usize {
        self.map
            .values()
            .map(|p| {
                2 * std::mem::size_of::<(i64, CompactString)>()
                    + std::mem::size_of::<Pair>()
                    + p.log.len() * 8
                    + p.fixed.len() * 32
            })
            .sum()
    }
}

impl PartialEq for Pairs {
    fn eq(&self, other: &Self) -> bool {
        self.map == other.map
    }
}

impl Eq for Pairs {}

//! The callers rejected most over the last minutes, in bounded memory.
//!
//! Space-Saving (Metwally, Agrawal, El Abbadi, 2005): `capacity` counters;
//! a new key takes over the smallest counter and inherits its count as its
//! possible overcount (`error`). Every key rejected more than
//! `total / capacity` times in a slot is in that slot's counters, and a
//! counter's true value lies in `[count - error, count]`. One summary per
//! minute; the last [`MINUTES`] are merged on request.

use std::collections::{HashMap, VecDeque};

use compact_str::CompactString;
use serde::Serialize;

/// Minutes the top list covers.
pub const MINUTES: i64 = 5;

/// One Space-Saving summary.
#[derive(Debug, Clone)]
pub struct SpaceSaving {
    capacity: usize,
    /// Key to (count, possible overcount).
    counts: HashMap<CompactString, (u64, u64)>,
}

impl SpaceSaving {
    /// A summary of `capacity` counters (at least one).
    pub fn new(capacity: usize) -> Self {
        SpaceSaving {
            capacity: capacity.max(1),
            counts: HashMap::with_capacity(capacity.max(1)),
        }
    }

    /// Counts one occurrence of `key`.
    pub fn add(&mut self, key: &str) {
        if let Some(c) = self.counts.get_mut(key) {
            c.0 += 1;
            return;
        }
        if self.counts.len() < self.capacity {
            self.counts.insert(key.into(), (1, 0));
            return;
        }
        let smallest = self
            .counts
            .iter()
            .min_by_key(|(_, (count, _))| *count)
            .map(|(k, (count, _))| (k.clone(), *count));
        if let Some((old, count)) = smallest {
            self.counts.remove(&old);
            self.counts.insert(key.into(), (count + 1, count));
        }
    }

    /// The counters: key, count, possible overcount.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u64, u64)> {
        self.counts.iter().map(|(k, (c, e))| (k.as_str(), *c, *e))
    }
}

/// A caller in the top list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopCaller {
    /// The caller (its pseudonym under `--hash-numbers`).
    pub caller: String,
    /// Rejected calls counted (at most `error` more than the truth).
    pub rejects: u64,
    /// Possible overcount.
    pub error: u64,
}

/// One summary per minute over the last [`MINUTES`].
#[derive(Debug)]
pub struct RecentTop {
    capacity: usize,
    slots: VecDeque<(i64, SpaceSaving)>,
}

impl RecentTop {
    /// Per-minute summaries of `capacity` counters.
    pub fn new(capacity: usize) -> Self {
        RecentTop {
            capacity,
            slots: VecDeque::new(),
        }
    }

    /// Counts a reject of `caller` at `now_s` (epoch seconds).
    pub fn add(&mut self, now_s: i64, caller: &str) {
        let minute = now_s.div_euclid(60);
        if self.slots.back().is_none_or(|(m, _)| *m != minute) {
            self.slots
                .push_back((minute, SpaceSaving::new(self.capacity)));
        }
        while self
            .slots
            .front()
            .is_some_and(|(m, _)| *m <= minute - MINUTES)
        {
            self.slots.pop_front();
        }
        if let Some((_, s)) = self.slots.back_mut() {
            s.add(caller);
        }
    }

    /// The `n` callers rejected most in the minutes up to `now_s`, most
    /// first (ties by caller).
    pub fn top(&self, now_s: i64, n: usize) -> Vec<TopCaller> {
        let minute = now_s.div_euclid(60);
        let mut merged: HashMap<&str, (u64, u64)> = HashMap::new();
        for (_, s) in self.slots.iter().filter(|(m, _)| *m > minute - MINUTES) {
            for (k, c, e) in s.iter() {
                let slot = merged.entry(k).or_default();
                slot.0 += c;
                slot.1 += e;
            }
        }
        let mut top: Vec<TopCaller> = merged
            .into_iter()
            .map(|(caller, (rejects, error))| TopCaller {
                caller: caller.to_string(),
                rejects,
                error,
            })
            .collect();
        top.sort_by(|a, b| {
            b.rejects
                .cmp(&a.rejects)
                .then_with(|| a.caller.cmp(&b.caller))
        });
        top.truncate(n);
        top
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_while_keys_fit() {
        let mut s = SpaceSaving::new(4);
        for k in ["a", "b", "a", "c", "a", "b"] {
            s.add(k);
        }
        let mut got: Vec<_> = s.iter().collect();
        got.sort();
        assert_eq!(got, vec![("a", 3, 0), ("b", 2, 0), ("c", 1, 0)]);
    }

    #[test]
    fn heavy_hitters_survive_a_stream_of_one_off_callers() {
        // Two floods among 10,000 callers seen once each: 11,400 rejects,
        // so with 32 counters every caller over 356 is guaranteed a place.
        let mut s = SpaceSaving::new(32);
        for i in 0..10_000 {
            s.add(&format!("once{i}"));
            if i % 10 == 0 {
                s.add("flood-a");
            }
            if i % 25 == 0 {
                s.add("flood-b");
            }
        }
        let mut top = RecentTop::new(32);
        top.slots.push_back((0, s));
        let got = top.top(0, 2);
        assert_eq!(got[0].caller, "flood-a");
        assert_eq!(got[1].caller, "flood-b");
        // The true counts lie within the bounds.
        assert!(got[0].rejects >= 1_000 && got[0].rejects - got[0].error <= 1_000);
        assert!(got[1].rejects >= 400 && got[1].rejects - got[1].error <= 400);
    }

    #[test]
    fn old_minutes_drop_out() {
        let mut t = RecentTop::new(4);
        t.add(0, "early");
        t.add(0, "early");
        t.add(59, "early");
        t.add(120, "later");
        assert_eq!(t.top(120, 10)[0].caller, "early");
        assert_eq!(t.top(120, 10)[0].rejects, 3);
        // Five minutes after the first, it no longer counts.
        t.add(300, "later");
        assert_eq!(
            t.top(300, 10),
            vec![TopCaller {
                caller: "later".into(),
                rejects: 2,
                error: 0
            }]
        );
        assert!(t.top(600, 10).is_empty());
    }
}

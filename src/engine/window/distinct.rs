//! The distinct-callees rule of one caller: each recorded callee's latest
//! call time, at most `cap` of them.
//!
//! The count of a call to `own` at `t` is
//! `min(cap, |{c kept: latest(c) > t - W} ∪ {own}|)`. Recording raises
//! `own`'s latest time, then, past `cap`, drops the callee with the
//! lowest (latest time, number): the set keeps the `cap` most recently
//! called callees, so the count is exact until it reaches `cap` and
//! saturates there. For calls in time order it is the number of distinct
//! callees in `(t - W, t]`. (`lua/window.lua` keeps the same set as a
//! sorted set, where `ZPOPMIN` drops the same callee.)

use std::collections::BTreeSet;

use compact_str::CompactString;
use foldhash::HashMap;

/// Recorded callees and their latest call times.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Callees {
    latest: HashMap<CompactString, i64>,
    by_time: BTreeSet<(i64, CompactString)>,
}

impl Callees {
    /// How many are kept.
    pub fn len(&self) -> usize {
        self.latest.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.latest.is_empty()
    }

    /// The count of a call to `own` at `t` in a window of `w` ms.
    pub fn count(&self, own: &str, t: i64, w: i64, cap: u64) -> u64 {
        let after = t.saturating_sub(w);
        let live = self
            .by_time
            .range((after.saturating_add(1), CompactString::default())..)
            .count() as u64;
        let own_live = self.latest.get(own).is_some_and(|&l| l > after);
        (live + u64::from(!own_live)).min(cap)
    }

    /// Records a call to `own` at `t`.
    pub fn record(&mut self, own: &str, t: i64, cap: u64) {
        match self.latest.get_mut(own) {
            Some(l) if *l >= t => return,
            Some(l) => {
                self.by_time.remove(&(*l, CompactString::from(own)));
                *l = t;
            }
            None => {
                self.latest.insert(own.into(), t);
            }
        }
        self.by_time.insert((t, own.into()));
        while self.latest.len() as u64 > cap {
            let Some((_, c)) = self.by_time.pop_first() else {
                break;
            };
            self.latest.remove(&c);
        }
    }

    /// Drops the callees whose latest call is at or below `horizon`.
    pub fn trim(&mut self, horizon: i64) {
        while self.by_time.first().is_some_and(|(l, _)| *l <= horizon) {
            if let Some((_, c)) = self.by_time.pop_first() {
                self.latest.remove(&c);
            }
        }
    }

    /// The last time `s > t` at which a call to `own` would still count
    /// above `limit` (below the cap), with no further calls: while at least
    /// `limit` other callees are live, i.e. until the `limit`-th most
    /// recent other one leaves the window.
    pub fn rejects_until(&self, own: &str, t: i64, w: i64, limit: u64) -> Option<i64> {
        let k = usize::try_from(limit).ok()?.checked_sub(1)?;
        let (l, _) = self
            .by_time
            .iter()
            .rev()
            .filter(|(_, c)| c.as_str() != own)
            .nth(k)?;
        let end = l.saturating_add(w - 1);
        (end > t).then_some(end)
    }

    /// The entries, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &(i64, CompactString)> {
        self.by_time.iter()
    }

    /// Approximate bytes held.
    pub fn approx_bytes(&self) -> usize {
        self.latest.len() * 2 * (std::mem::size_of::<(i64, CompactString)>() + 16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_distinct_live_callees_and_saturates_at_the_cap() {
        let mut c = Callees::default();
        for (i, t) in [0, 10, 20, 30].into_iter().enumerate() {
            let own = format!("+3460000000{i}");
            assert_eq!(c.count(&own, t, 25, 3), (i as u64 + 1).min(3));
            c.record(&own, t, 3);
        }
        // Kept: the three most recent (10, 20, 30); +34600000000 dropped.
        assert_eq!(c.len(), 3);
        // At 40 in a 25 ms window: 20 and 30 live, plus own.
        assert_eq!(c.count("+34600000009", 40, 25, 3), 3);
        assert_eq!(c.count("+34600000003", 40, 25, 3), 2);
        // Others live at 40: 30 and 20; the 2nd most recent, 20, leaves at 45.
        assert_eq!(c.rejects_until("+34600000003", 40, 25, 2), None);
        assert_eq!(c.rejects_until("+34600000009", 40, 25, 2), Some(44));
        c.trim(20);
        assert_eq!(c.len(), 1);
    }
}

//! Sums: what a sum rule (`sum = "talk"` or `"cost"`) keeps for one
//! caller: the allowed calls waiting for their ends, and what each ended
//! call added, at its end time.
//!
//! * A call the rule saw allowed (a shadow reject included: it connects)
//!   waits for its end. An end at `e` of a waiting call adds the call's
//!   amount at `max(e, start)`; an end at or after `start + max_duration`
//!   finds the call let go and adds nothing, as does a second end.
//! * The count of a call at `t` is what the kept ends add up to in its
//!   window (sliding: `(t - W, t]`; fixed: `t`'s bucket while it lives;
//!   sliding-approx: `floor(prev * (W - r - 1) / W) + cur` over the sums of
//!   `t`'s bucket and the one before). The call itself adds nothing.
//! * Kept while a call not late could see it: a waiting call until `start +
//!   max_duration` is at or below `L' - grace`; an ended one until no
//!   window of a call at or after `L' - grace` reaches it. A caller
//!   starting afresh keeps them (its calls' ends outlast its windows).

use std::collections::VecDeque;

use compact_str::CompactString;

use crate::engine::rates::Price;
use crate::engine::rules::WindowKind;

use super::counting::{bucket_end, bucket_of, insert_sorted};

/// A call waiting for its end.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Waiting {
    id: CompactString,
    start: i64,
    /// Its callee's price when it started (cost sums).
    price: Option<Price>,
}

/// One sum rule's state for one caller.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sums {
    /// By start time.
    waiting: VecDeque<Waiting>,
    /// (end time, amount), by end time.
    ended: VecDeque<(i64, u64)>,
}

/// A sum window's shape: its kind, length and the set's grace.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) kind: WindowKind,
    pub(crate) w: i64,
    pub(crate) grace: i64,
}

impl Shape {
    /// The shape of `rule` in a set with `grace`.
    pub(crate) fn of(rule: &crate::engine::rules::Rule, grace: i64) -> Self {
        Shape {
            kind: rule.kind,
            w: rule.window_ms,
            grace,
        }
    }
}

impl Sums {
    /// A call allowed at `start` waits for its end.
    pub(crate) fn wait(&mut self, id: &str, start: i64, price: Option<Price>) {
        let call = Waiting {
            id: id.into(),
            start,
            price,
        };
        insert_sorted(&mut self.waiting, call, |c| c.start <= start);
    }

    /// The end of call `id` at `end`: `None` when no such call waits;
    /// else the call stops waiting, and what its end adds at, and at which
    /// price, if the end came within `max_duration` (`Some(None)`: too
    /// late, it adds nothing).
    pub(crate) fn end(
        &mut self,
        id: &str,
        end: i64,
        max_duration: i64,
    ) -> Option<Option<(i64, Option<Price>)>> {
        let at = self.waiting.iter().rposition(|c| c.id == id)?;
        let call = self.waiting.remove(at)?;
        let in_time = end < call.start.saturating_add(max_duration);
        Some(in_time.then_some((end.max(call.start), call.price)))
    }

    /// Whether call `id` waits for its end.
    #[cfg(test)]
    fn is_waiting(&self, id: &str) -> bool {
        self.waiting.iter().any(|c| c.id == id)
    }

    /// An ended call adds `amount` at `at`.
    pub(crate) fn add(&mut self, at: i64, amount: u64) {
        insert_sorted(&mut self.ended, (at, amount), |&(x, _)| x <= at);
    }

    /// Drops what no call at or after `L' - grace` can see (`l_new` is `L'`).
    pub(crate) fn trim(&mut self, shape: Shape, max_duration: i64, l_new: i64) {
        let let_go = l_new.saturating_sub(shape.grace);
        // (By start: the calls let go are a prefix.)
        while self
            .waiting
            .front()
            .is_some_and(|c| c.start.saturating_add(max_duration) <= let_go)
        {
            self.waiting.pop_front();
        }
        let Shape { kind, w, grace } = shape;
        let gone = |at: i64| match kind {
            WindowKind::Fixed => bucket_end(bucket_of(at, w), w, grace) <= l_new,
            WindowKind::SlidingApprox => bucket_of(at, w) < bucket_of(let_go, w) - 1,
            _ => at <= let_go.saturating_sub(w),
        };
        while self.ended.front().is_some_and(|&(at, _)| gone(at)) {
            self.ended.pop_front();
        }
    }

    /// The sum of the amounts ended in `[lo, hi]`.
    fn between(&self, lo: i64, hi: i64) -> u64 {
        let from = self.ended.partition_point(|&(at, _)| at < lo);
        self.ended
            .range(from..)
            .take_while(|&&(at, _)| at <= hi)
            .map(|&(_, a)| a)
            .fold(0u64, u64::saturating_add)
    }

    /// The sum of bucket `b` of a `w`-ms window.
    fn bucket(&self, b: i64, w: i64) -> u64 {
        let lo = b.saturating_mul(w);
        self.between(lo, lo.saturating_add(w - 1))
    }

    /// The count of a call at `t` (`l_new`: `L'`).
    pub(crate) fn count(&self, shape: Shape, t: i64, l_new: i64) -> u64 {
        let Shape { kind, w, grace } = shape;
        let b = bucket_of(t, w);
        match kind {
            WindowKind::Fixed if bucket_end(b, w, grace) <= l_new => 0,
            WindowKind::Fixed => self.bucket(b, w),
            WindowKind::SlidingApprox => {
                approx_sum(self.bucket(b - 1, w), self.bucket(b, w), w, t - b * w)
            }
            _ => self.between(t.saturating_sub(w).saturating_add(1), t),
        }
    }

    /// The last time `s > t` at which a call would still be over `limit`
    /// (its count above it), given the ends kept and no others.
    pub(crate) fn rejects_until(&self, shape: Shape, t: i64, limit: u64) -> Option<i64> {
        let Shape { kind, w, .. } = shape;
        if self.ended.is_empty() {
            return None;
        }
        // The buckets holding ends, latest first (the others hold nothing).
        let buckets = || {
            let mut bs: Vec<i64> = self.ended.iter().map(|&(at, _)| bucket_of(at, w)).collect();
            bs.dedup();
            bs.into_iter().rev()
        };
        match kind {
            // Each kept bucket over the limit rejects to its end (a bucket
            // alive at t lives on to its end).
            WindowKind::Fixed => buckets()
                .take_while(|&b| b >= bucket_of(t, w))
                .find(|&b| self.bucket(b, w) > limit)
                .map(|b| (b + 1) * w - 1)
                .filter(|&s| s > t),
            // Within a bucket the estimate falls as it goes on: from the
            // latest bucket back, the last instant it is over the limit (a
            // bucket with ends, or the one after it).
            WindowKind::SlidingApprox => {
                let from = bucket_of(t, w);
                let mut candidates: Vec<i64> = buckets().flat_map(|b| [b + 1, b]).collect();
                candidates.sort_unstable_by(|a, b| b.cmp(a));
                candidates.dedup();
                candidates
                    .into_iter()
                    .take_while(|&b| b >= from)
                    .find_map(|b| {
                        let (prev, cur) = (self.bucket(b - 1, w), self.bucket(b, w));
                        let r = last_over(prev, cur, w, limit)?;
                        Some(b * w + r).filter(|&s| s > t)
                    })
            }
            // The count changes only as an end enters or leaves the
            // window: the last time over is some end's last instant in it.
            _ => self
                .ended
                .iter()
                .rev()
                .map(|&(at, _)| at.saturating_add(w - 1))
                .filter(|&s| s > t)
                .find(|&s| self.between(s.saturating_sub(w).saturating_add(1), s) > limit),
        }
    }

    /// The waiting calls (id, start, price), by start.
    pub(crate) fn waiting(&self) -> impl Iterator<Item = (&str, i64, Option<Price>)> {
        self.waiting
            .iter()
            .map(|c| (c.id.as_str(), c.start, c.price))
    }

    /// How many calls wait.
    pub(crate) fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// The ended calls (time, amount), by time.
    pub(super) fn ended(&self) -> impl Iterator<Item = (i64, u64)> + '_ {
        self.ended.iter().copied()
    }

    /// How many ended calls are kept.
    pub(super) fn ended_len(&self) -> usize {
        self.ended.len()
    }

    /// About how many bytes it holds.
    pub(super) fn approx_bytes(&self) -> usize {
        self.waiting.len() * std::mem::size_of::<Waiting>()
            + self.ended.len() * std::mem::size_of::<(i64, u64)>()
    }

    /// Whether it keeps nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.ended.is_empty()
    }

    /// The latest time it keeps anything for: a waiting call's start plus
    /// `max_duration`, an ended call's end plus the window.
    pub(super) fn kept_until(&self, w: i64, max_duration: i64) -> Option<i64> {
        let waiting = self
            .waiting
            .iter()
            .map(|c| c.start.saturating_add(max_duration))
            .max();
        let ended = self.ended.back().map(|&(at, _)| at.saturating_add(w));
        waiting.max(ended)
    }
}

/// The sliding-approx estimate of a sum: `floor(prev * (W - r - 1) / W) +
/// cur` (as the count's, without the call itself).
pub(super) fn approx_sum(prev: u64, cur: u64, w: i64, r: i64) -> u64 {
    let weight = u128::try_from(w - r - 1).unwrap_or(0);
    let w = u128::try_from(w).unwrap_or(1).max(1);
    let part = u128::from(prev) * weight / w;
    u64::try_from(part).unwrap_or(u64::MAX).saturating_add(cur)
}

/// The last offset `r` in a bucket (sums `prev` before, `cur` in it) at
/// which the estimate is over `limit`, if any.
fn last_over(prev: u64, cur: u64, w: i64, limit: u64) -> Option<i64> {
    if cur > limit {
        return Some(w - 1);
    }
    // floor(prev * (w - r - 1) / w) >= need  <=>  w - r - 1 >= ceil(need * w / prev).
    let need = u128::from(limit - cur) + 1;
    if prev == 0 {
        return None;
    }
    let w128 = u128::try_from(w).ok()?;
    let span = (need * w128).div_ceil(u128::from(prev));
    let r = w128.checked_sub(1)?.checked_sub(span)?;
    i64::try_from(r).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(kind: WindowKind) -> Shape {
        Shape {
            kind,
            w: 1_000,
            grace: 0,
        }
    }

    /// The sizes docs/rules.md gives per kept call.
    #[test]
    fn a_waiting_call_takes_56_bytes_and_an_ended_one_16() {
        assert_eq!(std::mem::size_of::<Waiting>(), 56);
        assert_eq!(std::mem::size_of::<(i64, u64)>(), 16);
        assert_eq!(std::mem::size_of::<super::super::open::Open>(), 72);
    }

    #[test]
    fn ends_add_in_the_window_of_their_end_time() {
        let mut s = Sums::default();
        s.add(100, 30);
        s.add(900, 20);
        s.add(1_500, 7);
        let sliding = shape(WindowKind::Sliding);
        assert_eq!(s.count(sliding, 1_000, 1_000), 50);
        assert_eq!(s.count(sliding, 1_100, 1_100), 20, "(100, 1100]");
        assert_eq!(s.count(sliding, 1_500, 1_500), 27);
        let fixed = shape(WindowKind::Fixed);
        assert_eq!(s.count(fixed, 999, 999), 50);
        assert_eq!(s.count(fixed, 1_000, 1_000), 7);
        let approx = shape(WindowKind::SlidingApprox);
        // r = 500: floor(50 * 499 / 1000) + 7.
        assert_eq!(s.count(approx, 1_500, 1_500), 24 + 7);
    }

    #[test]
    fn a_call_waits_for_one_end_within_its_max_duration() {
        let mut s = Sums::default();
        s.wait("a", 100, None);
        s.wait("b", 200, None);
        assert_eq!(s.end("a", 150, 1_000), Some(Some((150, None))));
        assert_eq!(s.end("a", 160, 1_000), None, "a second end");
        assert_eq!(
            s.end("b", 1_200, 1_000),
            Some(None),
            "past its max duration"
        );
        assert!(!s.is_waiting("b"));
    }

    #[test]
    fn the_last_rejecting_time_per_kind() {
        let mut s = Sums::default();
        s.add(100, 30);
        s.add(900, 20);
        // Sliding, limit 40: over while both are in, until 100 leaves at 1100.
        assert_eq!(
            s.rejects_until(shape(WindowKind::Sliding), 950, 40),
            Some(1_099)
        );
        assert_eq!(s.rejects_until(shape(WindowKind::Sliding), 950, 50), None);
        // Fixed: the bucket [0, 1000) holds 50.
        assert_eq!(
            s.rejects_until(shape(WindowKind::Fixed), 950, 40),
            Some(999)
        );
        // Approx, limit 40: in bucket 1, floor(50 * (999 - r) / 1000) > 40
        // while 999 - r >= 820, r <= 179.
        assert_eq!(
            s.rejects_until(shape(WindowKind::SlidingApprox), 950, 40),
            Some(1_179)
        );
        let approx = shape(WindowKind::SlidingApprox);
        assert!(s.count(approx, 1_179, 1_179) > 40);
        assert!(s.count(approx, 1_180, 1_180) <= 40);
    }

    #[test]
    fn trimming_keeps_what_a_call_not_late_can_see() {
        let mut s = Sums::default();
        s.add(100, 1);
        s.add(1_100, 1);
        s.wait("a", 0, None);
        let mut approx = s.clone();
        s.trim(shape(WindowKind::Sliding), 2_000, 1_101);
        assert_eq!(s.ended.len(), 1, "100 is out of every window from 1101 on");
        assert!(s.is_waiting("a"));
        s.trim(shape(WindowKind::Sliding), 2_000, 2_000);
        assert!(!s.is_waiting("a"));
        approx.trim(shape(WindowKind::SlidingApprox), 2_000, 1_999);
        assert_eq!(approx.ended.len(), 2, "bucket 0 is bucket 1's previous");
        approx.trim(shape(WindowKind::SlidingApprox), 2_000, 2_000);
        assert_eq!(approx.ended.len(), 1);
    }
}

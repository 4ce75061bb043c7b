//! Concurrent calls: the calls of one caller that a concurrent rule holds
//! open, and the ends that came before their calls.
//!
//! An allowed attempt `c` is open at `t` when `start(c) <= t < close(c)`,
//! `close(c) = min(max(end(c), start(c)), start(c) + max_duration)`:
//! `end(c)` is the time of its first end event (none yet: only
//! `max_duration` closes it). A call whose close is at or below `L' -
//! grace` is dropped: it can matter only to a late call, whose count sees
//! what is kept (as in every window).

use std::collections::VecDeque;

use compact_str::CompactString;

/// One call a concurrent rule saw allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Open {
    pub(super) id: CompactString,
    /// Its callee, for a rule keyed by caller and callee (else `None`).
    pub(super) callee: Option<CompactString>,
    pub(super) start: i64,
    /// When it stops holding a slot (see the module).
    pub(super) close: i64,
    /// Its end was seen: a later end changes nothing.
    pub(super) ended: bool,
}

/// The calls a concurrent rule holds for one caller, by start time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenCalls {
    calls: VecDeque<Open>,
}

/// When a call started at `start` stops holding a slot, given its end (if
/// seen) and the rule's `max_duration`: an end before the start closes it
/// at its start.
fn close_of(start: i64, end: Option<i64>, max_duration: i64) -> i64 {
    let longest = start.saturating_add(max_duration);
    end.map_or(longest, |e| e.max(start).min(longest))
}

impl OpenCalls {
    /// The count of a call at `t`: the calls open at `t` (to `callee`
    /// alone, for a rule keyed by caller and callee), plus one.
    pub(super) fn count(&self, t: i64, callee: Option<&str>) -> u64 {
        let open = self
            .calls
            .iter()
            .take_while(|c| c.start <= t)
            .filter(|c| t < c.close && (callee.is_none() || c.callee.as_deref() == callee))
            .count();
        1 + open as u64
    }

    /// Holds a call allowed at `start`, closed by `end` if its end came
    /// first.
    pub(super) fn open(
        &mut self,
        id: &str,
        callee: Option<&str>,
        start: i64,
        end: Option<i64>,
        max_duration: i64,
    ) {
        let call = Open {
            id: id.into(),
            callee: callee.map(Into::into),
            start,
            close: close_of(start, end, max_duration),
            ended: end.is_some(),
        };
        let at = if self.calls.back().is_none_or(|c| c.start <= start) {
            self.calls.len()
        } else {
            self.calls.partition_point(|c| c.start <= start)
        };
        self.calls.insert(at, call);
    }

    /// Closes call `id` at `end` (its first end only); whether it is held.
    pub(super) fn end(&mut self, id: &str, end: i64) -> bool {
        // From the back: a call usually ends soon after the latest ones.
        let Some(call) = self.calls.iter_mut().rev().find(|c| c.id == id) else {
            return false;
        };
        if !call.ended {
            call.ended = true;
            call.close = call.close.min(end.max(call.start));
        }
        true
    }

    /// Drops the calls closed at or before `closed` (`L' - grace`).
    pub(super) fn trim(&mut self, closed: i64) {
        self.calls.retain(|c| c.close > closed);
    }

    /// The last time `s > t` at which a call would still be over `limit`
    /// (`limit` calls open at `s`), given the calls held and no others.
    /// The open count drops only at a close, so that time is some close
    /// minus one.
    pub(super) fn rejects_until(&self, t: i64, limit: u64, callee: Option<&str>) -> Option<i64> {
        self.calls
            .iter()
            .filter(|c| callee.is_none() || c.callee.as_deref() == callee)
            .map(|c| c.close - 1)
            .filter(|&s| s > t && self.count(s, callee) > limit)
            .max()
    }

    /// The calls held, by start time.
    pub(super) fn calls(&self) -> impl Iterator<Item = &Open> {
        self.calls.iter()
    }

    /// Puts back a call held, as [`OpenCalls::calls`] gave it (in order).
    pub(super) fn restore(&mut self, call: Open) {
        self.calls.push_back(call);
    }

    /// How many are held.
    pub(super) fn len(&self) -> usize {
        self.calls.len()
    }
}

/// Most ends of calls not yet seen that a caller keeps: a switch sends a
/// call's end after its attempt, so these are few; a flood of ends for
/// calls that never came must not grow the state without bound.
pub const MAX_PENDING_ENDS: usize = 1024;

/// Ends of calls not yet seen (the switch's two messages reordered), kept
/// for the idempotency horizon: the attempt that arrives after its own end
/// is open only until that end. A call's first end stands; past
/// [`MAX_PENDING_ENDS`] the earliest end (then the lowest call id) goes,
/// as a Redis sorted set scored by end time pops it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingEnds {
    /// Call id to end time and talk time (kept only for rule sets that
    /// add up talk; else 0).
    by_id: foldhash::HashMap<CompactString, (i64, i64)>,
    /// (end time, call id), in order.
    by_end: std::collections::BTreeSet<(i64, CompactString)>,
}

impl PendingEnds {
    /// Remembers the end of call `id` at `end`, unless one is kept already.
    pub(super) fn note(&mut self, id: &str, end: i64, talk_ms: i64) {
        if self.by_id.contains_key(id) {
            return;
        }
        self.by_id.insert(id.into(), (end, talk_ms));
        self.by_end.insert((end, id.into()));
        while self.by_id.len() > MAX_PENDING_ENDS {
            let Some((_, first)) = self.by_end.pop_first() else {
                break;
            };
            self.by_id.remove(&first);
        }
    }

    /// The end of call `id` and its talk time, if it came first (and is
    /// let go: the call holds it now).
    pub(super) fn take(&mut self, id: &str) -> Option<(i64, i64)> {
        if self.by_id.is_empty() {
            return None;
        }
        let (end, talk) = self.by_id.remove(id)?;
        self.by_end.remove(&(end, CompactString::from(id)));
        Some((end, talk))
    }

    /// Drops the ends at or below the idempotency horizon.
    pub(super) fn trim(&mut self, dedup_horizon: i64) {
        while self
            .by_end
            .first()
            .is_some_and(|(end, _)| *end <= dedup_horizon)
        {
            if let Some((_, id)) = self.by_end.pop_first() {
                self.by_id.remove(&id);
            }
        }
    }

    /// Puts back an end kept, as [`PendingEnds::iter`] gave it.
    pub(super) fn restore(&mut self, end: i64, id: &str) {
        self.note(id, end, 0);
    }

    /// How many are kept.
    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// The talk time of each end kept, in [`PendingEnds::iter`]'s order.
    pub(super) fn talks(&self) -> impl Iterator<Item = i64> + '_ {
        self.by_end
            .iter()
            .map(|(_, id)| self.by_id.get(id).map_or(0, |&(_, talk)| talk))
    }

    /// Sets the talk times of the ends kept, in [`PendingEnds::iter`]'s
    /// order (after [`PendingEnds::restore`]).
    pub(super) fn restore_talks(&mut self, talks: &[i64]) {
        for ((_, id), &talk) in self.by_end.iter().zip(talks) {
            if let Some(kept) = self.by_id.get_mut(id) {
                kept.1 = talk;
            }
        }
    }

    /// The ends kept, (end time, call id) in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &(i64, CompactString)> {
        self.by_end.iter()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The latest end kept.
    pub(super) fn newest(&self) -> Option<i64> {
        self.by_end.last().map(|(end, _)| *end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_holds_its_slot_from_its_start_until_its_end_or_max_duration() {
        let mut o = OpenCalls::default();
        o.open("a", None, 100, None, 1_000);
        o.open("b", None, 200, None, 1_000);
        assert_eq!(o.count(99, None), 1, "not yet started");
        assert_eq!(o.count(150, None), 2);
        assert_eq!(o.count(250, None), 3);
        assert!(o.end("a", 300));
        assert_eq!(o.count(299, None), 3);
        assert_eq!(o.count(300, None), 2, "an end at t closes before t counts");
        assert!(o.end("a", 250), "a second end finds the call");
        assert_eq!(o.count(260, None), 3, "and changes nothing");
        assert_eq!(o.count(1_199, None), 2);
        assert_eq!(o.count(1_200, None), 1, "b's max_duration");
        assert!(!o.end("c", 300));
    }

    #[test]
    fn an_end_before_the_start_closes_the_call_at_its_start() {
        let mut o = OpenCalls::default();
        o.open("a", None, 100, Some(50), 1_000);
        assert_eq!(o.count(100, None), 1);
        o.open("b", None, 100, None, 1_000);
        o.end("b", 40);
        assert_eq!(o.count(100, None), 1);
    }

    #[test]
    fn the_last_rejecting_time_is_a_close_minus_one() {
        let mut o = OpenCalls::default();
        o.open("a", None, 0, Some(500), 10_000);
        o.open("b", None, 10, None, 1_000);
        // Limit 2: a third call is over while two are open, until a's end.
        assert_eq!(o.rejects_until(20, 2, None), Some(499));
        // Limit 1: a second call is over while one is open, until b's max_duration.
        assert_eq!(o.rejects_until(20, 1, None), Some(1_009));
        assert_eq!(o.rejects_until(20, 3, None), None);
        o.trim(600);
        assert_eq!(o.calls().count(), 1, "a is closed at or below the horizon");
    }

    #[test]
    fn pending_ends_are_taken_once_and_bounded() {
        let mut p = PendingEnds::default();
        p.note("a", 10, 5);
        p.note("a", 20, 6);
        assert_eq!(p.take("a"), Some((10, 5)), "the first end stands");
        assert_eq!(p.take("a"), None);
        for i in 0..MAX_PENDING_ENDS + 5 {
            p.note(&format!("x{i}"), i as i64, 0);
        }
        assert_eq!(p.iter().count(), MAX_PENDING_ENDS);
        assert_eq!(p.take("x0"), None, "the oldest went");
        p.trim(1_000);
        assert_eq!(p.iter().count(), MAX_PENDING_ENDS + 5 - 1_001);
    }
}

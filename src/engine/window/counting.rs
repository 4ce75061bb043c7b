//! The window arithmetic, per rule kind: a call's count, its record in a
//! caller-and-callee pair, and the last time a rule still rejects (the
//! Retry-After); the buckets and horizons they share. No state of its own:
//! [`CallerState`](super::CallerState) holds the counters.

use std::collections::VecDeque;

use crate::engine::event::CallEvent;
use crate::engine::rules::{Rule, RuleKey, RuleSet, WindowKind};

use super::pairs::Pair;
use super::{slot, CallerState, Tat};

/// State of the two-bucket approximate counter of one rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Approx {
    pub(super) bucket: Option<i64>,
    pub(super) cur: u64,
    pub(super) prev: u64,
}

impl Approx {
    /// Moves the counters to `t`'s bucket if it is newer, then estimates.
    /// A call at or below the horizon counts 1 (see [`Approx::counts_in_prev`]).
    pub(super) fn advance_and_count(&mut self, t: i64, w: i64, horizon: i64) -> u64 {
        let b = bucket_of(t, w);
        match self.bucket {
            None => {
                *self = Approx {
                    bucket: Some(b),
                    cur: 0,
                    prev: 0,
                }
            }
            Some(cb) if b > cb => {
                let prev = if b == cb + 1 { self.cur } else { 0 };
                *self = Approx {
                    bucket: Some(b),
                    cur: 0,
                    prev,
                };
            }
            _ => {}
        }
        let cb = self.bucket.unwrap_or(b);
        if b == cb {
            approx_estimate(self.prev, self.cur, w, t.rem_euclid(w))
        } else if Approx::counts_in_prev(b, cb, t, horizon) {
            self.prev + 1
        } else {
            1
        }
    }

    /// Whether a call at `t` (bucket `b`, the counters' bucket `cb`) is
    /// counted in, and recorded into, the previous bucket's counter: when
    /// it lies in that bucket and above the horizon `L' - R`. A call at or
    /// below the horizon is past the retention, as in every other rule
    /// (sliding logs drop it, its fixed bucket is dead): counted 1 and
    /// never recorded. Otherwise a call so late that its idempotency record
    /// is dropped at once (`t <= L' - D`, `D >= R`) would still raise the
    /// counter, and a redelivery of it would count itself a second time.
    pub(super) fn counts_in_prev(b: i64, cb: i64, t: i64, horizon: i64) -> bool {
        b == cb - 1 && t > horizon
    }
}

/// Inserts `item` into the sorted `deque` after every element for which
/// `before` holds (a stable insert): at the back, without a search, for
/// calls in time order.
pub(super) fn insert_sorted<T>(deque: &mut VecDeque<T>, item: T, before: impl Fn(&T) -> bool) {
    super::grow_small(deque);
    if deque.back().is_none_or(&before) {
        deque.push_back(item);
    } else {
        let at = deque.partition_point(before);
        deque.insert(at, item);
    }
}

/// Bucket of `t` for a window of `w` ms (floor division, also for negative times).
pub fn bucket_of(t: i64, w: i64) -> i64 {
    t.div_euclid(w)
}

/// When fixed bucket `b` of a window of `w` ms dies: `(b + 1) * w + grace`
/// (saturating: times at the ends of `i64` never overflow).
pub(super) fn bucket_end(b: i64, w: i64, grace: i64) -> i64 {
    b.saturating_add(1).saturating_mul(w).saturating_add(grace)
}

/// A pair's count for a call at `t` above the horizon (see `pairs.rs`).
pub(super) fn pair_count(rule: &Rule, pair: &mut Pair, t: i64, h: &Horizons, grace: i64) -> u64 {
    let w = rule.window_ms;
    match rule.kind {
        WindowKind::Sliding => sliding_count(&pair.log, t, w),
        WindowKind::Fixed => {
            let b = bucket_of(t, w);
            if bucket_end(b, w, grace) <= h.latest {
                1
            } else {
                1 + pair.fixed.get(&b).copied().unwrap_or(0)
            }
        }
        WindowKind::SlidingApprox => pair.approx.advance_and_count(t, w, h.retention),
        WindowKind::TokenBucket => match rule.rate {
            Some(rate) => Tat::next(pair.tat, t, rate).level(t, rate),
            None => 1,
        },
        // Not keyed by pair (the rule set refuses it).
        WindowKind::DistinctCallees | WindowKind::Concurrent => 1,
    }
}

/// Records a call at `t` above the horizon in its pair.
pub(super) fn pair_record(rule: &Rule, pair: &mut Pair, t: i64, h: &Horizons, grace: i64) {
    let w = rule.window_ms;
    let b = bucket_of(t, w);
    match rule.kind {
        WindowKind::Sliding => insert_sorted(&mut pair.log, t, |&x| x <= t),
        WindowKind::Fixed => {
            if bucket_end(b, w, grace) > h.latest {
                *pair.fixed.entry(b).or_insert(0) += 1;
            }
        }
        WindowKind::SlidingApprox => {
            let a = &mut pair.approx;
            match a.bucket {
                Some(cb) if cb == b => a.cur += 1,
                Some(cb) if Approx::counts_in_prev(b, cb, t, h.retention) => a.prev += 1,
                _ => {}
            }
        }
        WindowKind::TokenBucket => {
            if let Some(rate) = rule.rate {
                pair.tat = Some(Tat::next(pair.tat, t, rate));
            }
        }
        WindowKind::DistinctCallees | WindowKind::Concurrent => {}
    }
}

/// The last time a call to this pair's callee would still be rejected by
/// the rule, with no further calls; the pair is dropped (its calls start
/// afresh) once its latest call is past the retention.
pub(super) fn pair_rejects_until(
    rule: &Rule,
    pair: &Pair,
    t: i64,
    l_new: i64,
    rules: &RuleSet,
) -> Option<i64> {
    let (w, n) = (rule.window_ms, rule.limit);
    let expires = pair.latest.saturating_add(rules.retention_ms());
    match rule.kind {
        WindowKind::Sliding => sliding_rejects_until(&pair.log, w, n, t),
        WindowKind::Fixed => pair
            .fixed
            .iter()
            .rev()
            .find(|(&b, &c)| c >= n && bucket_end(b, w, rules.grace_ms) > l_new)
            .map(|(&b, _)| b.saturating_add(1).saturating_mul(w).saturating_sub(1)),
        WindowKind::SlidingApprox => {
            let a = pair.approx;
            a.bucket
                .and_then(|cb| approx_rejects_until(cb, a.cur, a.prev, w, n, expires))
        }
        WindowKind::TokenBucket => match (pair.tat, rule.rate) {
            (Some(tat), Some(rate)) => tat
                .rejects_until(t, rate, n)
                .map(|s| s.min(expires.saturating_sub(1))),
            _ => None,
        },
        WindowKind::DistinctCallees | WindowKind::Concurrent => None,
    }
    .filter(|&s| s > t)
}

/// A sliding count at `t` over the sorted recorded times `log`, this call
/// included: `1 + |{e in log: t - w < e <= t}|`.
pub(super) fn sliding_count(log: &VecDeque<i64>, t: i64, w: i64) -> u64 {
    let lo = log.partition_point(|&x| x <= t.saturating_sub(w));
    // Calls in time order: every recorded time is at or before t.
    let hi = if log.back().is_none_or(|&b| b <= t) {
        log.len()
    } else {
        log.partition_point(|&x| x <= t)
    };
    1 + (hi - lo) as u64
}

/// The last time after which a sliding rule (window `w`, limit `n`) stops
/// rejecting, given the sorted recorded times `log`: the largest `e_i + w - 1`
/// with `e_{i+n-1} <= e_i + w - 1`, if it is after `t`.
pub(super) fn sliding_rejects_until(log: &VecDeque<i64>, w: i64, n: u64, t: i64) -> Option<i64> {
    let n = usize::try_from(n).ok()?;
    let k = log.len();
    if n == 0 || k < n {
        return None;
    }
    for i in (0..=k - n).rev() {
        let end = log[i].saturating_add(w - 1);
        if end <= t {
            return None;
        }
        if log[i + n - 1] <= end {
            return Some(end);
        }
    }
    None
}

/// The last time a sliding-approx rule (window `w`, limit `n`) rejects, for
/// counters `cur` and `prev` of bucket `cb` and no further calls; `expires`
/// is when the caller's state expires (from then on every call counts 1).
pub(crate) fn approx_rejects_until(
    cb: i64,
    cur: u64,
    prev: u64,
    w: i64,
    n: u64,
    expires: i64,
) -> Option<i64> {
    let wu = w as u128;
    // Within a bucket the estimate is floor(x * (w - r - 1) / w) + extra,
    // over the limit while x * (w - r - 1) >= (n - extra + 1) * w, so the
    // last rejecting offset is w - 1 - ceil((n - extra + 1) * w / x).
    let last_offset = |x: u64, extra: u64| -> Option<i64> {
        if extra > n {
            return Some(w - 1);
        }
        if x == 0 {
            return None;
        }
        let need = (n - extra + 1) as u128 * wu; // 1 <= extra <= n here
        let ceil = need.div_ceil(x as u128);
        let r = wu.checked_sub(1)?.checked_sub(ceil)?;
        Some(r as i64)
    };
    let start = |b: i64| b.saturating_mul(w);
    let segments = [
        (cb.saturating_add(1), last_offset(cur, 1)),
        (cb, last_offset(prev, cur.saturating_add(1))),
        (
            cb.saturating_sub(1),
            (prev.saturating_add(1) > n).then_some(w - 1),
        ),
    ];
    for (b, offset) in segments {
        if let Some(r) = offset {
            let s = start(b).saturating_add(r).min(expires.saturating_sub(1));
            if s >= start(b) {
                return Some(s);
            }
        }
    }
    None
}

/// The sliding-approx estimate from the counters (integer arithmetic, as in Lua).
pub fn approx_estimate(prev: u64, cur: u64, w: i64, r: i64) -> u64 {
    let weight = (w - r - 1).max(0) as u128;
    ((prev as u128 * weight) / w as u128) as u64 + cur + 1
}

/// The caller's latest time after an event, and the horizons it sets.
#[derive(Debug, Clone, Copy)]
pub(super) struct Horizons {
    /// `L' = max(L, t)`.
    pub(super) latest: i64,
    /// `L' - R`: window data at or below it is dropped.
    pub(super) retention: i64,
    /// `L' - D`: idempotency records at or below it are dropped.
    pub(super) dedup: i64,
}

impl Horizons {
    pub(super) fn new(rules: &RuleSet, latest: Option<i64>, t: i64) -> Self {
        let l_new = latest.map_or(t, |l| l.max(t));
        Horizons {
            latest: l_new,
            retention: l_new.saturating_sub(rules.retention_ms()),
            dedup: l_new.saturating_sub(rules.dedup_ms()),
        }
    }
}

/// A rule's part of the retry-after of a call at `t` whose window would
/// reject until `s`: the last instant of `[t, s]` its time profile holds at
/// (`None`: none), since it rejects only calls it sees. Past `t + grace +
/// retention`, which only a late call's part reaches (its caller's latest
/// call is more than the grace ahead of it), `s` stands, as if the profile
/// held there: the window script is given the profile's ranges up to
/// there, and every store answers alike (never too early).
fn profiled(rules: &RuleSet, rule: &Rule, t: i64, s: i64) -> Option<i64> {
    let span_end = t
        .saturating_add(rules.grace_ms)
        .saturating_add(rules.retention_ms());
    if s > span_end {
        return Some(s);
    }
    rule.filter.last_seen_within(t, s)
}

impl CallerState {
    /// Shadow rules never reject; the later call is this one again (the
    /// same callee); a rule with a time profile rejects only at the times
    /// the profile holds, so its part ends at the last of them before its
    /// window would let the call through ([`profiled`]).
    pub(super) fn retry_after(&mut self, rules: &RuleSet, ev: &CallEvent, l_new: i64) -> i64 {
        let t = ev.ts_ms;
        let profiled = |rule: &Rule, s: i64| profiled(rules, rule, t, s);
        let expires = l_new.saturating_add(rules.retention_ms());
        let own = ev.callee.as_deref().filter(|c| !c.is_empty());
        let mut last = t;
        for (i, rule) in rules.rules.iter().enumerate() {
            if rule.shadow || !rule.filter.sees_callee(ev.callee_for_filters()) {
                continue;
            }
            if rule.key.is_aggregate() {
                // Its window is the callee's (or everyone's): as the gate saw it.
                if let Some(s) = ev.aggregated(i).until {
                    last = last.max(s);
                }
                continue;
            }
            let (w, n) = (rule.window_ms, rule.limit);
            if rule.kind == WindowKind::Concurrent {
                // Keyed by caller and callee: the calls to this callee.
                let by_callee = rule.key == RuleKey::CallerCallee;
                if by_callee && own.is_none() {
                    continue;
                }
                let callee = own.filter(|_| by_callee);
                let s = slot(&mut self.rare_mut().open, rule).rejects_until(t, n, callee);
                if let Some(s) = s.and_then(|s| profiled(rule, s)) {
                    last = last.max(s);
                }
                continue;
            }
            if rule.sum.is_some() {
                let shape = super::Shape::of(rule, rules.grace_ms);
                let s = slot(&mut self.rare_mut().sums, rule).rejects_until(shape, t, n);
                if let Some(s) = s.and_then(|s| profiled(rule, s)) {
                    last = last.max(s);
                }
                continue;
            }
            if rule.key == RuleKey::CallerCallee {
                let pair = own.and_then(|c| slot(&mut self.rare_mut().pairs, rule).get(c));
                let s = pair.and_then(|p| pair_rejects_until(rule, p, t, l_new, rules));
                if let Some(s) = s.and_then(|s| profiled(rule, s)) {
                    last = last.max(s);
                }
                continue;
            }
            let rejects_until = match rule.kind {
                WindowKind::Sliding if rule.own_log() => {
                    sliding_rejects_until(slot(&mut self.rare_mut().own_logs, rule), w, n, t)
                }
                WindowKind::Sliding => sliding_rejects_until(&self.log, w, n, t),
                WindowKind::TokenBucket => {
                    match (*slot(&mut self.rare_mut().buckets, rule), rule.rate) {
                        (Some(tat), Some(rate)) => tat
                            .rejects_until(t, rate, n)
                            .map(|s| s.min(expires.saturating_sub(1))),
                        _ => None,
                    }
                }
                WindowKind::DistinctCallees => own.and_then(|own| {
                    slot(&mut self.rare_mut().distinct, rule)
                        .rejects_until(own, t, w, n)
                        .map(|s| s.min(expires.saturating_sub(1)))
                }),
                WindowKind::Fixed => slot(&mut self.fixed, rule)
                    .iter()
                    .rev()
                    .find(|(&b, &c)| c >= n && bucket_end(b, w, rules.grace_ms) > l_new)
                    .map(|(&b, _)| b.saturating_add(1).saturating_mul(w).saturating_sub(1)),
                WindowKind::SlidingApprox => {
                    let a = *slot(&mut self.approx, rule);
                    a.bucket
                        .and_then(|cb| approx_rejects_until(cb, a.cur, a.prev, w, n, expires))
                }
                // Taken above.
                WindowKind::Concurrent => None,
            };
            if let Some(s) = rejects_until.and_then(|s| profiled(rule, s)) {
                last = last.max(s);
            }
        }
        last.saturating_add(1).saturating_sub(t)
    }
}

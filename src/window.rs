//! The window algorithm for one caller: the reference semantics.
//!
//! Every store must produce exactly what [`CallerState::apply`] produces; the
//! Redis script (`lua/window.lua`) is a line-by-line port of it. The contract
//! (also in the README):
//!
//! * `L` is the caller's latest event time before the event, `t` the event
//!   time, `L' = max(L, t)`, `R` the retention (longest window + grace) and
//!   `H = L' - R` the horizon. Recorded data with `ts <= H` is dropped, and a
//!   previous state whose `L <= H` counts as no state at all.
//! * A call id already decided, whose record is newer than `L' - D` (`D`, the
//!   idempotency horizon, is at least `R`), gets the same record back and
//!   changes nothing.
//! * sliding: count = 1 + recorded events with ts in `(t - W, t]`.
//! * fixed: bucket `b = floor(t / W)`; count = 1 + recorded events in `b`.
//!   A bucket is dead once `(b + 1) * W + grace <= L'`: a late event in a
//!   dead bucket counts 1 and is not recorded.
//! * sliding-approx: counters for the current bucket `B` and the one before;
//!   the estimate is `floor(prev * (W - r - 1) / W) + cur + 1` with
//!   `r = t - b * W` (the previous bucket weighted by its overlap with
//!   `(t - W, t]`, in whole milliseconds). An event in bucket `B - 1` counts
//!   `prev + 1`; older buckets count 1 and are not recorded.
//! * `late = L exists and t < L - grace`.
//! * Decision: denylist, then allowlist, then the first rule whose count
//!   exceeds its limit; shadow mode emits `allow` instead of `reject`.
//! * Recording: every event under `attempts`; under `admitted` only events
//!   whose decision (before shadow) is allow.
//! * Distinct callees (a feature, when the rule set keeps it): each callee's
//!   latest call time is kept for every non-duplicate call that names one,
//!   whatever its decision, and trimmed at `H` like the rest. The feature is
//!   the number of callees whose latest call time is after `t - Wmax`
//!   (`Wmax` the longest window), this call's callee included. For calls in
//!   time order that is the distinct callees in `(t - Wmax, t]`.

use std::collections::{BTreeMap, VecDeque};

use foldhash::HashMap;

use crate::decision::{
    Decision, DecisionRecord, Verdict, REASON_ALLOWLIST, REASON_DENYLIST, REASON_OK,
};
use crate::event::CallEvent;
use crate::rules::{CountPolicy, Listed, RuleSet, WindowKind};

/// State of the two-bucket approximate counter of one rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Approx {
    bucket: Option<i64>,
    cur: u64,
    prev: u64,
}

/// All window state of one caller.
#[derive(Debug, Clone, Default)]
pub struct CallerState {
    latest: Option<i64>,
    /// Sorted event times of recorded events (shared by all sliding rules);
    /// a deque, as calls in time order append at the back and trim the front.
    log: VecDeque<i64>,
    /// Per rule: fixed bucket → recorded count.
    fixed: Vec<BTreeMap<i64, u64>>,
    /// Per rule: approximate counter.
    approx: Vec<Approx>,
    /// Idempotency: call id → the verdict it got.
    seen: HashMap<String, Verdict>,
    /// Idempotency index for trimming: call ids by (ts, insertion order).
    /// Sorted deques here and below: calls in time order append at the
    /// back and trim the front, and a sparse caller costs a few bytes, not
    /// a B-tree node.
    seen_by_ts: VecDeque<(i64, String)>,
    /// Distinct callees: callee → latest event time of a call to it.
    callees: HashMap<String, i64>,
    /// (time, callee, still its latest call) ordered by time, for trimming
    /// and counting. A callee called again marks its old entry stale rather
    /// than removing it from the middle: calls in time order then only
    /// append and trim, whatever a busy trunk's callee list looks like.
    callees_by_ts: VecDeque<(i64, String, bool)>,
}

/// Bucket of `t` for a window of `w` ms (floor division, also for negative times).
pub fn bucket_of(t: i64, w: i64) -> i64 {
    t.div_euclid(w)
}

/// The sliding-approx estimate from the counters (integer arithmetic, as in Lua).
pub fn approx_estimate(prev: u64, cur: u64, w: i64, r: i64) -> u64 {
    let weight = (w - r - 1).max(0) as u128;
    ((prev as u128 * weight) / w as u128) as u64 + cur + 1
}

impl CallerState {
    /// The caller's latest event time.
    pub fn latest(&self) -> Option<i64> {
        self.latest
    }

    /// Applies one event and returns its verdict.
    pub fn apply(&mut self, rules: &RuleSet, ev: &CallEvent) -> Verdict {
        self.apply_with(rules, ev, true)
    }

    /// [`CallerState::apply`], where `remember = false` says the call id
    /// occurs nowhere else in the input: the idempotency lookup would miss
    /// and the record would never be looked up, so both are skipped (the
    /// verdict is the same; offline replays of unique ids save the work and
    /// the memory).
    pub fn apply_with(&mut self, rules: &RuleSet, ev: &CallEvent, remember: bool) -> Verdict {
        let t = ev.ts_ms;
        let retention = rules.retention_ms();
        let l_new = self.latest.map_or(t, |l| l.max(t));
        let horizon = l_new - retention;
        let dedup_horizon = l_new - rules.dedup_ms();
        let prev = self.latest.filter(|&l| l > horizon);

        if let Some(v) = self.seen.get(&ev.call_id).filter(|_| remember) {
            if v.record.ts_ms > dedup_horizon {
                let mut v = v.clone();
                v.duplicate = true;
                return v;
            }
        }

        if prev.is_none() {
            // No window data older than the horizon can matter: start afresh
            // (idempotency records have their own, longer horizon).
            let kept = CallerState {
                seen: std::mem::take(&mut self.seen),
                seen_by_ts: std::mem::take(&mut self.seen_by_ts),
                ..CallerState::default()
            };
            *self = kept;
        }
        self.trim(rules, horizon, dedup_horizon, l_new);
        if self.fixed.len() != rules.rules.len() {
            self.fixed = vec![BTreeMap::new(); rules.rules.len()];
            self.approx = vec![Approx::default(); rules.rules.len()];
        }

        let distinct_callees = rules.tracks_callees().then(|| {
            if let Some(callee) = ev.callee.as_deref().filter(|c| !c.is_empty()) {
                self.note_callee(callee, t);
            }
            // Live entries not after t - Wmax lie between the horizon and
            // t - Wmax + 1 (at most grace + 1 ms), so counting them is cheap.
            let after = t.saturating_sub(rules.max_window_ms()).saturating_add(1);
            let band = self.callees_by_ts.partition_point(|(ts, _, _)| *ts < after);
            let not_after = self
                .callees_by_ts
                .range(..band)
                .filter(|(_, _, live)| *live)
                .count();
            (self.callees.len() - not_after) as u64
        });

        let late = prev.is_some_and(|l| t < l - rules.grace_ms);
        let mut counts = Vec::with_capacity(rules.rules.len());
        for (i, rule) in rules.rules.iter().enumerate() {
            let w = rule.window_ms;
            let count = match rule.kind {
                WindowKind::Sliding => {
                    let lo = self.log.partition_point(|&x| x <= t - w);
                    let hi = self.log.partition_point(|&x| x <= t);
                    1 + (hi - lo) as u64
                }
                WindowKind::Fixed => {
                    let b = bucket_of(t, w);
                    if (b + 1) * w + rules.grace_ms <= l_new {
                        1
                    } else {
                        1 + self.fixed[i].get(&b).copied().unwrap_or(0)
                    }
                }
                WindowKind::SlidingApprox => {
                    let b = bucket_of(t, w);
                    let a = &mut self.approx[i];
                    match a.bucket {
                        None => {
                            *a = Approx {
                                bucket: Some(b),
                                cur: 0,
                                prev: 0,
                            }
                        }
                        Some(cb) if b > cb => {
                            let prev = if b == cb + 1 { a.cur } else { 0 };
                            *a = Approx {
                                bucket: Some(b),
                                cur: 0,
                                prev,
                            };
                        }
                        _ => {}
                    }
                    let cb = a.bucket.unwrap_or(b);
                    if b == cb {
                        approx_estimate(a.prev, a.cur, w, t - b * w)
                    } else if b == cb - 1 {
                        a.prev + 1
                    } else {
                        1
                    }
                }
            };
            counts.push(count);
        }

        let (would, reason) = match rules.listed(&ev.caller) {
            Listed::Deny => (Decision::Reject, REASON_DENYLIST.to_string()),
            Listed::Allow => (Decision::Allow, REASON_ALLOWLIST.to_string()),
            Listed::No => match rules.rules.iter().zip(&counts).find(|(r, &c)| c > r.limit) {
                Some((r, _)) => (Decision::Reject, r.name.clone()),
                None => (Decision::Allow, REASON_OK.to_string()),
            },
        };
        let record_it = rules.count == CountPolicy::Attempts || would == Decision::Allow;
        if record_it {
            self.record(rules, t, l_new);
        }
        self.latest = Some(l_new);

        let shadow = rules.shadow && would == Decision::Reject;
        let verdict = Verdict {
            record: DecisionRecord {
                call_id: ev.call_id.clone(),
                caller: ev.caller.clone(),
                ts_ms: t,
                decision: if shadow { Decision::Allow } else { would },
                reason,
                counts,
                shadow,
                late,
                degraded: false,
                rules_version: rules.version().to_string(),
            },
            prev_ts_ms: prev,
            distinct_callees,
            duplicate: false,
        };
        if remember {
            let pos = self.seen_by_ts.partition_point(|(ts, _)| *ts <= t);
            self.seen_by_ts.insert(pos, (t, ev.call_id.clone()));
            self.seen.insert(ev.call_id.clone(), verdict.clone());
        }
        verdict
    }

    fn record(&mut self, rules: &RuleSet, t: i64, l_new: i64) {
        if rules.has_sliding() {
            let pos = self.log.partition_point(|&x| x <= t);
            self.log.insert(pos, t);
        }
        for (i, rule) in rules.rules.iter().enumerate() {
            let w = rule.window_ms;
            let b = bucket_of(t, w);
            match rule.kind {
                WindowKind::Sliding => {}
                WindowKind::Fixed => {
                    if (b + 1) * w + rules.grace_ms > l_new {
                        *self.fixed[i].entry(b).or_insert(0) += 1;
                    }
                }
                WindowKind::SlidingApprox => {
                    let a = &mut self.approx[i];
                    match a.bucket {
                        Some(cb) if cb == b => a.cur += 1,
                        Some(cb) if cb == b + 1 => a.prev += 1,
                        _ => {}
                    }
                }
            }
        }
    }

    /// Raises the callee's latest call time to `t` (never lowers it).
    fn note_callee(&mut self, callee: &str, t: i64) {
        match self.callees.get_mut(callee) {
            Some(latest) if *latest >= t => {}
            Some(latest) => {
                let old = *latest;
                *latest = t;
                let at = self
                    .callees_by_ts
                    .partition_point(|(ts, c, _)| (*ts, c.as_str()) < (old, callee));
                if let Some(entry) = self.callees_by_ts.get_mut(at) {
                    entry.2 = false;
                }
                self.insert_callee(t, callee.to_string());
            }
            None => {
                self.callees.insert(callee.to_string(), t);
                self.insert_callee(t, callee.to_string());
            }
        }
    }

    fn insert_callee(&mut self, t: i64, callee: String) {
        let at = self
            .callees_by_ts
            .partition_point(|(ts, c, _)| (*ts, c.as_str()) < (t, callee.as_str()));
        self.callees_by_ts.insert(at, (t, callee, true));
    }

    fn trim(&mut self, rules: &RuleSet, horizon: i64, dedup_horizon: i64, l_new: i64) {
        let cut = self.log.partition_point(|&x| x <= horizon);
        self.log.drain(..cut);
        for (i, rule) in rules.rules.iter().enumerate() {
            if let Some(map) = self.fixed.get_mut(i) {
                let w = rule.window_ms;
                map.retain(|&b, _| (b + 1) * w + rules.grace_ms > l_new);
            }
        }
        while self
            .callees_by_ts
            .front()
            .is_some_and(|(ts, _, _)| *ts <= horizon)
        {
            if let Some((_, callee, true)) = self.callees_by_ts.pop_front() {
                self.callees.remove(&callee);
            }
        }
        while self
            .seen_by_ts
            .front()
            .is_some_and(|(ts, _)| *ts <= dedup_horizon)
        {
            let Some((_, id)) = self.seen_by_ts.pop_front() else {
                break;
            };
            if self
                .seen
                .get(&id)
                .is_some_and(|v| v.record.ts_ms <= dedup_horizon)
            {
                self.seen.remove(&id);
            }
        }
    }
}

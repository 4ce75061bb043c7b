//! A brute-force reference of the window contract: every decision is
//! recomputed from the full history, with no incremental state. The random
//! tests compare the stores with it.
#![allow(dead_code)]

use callguard::engine::event::CallEvent;
use callguard::engine::record::{Decision, REASON_ALLOWLIST, REASON_DENYLIST, REASON_OK};
use callguard::engine::rules::{CountPolicy, Listed, RuleSet, WindowKind};

/// What the reference says of one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub ts_ms: i64,
    pub decision: Decision,
    pub reason: String,
    pub counts: Vec<u64>,
    pub shadow: bool,
    pub late: bool,
    pub prev_ts_ms: Option<i64>,
    pub distinct_callees: Option<u64>,
    pub duplicate: bool,
    pub retry_after_ms: Option<i64>,
}

struct Past {
    caller: String,
    call_id: String,
    callee: Option<String>,
    ts: i64,
    recorded: bool,
    /// At or below the horizon `L' - R` when decided: past the retention,
    /// so no sliding-approx counter holds it.
    beyond: bool,
    expected: Expected,
}

/// Decides `events` in order by brute force, without retry-afters (every
/// `retry_after_ms` is `None`).
pub fn decide_all(rules: &RuleSet, events: &[CallEvent]) -> Vec<Expected> {
    decide(rules, events, false)
}

/// [`decide_all`] with the retry-after of every reject, found by deciding a
/// probe call at every later millisecond until the caller's state would
/// expire (so keep windows short).
pub fn decide_all_with_retry(rules: &RuleSet, events: &[CallEvent]) -> Vec<Expected> {
    decide(rules, events, true)
}

fn decide(rules: &RuleSet, events: &[CallEvent], retry: bool) -> Vec<Expected> {
    let mut history: Vec<Past> = Vec::new();
    let mut out = Vec::new();
    for e in events {
        let mut expected = decide_one(rules, &history, e);
        if expected.duplicate {
            out.push(expected);
            continue;
        }
        let recorded = rules.count == CountPolicy::Attempts
            || (expected.decision == Decision::Allow && !expected.shadow);
        let latest = history
            .iter()
            .filter(|p| p.caller == e.caller)
            .map(|p| p.ts)
            .max()
            .map_or(e.ts_ms, |l| l.max(e.ts_ms));
        let beyond = e.ts_ms <= latest - rules.retention_ms();
        history.push(Past {
            caller: e.caller.to_string(),
            call_id: e.call_id.to_string(),
            callee: e.callee.as_ref().map(|c| c.to_string()),
            ts: e.ts_ms,
            recorded,
            beyond,
            expected: expected.clone(),
        });
        if retry && expected.decision == Decision::Reject && expected.reason != REASON_DENYLIST {
            expected.retry_after_ms = Some(retry_after(rules, &history, e));
            history.last_mut().expect("just pushed").expected = expected.clone();
        }
        out.push(expected);
    }
    out
}

/// The smallest `d >= 1` such that a probe call at every time `>= t + d`
/// is allowed, given `history` (which ends with the call at `t`).
fn retry_after(rules: &RuleSet, history: &[Past], e: &CallEvent) -> i64 {
    let t = e.ts_ms;
    let latest = history
        .iter()
        .filter(|p| p.caller == e.caller)
        .map(|p| p.ts)
        .max()
        .unwrap_or(t);
    // From latest + retention on, the caller starts afresh: every call counts 1.
    let end = latest + rules.retention_ms();
    let mut last_reject = t;
    for s in t + 1..end {
        let probe = CallEvent {
            call_id: "probe-never-used".into(),
            ts_ms: s,
            callee: None,
            ..e.clone()
        };
        let x = decide_one(rules, history, &probe);
        assert!(!x.duplicate, "a probe is no duplicate");
        if x.decision == Decision::Reject {
            last_reject = s;
        }
    }
    last_reject + 1 - t
}

/// What the contract says of `e` after `history` (for a duplicate, the
/// record it got before).
fn decide_one(rules: &RuleSet, history: &[Past], e: &CallEvent) -> Expected {
    let retention = rules.retention_ms();
    let t = e.ts_ms;
    let prior: Vec<&Past> = history.iter().filter(|p| p.caller == e.caller).collect();
    let latest = prior.iter().map(|p| p.ts).max();
    let l_new = latest.map_or(t, |l| l.max(t));
    let h = l_new - retention;
    if let Some(p) = prior
        .iter()
        .rev()
        .find(|p| p.call_id == e.call_id && p.ts > l_new - rules.dedup_ms())
    {
        let mut x = p.expected.clone();
        x.duplicate = true;
        return x;
    }
    let prev = latest.filter(|&l| l > h);
    // Events since the caller's state last started afresh.
    let mut epoch_start = 0;
    {
        let mut l: Option<i64> = None;
        for (i, p) in prior.iter().enumerate() {
            let ln = l.map_or(p.ts, |l| l.max(p.ts));
            if l.is_none_or(|l| l <= ln - retention) {
                epoch_start = i;
            }
            l = Some(ln);
        }
    }
    let live: Vec<&&Past> = if prev.is_some() {
        prior[epoch_start..].iter().collect()
    } else {
        Vec::new()
    };
    let mut counts = Vec::new();
    for rule in &rules.rules {
        let w = rule.window_ms;
        let b = t.div_euclid(w);
        let rec_in = |bucket: i64| {
            live.iter()
                .filter(|p| p.recorded && p.ts.div_euclid(w) == bucket)
                .count() as u64
        };
        let c = match rule.kind {
            WindowKind::Sliding => {
                1 + live
                    .iter()
                    .filter(|p| p.recorded && p.ts > h && p.ts > t - w && p.ts <= t)
                    .count() as u64
            }
            WindowKind::Fixed => {
                if (b + 1) * w + rules.grace_ms <= l_new {
                    1
                } else {
                    1 + rec_in(b)
                }
            }
            WindowKind::SlidingApprox => {
                let bmax = live
                    .iter()
                    .map(|p| p.ts.div_euclid(w))
                    .max()
                    .map_or(b, |m| m.max(b));
                // The counters hold recorded calls that were above the
                // horizon when decided; a call at or below it counts 1.
                let counted = |bucket: i64| {
                    live.iter()
                        .filter(|p| p.recorded && !p.beyond && p.ts.div_euclid(w) == bucket)
                        .count() as u64
                };
                if b == bmax {
                    let r = t - b * w;
                    counted(b - 1) * ((w - r - 1).max(0) as u64) / (w as u64) + counted(b) + 1
                } else if b == bmax - 1 && t > h {
                    counted(b) + 1
                } else {
                    1
                }
            }
        };
        counts.push(c);
    }
    let (would, reason) = match rules.listed(&e.caller) {
        Listed::Deny => (Decision::Reject, REASON_DENYLIST.to_string()),
        Listed::Allow => (Decision::Allow, REASON_ALLOWLIST.to_string()),
        Listed::No => match rules.rules.iter().zip(&counts).find(|(r, &c)| c > r.limit) {
            Some((r, _)) => (Decision::Reject, r.name.clone()),
            None => (Decision::Allow, REASON_OK.to_string()),
        },
    };
    let distinct_callees = rules.tracks_callees().then(|| {
        // A callee's latest call time among this caller's decided calls;
        // gone once at or below the horizon, then raised by this call.
        let named = |c: &Option<String>| c.clone().filter(|c| !c.is_empty());
        let mut latest: std::collections::HashMap<String, i64> = Default::default();
        for p in &prior {
            if let Some(c) = named(&p.callee) {
                let v = latest.entry(c).or_insert(p.ts);
                *v = (*v).max(p.ts);
            }
        }
        latest.retain(|_, v| *v > h);
        if let Some(c) = named(&e.callee.as_ref().map(|c| c.to_string())) {
            let v = latest.entry(c).or_insert(t);
            *v = (*v).max(t);
        }
        latest
            .values()
            .filter(|&&v| v > t - rules.max_window_ms())
            .count() as u64
    });
    let shadow = rules.shadow && would == Decision::Reject;
    Expected {
        ts_ms: t,
        decision: if shadow { Decision::Allow } else { would },
        reason,
        counts,
        shadow,
        late: prev.is_some_and(|l| t < l - rules.grace_ms),
        prev_ts_ms: prev,
        distinct_callees,
        duplicate: false,
        retry_after_ms: None,
    }
}

//! A brute-force reference of the window contract: every decision is
//! recomputed from the full history, with no incremental state. The random
//! tests compare the stores with it.
#![allow(dead_code)]

use callguard::engine::event::{CallEvent, EventKind};
use callguard::engine::rates::Price;
use callguard::engine::record::{
    Decision, REASON_ALLOWLIST, REASON_BAD_CALLER, REASON_DENYLIST, REASON_END, REASON_OK,
};
use callguard::engine::rules::{CountPolicy, Listed, RuleKey, RuleSet, WindowKind};

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
    pub warn: Option<String>,
    /// A call's end: applied, not decided.
    pub end: bool,
}

struct Past {
    caller: String,
    call_id: String,
    callee: Option<String>,
    ts: i64,
    /// Per rule: the rule saw the call.
    seen: Vec<bool>,
    /// Per rule: the rule saw and recorded the call.
    recorded: Vec<bool>,
    /// The caller's horizon `L' - R` when the call was decided.
    horizon: i64,
    /// At or below the horizon `L' - R` when decided: past the retention,
    /// so no sliding-approx counter holds it.
    beyond: bool,
    /// Per rule: a concurrent rule saw the call allowed, so holds it open.
    opened: Vec<bool>,
    /// The time of the first end that reached the call while it was held
    /// (or that came before it and was kept for it).
    end: Option<i64>,
    /// Some concurrent rule still holds it: opened, not yet trimmed (its
    /// close at or below a later call's horizon) nor dropped with its
    /// caller's state (started afresh).
    held: bool,
    /// Per sum rule: the call waits for its end (seen allowed, no end yet,
    /// not let go by a later call's `L' - grace`).
    waits: Vec<bool>,
    /// Per sum rule: its price for the call (cost sums).
    prices: Vec<Option<Price>>,
    /// Per sum rule: what its end added, and when.
    adds: Vec<Option<(i64, u64)>>,
    expected: Expected,
}

/// An end kept for a call not seen yet: (caller, call id, end time, talk
/// time: kept only when the rule set adds up talk, else 0).
type Pending = (String, String, i64, i64);

impl Past {
    /// When the call stops holding a slot of concurrent rule `i`.
    fn close(&self, rules: &RuleSet, i: usize) -> i64 {
        let longest = self.ts + rules.rules[i].window_ms;
        self.end.map_or(longest, |e| e.max(self.ts).min(longest))
    }
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
    let mut pending: Vec<Pending> = Vec::new();
    let mut out = Vec::new();
    for e in events {
        if e.kind == EventKind::End {
            end_call(rules, &mut history, &mut pending, e);
            out.push(Expected {
                ts_ms: e.ts_ms,
                decision: Decision::Allow,
                reason: REASON_END.to_string(),
                counts: vec![0; rules.rules.len()],
                shadow: false,
                late: false,
                prev_ts_ms: None,
                distinct_callees: None,
                duplicate: false,
                retry_after_ms: None,
                warn: None,
                end: true,
            });
            continue;
        }
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
        let seen: Vec<bool> = rules.rules.iter().map(|r| r.filter.sees(e)).collect();
        let opened: Vec<bool> = rules
            .rules
            .iter()
            .zip(&seen)
            .map(|(r, &s)| {
                let named = e.callee.as_deref().is_some_and(|c| !c.is_empty());
                s && r.kind == WindowKind::Concurrent
                    && (r.key != RuleKey::CallerCallee || named)
                    && expected.decision == Decision::Allow
                    && !beyond
            })
            .collect();
        // The caller's calls held open are dropped once closed at or
        // before L' - grace (only a late call could count them), or all
        // when it starts afresh; its kept ends at the idempotency horizon.
        let afresh = expected.prev_ts_ms.is_none();
        let horizon = latest - rules.grace_ms;
        for p in history
            .iter_mut()
            .filter(|p| p.caller == e.caller && p.held)
        {
            p.held = !afresh
                && (0..rules.rules.len()).any(|i| p.opened[i] && p.close(rules, i) > horizon);
        }
        let dedup_horizon = latest - rules.dedup_ms();
        pending.retain(|(c, _, ts, _)| *c != e.caller || *ts > dedup_horizon);
        // A call waiting for its end in a sum rule is let go once its
        // start plus max_duration is at or below a later call's L' - grace.
        for p in history.iter_mut().filter(|p| p.caller == e.caller) {
            for (i, rule) in rules.rules.iter().enumerate() {
                if let Some(sum) = &rule.sum {
                    p.waits[i] &= p.ts + sum.max_duration_ms > latest - rules.grace_ms;
                }
            }
        }
        let mut waits: Vec<bool> = rules
            .rules
            .iter()
            .zip(&seen)
            .map(|(r, &s)| r.sum.is_some() && s && expected.decision == Decision::Allow && !beyond)
            .collect();
        // An end that came first, kept within the idempotency horizon, is
        // the call's (taken once, by a call some concurrent rule holds or
        // some sum rule waits on).
        let mut taken = None;
        if opened.contains(&true) || waits.contains(&true) {
            if let Some(at) = pending
                .iter()
                .position(|(c, id, _, _)| *c == e.caller && *id == e.call_id)
            {
                let (_, _, end, talk) = pending.remove(at);
                taken = Some((end, talk));
            }
        }
        let prices: Vec<Option<Price>> = rules
            .rules
            .iter()
            .map(|r| r.sum.as_ref().and_then(|s| s.price(e.callee_for_filters())))
            .collect();
        let mut adds = vec![None; rules.rules.len()];
        if let Some((end, talk)) = taken {
            for (i, rule) in rules.rules.iter().enumerate() {
                let Some(sum) = rule.sum.as_ref().filter(|_| waits[i]) else {
                    continue;
                };
                waits[i] = false;
                if end < e.ts_ms + sum.max_duration_ms {
                    adds[i] = Some((end.max(e.ts_ms), sum.amount(prices[i], talk)));
                }
            }
        }
        let end = taken.map(|(end, _)| end);
        history.push(Past {
            held: opened.contains(&true),
            waits,
            prices,
            adds,
            opened,
            end,
            caller: e.caller.to_string(),
            call_id: e.call_id.to_string(),
            callee: e.callee.as_ref().map(|c| c.to_string()),
            ts: e.ts_ms,
            recorded: seen.iter().map(|&s| s && recorded).collect(),
            seen,
            horizon: latest - rules.retention_ms(),
            beyond,
            expected: expected.clone(),
        });
        let listed = [REASON_DENYLIST, REASON_BAD_CALLER].contains(&expected.reason.as_str());
        if retry && expected.decision == Decision::Reject && !listed {
            expected.retry_after_ms = Some(retry_after(rules, &history, e));
            history.last_mut().expect("just pushed").expected = expected.clone();
        }
        out.push(expected);
    }
    out
}

/// A call's end: closes the call if some concurrent rule holds it (the
/// latest by start of that id), else is kept for a call not decided yet,
/// else (the call was decided within the idempotency horizon) changes
/// nothing.
fn end_call(rules: &RuleSet, history: &mut [Past], pending: &mut Vec<Pending>, e: &CallEvent) {
    let sums = rules.rules.iter().any(|r| r.sum.is_some());
    if !sums && !rules.rules.iter().any(|r| r.kind == WindowKind::Concurrent) {
        return;
    }
    let mine: Vec<usize> = (0..history.len())
        .filter(|&k| history[k].caller == e.caller)
        .collect();
    let latest = mine.iter().map(|&k| history[k].ts).max();
    let held = mine
        .iter()
        .copied()
        .filter(|&k| history[k].held && history[k].call_id == e.call_id)
        .max_by_key(|&k| (history[k].ts, k));
    let mut found = held.is_some();
    if let Some(k) = held {
        if history[k].end.is_none() {
            history[k].end = Some(e.ts_ms);
        }
    }
    // Each sum rule's latest waiting call of that id stops waiting; its
    // end adds if it came within max_duration.
    let talk = e.talk_ms.unwrap_or(0);
    for (i, rule) in rules.rules.iter().enumerate() {
        let Some(sum) = &rule.sum else { continue };
        let waiting = mine
            .iter()
            .copied()
            .filter(|&k| history[k].waits[i] && history[k].call_id == e.call_id)
            .max_by_key(|&k| (history[k].ts, k));
        if let Some(k) = waiting {
            found = true;
            let p = &mut history[k];
            p.waits[i] = false;
            if e.ts_ms < p.ts + sum.max_duration_ms {
                p.adds[i] = Some((e.ts_ms.max(p.ts), sum.amount(p.prices[i], talk)));
            }
        }
    }
    if found {
        return;
    }
    let dedup_horizon = latest.map_or(i64::MIN, |l| l - rules.dedup_ms());
    let seen = mine
        .iter()
        .rev()
        .find(|&&k| history[k].call_id == e.call_id)
        .is_some_and(|&k| history[k].ts > dedup_horizon);
    let noted = pending
        .iter()
        .any(|(c, id, _, _)| *c == e.caller && *id == e.call_id);
    if !seen && !noted {
        let talk = if sums { talk } else { 0 };
        pending.push((e.caller.to_string(), e.call_id.to_string(), e.ts_ms, talk));
    }
}

/// Where a caller's calls (`prior`, in processing order) last started afresh.
fn epoch_start(retention: i64, prior: &[&Past]) -> usize {
    let mut start = 0;
    let mut l: Option<i64> = None;
    for (i, p) in prior.iter().enumerate() {
        let ln = l.map_or(p.ts, |l| l.max(p.ts));
        if l.is_none_or(|l| l <= ln - retention) {
            start = i;
        }
        l = Some(ln);
    }
    start
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
    // From latest + retention on, the caller starts afresh: every call
    // counts 1, but for what ended calls added to sums (kept past it: the
    // last of them leaves every window two windows after it).
    let sums_end = history
        .iter()
        .filter(|p| p.caller == e.caller)
        .flat_map(|p| {
            p.adds
                .iter()
                .zip(&rules.rules)
                .filter_map(|(a, r)| a.map(|(at, _)| at + 2 * r.window_ms + 1))
        })
        .max()
        .unwrap_or(i64::MIN);
    let end = (latest + rules.retention_ms()).max(sums_end);
    // The same call again; shadow rules never reject, and a rule with a
    // time profile sees (so rejects) only the probes in its profile, up to
    // t + grace + retention; past it (a late call's) the profile is taken
    // to hold.
    let mut spec = rules.spec();
    for r in &mut spec.rules {
        r.filter.hours = None;
        r.filter.days = None;
    }
    let always = RuleSet::build(spec).expect("the same rules");
    let span_end = t + rules.grace_ms + rules.retention_ms();
    let mut last_reject = t;
    for s in t + 1..end {
        let probe = CallEvent {
            call_id: "probe-never-used".into(),
            ts_ms: s,
            ..e.clone()
        };
        let probe_rules = if s > span_end { &always } else { rules };
        let x = decide_one(probe_rules, history, &probe);
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
    let epoch_start = epoch_start(retention, &prior);
    let live: Vec<&&Past> = if prev.is_some() {
        prior[epoch_start..].iter().collect()
    } else {
        Vec::new()
    };
    let mut counts = Vec::new();
    for (i, rule) in rules.rules.iter().enumerate() {
        if !rule.filter.sees(e) {
            counts.push(0);
            continue;
        }
        if rule.sum.is_some() {
            counts.push(sum_count(rules, i, &prior, t, l_new));
            continue;
        }
        // The calls the rule counts on: the caller's, or its calls to this
        // callee since the pair was last created.
        let pair_calls;
        let live: &[&&Past] = if rule.key == RuleKey::CallerCallee {
            let Some(callee) = e.callee.as_deref().filter(|c| !c.is_empty()) else {
                counts.push(0);
                continue;
            };
            if t <= h {
                counts.push(1);
                continue;
            }
            pair_calls = if rule.kind == WindowKind::Concurrent {
                // The caller's calls to this callee (no pair state: the
                // calls open are the state).
                live.iter()
                    .copied()
                    .filter(|p| p.callee.as_deref() == Some(callee))
                    .collect()
            } else {
                pair_history(rules, &live, i, callee, h)
            };
            &pair_calls
        } else {
            &live
        };
        let w = rule.window_ms;
        let b = t.div_euclid(w);
        let rec_in = |bucket: i64| {
            live.iter()
                .filter(|p| p.recorded[i] && p.ts.div_euclid(w) == bucket)
                .count() as u64
        };
        let c = match rule.kind {
            WindowKind::Sliding => {
                1 + live
                    .iter()
                    .filter(|p| p.recorded[i] && p.ts > h && p.ts > t - w && p.ts <= t)
                    .count() as u64
            }
            WindowKind::TokenBucket | WindowKind::SlidingApprox | WindowKind::Concurrent
                if t <= h =>
            {
                1
            }
            WindowKind::Concurrent => {
                1 + live
                    .iter()
                    .filter(|p| {
                        // Closed at or before L' - grace: dropped (only a
                        // late call could have counted it).
                        let close = p.close(rules, i);
                        p.opened[i] && p.ts <= t && t < close && close > l_new - rules.grace_ms
                    })
                    .count() as u64
            }
            WindowKind::TokenBucket => token_level(rule, live, i, t),
            WindowKind::DistinctCallees => distinct_count(rules, live, i, e, h),
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
                    .filter(|p| p.seen[i] && !p.beyond)
                    .map(|p| p.ts.div_euclid(w))
                    .max()
                    .map_or(b, |m| m.max(b));
                // The counters hold recorded calls that were above the
                // horizon when decided; a call at or below it counts 1.
                let counted = |bucket: i64| {
                    live.iter()
                        .filter(|p| p.recorded[i] && !p.beyond && p.ts.div_euclid(w) == bucket)
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
    let over = |shadow: bool| {
        rules
            .rules
            .iter()
            .zip(&counts)
            .find(|(r, &c)| r.shadow == shadow && c > r.limit)
            .map(|(r, _)| r.name.clone())
    };
    let (would, reason, rule_shadow) = match rules.listed(&e.caller) {
        Listed::Deny => (Decision::Reject, REASON_DENYLIST.to_string(), false),
        Listed::Allow => (Decision::Allow, REASON_ALLOWLIST.to_string(), false),
        Listed::BadCallerReject => (Decision::Reject, REASON_BAD_CALLER.to_string(), false),
        Listed::BadCallerAllow => (Decision::Allow, REASON_BAD_CALLER.to_string(), false),
        Listed::No => match (over(false), over(true)) {
            (Some(name), _) => (Decision::Reject, name, false),
            (None, Some(name)) => (Decision::Reject, name, true),
            (None, None) => (Decision::Allow, REASON_OK.to_string(), false),
        },
    };
    let distinct_callees = rules.tracks_callees().then(|| {
        // Each callee's latest call time among this caller's decided
        // calls, replayed call by call: trimmed at each call's horizon, a
        // new callee kept only below the cap; then this call's.
        let cap = rules.max_distinct_callees() as usize;
        let named = |c: Option<&str>| c.filter(|c| !c.is_empty()).map(str::to_string);
        let note =
            |latest: &mut std::collections::HashMap<String, i64>, c: Option<String>, ts: i64| {
                if let Some(c) = c {
                    if let Some(v) = latest.get_mut(&c) {
                        *v = (*v).max(ts);
                    } else if latest.len() < cap {
                        latest.insert(c, ts);
                    }
                }
            };
        let mut latest: std::collections::HashMap<String, i64> = Default::default();
        for p in &prior {
            latest.retain(|_, v| *v > p.horizon);
            note(&mut latest, named(p.callee.as_deref()), p.ts);
        }
        latest.retain(|_, v| *v > h);
        note(&mut latest, named(e.callee.as_deref()), t);
        latest
            .values()
            .filter(|&&v| v > t - rules.max_window_ms())
            .count() as u64
    });
    let shadow = (rules.shadow || rule_shadow) && would == Decision::Reject;
    let decision = if shadow { Decision::Allow } else { would };
    let warn = (decision == Decision::Allow && rules.listed(&e.caller) == Listed::No)
        .then(|| {
            rules
                .rules
                .iter()
                .zip(&counts)
                .find(|(r, &c)| r.warn.is_some_and(|w| c > w))
                .map(|(r, _)| r.name.clone())
        })
        .flatten();
    Expected {
        ts_ms: t,
        decision,
        warn,
        reason,
        counts,
        shadow,
        late: prev.is_some_and(|l| t < l - rules.grace_ms),
        prev_ts_ms: prev,
        distinct_callees,
        duplicate: false,
        retry_after_ms: None,
        end: false,
    }
}

/// A sum rule's count for a call at `t` (`l_new`: `L'`): what the
/// caller's ended calls added and the rule still keeps (what no call at or
/// after `L' - grace` could see is gone), in the window of `t`.
fn sum_count(rules: &RuleSet, i: usize, prior: &[&Past], t: i64, l_new: i64) -> u64 {
    let rule = &rules.rules[i];
    let (w, grace) = (rule.window_ms, rules.grace_ms);
    let bucket = |x: i64| x.div_euclid(w);
    let gone = |at: i64| match rule.kind {
        WindowKind::Fixed => (bucket(at) + 1) * w + grace <= l_new,
        WindowKind::SlidingApprox => bucket(at) < bucket(l_new - grace) - 1,
        _ => at <= l_new - grace - w,
    };
    let kept: Vec<(i64, u64)> = prior
        .iter()
        .filter_map(|p| p.adds[i])
        .filter(|&(at, _)| !gone(at))
        .collect();
    let in_bucket = |b: i64| -> u64 {
        kept.iter()
            .filter(|(at, _)| bucket(*at) == b)
            .map(|(_, a)| a)
            .sum()
    };
    let b = bucket(t);
    match rule.kind {
        WindowKind::Fixed if (b + 1) * w + grace <= l_new => 0,
        WindowKind::Fixed => in_bucket(b),
        WindowKind::SlidingApprox => {
            let r = t - b * w;
            (in_bucket(b - 1) as u128 * (w - r - 1).max(0) as u128 / w as u128) as u64
                + in_bucket(b)
        }
        _ => kept
            .iter()
            .filter(|(at, _)| *at > t - w && *at <= t)
            .map(|(_, a)| a)
            .sum(),
    }
}

/// A token bucket's level for a call at `t`, from the recorded calls in
/// processing order: times in `n`-ths of a millisecond (exact rationals).
fn token_level(rule: &callguard::engine::rules::Rule, live: &[&&Past], i: usize, t: i64) -> u64 {
    let rate = rule.rate.expect("a token bucket has a rate");
    let (n, per) = (rate.calls as i128, rate.per_ms as i128);
    let next =
        |tat: Option<i128>, at: i64| tat.map_or(at as i128 * n, |x| x.max(at as i128 * n)) + per;
    let mut tat = None;
    for p in live.iter().filter(|p| p.recorded[i] && !p.beyond) {
        tat = Some(next(tat, p.ts));
    }
    let ticks = (next(tat, t) - t as i128 * n).max(0);
    ((ticks + per - 1) / per) as u64
}

/// A distinct-callees count: the kept set replayed call by call (trimmed
/// at each call's horizon, the `cap` most recent kept), then
/// `min(cap, |{live} ∪ {own}|)`.
fn distinct_count(rules: &RuleSet, live: &[&&Past], i: usize, e: &CallEvent, h: i64) -> u64 {
    let Some(own) = e.callee.as_deref().filter(|c| !c.is_empty()) else {
        return 0;
    };
    let cap = rules.max_distinct_callees() as usize;
    let w = rules.rules[i].window_ms;
    let mut kept: std::collections::BTreeMap<String, i64> = Default::default();
    for p in live {
        kept.retain(|_, l| *l > p.horizon);
        let Some(c) = p.callee.as_deref().filter(|c| !c.is_empty()) else {
            continue;
        };
        if !p.recorded[i] {
            continue;
        }
        let l = kept.entry(c.to_string()).or_insert(p.ts);
        *l = (*l).max(p.ts);
        while kept.len() > cap {
            let lowest = kept
                .iter()
                .min_by(|a, b| (a.1, a.0).cmp(&(b.1, b.0)))
                .map(|(c, _)| c.clone())
                .expect("not empty");
            kept.remove(&lowest);
        }
    }
    kept.retain(|_, l| *l > h);
    let mut live_callees: std::collections::BTreeSet<&str> = kept
        .iter()
        .filter(|(_, &l)| l > e.ts_ms - w)
        .map(|(c, _)| c.as_str())
        .collect();
    live_callees.insert(own);
    (live_callees.len() as u64).min(cap as u64)
}

/// The calls to `callee` of rule `i`'s pair as it stands at horizon `h`:
/// pair membership replayed call by call (a pair is created by a call the
/// rule sees above the horizon, dropped once its latest such call is at or
/// below a call's horizon, and the lowest (latest, callee) dropped past the
/// cap), the calls of its current life returned.
fn pair_history<'a, 'b>(
    rules: &RuleSet,
    live: &[&'b &'a Past],
    i: usize,
    callee: &str,
    h: i64,
) -> Vec<&'b &'a Past> {
    let cap = rules.max_distinct_callees() as usize;
    let mut pairs: std::collections::BTreeMap<String, (i64, Vec<&'b &'a Past>)> =
        Default::default();
    for &q in live {
        pairs.retain(|_, (l, _)| *l > q.horizon);
        if let Some(c) = q.callee.as_deref().filter(|c| !c.is_empty()) {
            if q.seen[i] && !q.beyond {
                let entry = pairs.entry(c.to_string()).or_insert((q.ts, Vec::new()));
                entry.0 = entry.0.max(q.ts);
                entry.1.push(q);
            }
        }
        while pairs.len() > cap {
            let lowest = pairs
                .iter()
                .min_by(|a, b| ((a.1).0, a.0).cmp(&((b.1).0, b.0)))
                .map(|(c, _)| c.clone())
                .expect("not empty");
            pairs.remove(&lowest);
        }
    }
    pairs.retain(|_, (l, _)| *l > h);
    pairs
        .remove(callee)
        .map(|(_, calls)| calls)
        .unwrap_or_default()
}

/// [`decide_all`] (with retry-afters when `retry`) of a rule set with
/// pools (concurrent rules keyed by account, callee or global): the
/// caller's rules by brute force without them, then the pools' contract
/// (`callguard::engine::pool`) step by step on plain lists, each pool's
/// retry-after searched over every later millisecond.
pub fn decide_with_pools(rules: &RuleSet, events: &[CallEvent], retry: bool) -> Vec<Expected> {
    let pooled: Vec<usize> = (0..rules.rules.len())
        .filter(|&i| rules.rules[i].is_pooled())
        .collect();
    let mut spec = rules.spec();
    spec.rules.retain(|r| !r.is_pooled());
    let callers = RuleSet::build(spec).expect("the rules without pools");
    let mut out = decide(&callers, events, retry);
    for x in &mut out {
        for &i in &pooled {
            x.counts.insert(i, 0);
        }
    }
    let mut model = PoolModel::default();
    for (e, x) in events.iter().zip(&mut out) {
        model.apply(rules, &pooled, e, x);
        if !retry {
            x.retry_after_ms = None;
        }
    }
    out
}

/// What a pool found for a call: (rule, count, until).
type PoolFound = (usize, u64, Option<i64>);

/// A slot: (call, pool, start, close, ended, reachable: an end finds it,
/// until what its call got is forgotten).
type PoolSlot = (String, String, i64, i64, bool, bool);

/// A call a sum pool waits on: (call, pool, rule, start, price,
/// reachable).
type PoolWait = (String, String, usize, i64, Option<Price>, bool);

/// The pools' state, on lists.
#[derive(Default)]
struct PoolModel {
    slots: Vec<PoolSlot>,
    /// Calls sum pools wait on.
    waiting: Vec<PoolWait>,
    /// What ended calls added: (pool, rule, at, amount).
    adds: Vec<(String, usize, i64, u64)>,
    /// (call, end time, talk)
    pending: Vec<(String, i64, i64)>,
    /// (call, time, per pooled rule: (rule, count, until))
    results: Vec<(String, i64, Vec<PoolFound>)>,
    /// The newest attempt any pool has seen (the idempotency horizon's).
    latest: Option<i64>,
    /// Per pool, the newest attempt it has seen (its own trims').
    latest_of: std::collections::HashMap<String, i64>,
}

impl PoolModel {
    fn apply(&mut self, rules: &RuleSet, pooled: &[usize], e: &CallEvent, x: &mut Expected) {
        let key = format!("{} {}", e.caller, e.call_id);
        if e.kind == EventKind::End {
            let mut held = false;
            let first = !self.slots.iter().any(|s| s.0 == key && s.5 && s.4);
            for s in self.slots.iter_mut().filter(|s| s.0 == key && s.5) {
                held = true;
                if first {
                    s.3 = s.3.min(e.ts_ms.max(s.2));
                    s.4 = true;
                }
            }
            let talk = e.talk_ms.unwrap_or(0);
            if first {
                let (ended, waiting): (Vec<PoolWait>, Vec<PoolWait>) =
                    std::mem::take(&mut self.waiting)
                        .into_iter()
                        .partition(|w| w.0 == key && w.5);
                self.waiting = waiting;
                for (_, pool, i, start, price, _) in ended {
                    held = true;
                    let sum = rules.rules[i].sum.as_ref().expect("a sum rule");
                    if e.ts_ms < start + sum.max_duration_ms {
                        let amount = sum.amount(price, talk);
                        self.adds.push((pool, i, e.ts_ms.max(start), amount));
                    }
                }
            }
            let known = self.results.iter().any(|r| r.0 == key);
            if !held && !known && !self.pending.iter().any(|p| p.0 == key) {
                self.pending.push((key, e.ts_ms, talk));
            }
            return;
        }
        if let Some(r) = self.results.iter().find(|r| r.0 == key) {
            let found = r.2.clone();
            merge(rules, e, x, &found);
            return;
        }
        let pools: Vec<(usize, String)> = pooled
            .iter()
            .filter_map(|&i| {
                let r = &rules.rules[i];
                if !r.filter.sees(e) {
                    return None;
                }
                let k = match r.key {
                    RuleKey::Account => e.account.as_deref().filter(|a| !a.is_empty())?,
                    RuleKey::Callee => e.callee.as_deref().filter(|c| !c.is_empty())?,
                    _ => "",
                };
                Some((
                    i,
                    match &r.sum {
                        Some(sum) => {
                            format!("{}:{}:{}:{k}", r.name, r.window_ms, sum.max_duration_ms)
                        }
                        None => format!("{}:{}:{k}", r.name, r.window_ms),
                    },
                ))
            })
            .collect();
        if pools.is_empty() {
            return;
        }
        let t = e.ts_ms;
        let l = self.latest.map_or(t, |l| l.max(t));
        self.latest = Some(l);
        let horizon = l - rules.dedup_ms();
        self.pending.retain(|p| p.1 > horizon);
        // What a call got is forgotten past the horizon, and an end no
        // longer finds where it is held.
        let forgotten: Vec<String> = self
            .results
            .iter()
            .filter(|r| r.1 <= horizon)
            .map(|r| r.0.clone())
            .collect();
        self.results.retain(|r| r.1 > horizon);
        for k in &forgotten {
            self.slots
                .iter_mut()
                .filter(|s| s.0 == *k)
                .for_each(|s| s.5 = false);
            self.waiting
                .iter_mut()
                .filter(|w| w.0 == *k)
                .for_each(|w| w.5 = false);
        }
        // Each pool this call is in, by its own time: a call closed at or
        // before L'_p - grace dropped; a sum pool lets go of a call at
        // start + max_duration, and keeps what ended calls added while a
        // call not late could see it.
        for (_, pool) in &pools {
            let lp = self.latest_of.get(pool).map_or(t, |v| (*v).max(t));
            self.latest_of.insert(pool.clone(), lp);
            let let_go = lp - rules.grace_ms;
            self.slots.retain(|s| s.1 != *pool || s.3 > let_go);
            self.waiting.retain(|w| {
                w.1 != *pool
                    || w.3
                        + rules.rules[w.2]
                            .sum
                            .as_ref()
                            .expect("a sum rule")
                            .max_duration_ms
                        > let_go
            });
            self.adds.retain(|&(ref p, i, at, _)| {
                let w = rules.rules[i].window_ms;
                *p != *pool
                    || match rules.rules[i].kind {
                        WindowKind::Fixed => (at.div_euclid(w) + 1) * w + rules.grace_ms > lp,
                        WindowKind::SlidingApprox => at.div_euclid(w) >= let_go.div_euclid(w) - 1,
                        _ => at > let_go - w,
                    }
            });
        }
        let found: Vec<PoolFound> = pools
            .iter()
            .map(|(i, pool)| {
                let rule = &rules.rules[*i];
                if rule.sum.is_some() {
                    return self.sum_found(rules, *i, pool, t, self.latest_of[pool]);
                }
                let mine: Vec<(i64, i64)> = self
                    .slots
                    .iter()
                    .filter(|s| s.1 == *pool)
                    .map(|s| (s.2, s.3))
                    .collect();
                let open_at =
                    |s: i64| mine.iter().filter(|&&(a, c)| a <= s && s < c).count() as u64;
                let last = mine.iter().map(|m| m.1).max().unwrap_or(t);
                let until = (t + 1..last)
                    .rev()
                    .find(|&s| open_at(s) + 1 > rule.limit)
                    .and_then(|u| rule.filter.last_seen_within(t, u));
                (*i, open_at(t) + 1, until)
            })
            .collect();
        let before = x.decision;
        merge(rules, e, x, &found);
        let listed = matches!(
            rules.listed(e.number_for_lists()),
            Listed::Allow | Listed::BadCallerAllow
        );
        let over = found
            .iter()
            .any(|&(i, c, _)| !rules.rules[i].shadow && c > rules.rules[i].limit);
        let opens = before == Decision::Allow && (listed || rules.shadow || !over);
        assert_eq!(
            opens,
            x.decision == Decision::Allow,
            "a call opens when allowed"
        );
        if opens {
            let end = self
                .pending
                .iter()
                .position(|p| p.0 == key)
                .map(|at| self.pending.remove(at))
                .map(|p| (p.1, p.2));
            for (i, pool) in &pools {
                if let Some(sum) = &rules.rules[*i].sum {
                    let price = sum.price(e.callee_for_filters());
                    match end {
                        Some((at, talk)) if at < t + sum.max_duration_ms => {
                            self.adds
                                .push((pool.clone(), *i, at.max(t), sum.amount(price, talk)));
                        }
                        Some(_) => {}
                        None if self.waiting.iter().any(|w| w.0 == key && w.1 == *pool) => {}
                        None => self
                            .waiting
                            .push((key.clone(), pool.clone(), *i, t, price, true)),
                    }
                    continue;
                }
                let end = end.map(|e| e.0);
                if self.slots.iter().any(|s| s.0 == key && s.1 == *pool) {
                    continue;
                }
                let longest = t + rules.rules[*i].window_ms;
                let close = end.map_or(longest, |e| e.max(t).min(longest));
                self.slots
                    .push((key.clone(), pool.clone(), t, close, end.is_some(), true));
            }
        }
        self.results.push((key, t, found));
    }
}

impl PoolModel {
    /// What sum pool `pool` (rule `i`) finds for a call at `t` (`l`: L'):
    /// the window's sum of what was added, and the last later time a call
    /// would be over the limit, searched over every millisecond.
    fn sum_found(&self, rules: &RuleSet, i: usize, pool: &str, t: i64, l: i64) -> PoolFound {
        let rule = &rules.rules[i];
        let w = rule.window_ms;
        let adds: Vec<(i64, u64)> = self
            .adds
            .iter()
            .filter(|a| a.0 == pool)
            .map(|a| (a.2, a.3))
            .collect();
        let between = |lo: i64, hi: i64| -> u64 {
            adds.iter()
                .filter(|a| a.0 >= lo && a.0 <= hi)
                .map(|a| a.1)
                .sum()
        };
        let bucket = |b: i64| between(b * w, b * w + w - 1);
        let at = |s: i64| -> u64 {
            let b = s.div_euclid(w);
            match rule.kind {
                WindowKind::Fixed => bucket(b),
                WindowKind::SlidingApprox => {
                    let weight = (w - (s - b * w) - 1) as u128;
                    (u128::from(bucket(b - 1)) * weight / w as u128) as u64 + bucket(b)
                }
                _ => between(s - w + 1, s),
            }
        };
        let b = t.div_euclid(w);
        let count = match rule.kind {
            WindowKind::Fixed if (b + 1) * w + rules.grace_ms <= l => 0,
            _ => at(t),
        };
        let last = adds.iter().map(|a| a.0).max().unwrap_or(t) + 2 * w;
        let until = (t + 1..=last)
            .rev()
            .find(|&s| at(s) > rule.limit)
            .and_then(|u| rule.filter.last_seen_within(t, u));
        (i, count, until)
    }
}

/// The pools' counts written into a call's record, and a call the
/// caller's rules allowed judged again with them (the first enforcing
/// rule over its limit rejects, else the first shadow one flags).
fn merge(rules: &RuleSet, e: &CallEvent, x: &mut Expected, found: &[PoolFound]) {
    for &(i, c, _) in found {
        x.counts[i] = c;
    }
    if x.decision == Decision::Reject {
        return;
    }
    let listed = rules.listed(e.number_for_lists());
    if matches!(listed, Listed::Allow | Listed::BadCallerAllow) {
        return;
    }
    let over: Vec<usize> = (0..rules.rules.len())
        .filter(|&i| x.counts[i] > rules.rules[i].limit)
        .collect();
    let enforcing = over.iter().copied().find(|&i| !rules.rules[i].shadow);
    let first = enforcing.or(over.first().copied());
    let t = e.ts_ms;
    match first {
        Some(i) => {
            x.reason = rules.rules[i].name.clone();
            let shadow = rules.shadow || enforcing.is_none();
            x.shadow = shadow;
            x.decision = if shadow {
                Decision::Allow
            } else {
                Decision::Reject
            };
            x.retry_after_ms = x.retry_after_ms.or(Some(0)).filter(|_| !shadow).map(|_| {
                found
                    .iter()
                    .filter(|f| !rules.rules[f.0].shadow)
                    .filter_map(|f| f.2)
                    .fold(t, i64::max)
                    + 1
                    - t
            });
        }
        None => {
            x.reason = REASON_OK.to_string();
            x.shadow = false;
            x.retry_after_ms = None;
        }
    }
    let allowed = x.decision == Decision::Allow;
    x.warn = if allowed {
        (0..rules.rules.len())
            .find(|&i| rules.rules[i].warn.is_some_and(|w| x.counts[i] > w))
            .map(|i| rules.rules[i].name.clone())
    } else {
        None
    };
}

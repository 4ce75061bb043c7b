//! Random rule sets and event sequences: same-millisecond ties, events out
//! of order within grace, late events, idle gaps, duplicate call ids, every
//! rule kind and policy, allow and deny lists, shadow mode; rules that see
//! only some callees or times of day, keyed by caller and callee, per-rule
//! shadow and warning levels.
#![allow(dead_code)]

use callguard::engine::event::CallEvent;
use callguard::engine::filter::{parse_days, parse_timezone, Filter, Hours};
use callguard::engine::rules::{CountPolicy, Rate, Rule, RuleKey, RuleSet, RuleSpec, WindowKind};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::scenarios::T0;

/// A random rule set.
pub fn random_rules(rng: &mut StdRng) -> RuleSet {
    random_rules_scaled(rng, 1)
}

/// A random rule set with every duration divided by `scale` (short
/// windows, for brute-force searches over every millisecond).
pub fn random_rules_scaled(rng: &mut StdRng, scale: i64) -> RuleSet {
    let n = rng.random_range(1..=3);
    let windows = [500, 1_000, 2_000, 5_000, 10_000].map(|w: i64| (w / scale).max(1));
    let kinds = [
        WindowKind::Fixed,
        WindowKind::Sliding,
        WindowKind::SlidingApprox,
        WindowKind::TokenBucket,
        WindowKind::DistinctCallees,
    ];
    // Sometimes few callees kept, so the cap is reached.
    let cap = if rng.random_bool(0.3) {
        rng.random_range(2..=5)
    } else {
        callguard::engine::rules::DEFAULT_MAX_DISTINCT_CALLEES
    };
    // Only the first rule set of a sequence has the newer features often.
    let extras = rng.random_bool(0.6);
    let rules = (0..n)
        .map(|i| {
            let kind = kinds[rng.random_range(0..if extras { 5 } else { 3 })];
            let mut limit = rng.random_range(1..=6);
            let mut rule = Rule::new(
                format!("r{i}"),
                kind,
                windows[rng.random_range(0..windows.len())],
                limit,
            );
            if kind == WindowKind::TokenBucket {
                // T of 100 ms to 1 s (1 to 10 ms when scaled by 100).
                let calls = [10, 3, 2, 1][rng.random_range(0..4)] * scale as u64;
                let rate = Rate {
                    calls,
                    per_ms: 1_000,
                };
                rule.rate = Some(rate);
                rule.window_ms = rate.span_ms(limit);
            }
            if kind == WindowKind::DistinctCallees {
                limit = rng.random_range(1..cap.min(5));
                rule.limit = limit;
            }
            if extras {
                random_options(rng, &mut rule);
            }
            rule
        })
        .collect();
    let count = if rng.random_bool(0.5) {
        CountPolicy::Attempts
    } else {
        CountPolicy::Admitted
    };
    let grace = [0, 1_000, 3_000][rng.random_range(0..3)] / scale;
    let allow = if rng.random_bool(0.3) {
        vec!["+3460000001".to_string()]
    } else {
        vec![]
    };
    let deny = if rng.random_bool(0.3) {
        vec!["+3460000002".to_string()]
    } else {
        vec![]
    };
    let set = RuleSet::build(RuleSpec {
        count,
        grace_ms: grace,
        allow,
        deny,
        shadow: rng.random_bool(0.2),
        max_distinct_callees: cap,
        ..RuleSpec::new(rules)
    })
    .unwrap()
    .with_distinct_callees(rng.random_bool(0.85));
    // Sometimes a short idempotency horizon, so old records are trimmed.
    match rng.random_range(0..3) {
        0 => set.with_dedup(1).unwrap(),
        1 => set.with_dedup(25_000 / scale).unwrap(),
        _ => set,
    }
}

/// Per-rule options: a warning level, shadow, a callee prefix, a time profile
/// that flips at midnight UTC (where the random sequences may start).
fn random_options(rng: &mut StdRng, rule: &mut Rule) {
    if rng.random_bool(0.3) && rule.limit > 1 {
        rule.warn = Some(rng.random_range(0..rule.limit));
    }
    rule.shadow = rng.random_bool(0.2);
    if rule.kind != WindowKind::DistinctCallees && rng.random_bool(0.3) {
        rule.key = RuleKey::CallerCallee;
    }
    let mut filter = Filter::default();
    if rng.random_bool(0.3) {
        // Callee 3, or callees 3 and 4, of the random sequences' callees.
        filter.callees = vec!["+34910000003".into()];
        if rng.random_bool(0.5) {
            filter.callees.push("+34910000004".into());
        }
    }
    match rng.random_range(0..6) {
        0 => {
            filter.hours = Some(Hours::parse("00:00-12:00").unwrap());
        }
        1 => {
            filter.hours = Some(Hours::parse("01:00-13:00").unwrap());
            filter.timezone = Some(parse_timezone("Europe/Madrid").unwrap());
        }
        2 => {
            filter.days = Some(parse_days(&["mon".into()]).unwrap());
        }
        _ => {}
    }
    rule.filter = filter;
}

/// A random event sequence over `callers` callers.
pub fn random_events(rng: &mut StdRng, n: usize, callers: usize) -> Vec<CallEvent> {
    random_events_scaled(rng, n, callers, 1)
}

/// [`random_events`] with every time step divided by `scale`.
pub fn random_events_scaled(
    rng: &mut StdRng,
    n: usize,
    callers: usize,
    scale: i64,
) -> Vec<CallEvent> {
    // Sometimes from just before midnight UTC (T0), so time profiles flip.
    let mut t = if rng.random_bool(0.3) {
        T0 - rng.random_range(0..20_000)
    } else {
        T0 + rng.random_range(0..1_000) / scale
    };
    let mut out: Vec<CallEvent> = Vec::with_capacity(n);
    for i in 0..n {
        let roll: f64 = rng.random();
        if roll < 0.06 && !out.is_empty() {
            // Redelivery of an earlier event.
            let j = rng.random_range(0..out.len());
            out.push(out[j].clone());
            continue;
        }
        if roll < 0.10 {
            t += rng.random_range(10_000..40_000) / scale; // idle gap
        } else if roll < 0.45 {
            // same millisecond
        } else {
            t += rng.random_range(0..400) / scale;
        }
        let jitter = if rng.random_bool(0.15) {
            rng.random_range(0..6_000) / scale
        } else {
            0
        };
        let who = rng.random_range(0..callers);
        let caller = format!("+346000000{who:02}");
        // Accounts shared across callers (no draw from `rng`: the other
        // fields stay as they were); a third of the calls have none.
        let account = ["pbx-a", "trunk:7", ""][(i * 7 + who) % 3];
        // A few callees, so some repeat; sometimes none or an empty one.
        // Eight at a time, the eight changing every 32 calls (no draw from
        // `rng`): a busy caller's window then holds more than eight, which
        // a caller's state keeps in a table rather than its list.
        let callee = match rng.random_range(0..10) {
            0 => None,
            1 => Some(Default::default()),
            k => Some(format!("+349100000{:02}", k + 8 * ((i / 32) % 3)).into()),
        };
        out.push(CallEvent {
            call_id: format!("c{i}").into(),
            caller: caller.into(),
            ts_ms: t - jitter,
            callee,
            account: (!account.is_empty()).then(|| account.into()),
            ..Default::default()
        });
    }
    out
}

/// A random case from a seed.
pub fn case(seed: u64, n: usize, callers: usize) -> (RuleSet, Vec<CallEvent>) {
    case_scaled(seed, n, callers, 1)
}

/// A random case with every duration divided by `scale`.
pub fn case_scaled(seed: u64, n: usize, callers: usize, scale: i64) -> (RuleSet, Vec<CallEvent>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let rules = random_rules_scaled(&mut rng, scale);
    let events = random_events_scaled(&mut rng, n, callers, scale);
    (rules, events)
}

/// `rules` with a rule keyed by callee, global or account added at a random place
/// (fixed or sliding-approx, maybe shadow, maybe with a warning level).
pub fn with_aggregate(rng: &mut StdRng, rules: &RuleSet) -> RuleSet {
    let kind = [WindowKind::Fixed, WindowKind::SlidingApprox][rng.random_range(0..2)];
    let limit = rng.random_range(2..=8);
    let mut rule = Rule::new(
        "agg",
        kind,
        [500, 1_000, 5_000][rng.random_range(0..3)],
        limit,
    );
    rule.key = [RuleKey::Callee, RuleKey::Global, RuleKey::Account][rng.random_range(0..3)];
    rule.shadow = rng.random_bool(0.2);
    if rng.random_bool(0.3) {
        rule.warn = Some(limit - 1);
    }
    let mut spec = rules.spec();
    let at = rng.random_range(0..=spec.rules.len());
    spec.rules.insert(at, rule);
    RuleSet::build(spec).expect("a valid rule set")
}

/// [`case`] with a rule keyed by callee or global.
pub fn aggregate_case(seed: u64, n: usize, callers: usize) -> (RuleSet, Vec<CallEvent>) {
    let (rules, events) = case(seed, n, callers);
    let mut rng = StdRng::seed_from_u64(seed ^ 0xa66);
    (with_aggregate(&mut rng, &rules), events)
}

/// `rules` with one or two concurrent rules added at random places (short
/// max durations, maybe shadow, a warning level or a callee filter).
pub fn with_concurrent(rng: &mut StdRng, rules: &RuleSet, scale: i64) -> RuleSet {
    let mut spec = rules.spec();
    for k in 0..rng.random_range(1..=2) {
        let limit = rng.random_range(1..=4);
        let max_ms = ([300, 1_000, 3_000, 8_000][rng.random_range(0..4)] / scale).max(1);
        let mut rule = Rule::new(format!("open{k}"), WindowKind::Concurrent, max_ms, limit);
        random_options(rng, &mut rule);
        // random_options keys a third of the rules by caller and callee.
        if rule.key != RuleKey::CallerCallee {
            rule.key = RuleKey::Caller;
        }
        let at = rng.random_range(0..=spec.rules.len());
        spec.rules.insert(at, rule);
    }
    RuleSet::build(spec).expect("a valid rule set")
}

/// `events` with call ends: most calls end after a random duration (some
/// at their attempt's millisecond), their ends placed where their times
/// fall among the events; some ends come before their attempts, some
/// twice, some for calls that never come.
pub fn with_ends(rng: &mut StdRng, events: &[CallEvent], scale: i64) -> Vec<CallEvent> {
    use callguard::engine::event::EventKind;
    let mut out = events.to_vec();
    for (i, e) in events.iter().enumerate() {
        if !rng.random_bool(0.6) || events[..i].iter().any(|p| p.call_id == e.call_id) {
            continue;
        }
        let duration = match rng.random_range(0..5) {
            0 => 0,
            _ => rng.random_range(0..6_000) / scale,
        };
        let mut end = CallEvent {
            kind: EventKind::End,
            ts_ms: e.ts_ms + duration,
            talk_ms: Some(duration / 2),
            ..e.clone()
        };
        if rng.random_bool(0.05) {
            end.ts_ms = e.ts_ms - rng.random_range(1..1_000) / scale;
        }
        let own = out.iter().position(|p| p.call_id == e.call_id).unwrap_or(0);
        let at = if rng.random_bool(0.15) {
            // The switch's two messages reordered: the end first.
            own
        } else {
            own + 1
                + out[own + 1..]
                    .iter()
                    .position(|p| p.ts_ms > end.ts_ms)
                    .unwrap_or(out.len() - own - 1)
        };
        if rng.random_bool(0.1) {
            let again = rng.random_range(at..=out.len());
            out.insert(again, end.clone());
        }
        out.insert(at, end);
    }
    for _ in 0..rng.random_range(0..3) {
        let at = rng.random_range(0..=out.len());
        let near = out.get(at.min(out.len().saturating_sub(1))).cloned();
        if let Some(near) = near {
            out.insert(
                at,
                CallEvent {
                    kind: EventKind::End,
                    call_id: format!("never{at}").into(),
                    ..near
                },
            );
        }
    }
    out
}

/// `rules` with one or two sum rules added at random places: talk or
/// cost (a small rate table over the random callees: per-second and
/// per-6-second billing, one callee unpriced), fixed, sliding or
/// sliding-approx, short windows and max durations, maybe shadow, a
/// warning level or a filter; keyed by caller.
pub fn with_sums(rng: &mut StdRng, rules: &RuleSet, scale: i64) -> RuleSet {
    use callguard::engine::rates::Rates;
    use callguard::engine::rules::{Sum, SumOf};
    let rates = Rates::parse(
        "+3491000000,0.000060,1\n+34910000003,0.000600,6\n+34910000005,0.000120,1\n+34910000009,0.000000,1\n",
        |p| Ok(p.to_string()),
    )
    .expect("rates");
    let rates = std::sync::Arc::new(rates);
    let mut spec = rules.spec();
    for k in 0..rng.random_range(1..=2) {
        let kind = [
            WindowKind::Fixed,
            WindowKind::Sliding,
            WindowKind::SlidingApprox,
        ][rng.random_range(0..3)];
        let w = ([200, 1_000, 5_000, 20_000][rng.random_range(0..4)] / scale).max(1);
        let talk = rng.random_bool(0.5);
        let limit = rng.random_range(1..=if talk { 6 } else { 40 });
        let mut rule = Rule::new(format!("sum{k}"), kind, w, limit);
        random_options(rng, &mut rule);
        rule.key = RuleKey::Caller;
        rule.sum = Some(Sum {
            of: if talk {
                SumOf::Talk
            } else {
                SumOf::Cost(rates.clone())
            },
            max_duration_ms: ([300, 2_000, 8_000][rng.random_range(0..3)] / scale).max(1),
        });
        let at = rng.random_range(0..=spec.rules.len());
        spec.rules.insert(at, rule);
    }
    RuleSet::build(spec).expect("a valid rule set")
}

/// A random case with sum rules (and sometimes concurrent rules) and
/// call ends, talk times of up to 3 s (at scale 1).
pub fn sum_case_scaled(
    seed: u64,
    n: usize,
    callers: usize,
    scale: i64,
) -> (RuleSet, Vec<CallEvent>) {
    let (rules, events) = case_scaled(seed, n, callers, scale);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5a5);
    let rules = if rng.random_bool(0.3) {
        with_concurrent(&mut rng, &rules, scale)
    } else {
        rules
    };
    let rules = with_sums(&mut rng, &rules, scale);
    let mut events = with_ends(&mut rng, &events, scale);
    // Talk times from 0 to 3 s, whatever the scale: sums need seconds.
    for e in &mut events {
        if e.talk_ms.is_some() {
            e.talk_ms = Some(rng.random_range(0..3_000));
        }
    }
    (rules, events)
}

/// A random case with concurrent rules and call ends.
pub fn concurrent_case_scaled(
    seed: u64,
    n: usize,
    callers: usize,
    scale: i64,
) -> (RuleSet, Vec<CallEvent>) {
    let (rules, events) = case_scaled(seed, n, callers, scale);
    let mut rng = StdRng::seed_from_u64(seed ^ 0xc0c);
    let rules = with_concurrent(&mut rng, &rules, scale);
    let events = with_ends(&mut rng, &events, scale);
    (rules, events)
}

/// `rules` with one or two pools (concurrent rules keyed by account,
/// callee or global) added at random places: short max durations, maybe
/// shadow, a warning level or a filter. The set counts attempts and keeps
/// none of the caller's concurrent or sum rules (what pools need).
pub fn with_pools(rng: &mut StdRng, rules: &RuleSet, scale: i64) -> RuleSet {
    let mut spec = rules.spec();
    spec.count = CountPolicy::Attempts;
    for k in 0..rng.random_range(1..=2) {
        let mut rule = if rng.random_bool(0.5) {
            let limit = rng.random_range(1..=4);
            let max_ms = ([300, 1_000, 3_000, 8_000][rng.random_range(0..4)] / scale).max(1);
            let mut rule = Rule::new(format!("pool{k}"), WindowKind::Concurrent, max_ms, limit);
            random_options(rng, &mut rule);
            rule
        } else {
            // A sum rule as `with_sums` makes them, renamed.
            let none = RuleSet::build(RuleSpec::new(vec![Rule::new(
                "x",
                WindowKind::Fixed,
                1_000,
                1,
            )]))
            .expect("a rule set");
            let sums = with_sums(rng, &none, scale);
            let mut rule = sums
                .rules
                .into_iter()
                .find(|r| r.sum.is_some())
                .expect("a sum rule");
            rule.name = format!("pool{k}");
            rule
        };
        rule.key = [
            RuleKey::Account,
            RuleKey::Account,
            RuleKey::Callee,
            RuleKey::Global,
        ][rng.random_range(0..4)];
        let at = rng.random_range(0..=spec.rules.len());
        spec.rules.insert(at, rule);
    }
    RuleSet::build(spec).expect("a valid rule set")
}

/// The account of a random sequence's caller: two trunks share most
/// callers, some have none.
pub fn account_of(caller: &str) -> Option<String> {
    let last = caller.bytes().last().unwrap_or(b'0');
    match last % 4 {
        0 => None,
        1 | 2 => Some("trunk-a".into()),
        _ => Some("trunk-b".into()),
    }
}

/// A random case with pools and call ends; callers belong to accounts
/// ([`account_of`]), and half the ends name no account (a switch's end
/// message may carry only the call's identity).
pub fn pool_case_scaled(
    seed: u64,
    n: usize,
    callers: usize,
    scale: i64,
) -> (RuleSet, Vec<CallEvent>) {
    use callguard::engine::event::EventKind;
    let (rules, events) = case_scaled(seed, n, callers, scale);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9001);
    let rules = with_pools(&mut rng, &rules, scale);
    let mut events = with_ends(&mut rng, &events, scale);
    for e in &mut events {
        // Talk times from 0 to 3 s, whatever the scale: sums need seconds.
        if e.talk_ms.is_some() {
            e.talk_ms = Some(rng.random_range(0..3_000));
        }
        e.account = account_of(&e.caller).map(Into::into);
        if e.kind == EventKind::End && rng.random_bool(0.5) {
            e.account = None;
        }
    }
    (rules, events)
}

//! Random rule sets and event sequences: same-millisecond ties, events out
//! of order within grace, late events, idle gaps, duplicate call ids, every
//! rule kind and policy, allow and deny lists, shadow mode.
#![allow(dead_code)]

use callguard::engine::event::CallEvent;
use callguard::engine::rules::{CountPolicy, Rule, RuleSet, WindowKind};
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
    ];
    let rules = (0..n)
        .map(|i| Rule {
            name: format!("r{i}"),
            kind: kinds[rng.random_range(0..3)],
            window_ms: windows[rng.random_range(0..windows.len())],
            limit: rng.random_range(1..=6),
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
    let set = RuleSet::new(rules, count, grace, allow, deny, rng.random_bool(0.2))
        .unwrap()
        .with_distinct_callees(rng.random_bool(0.85));
    // Sometimes a short idempotency horizon, so old records are trimmed.
    match rng.random_range(0..3) {
        0 => set.with_dedup(1).unwrap(),
        1 => set.with_dedup(25_000 / scale).unwrap(),
        _ => set,
    }
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
    let mut t = T0 + rng.random_range(0..1_000) / scale;
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
        let caller = format!("+346000000{:02}", rng.random_range(0..callers));
        // A few callees, so some repeat; sometimes none or an empty one.
        let callee = match rng.random_range(0..10) {
            0 => None,
            1 => Some(Default::default()),
            k => Some(format!("+3491000000{k}").into()),
        };
        out.push(CallEvent {
            call_id: format!("c{i}").into(),
            caller: caller.into(),
            ts_ms: t - jitter,
            callee,
            duration_ms: None,
            label: None,
            list_number: None,
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

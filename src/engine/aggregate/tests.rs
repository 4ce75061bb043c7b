use std::collections::HashMap as StdMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::engine::event::Aggregated;
use crate::engine::rules::{Rule, RuleSpec};
use crate::engine::window::approx_rejects_until;

fn ev(id: usize, t: i64, callee: &str) -> CallEvent {
    // Two accounts over many callers; every third call has none.
    let account = ["pbx-a", "pbx-b", ""][id % 3];
    CallEvent {
        call_id: format!("c{id}").into(),
        caller: format!("+3460000{:04}", id % 7919).into(),
        ts_ms: t,
        callee: Some(callee.into()),
        account: (!account.is_empty()).then(|| account.into()),
        ..Default::default()
    }
}

fn rules(kind: WindowKind, key: RuleKey, w: i64, n: u64) -> RuleSet {
    let mut r = Rule::new("agg", kind, w, n);
    r.key = key;
    let per_caller = Rule::new("caller", WindowKind::Fixed, 1_000, 1_000);
    let mut spec = RuleSpec::new(vec![per_caller, r]);
    spec.grace_ms = w / 3;
    RuleSet::build(spec).expect("valid rules")
}

/// The contract by brute force: one counter per (key, bucket), calls in
/// order, no credits.
fn naive(rules: &RuleSet, events: &[CallEvent]) -> Vec<Aggregated> {
    let rule = &rules.rules[1];
    let (w, n) = (rule.window_ms, rule.limit);
    let approx = rule.kind == WindowKind::SlidingApprox;
    let mut counts: StdMap<(String, i64), u64> = StdMap::new();
    let mut seen: StdMap<String, Aggregated> = StdMap::new();
    let mut out = Vec::new();
    for e in events {
        if let Some(a) = seen.get(e.call_id.as_str()) {
            out.push(*a);
            continue;
        }
        let key = match rule.key {
            RuleKey::Global => Some(String::new()),
            RuleKey::Account => e.account.as_ref().map(|a| a.to_string()),
            _ => Some(e.callee.clone().unwrap_or_default().to_string()),
        };
        // A call without an account is not counted by an account's rule.
        let Some(key) = key else {
            out.push(Aggregated::default());
            continue;
        };
        let b = e.ts_ms.div_euclid(w);
        let r = e.ts_ms - b * w;
        let c = counts.get(&(key.clone(), b)).copied().unwrap_or(0);
        let p = counts.get(&(key.clone(), b - 1)).copied().unwrap_or(0);
        let weighted = if approx {
            p * (w - r - 1).max(0) as u64 / w as u64
        } else {
            0
        };
        let count = weighted + c + 1;
        let admitted = count <= n;
        if admitted {
            counts.insert((key, b), c + 1);
        }
        let after = c + u64::from(admitted);
        let until = if approx {
            approx_rejects_until(b, after, p, w, n, i64::MAX).or((!admitted).then_some(e.ts_ms))
        } else {
            (!admitted || after >= n).then_some((b + 1) * w - 1)
        };
        let a = Aggregated { count, until };
        seen.insert(e.call_id.to_string(), a);
        out.push(a);
    }
    out
}

/// Calls in rough time order (never more than a window behind), to a few
/// callees, some call ids repeated.
fn random_events(rng: &mut StdRng, len: usize, w: i64) -> Vec<CallEvent> {
    random_events_within(rng, len, w, 8 * w)
}

/// [`random_events`], none more than `late` behind the newest before it.
fn random_events_within(rng: &mut StdRng, len: usize, w: i64, late: i64) -> Vec<CallEvent> {
    let mut t = 1_000_000i64;
    (0..len)
        .map(|i| {
            t += rng.random_range(0..w / 4);
            let jitter = if rng.random_range(0..30) == 0 {
                rng.random_range(0..late)
            } else {
                rng.random_range(0..w / 2)
            };
            let id = if i > 0 && rng.random_range(0..20) == 0 {
                rng.random_range(0..i)
            } else {
                i
            };
            ev(
                id,
                t - jitter,
                &format!("+3491000000{}", rng.random_range(0..3)),
            )
        })
        .collect()
}

/// A case's window kind (fixed or sliding-approx, in turn) and key
/// (global every third case, account every sixth after it, else callee).
fn kind_and_key(case: usize) -> (WindowKind, RuleKey) {
    let kind = if case.is_multiple_of(2) {
        WindowKind::Fixed
    } else {
        WindowKind::SlidingApprox
    };
    let key = match case % 6 {
        0 | 3 => RuleKey::Global,
        1 => RuleKey::Account,
        _ => RuleKey::Callee,
    };
    (kind, key)
}

/// Runs `events` through `gate` in batches of 1 to 39.
fn run_in_random_batches(
    rng: &mut StdRng,
    gate: &mut Gate,
    ledger: &mut MemoryLedger,
    set: &RuleSet,
    events: &mut [CallEvent],
) {
    let mut at = 0;
    while at < events.len() {
        let size = rng.random_range(1..40).min(events.len() - at);
        gate.run(ledger, set, &mut events[at..at + size]);
        at += size;
    }
}

#[test]
fn one_instance_on_the_memory_ledger_is_the_contract_whatever_the_batches() {
    let mut rng = StdRng::seed_from_u64(7);
    for case in 0..300 {
        let (kind, key) = kind_and_key(case);
        let w = rng.random_range(40..400);
        let n = rng.random_range(1..12);
        let set = rules(kind, key, w, n);
        let mut events = random_events(&mut rng, 200, w);
        let expected = naive(&set, &events);
        let (mut gate, mut ledger) = (Gate::new(), MemoryLedger::new());
        run_in_random_batches(&mut rng, &mut gate, &mut ledger, &set, &mut events);
        let got: Vec<Aggregated> = events.iter().map(|e| e.aggregated(1)).collect();
        assert_eq!(got, expected, "case {case}: {kind:?} {key:?} W={w} N={n}");
        assert!(events
            .iter()
            .all(|e| e.aggregated(0) == Aggregated::default()));
    }
}

#[test]
fn instances_sharing_a_ledger_never_admit_past_the_limit_and_hold_at_most_a_block() {
    let mut rng = StdRng::seed_from_u64(11);
    for case in 0..200 {
        let w = 1_000;
        let n = rng.random_range(1..80);
        let set = rules(WindowKind::Fixed, RuleKey::Callee, w, n);
        let mut ledger = MemoryLedger::new();
        let mut gates: Vec<Gate> = (0..3).map(|_| Gate::new()).collect();
        let mut admitted: StdMap<(String, i64), u64> = StdMap::new();
        let mut t = 0i64;
        for round in 0..60 {
            let g = rng.random_range(0..gates.len());
            let mut batch: Vec<CallEvent> = (0..rng.random_range(1..30))
                .map(|k| {
                    t += rng.random_range(0..20);
                    ev(
                        round * 100 + k,
                        t,
                        &format!("+349100000{}", rng.random_range(0..2)),
                    )
                })
                .collect();
            gates[g].run(&mut ledger, &set, &mut batch);
            for e in &batch {
                let a = e.aggregated(1);
                if a.count <= n {
                    let key = (
                        e.callee.clone().unwrap_or_default().to_string(),
                        e.ts_ms / w,
                    );
                    *admitted.entry(key).or_default() += 1;
                }
            }
            for gate in &gates {
                for h in gate.held_values() {
                    assert!(
                        h.held <= block_cap(n),
                        "case {case}: holds {} > block",
                        h.held
                    );
                }
            }
        }
        for ((key, b), a) in &admitted {
            assert!(
                *a <= n,
                "case {case}: {a} admitted to {key} in bucket {b}, limit {n}"
            );
        }
    }
}

#[test]
fn a_share_scales_the_limit_and_never_goes_to_zero() {
    let set = rules(WindowKind::Fixed, RuleKey::Global, 10_000, 9);
    let mut events: Vec<CallEvent> = (0..20)
        .map(|i| ev(i, 5_000 + i as i64, "+34910000001"))
        .collect();
    Gate::new().run(&mut MemoryLedger::with_share(1.0 / 3.0), &set, &mut events);
    let admitted = events.iter().filter(|e| e.aggregated(1).count <= 9).count();
    assert_eq!(admitted, 3);
    let mut events: Vec<CallEvent> = (0..5)
        .map(|i| ev(i, 5_000 + i as i64, "+34910000001"))
        .collect();
    Gate::new().run(&mut MemoryLedger::with_share(0.01), &set, &mut events);
    assert_eq!(
        events.iter().filter(|e| e.aggregated(1).count <= 9).count(),
        1
    );
}

#[test]
fn a_call_decided_before_takes_no_second_credit() {
    let set = rules(WindowKind::Fixed, RuleKey::Callee, 10_000, 2);
    let (mut gate, mut ledger) = (Gate::new(), MemoryLedger::new());
    let mut first = vec![ev(1, 100, "+34910000001")];
    gate.run(&mut ledger, &set, &mut first);
    let mut again = vec![
        ev(1, 100, "+34910000001"),
        ev(2, 101, "+34910000001"),
        ev(3, 102, "+34910000001"),
    ];
    gate.run(&mut ledger, &set, &mut again);
    let counts: Vec<u64> = again.iter().map(|e| e.aggregated(1).count).collect();
    assert_eq!(counts, vec![1, 2, 3]);
    assert_eq!(again[2].aggregated(1).until, Some(9_999));
}

/// One instance holding the only slot, whose span covers every bucket:
/// the contract exactly, its reserves and the ledger's shared part
/// together making up each limit (a call later than its counter's time
/// finds the reserve spent in it remembered).
#[test]
fn one_instance_with_the_only_reserve_slot_is_the_contract() {
    let mut rng = StdRng::seed_from_u64(17);
    let mut reserved = 0;
    for case in 0..300 {
        let (kind, key) = kind_and_key(case);
        let w = rng.random_range(40..400);
        let n = rng.random_range(1..60);
        let set = rules(kind, key, w, n);
        let mut events = random_events(&mut rng, 200, w);
        let expected = naive(&set, &events);
        let (mut gate, mut ledger) = (Gate::new(), MemoryLedger::new());
        gate.set_reserves(Reserves {
            slots: 1,
            span: Some(Span::ALL),
        });
        run_in_random_batches(&mut rng, &mut gate, &mut ledger, &set, &mut events);
        reserved += gate.held_values().filter(|h| h.reserve > 0).count();
        let got: Vec<Aggregated> = events.iter().map(|e| e.aggregated(1)).collect();
        assert_eq!(got, expected, "case {case}: {kind:?} {key:?} W={w} N={n}");
    }
    assert!(reserved > 100, "reserves were taken: {reserved}");
}

/// Calls of a round to two callees, in time order from `t`.
fn round_of(rng: &mut StdRng, round: usize, t: &mut i64) -> Vec<CallEvent> {
    (0..rng.random_range(1..30))
        .map(|k| {
            *t += rng.random_range(0..20);
            ev(
                round * 100 + k,
                *t,
                &format!("+349100000{}", rng.random_range(0..2)),
            )
        })
        .collect()
}

/// Three instances, each holding a slot, share a ledger. The first's span
/// grows with its calls, as the store raises it in Redis; midway it is
/// replaced by a new holder of its slot, whose span starts where the old
/// one's ended, and calls go back into buckets the old holder spent its
/// reserve in (below the new span: leased). Never more than the limit
/// admitted in a bucket. (With the new holder given every bucket instead,
/// this fails: the old holder's reserve is spent twice.)
#[test]
fn reserve_slots_and_a_new_holder_never_admit_past_the_limit() {
    let mut rng = StdRng::seed_from_u64(23);
    let mut from_reserves = 0;
    for case in 0..200 {
        let w = 1_000;
        let n = rng.random_range(1..80);
        let set = rules(WindowKind::Fixed, RuleKey::Callee, w, n);
        let mut ledger = MemoryLedger::new();
        let spanned = |span| {
            let mut g = Gate::new();
            g.set_reserves(Reserves {
                slots: 3,
                span: Some(span),
            });
            g
        };
        let mut span = Span {
            from: i64::MIN,
            until: 0,
        };
        let mut gates: Vec<Gate> = vec![spanned(span), spanned(Span::ALL), spanned(Span::ALL)];
        let mut admitted: StdMap<(String, i64), u64> = StdMap::new();
        let mut t = 0i64;
        for round in 0..60 {
            if round == 30 {
                span = Span {
                    from: span.until,
                    until: span.until,
                };
                gates[0] = spanned(span);
                t -= (2 * w).min(t);
            }
            let g = rng.random_range(0..gates.len());
            let mut batch = round_of(&mut rng, round, &mut t);
            if g == 0 {
                // The store raises the span before the batch is planned.
                let newest = batch.iter().map(|e| e.ts_ms).max().unwrap_or(0);
                span.until = span.until.max(newest + 1);
                gates[0].set_reserves(Reserves {
                    slots: 3,
                    span: Some(span),
                });
            }
            gates[g].run(&mut ledger, &set, &mut batch);
            for e in &batch {
                if e.aggregated(1).count <= n {
                    let key = (
                        e.callee.clone().unwrap_or_default().to_string(),
                        e.ts_ms / w,
                    );
                    *admitted.entry(key).or_default() += 1;
                }
            }
            for gate in &gates {
                from_reserves += gate.held_values().map(|h| h.reserve).sum::<u64>();
            }
        }
        for ((key, b), a) in &admitted {
            assert!(
                *a <= n,
                "case {case}: {a} admitted to {key} in bucket {b}, limit {n}"
            );
        }
    }
    assert!(from_reserves > 0);
}

/// A counter the gate dropped (its time past) gets no second reserve when
/// a late call comes for it: what was left of its reserve is spent, then
/// the ledger is asked, the count with the reserve spent in it. Once
/// forgotten (the oldest past [`SPENT_KEPT`]), no reserve is taken below
/// its bucket's end.
#[test]
fn a_dropped_counter_takes_no_second_reserve() {
    let set = rules(WindowKind::Fixed, RuleKey::Callee, 1_000, 32);
    assert_eq!(reserve_of(32, 1), 2);
    let mut gate = Gate::new();
    gate.set_reserves(Reserves {
        slots: 1,
        span: Some(Span::ALL),
    });
    let mut ledger = MemoryLedger::new();
    let mut first = vec![ev(1, 100, "+34910000001")];
    assert!(gate.plan(&set, &first).is_empty(), "the reserve covers it");
    gate.run(&mut ledger, &set, &mut first);
    // Later: the counter of bucket 0 is dropped.
    let mut later = vec![ev(2, 100_000, "+34910000002")];
    gate.run(&mut ledger, &set, &mut later);
    let mut late = vec![ev(3, 200, "+34910000001")];
    assert!(gate.plan(&set, &late).is_empty(), "the reserve left");
    gate.run(&mut ledger, &set, &mut late);
    assert_eq!(late[0].aggregated(1).count, 2);
    // Dropped again, then a third call: nothing left, asked of the ledger.
    let mut later = vec![ev(4, 200_000, "+34910000002")];
    gate.run(&mut ledger, &set, &mut later);
    let mut third = vec![ev(5, 300, "+34910000001")];
    let asked = gate.plan(&set, &third);
    assert_eq!(asked.len(), 1, "asked of the ledger: {asked:?}");
    assert_eq!(asked[0].limit, shared_limit(32, 1));
    gate.run(&mut ledger, &set, &mut third);
    assert_eq!(third[0].aggregated(1).count, 3, "the reserve spent counts");
    // Another callee in that bucket, never seen: its reserve is untouched.
    let other = vec![ev(6, 400, "+34910000003")];
    assert!(gate.plan(&set, &other).is_empty());
    // Forgotten: no reserve at or below its bucket, even for a new callee.
    let mut much_later = vec![ev(7, 2 * MEMORY_MARGIN_MS, "+34910000004")];
    gate.run(&mut ledger, &set, &mut much_later);
    while !gate.spent.is_empty() {
        gate.forget_oldest_spent();
    }
    let below = vec![ev(8, 500, "+34910000009")];
    assert_eq!(gate.plan(&set, &below).len(), 1);
    let new = vec![ev(9, 2 * MEMORY_MARGIN_MS + 5_000, "+34910000005")];
    assert!(gate.plan(&set, &new).is_empty(), "a new bucket: reserved");
}

/// The batch planned last counts as planned until it is decided, another
/// batch is decided, or its plan is forgotten (its lease failed); and
/// deciding it on that plan, without planning it again, gives the counts
/// of planning it when it comes.
#[test]
fn a_batch_is_planned_until_decided_or_forgotten() {
    let set = rules(WindowKind::Fixed, RuleKey::Callee, 1_000, 3);
    let batch = |from: usize| -> Vec<CallEvent> {
        (from..from + 5)
            .map(|i| ev(i, 100 + i as i64, "+34910000001"))
            .collect()
    };
    let (mut gate, mut ledger) = (Gate::new(), MemoryLedger::new());
    let mut first = batch(0);
    let requests = gate.plan(&set, &first);
    assert!(gate.planned(&first));
    assert!(!gate.planned(&batch(5)), "another batch");
    let leases = ledger.lease(&requests);
    gate.settle(&requests, &leases);
    gate.decide(&set, &mut first);
    assert!(!gate.planned(&first), "decided since");
    let second = batch(5);
    gate.plan(&set, &second);
    gate.forget_plan();
    assert!(!gate.planned(&second), "forgotten");
    // Planned and leased, then decided with no second plan: the counts of
    // one run over both batches.
    let (mut once, mut whole) = ((Gate::new(), MemoryLedger::new()), batch(0));
    whole.extend(batch(5));
    once.0.run(&mut once.1, &set, &mut whole);
    let mut second = batch(5);
    let requests = gate.plan(&set, &second);
    let leases = ledger.lease(&requests);
    gate.settle(&requests, &leases);
    assert!(gate.planned(&second));
    gate.decide(&set, &mut second);
    let got: Vec<Aggregated> = first
        .iter()
        .chain(&second)
        .map(|e| e.aggregated(1))
        .collect();
    let want: Vec<Aggregated> = whole.iter().map(|e| e.aggregated(1)).collect();
    assert_eq!(got, want);
}

/// Two rules keyed by callee and global, between rules keyed by caller.
fn two_aggregate_rules(kind: WindowKind, w: i64, n: u64) -> RuleSet {
    let mut callee = Rule::new("callee", kind, w, n);
    callee.key = RuleKey::Callee;
    let mut global = Rule::new("global", kind, 2 * w, 3 * n);
    global.key = RuleKey::Global;
    let caller = |name| Rule::new(name, WindowKind::Fixed, 1_000, 1_000);
    let mut spec = RuleSpec::new(vec![caller("a"), callee, caller("b"), global]);
    spec.grace_ms = w / 3;
    RuleSet::build(spec).expect("valid rules")
}

#[test]
fn a_batch_decided_on_its_plan_equals_one_decided_looking_each_call_up() {
    let mut rng = StdRng::seed_from_u64(17);
    for case in 0..120 {
        let (kind, _) = kind_and_key(case);
        let w = rng.random_range(40..400);
        let n = rng.random_range(1..12);
        let set = two_aggregate_rules(kind, w, n);
        let mut planned = random_events(&mut rng, 300, w);
        let mut looked_up = planned.clone();
        let gates = || {
            let mut gate = Gate::new();
            if case % 4 < 2 {
                gate.set_reserves(Reserves {
                    slots: 1,
                    span: Some(Span::ALL),
                });
            }
            (gate, MemoryLedger::new())
        };
        let ((mut a, mut la), (mut b, mut lb)) = (gates(), gates());
        let mut at = 0;
        while at < planned.len() {
            let size = rng.random_range(1..40).min(planned.len() - at);
            a.run(&mut la, &set, &mut planned[at..at + size]);
            let batch = &mut looked_up[at..at + size];
            let requests = b.plan(&set, batch);
            let leases = lb.lease(&requests);
            b.settle(&requests, &leases);
            b.forget_plan();
            b.decide(&set, batch);
            at += size;
        }
        for (p, l) in planned.iter().zip(&looked_up) {
            assert_eq!(p.aggregate, l.aggregate, "case {case}: {}", p.call_id);
        }
        // (Both rules counted something, in a case where they can.)
        let counted = |i| planned.iter().filter(|e| e.aggregated(i).count > 0).count();
        assert_eq!((counted(1), counted(3)), (planned.len(), planned.len()));
        assert_eq!(a.held_values().count(), b.held_values().count());
        assert_eq!(a.held.len(), a.counters.values().count(), "no place lost");
    }
}

//! The gate's own CPU per call, without Redis: the rules keyed by callee
//! or global decided on an in-process ledger, as `bench_store aggregate`
//! feeds the store (5,000 callees called in turn, a call every 2 ms of
//! event time, batches of 256), with the one reserve slot an instance
//! alone holds.
//!
//! Run: `cargo run --release --example bench_gate [-- EVENTS]` (default
//! 1,000,000). Prints nanoseconds per call for each rule, the median of 5
//! rounds, each round on a fresh gate.

use std::time::Instant;

use callguard::engine::aggregate::{Gate, MemoryLedger, Reserves, Span};
use callguard::engine::event::CallEvent;
use callguard::engine::rules::RuleSet;

/// The allocator the callguard binary runs with (src/main.rs).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const T0: i64 = 1_764_547_200_000;
const BATCH: usize = 256;

/// Calls `from..from + total` of the stream.
fn events(from: usize, total: usize) -> Vec<CallEvent> {
    (from..from + total)
        .map(|i| CallEvent {
            call_id: format!("c{}-{i}", i % 100_000).into(),
            caller: format!("+3460{:07}", i % 100_000).into(),
            callee: Some(format!("+3491{:07}", i % 5_000).into()),
            ts_ms: T0 + (i as i64) * 2,
            ..CallEvent::default()
        })
        .collect()
}

/// Nanoseconds per call of one round: a fresh gate warmed by `warm`
/// (its memories filled as a long-running instance's are), then timed on
/// `events`.
fn round(rules: &RuleSet, warm: &[CallEvent], events: &[CallEvent]) -> f64 {
    let mut gate = Gate::new();
    gate.set_reserves(Reserves {
        slots: 1,
        span: Some(Span::ALL),
    });
    let mut ledger = MemoryLedger::new();
    for batch in warm.chunks(BATCH) {
        gate.run(&mut ledger, rules, &mut batch.to_vec());
    }
    let mut batches: Vec<Vec<CallEvent>> = events.chunks(BATCH).map(<[_]>::to_vec).collect();
    let start = Instant::now();
    for batch in &mut batches {
        gate.run(&mut ledger, rules, batch);
    }
    let ns = start.elapsed().as_nanos() as f64 / events.len() as f64;
    // (The decisions are used, so none of the work is optimised away.)
    let decided = batches
        .iter()
        .flatten()
        .filter(|e| e.aggregate.is_some())
        .count();
    assert_eq!(decided, events.len(), "every call decided");
    ns
}

fn main() {
    let total: usize = std::env::args()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let warm = events(0, warm_up());
    let events = events(warm.len(), total);
    let rule = |name: &str, kind: &str, window: &str, limit: u64, key: &str| {
        let toml = format!(
            "[[rule]]\nname = \"{name}\"\nkind = \"{kind}\"\nwindow = \"{window}\"\nlimit = {limit}\nkey = \"{key}\"\n"
        );
        RuleSet::from_toml(&toml).expect("rules")
    };
    let sets = [
        (
            "callee, fixed 10 s, 50",
            rule("tdos", "fixed", "10s", 50, "callee"),
        ),
        (
            "global, fixed 1 s, 1,000,000",
            rule("all", "fixed", "1s", 1_000_000, "global"),
        ),
        (
            "callee, sliding-approx 60 s, 500",
            rule("min", "sliding-approx", "60s", 500, "callee"),
        ),
    ];
    println!("| rule | ns per call (median of 5) |");
    println!("|---|---|");
    // (`BENCH_GATE_SETS=0,2`: only those rules, e.g. under a profiler.)
    let only: Option<Vec<usize>> = std::env::var("BENCH_GATE_SETS")
        .ok()
        .map(|v| v.split(',').filter_map(|k| k.trim().parse().ok()).collect());
    for (k, (what, rules)) in sets.into_iter().enumerate() {
        if only.as_ref().is_some_and(|o| !o.contains(&k)) {
            continue;
        }
        let mut ns: Vec<f64> = (0..5).map(|_| round(&rules, &warm, &events)).collect();
        ns.sort_by(f64::total_cmp);
        println!("| {what} | {:.0} |", ns[2]);
    }
}

/// Calls decided before the timed ones: `BENCH_WARM` (default 0, a
/// fresh gate; 2,000,000 fill its memories).
fn warm_up() -> usize {
    std::env::var("BENCH_WARM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

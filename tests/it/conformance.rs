//! One algorithm, every store: the same scenarios and random sequences run
//! against the in-memory store and against real Redis (standalone and a
//! 3-master Cluster), with the algorithm in the window script and in
//! process on cached state; the decision records must be identical.

use crate::common;

use std::time::Duration;

use callguard::engine::aggregate::MemoryLedger;
use callguard::engine::event::CallEvent;
use callguard::engine::record::{Decision, Verdict};
use callguard::engine::rules::RuleSet;
use callguard::store::cached::CachedStore;
use callguard::store::gated::{Gated, Ledger};
use callguard::store::memory::MemoryStore;
use callguard::store::redis::aggregate::lease::RedisLedger;
use callguard::store::redis::{RedisConfig, RedisStore};
use callguard::store::{AnyStore, Next, WindowStore};
use common::scenarios::{self, T0};
use common::{ev, random, raw_command, RedisCluster, RedisServer};

fn config(urls: Vec<String>, prefix: &str) -> RedisConfig {
    RedisConfig {
        cluster: urls.len() > 1,
        urls,
        key_prefix: prefix.to_string(),
        idempotency: true,
        decide_ahead: true,
        timeout: Duration::from_secs(5),
        ttl_slack: Duration::ZERO,
        tls_ca: None,
        block_keys: true,
        ..RedisConfig::default()
    }
}

/// Where the window algorithm runs with a Redis store.
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// In the window script.
    Script,
    /// In process, on cached state written back under a version check.
    Cached,
}

const MODES: [Mode; 2] = [Mode::Script, Mode::Cached];

/// A Redis store in `mode` (the cached store with a small cache, so it
/// also evicts and re-reads callers, and keeps logs of more than 6 times
/// and more than 4 records apart, so they move out, grow, get trimmed,
/// compacted and move back in).
async fn open(mode: Mode, urls: Vec<String>, prefix: &str) -> AnyStore {
    open_with(mode, config(urls, prefix)).await
}

/// [`open`] on the Redis `c` names.
async fn open_with(mode: Mode, c: RedisConfig) -> AnyStore {
    match mode {
        Mode::Script => AnyStore::Redis(Box::new(RedisStore::connect(c).await.unwrap())),
        Mode::Cached => AnyStore::Cached(Box::new(
            CachedStore::connect(c, 4)
                .await
                .unwrap()
                .with_log_apart_above(6)
                .with_records_apart_above(4),
        )),
    }
}

async fn memory_run(rules: &RuleSet, events: &[CallEvent]) -> Vec<Verdict> {
    let mut m = MemoryStore::new();
    m.apply_batch(rules, events).await.unwrap()
}

/// Runs `events` through Redis in batches of `batch`, each told the batch
/// after it as the consumer tells it (the cached store decides that one's
/// other callers ahead, while it commits), and compares with memory.
async fn assert_same<S: WindowStore>(
    redis: &mut S,
    rules: &RuleSet,
    events: &[CallEvent],
    batch: usize,
    what: &str,
) -> Vec<Verdict> {
    let expected = memory_run(rules, events).await;
    let mut got = Vec::new();
    let chunks: Vec<&[CallEvent]> = events.chunks(batch).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let mut next = chunks.get(i + 1).map(|&events| Next { rules, events });
        let verdicts = redis
            .apply_batch_partial_ahead(rules, chunk, &mut next)
            .await
            .unwrap();
        got.extend(
            verdicts
                .into_iter()
                .map(|v| v.expect("one writer: every call decided")),
        );
    }
    assert_eq!(got.len(), expected.len());
    for (i, (g, x)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g, x, "{what}: event #{i} {:?}", events[i]);
    }
    got
}

async fn scenario_suite(urls: Vec<String>) {
    for mode in MODES {
        for (n, sc) in scenarios::all().into_iter().enumerate() {
            let events: Vec<CallEvent> = sc
                .events
                .iter()
                .map(|(c, id, dt, _)| ev(c, id, T0 + dt))
                .collect();
            let what = format!("{mode:?}: {}", sc.name);
            // One event per round trip, and all in one pipelined batch.
            let mut redis = open(mode, urls.clone(), &format!("sc{mode:?}{n}:")).await;
            assert_same(&mut redis, &sc.rules, &events, 1, &what).await;
            let mut redis = open(mode, urls.clone(), &format!("scb{mode:?}{n}:")).await;
            assert_same(&mut redis, &sc.rules, &events, 64, &what).await;
        }
    }
}

async fn random_suite(urls: Vec<String>, seeds: std::ops::Range<u64>) {
    let (mut most_callees, mut decided_ahead) = (0, 0);
    for mode in MODES {
        for seed in seeds.clone() {
            let (rules, events) = random::case(seed, 600, 6);
            let mut redis = open(mode, urls.clone(), &format!("r{mode:?}{seed}:")).await;
            let got = assert_same(
                &mut redis,
                &rules,
                &events,
                97,
                &format!("{mode:?}: seed {seed}, rules {rules:?}"),
            )
            .await;
            let most = got.iter().filter_map(|v| v.distinct_callees).max();
            most_callees = most_callees.max(most.unwrap_or(0));
            if let Mode::Cached = mode {
                // Batches of five, most of whose callers are not in the
                // batch before: decided ahead while it commits.
                let mut redis = open(mode, urls.clone(), &format!("ra{seed}:")).await;
                let what = format!("ahead: seed {seed}, rules {rules:?}");
                assert_same(&mut redis, &rules, &events, 5, &what).await;
                if let AnyStore::Cached(c) = &redis {
                    decided_ahead += c.calls_decided_ahead();
                }
            }
        }
    }
    let runs = seeds.end - seeds.start;
    assert!(
        decided_ahead > runs * 100,
        "{decided_ahead} calls decided ahead in {runs} runs of 600"
    );
    // Some caller had more callees in its window than a caller's state
    // lists inline (eight): the table form went through every store too.
    assert!(most_callees > 8, "at most {most_callees} distinct callees");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_scenarios_match_memory() {
    let server = RedisServer::start(&[]);
    scenario_suite(vec![server.url()]).await;
}

/// Defect 2 of the reliability issue: at both ends of the accepted time
/// range, with 31-day windows, Redis decides exactly as memory (Lua
/// formats window bounds with %d, never tostring).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edges_of_the_time_range_match_memory() {
    use callguard::engine::event::{MAX_TS_MS, MIN_TS_MS};
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(
        None,
        &[
            "f:fixed:31d:3".into(),
            "s:sliding:31d:3".into(),
            "a:sliding-approx:31d:3".into(),
            "m:sliding:1s:2".into(),
        ],
    )
    .unwrap();
    for (n, base) in [MIN_TS_MS, MAX_TS_MS - 40 * 86_400_000]
        .into_iter()
        .enumerate()
    {
        let offsets = [
            0,
            1,
            999,
            1_000,
            1_001,
            86_400_000,
            2_678_400_000,
            2_678_400_001,
        ];
        let mut events = Vec::new();
        for (i, dt) in offsets.into_iter().enumerate() {
            events.push(ev("+34911000001", &format!("e{n}-{i}"), base + dt));
            events.push(ev("+34911000001", &format!("d{n}-{i}"), base + dt));
        }
        events.push(ev("+34911000001", "last", MAX_TS_MS - 1));
        for mode in MODES {
            let mut redis = open(mode, vec![server.url()], &format!("edge{mode:?}{n}:")).await;
            assert_same(
                &mut redis,
                &rules,
                &events,
                1,
                &format!("{mode:?}: time range edge"),
            )
            .await;
        }
    }
}

/// Defect 6 of the reliability issue: a reload that changes rules' windows
/// (same names, same number of rules) must not carry the old counters
/// over in memory: Redis keys per-rule state by name and window, and so
/// must the memory store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_with_changed_windows_matches_redis() {
    let server = RedisServer::start(&[]);
    let before = RuleSet::from_args(
        None,
        &["a:sliding-approx:10s:5".into(), "f:fixed:10s:5".into()],
    )
    .unwrap();
    let after = RuleSet::from_args(
        None,
        &["a:sliding-approx:60s:5".into(), "f:fixed:60s:5".into()],
    )
    .unwrap();
    let mut memory = MemoryStore::new();
    let mut redis = RedisStore::connect(config(vec![server.url()], "reload:"))
        .await
        .unwrap();
    let mut rejected = 0;
    for i in 0..90 {
        let rules = if i < 45 { &before } else { &after };
        let e = ev("+34911000001", &format!("c{i}"), T0 + 30_000 + 1_000 * i);
        let m = memory
            .apply_batch(rules, std::slice::from_ref(&e))
            .await
            .unwrap();
        let r = redis
            .apply_batch(rules, std::slice::from_ref(&e))
            .await
            .unwrap();
        assert_eq!(m, r, "call #{i}");
        rejected += usize::from(m[0].record.would_reject() && i >= 45);
    }
    assert!(
        rejected > 30,
        "the 60 s rules reject after the reload: {rejected}"
    );
}

/// Defect 4 of the reliability issue: with a small cap on distinct callees
/// (the random sequences use eight), Redis keeps and counts exactly the
/// callees memory does, as entries age out and new ones take their place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capped_callee_sets_match_memory() {
    let server = RedisServer::start(&[]);
    let mut tested = 0;
    for seed in 0..16u64 {
        let (rules, events) = random::case(seed, 400, 3);
        // (A distinct-callees rule with a limit of 3 or more takes no cap of 3.)
        let Ok(rules) = rules
            .with_distinct_callees(true)
            .with_max_distinct_callees(3)
        else {
            continue;
        };
        tested += 1;
        for mode in MODES {
            let mut redis = open(mode, vec![server.url()], &format!("cap{mode:?}{seed}:")).await;
            assert_same(
                &mut redis,
                &rules,
                &events,
                64,
                &format!("{mode:?}: cap seed {seed}"),
            )
            .await;
        }
        let saturated = memory_run(&rules, &events)
            .await
            .iter()
            .filter(|v| v.distinct_callees == Some(3))
            .count();
        assert!(saturated > 0, "seed {seed}: the cap is never reached");
    }
    assert!(tested >= 10, "only {tested} random rule sets took the cap");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_random_sequences_match_memory() {
    let server = RedisServer::start(&[]);
    random_suite(vec![server.url()], 0..40).await;
}

/// Rules keyed by callee or global: one instance leasing from Redis in
/// either mode, holding the only reserve slot (most callees' credits from
/// its reserve, the rest leased), decides like the in-memory store behind
/// the in-process ledger (the offline path), whatever the batches.
/// Concurrent rules and call ends, in both modes, against memory.
async fn concurrent_suite(urls: Vec<String>, seeds: std::ops::Range<u64>) {
    for mode in MODES {
        for seed in seeds.clone() {
            let (rules, events) = random::concurrent_case_scaled(seed, 300, 6, 1);
            let mut redis = open(mode, urls.clone(), &format!("co{mode:?}{seed}:")).await;
            let what = format!("{mode:?}: concurrent seed {seed}");
            assert_same(&mut redis, &rules, &events, 41, &what).await;
        }
    }
}

/// Sum rules and call ends, in both modes, against memory: windows as
/// generated, and 100 times shorter (short windows and max durations: the
/// trims' and the retry-after's boundaries are met often).
async fn sum_suite(urls: Vec<String>, seeds: std::ops::Range<u64>) {
    for mode in MODES {
        for seed in seeds.clone() {
            for scale in [1, 100] {
                let (rules, events) = random::sum_case_scaled(seed, 300, 3, scale);
                let prefix = format!("su{mode:?}{seed}x{scale}:");
                let mut redis = open(mode, urls.clone(), &prefix).await;
                let what = format!("{mode:?}: sum seed {seed}, scale {scale}");
                assert_same(&mut redis, &rules, &events, 41, &what).await;
            }
        }
    }
}

/// Large spend in a day-long sliding-approx window, through both modes:
/// the script's weighted sum (`floor(prev * (W - r - 1) / W)`, products
/// far beyond 2^53, in limbs below 2^49) and its retry-after equal the
/// engine's u128 arithmetic (dropping a limb fails it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_sums_stay_exact_in_the_script() {
    use callguard::engine::event::EventKind;
    let server = RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("rates.csv"), "+881,99.999999,1\n").unwrap();
    std::fs::write(
        dir.path().join("rules.toml"),
        "[[rule]]\nname = \"spend\"\nkind = \"sliding-approx\"\nwindow = \"1d\"\nsum = \"cost\"\nrates_file = \"rates.csv\"\nlimit = \"50000.000001\"\nmax_duration = \"6h\"\n",
    )
    .unwrap();
    let rules = RuleSet::from_file(&dir.path().join("rules.toml")).unwrap();
    let hour = 3_600_000;
    let mut events = Vec::new();
    for k in 0..12i64 {
        let start = T0 + k * 2 * hour + k * 7_919;
        let attempt = CallEvent {
            callee: Some("+8812345".into()),
            ..ev("+34911000001", &format!("c{k}"), start)
        };
        let end = CallEvent {
            kind: EventKind::End,
            talk_ms: Some(4 * hour - 1_234 * k),
            ..attempt.clone()
        };
        events.push(attempt);
        events.push(CallEvent {
            ts_ms: start + 4 * hour,
            ..end
        });
    }
    events.sort_by_key(|e| e.ts_ms);
    let expected = memory_run(&rules, &events).await;
    let rejected = expected
        .iter()
        .filter(|v| v.record.retry_after_ms.is_some())
        .count();
    assert!(rejected > 0, "the cap is reached");
    // 4.8e10 micro-units times a day's 8.64e7 ms: far beyond 2^53.
    assert!(
        expected.iter().any(|v| v.record.counts[0] > 40_000_000_000),
        "sums beyond 4e10 micro-units"
    );
    for mode in MODES {
        let mut redis = open(mode, vec![server.url()], &format!("big{mode:?}:")).await;
        assert_same(&mut redis, &rules, &events, 5, &format!("{mode:?}")).await;
    }
}

/// A waiting call is let go exactly when its start + max_duration reaches
/// a later call's `L' - grace`: its end, arriving late after that, adds
/// nothing in any store; one millisecond earlier it still adds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_let_go_at_max_duration_adds_nothing_in_every_store() {
    use callguard::engine::event::EventKind;
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_toml(
        "grace = \"1s\"\n[[rule]]\nname = \"talk\"\nkind = \"sliding\"\nwindow = \"1h\"\nsum = \"talk\"\nlimit = 100\nmax_duration = \"10s\"\n",
    )
    .unwrap();
    for (n, later) in [(0, 11_000i64), (1, 10_999)] {
        let call = |id: &str, t: i64| ev("+34911000001", id, T0 + t);
        let end = CallEvent {
            kind: EventKind::End,
            talk_ms: Some(5_000),
            ..call("a", 5_000)
        };
        let events = vec![call("a", 0), call("b", later), end, call("c", later + 1)];
        let expected = memory_run(&rules, &events).await;
        let c = expected[3].record.counts[0];
        assert_eq!(c, if later == 11_000 { 0 } else { 5 }, "later {later}");
        for mode in MODES {
            let mut redis = open(mode, vec![server.url()], &format!("lg{mode:?}{n}:")).await;
            assert_same(&mut redis, &rules, &events, 1, &format!("{mode:?} {later}")).await;
        }
    }
}

/// Sum rules through both Redis modes on a standalone server, many seeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sum_rules_in_both_modes_match_memory() {
    let server = RedisServer::start(&[]);
    sum_suite(vec![server.url()], 0..60).await;
}

async fn aggregate_suite(urls: Vec<String>, seeds: std::ops::Range<u64>) {
    let mut unblocked = 0;
    let mut reserved = 0;
    for mode in MODES {
        for seed in seeds.clone() {
            let (rules, events) = random::aggregate_case(seed, 600, 6);
            let prefix = format!("a{mode:?}{seed}:");
            let mut memory = Gated::new(MemoryStore::new(), Ledger::Memory(MemoryLedger::new()));
            let expected = memory.apply_batch(&rules, &events).await.unwrap();
            let ledger = Ledger::Redis(Box::new(RedisLedger::new(config(urls.clone(), &prefix))));
            let mut redis = Gated::new(open(mode, urls.clone(), &prefix).await, ledger);
            let mut got = Vec::new();
            for chunk in events.chunks(1 + seed as usize % 90) {
                got.extend(redis.apply_batch(&rules, chunk).await.unwrap());
            }
            for (i, (g, x)) in got.iter().zip(&expected).enumerate() {
                assert_eq!(g, x, "{mode:?}: seed {seed}, event #{i}, rules {rules:?}");
            }
            assert_eq!(got.len(), expected.len());
            reserved += redis.stats().lease.reserved;
            // A reject by the aggregate rule blocks no caller: callers no
            // other rule rejected have no block key.
            let by_others: std::collections::HashSet<&str> = got
                .iter()
                .filter(|v| v.record.retry_after_ms.is_some() && v.record.reason != "agg")
                .map(|v| v.record.caller.as_str())
                .collect();
            let cfg = config(urls.clone(), &prefix);
            let mut con = redis::Client::open(urls[0].as_str())
                .unwrap()
                .get_connection()
                .unwrap();
            for v in got.iter().filter(|v| {
                v.record.reason == "agg" && v.record.retry_after_ms.is_some() && urls.len() == 1
            }) {
                if !by_others.contains(v.record.caller.as_str()) {
                    let key: Option<String> = redis::cmd("GET")
                        .arg(cfg.block_key(&v.record.caller))
                        .query(&mut con)
                        .unwrap();
                    assert_eq!(
                        key, None,
                        "{mode:?} seed {seed}: {} blocked",
                        v.record.caller
                    );
                    unblocked += 1;
                }
            }
            let k = rules
                .rules
                .iter()
                .position(|r| r.key.is_aggregate())
                .unwrap();
            assert!(
                expected.iter().any(|v| v.record.counts[k] > 1),
                "seed {seed}: the aggregate rule never counted past 1"
            );
        }
    }
    assert!(reserved > 100, "{reserved} counters taken from reserves");
    assert!(
        urls.len() > 1 || unblocked > 20,
        "{unblocked} unblocked rejects checked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_aggregate_rules_match_memory() {
    let server = RedisServer::start(&[]);
    aggregate_suite(vec![server.url()], 0..30).await;
}

/// Pools (concurrent and sum rules keyed by account, callee or global)
/// with call ends, windows as generated and 100 times shorter, in both
/// modes: one instance in random batches, and two instances
/// on the same prefix taking the batches in turns (as `serve` instances
/// behind one switch), decide as the memory store and the in-process
/// pools do. Each seed's pools reject some calls, over the suite.
async fn pool_suite(urls: Vec<String>, seeds: std::ops::Range<u64>) {
    let (mut by_pool, mut by_sum) = (0, 0);
    for mode in MODES {
        for (seed, scale) in seeds.clone().flat_map(|s| [(s, 1), (s, 100)]) {
            let (rules, events) = random::pool_case_scaled(seed, 300, 6, scale);
            let mut memory = Gated::new(MemoryStore::new(), Ledger::Memory(MemoryLedger::new()));
            let expected = memory.apply_batch(&rules, &events).await.unwrap();
            // (Keys live an hour past their event-time span: windows of a
            // few milliseconds must not expire between two batches.)
            let gated = |prefix: String| {
                let c = RedisConfig {
                    ttl_slack: Duration::from_secs(3_600),
                    ..config(urls.clone(), &prefix)
                };
                async move {
                    let ledger = Ledger::Redis(Box::new(RedisLedger::new(c.clone())));
                    Gated::new(open_with(mode, c).await, ledger)
                }
            };
            let mut one = gated(format!("p1{mode:?}{seed}x{scale}:")).await;
            let shared = format!("p2{mode:?}{seed}x{scale}:");
            let mut two = [gated(shared.clone()).await, gated(shared).await];
            let (mut alone, mut turns) = (Vec::new(), Vec::new());
            for (k, batch) in random_batches(&events, seed).into_iter().enumerate() {
                alone.extend(one.apply_batch(&rules, batch).await.unwrap());
                turns.extend(two[k % 2].apply_batch(&rules, batch).await.unwrap());
            }
            for (which, got) in [("one instance", &alone), ("two instances", &turns)] {
                assert_eq!(got.len(), expected.len());
                for (i, (g, x)) in got.iter().zip(&expected).enumerate() {
                    assert_eq!(
                        g, x,
                        "{mode:?}, {which}: pool seed {seed} x{scale}, event #{i} {:?}",
                        events[i]
                    );
                }
            }
            for v in expected
                .iter()
                .filter(|v| v.record.decision == Decision::Reject)
            {
                let rule = rules.rules.iter().find(|r| r.name == v.record.reason);
                if let Some(r) = rule.filter(|r| r.is_pooled()) {
                    by_pool += 1;
                    by_sum += usize::from(r.sum.is_some());
                }
            }
        }
    }
    assert!(
        by_pool > 0 && by_sum > 0,
        "pool rejects {by_pool}, by sums {by_sum}"
    );
}

/// A pool's calls of a busy minute, then a call days later (what 9,000
/// calls got passes the idempotency horizon at once: Redis lets it go a
/// bounded number at a time), then an early call seen again: decided
/// afresh, as memory does, in both modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_s_records_passing_the_horizon_at_once_match_memory() {
    use callguard::engine::event::EventKind;
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_toml(
        "[[rule]]\nname = \"m\"\nkind = \"sliding\"\nwindow = \"1m\"\nlimit = 100\n\
         [[rule]]\nname = \"trunk\"\nkind = \"concurrent\"\nkey = \"account\"\nlimit = 40\nmax_duration = \"1h\"\n",
    )
    .unwrap();
    let call = |i: usize, ts: i64| CallEvent {
        call_id: format!("c{i}").into(),
        caller: format!("+3491100{:04}", i % 500).into(),
        ts_ms: ts,
        account: Some("trunk-1".into()),
        ..Default::default()
    };
    let mut events = Vec::new();
    for i in 0..9_000 {
        events.push(call(i, T0 + i as i64 * 6));
        if i % 3 == 0 {
            events.push(CallEvent {
                kind: EventKind::End,
                ts_ms: T0 + i as i64 * 6 + 50,
                ..call(i, 0)
            });
        }
    }
    events.push(call(9_000, T0 + 3 * 86_400_000));
    events.push(call(1, T0 + 3 * 86_400_000 + 1));
    let mut memory = Gated::new(MemoryStore::new(), Ledger::Memory(MemoryLedger::new()));
    let expected = memory.apply_batch(&rules, &events).await.unwrap();
    let rejected = expected
        .iter()
        .filter(|v| v.record.reason == "trunk")
        .count();
    assert!(rejected > 100, "{rejected}");
    assert!(!expected.last().unwrap().duplicate);
    for mode in MODES {
        let c = RedisConfig {
            ttl_slack: Duration::from_secs(3_600),
            ..config(vec![server.url()], &format!("gap{mode:?}:"))
        };
        let ledger = Ledger::Redis(Box::new(RedisLedger::new(c.clone())));
        let mut redis = Gated::new(open_with(mode, c).await, ledger);
        let mut got = Vec::new();
        for batch in events.chunks(256) {
            got.extend(redis.apply_batch(&rules, batch).await.unwrap());
        }
        for (i, (g, x)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, x, "{mode:?}: event #{i}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_in_both_modes_and_two_instances_match_memory() {
    let server = RedisServer::start(&[]);
    pool_suite(vec![server.url()], 0..30).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_scenarios_and_random_sequences_match_memory() {
    let cluster = RedisCluster::start();
    scenario_suite(cluster.urls()).await;
    random_suite(cluster.urls(), 100..115).await;
    aggregate_suite(cluster.urls(), 200..206).await;
    concurrent_suite(cluster.urls(), 300..306).await;
    sum_suite(cluster.urls(), 400..406).await;
    pool_suite(cluster.urls(), 500..504).await;
    // The callers really were spread over the three masters.
    for node in &cluster.nodes {
        let info = raw_command(node.port, "DBSIZE").unwrap();
        let n: i64 = info.trim_start_matches(':').trim().parse().unwrap();
        assert!(n > 0, "node {} holds no keys", node.port);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_is_reloaded_after_script_flush() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["m:sliding:1m:2".into()]).unwrap();
    let mut redis = RedisStore::connect(config(vec![server.url()], "cg:"))
        .await
        .unwrap();
    let a = redis
        .apply_batch(&rules, &[ev("+34911000001", "1", T0)])
        .await
        .unwrap();
    assert!(raw_command(server.port, "SCRIPT FLUSH")
        .unwrap()
        .starts_with("+OK"));
    let b = redis
        .apply_batch(
            &rules,
            &[
                ev("+34911000001", "2", T0 + 1),
                ev("+34911000001", "3", T0 + 2),
            ],
        )
        .await
        .unwrap();
    assert_eq!(a[0].record.counts.as_slice(), [1]);
    assert_eq!(b[1].record.counts.as_slice(), [3]);
    assert_eq!(b[1].record.reason, "m");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_has_a_ttl_and_all_expire() {
    let server = RedisServer::start(&[]);
    // Short windows so the keys expire within the test.
    let rules = RuleSet::new(
        vec![
            callguard::engine::rules::Rule::parse_shorthand("f:fixed:300ms:3").unwrap(),
            callguard::engine::rules::Rule::parse_shorthand("s:sliding:400ms:3").unwrap(),
            callguard::engine::rules::Rule::parse_shorthand("a:sliding-approx:500ms:3").unwrap(),
        ],
        callguard::engine::rules::CountPolicy::Admitted,
        200,
        vec![],
        vec![],
        false,
    )
    .unwrap()
    .with_dedup(700)
    .unwrap();
    let mut redis = RedisStore::connect(config(vec![server.url()], "ttl:"))
        .await
        .unwrap();
    let mut rng_events = Vec::new();
    for i in 0..2_000i64 {
        rng_events.push(ev(
            &format!("+3460000{:04}", i % 97),
            &format!("c{i}"),
            T0 + i * 3,
        ));
    }
    for chunk in rng_events.chunks(256) {
        redis.apply_batch(&rules, chunk).await.unwrap();
    }
    let mut con = server.connection();
    let mut names: Vec<String> = redis::cmd("KEYS").arg("ttl:*").query(&mut con).unwrap();
    // The prefix's mode claim is the one key without a TTL.
    names.retain(|k| k != "ttl:mode");
    // Each caller has its meta hash (window state and records), sliding log
    // and idempotency index (the policy is `admitted`, so the log is not the
    // index); fixed counters live in the meta hash.
    for suffix in [":m", ":l", ":i"] {
        let n = names.iter().filter(|k| k.ends_with(suffix)).count();
        assert_eq!(n, 97, "callers with a {suffix} key: {names:?}");
    }
    assert_eq!(names.len(), 97 * 3, "unexpected keys: {names:?}");
    // Longest window + grace is 700 ms.
    assert_all_expire(&server, &mut con, &names).await;
}

/// The keys of the rules with state of their own (a sliding rule's own log,
/// a distinct-callees set, caller+callee pairs) get TTLs and expire too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_rules_with_state_of_their_own_have_ttls() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_toml(
        r#"
        grace = "100ms"
        [[rule]]
        name = "own"
        kind = "sliding"
        window = "400ms"
        limit = 3
        callees = ["+3491"]
        [[rule]]
        name = "spray"
        kind = "distinct-callees"
        window = "300ms"
        limit = 2
        [[rule]]
        name = "pair"
        key = "caller+callee"
        kind = "sliding"
        window = "500ms"
        limit = 2
        [[rule]]
        name = "tb"
        kind = "token-bucket"
        rate = "10/s"
        burst = 3
        "#,
    )
    .unwrap()
    .with_dedup(600)
    .unwrap();
    let mut redis = RedisStore::connect(config(vec![server.url()], "own:"))
        .await
        .unwrap();
    let events: Vec<CallEvent> = (0..600i64)
        .map(|i| CallEvent {
            callee: Some(format!("+349100000{:02}", i % 13).into()),
            ..ev(
                &format!("+3460000{:04}", i % 31),
                &format!("c{i}"),
                T0 + i * 3,
            )
        })
        .collect();
    for chunk in events.chunks(128) {
        redis.apply_batch(&rules, chunk).await.unwrap();
    }
    let mut con = server.connection();
    let mut names: Vec<String> = redis::cmd("KEYS").arg("own:*").query(&mut con).unwrap();
    names.retain(|k| k != "own:mode");
    for suffix in [
        ":m",
        ":l:own:400",
        ":d:spray:300",
        ":p:pair:500",
        ":pz:pair:500",
    ] {
        let n = names.iter().filter(|k| k.ends_with(suffix)).count();
        assert_eq!(n, 31, "callers with a {suffix} key: {names:?}");
    }
    assert_all_expire(&server, &mut con, &names).await;
}

/// Every key of `names` carries a caller's hash tag and a TTL, and all are
/// gone within seconds once the horizons pass (Redis expires keys lazily
/// and by sampling, so allow up to 15 s); the prefix's mode key, the one
/// key without a TTL, is not in `names`.
async fn assert_all_expire(server: &RedisServer, con: &mut redis::Connection, names: &[String]) {
    for k in names {
        assert!(k.contains("{+3460000"), "key {k} lacks the caller hash tag");
        // -1: no TTL (the defect); -2: already expired since KEYS (fine on a busy machine).
        let ttl: i64 = redis::cmd("PTTL").arg(k).query(con).unwrap();
        assert_ne!(ttl, -1, "key {k} has no TTL");
    }
    let mut left = names.len();
    for _ in 0..150 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let n = raw_command(server.port, "DBSIZE").unwrap();
        left = n.trim_start_matches(':').trim().parse::<usize>().unwrap() - 1;
        if left == 0 {
            break;
        }
    }
    assert_eq!(
        left, 0,
        "keys left after the horizons passed (besides the mode key)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acl_user_in_url_and_typed_errors() {
    let server = RedisServer::start(&[
        "--user", "cg", "on", ">s3cret", "~cg:*", "+@all", "--user", "default", "off",
    ]);
    let rules = RuleSet::from_args(None, &["m:sliding:1m:2".into()]).unwrap();
    let url = format!("redis://cg:s3cret@127.0.0.1:{}", server.port);
    let mut redis = RedisStore::connect(config(vec![url], "cg:")).await.unwrap();
    let v = redis
        .apply_batch(&rules, &[ev("+34911000001", "1", T0)])
        .await
        .unwrap();
    assert_eq!(v[0].record.counts.as_slice(), [1]);
    // Wrong password: a fatal error, not retried forever.
    let bad = format!("redis://cg:wrong@127.0.0.1:{}", server.port);
    let err = RedisStore::connect(config(vec![bad], "cg:"))
        .await
        .expect_err("must fail");
    assert!(!err.is_transient(), "{err}");
    // Keys outside the user's pattern are refused by Redis: fatal too, at
    // start (claiming the prefix's mode writes its first key).
    let err = RedisStore::connect(config(
        vec![format!("redis://cg:s3cret@127.0.0.1:{}", server.port)],
        "prod:",
    ))
    .await
    .expect_err("must fail");
    assert!(!err.is_transient(), "{err}");
    assert!(format!("{err:?}").contains("NoPerm"), "{err:?}");
    // A server that is gone: transient.
    drop(server);
    let err = redis
        .apply_batch(&rules, &[ev("+34911000001", "3", T0 + 1)])
        .await
        .expect_err("must fail");
    assert!(err.is_transient(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = |args: &[&str]| {
        let o = std::process::Command::new("openssl")
            .args(args)
            .current_dir(d)
            .output()
            .expect("openssl");
        assert!(
            o.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=callguard test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(
        d.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    let tls_port = common::free_port();
    let p = |f: &str| d.join(f).display().to_string();
    let server = RedisServer::start(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &p("server.pem"),
        "--tls-key-file",
        &p("server.key"),
        "--tls-ca-cert-file",
        &p("ca.pem"),
        "--tls-auth-clients",
        "no",
    ]);
    let rules = RuleSet::from_args(None, &["m:fixed:1m:1".into()]).unwrap();
    let mut cfg = config(vec![format!("rediss://localhost:{tls_port}")], "cg:");
    cfg.tls_ca = Some(d.join("ca.pem"));
    let mut redis = RedisStore::connect(cfg).await.unwrap();
    let v = redis
        .apply_batch(
            &rules,
            &[ev("+34911000001", "1", T0), ev("+34911000001", "2", T0 + 1)],
        )
        .await
        .unwrap();
    assert_eq!(v[1].record.reason, "m");
    // Without the CA the server certificate is not trusted.
    let untrusted = RedisStore::connect(config(
        vec![format!("rediss://localhost:{tls_port}")],
        "cg:",
    ))
    .await;
    assert!(untrusted.is_err());
    drop(server);
}

/// Splits `events` into batches of random sizes (1 to 40).
fn random_batches(events: &[CallEvent], seed: u64) -> Vec<&[CallEvent]> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut rest = events;
    while !rest.is_empty() {
        let n = rng.random_range(1..=40).min(rest.len());
        let (head, tail) = rest.split_at(n);
        out.push(head);
        rest = tail;
    }
    out
}

/// Two cached stores deciding the same callers in turns (as during a
/// rebalance, or `serve` beside `consume`): each write is checked against
/// the version its writer read, a refused one is decided again on the
/// current state, and together they decide exactly as one memory store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_writers_of_the_same_callers_match_memory() {
    let server = RedisServer::start(&[]);
    let mut conflicts = 0;
    for seed in 0..16u64 {
        let (rules, events) = random::case(seed, 600, 6);
        let expected = memory_run(&rules, &events).await;
        let prefix = format!("two{seed}:");
        let mut a = CachedStore::connect(config(vec![server.url()], &prefix), 1_000)
            .await
            .unwrap()
            .with_log_apart_above(3)
            .with_records_apart_above(2);
        let mut b = CachedStore::connect(config(vec![server.url()], &prefix), 1_000)
            .await
            .unwrap()
            .with_log_apart_above(3)
            .with_records_apart_above(2);
        let mut got = Vec::new();
        for (i, batch) in random_batches(&events, seed).into_iter().enumerate() {
            let store = if i % 2 == 0 { &mut a } else { &mut b };
            got.extend(store.apply_batch(&rules, batch).await.unwrap());
        }
        for (i, (g, x)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, x, "seed {seed}: event #{i} {:?}", events[i]);
        }
        assert_eq!(got.len(), expected.len());
        conflicts += a.conflicts() + b.conflicts();
    }
    assert!(
        conflicts > 100,
        "the writers rarely met: {conflicts} conflicts"
    );
}

/// Concurrent rules and call ends through the cached store, alone (a
/// small cache: callers evicted and read back with their open calls and
/// kept ends) and as two writers of the same callers, batch by batch, and
/// through the window script: the records memory gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_rules_through_every_redis_store_match_memory() {
    ends_through_redis_stores(random::concurrent_case_scaled, "open", true).await;
}

/// Sum rules (talk and cost) and call ends, the same ways: the cached
/// store alone (callers evicted and read back with their waiting calls,
/// what ended calls added, and kept ends' talk times) and as two writers;
/// the window script when it keeps sums.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sum_rules_through_every_redis_store_match_memory() {
    ends_through_redis_stores(random::sum_case_scaled, "sum", true).await;
}

/// Random cases of `case` (rules and events with call ends) through the
/// cached store alone, two cached writers, and (with `script`) the window
/// script, against memory; rules named `reason...` must reject some calls.
async fn ends_through_redis_stores(
    case: fn(u64, usize, usize, i64) -> (RuleSet, Vec<CallEvent>),
    reason: &str,
    script: bool,
) {
    let server = RedisServer::start(&[]);
    let mut conflicts = 0;
    let mut rejected_by_open = 0;
    for seed in 0..24u64 {
        let (rules, events) = case(seed, 300, 4, 1);
        let expected = memory_run(&rules, &events).await;
        rejected_by_open += expected
            .iter()
            .filter(|v| v.record.reason.starts_with(reason))
            .count();
        let mut alone = open(
            Mode::Cached,
            vec![server.url()],
            &format!("ccone{reason}{seed}:"),
        )
        .await;
        assert_same(
            &mut alone,
            &rules,
            &events,
            37,
            &format!("cached: seed {seed}"),
        )
        .await;
        let prefix = format!("cctwo{reason}{seed}:");
        let mut a = CachedStore::connect(config(vec![server.url()], &prefix), 2)
            .await
            .unwrap();
        let mut b = CachedStore::connect(config(vec![server.url()], &prefix), 2)
            .await
            .unwrap();
        let mut got = Vec::new();
        for (i, batch) in random_batches(&events, seed).into_iter().enumerate() {
            let store = if i % 2 == 0 { &mut a } else { &mut b };
            got.extend(store.apply_batch(&rules, batch).await.unwrap());
        }
        assert_eq!(got.len(), expected.len());
        for (i, (g, x)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, x, "two writers, seed {seed}: event #{i} {:?}", events[i]);
        }
        conflicts += a.conflicts() + b.conflicts();
        if script {
            let mut script = open(
                Mode::Script,
                vec![server.url()],
                &format!("cscript{reason}{seed}:"),
            )
            .await;
            assert_same(
                &mut script,
                &rules,
                &events,
                29,
                &format!("script: seed {seed}"),
            )
            .await;
        }
    }
    assert!(
        rejected_by_open > 20,
        "rules {reason}* rarely rejected: {rejected_by_open}"
    );
    assert!(
        conflicts > 10,
        "the writers rarely met: {conflicts} conflicts"
    );
}

/// A cached store that starts on state another wrote (a restart, a
/// rebalance) reads it back, records included: it decides the rest of the
/// stream, and redeliveries of calls the first one decided, exactly as one
/// memory store that saw everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_store_restarts_from_what_redis_holds() {
    let server = RedisServer::start(&[]);
    let mut redelivered = 0;
    let mut logs_apart = 0;
    let mut records_apart = 0;
    for seed in 0..16u64 {
        let (rules, mut events) = random::case(seed, 600, 6);
        let cut = events.len() * 2 / 3;
        // Redeliveries of calls decided before the restart, at its point.
        let again: Vec<CallEvent> = events[cut - 40..cut].to_vec();
        events.splice(cut..cut, again);
        let expected = memory_run(&rules, &events).await;
        let prefix = format!("restart{seed}:");
        let mut first = CachedStore::connect(config(vec![server.url()], &prefix), 1_000)
            .await
            .unwrap()
            .with_log_apart_above(3)
            .with_records_apart_above(3);
        let mut got = first.apply_batch(&rules, &events[..cut]).await.unwrap();
        drop(first);
        let mut con = server.connection();
        let logs: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*:l"))
            .query(&mut con)
            .unwrap();
        logs_apart += logs.len();
        let records: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*:r"))
            .query(&mut con)
            .unwrap();
        records_apart += records.len();
        let mut second = CachedStore::connect(config(vec![server.url()], &prefix), 1_000)
            .await
            .unwrap()
            .with_log_apart_above(3)
            .with_records_apart_above(3);
        for batch in events[cut..].chunks(50) {
            got.extend(second.apply_batch(&rules, batch).await.unwrap());
        }
        for (i, (g, x)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, x, "seed {seed}: event #{i} {:?}", events[i]);
        }
        redelivered += got[cut..cut + 40].iter().filter(|v| v.duplicate).count();
    }
    assert!(
        redelivered > 200,
        "records were not read back: {redelivered} duplicates"
    );
    assert!(
        logs_apart > 5,
        "logs kept apart were not read back: {logs_apart}"
    );
    assert!(
        records_apart > 5,
        "records kept apart were not read back: {records_apart}"
    );
}

/// A caller the cached store believes new but whose state is in Redis
/// (written by another instance) comes back from the plain `SET ... NX`
/// write: a state string that holds the whole state is loaded from that
/// reply, and one whose log is kept apart is read back with its log (here
/// idempotency is off, so the string has no records and only the log is
/// apart). Either way the calls are decided again on what Redis holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_store_reads_back_a_log_kept_apart_of_a_caller_it_thought_new() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["s:sliding:10s:30".into()]).unwrap();
    let mut c = config(vec![server.url()], "back:");
    c.idempotency = false;
    let (busy, quiet) = ("+34600000001", "+34600000002");
    let events: Vec<CallEvent> = (0..80i64)
        .map(|i| {
            let caller = if i % 8 == 7 { quiet } else { busy };
            ev(caller, &format!("c{i}"), T0 + i * 100)
        })
        .collect();
    let mut memory = MemoryStore::new();
    let expected: Vec<Verdict> = events
        .iter()
        .map(|e| memory.apply_unique(&rules, e, true))
        .collect();
    let (head, tail) = events.split_at(40);
    let mut first = CachedStore::connect(c.clone(), 1_000)
        .await
        .unwrap()
        .with_log_apart_above(8);
    let mut got = first.apply_batch(&rules, head).await.unwrap();
    drop(first);
    let mut con = server.connection();
    let mut apart: Vec<String> = redis::cmd("KEYS")
        .arg("back:*:[lr]")
        .query(&mut con)
        .unwrap();
    apart.sort();
    assert_eq!(apart, vec![format!("back:{{{busy}}}:l")]);
    let mut second = CachedStore::connect(c, 1_000)
        .await
        .unwrap()
        .with_log_apart_above(8);
    for chunk in tail.chunks(8) {
        got.extend(second.apply_batch(&rules, chunk).await.unwrap());
    }
    assert_eq!(got, expected);
    assert!(
        got[40..]
            .iter()
            .any(|v| v.record.decision == Decision::Reject),
        "the busy caller's window, read back, must reach its limit"
    );
    assert_eq!(second.misses(), 2, "each caller was refused once");
    assert_eq!(
        second.conflicts(),
        0,
        "a first sight is a miss, not a conflict"
    );
}

/// The cached store keeps one string per caller (plus block keys, and
/// records and logs kept apart), every key with a TTL, all expiring once
/// the horizons pass; a flushed script is loaded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_store_keys_have_ttls_and_survive_a_script_flush() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(
        None,
        &[
            "f:fixed:300ms:3".into(),
            "s:sliding:400ms:3".into(),
            "a:sliding-approx:500ms:3".into(),
        ],
    )
    .unwrap()
    .with_dedup(700)
    .unwrap();
    // Wall-clock TTLs of the 0.7 s horizon plus 3 s of slack: long enough
    // that a slow machine never expires a caller between two of its
    // batches, short enough that the test waits seconds for the expiry.
    let slack = RedisConfig {
        ttl_slack: Duration::from_secs(3),
        ..config(vec![server.url()], "cttl:")
    };
    let mut store = CachedStore::connect(slack, 1_000)
        .await
        .unwrap()
        .with_log_apart_above(3)
        .with_records_apart_above(1);
    let events: Vec<CallEvent> = (0..2_000i64)
        .map(|i| {
            ev(
                &format!("+3460000{:04}", i % 97),
                &format!("c{i}"),
                T0 + i * 3,
            )
        })
        .collect();
    let (head, tail) = events.split_at(1_000);
    let mut got = store.apply_batch(&rules, head).await.unwrap();
    assert!(raw_command(server.port, "SCRIPT FLUSH")
        .unwrap()
        .starts_with("+OK"));
    for chunk in tail.chunks(256) {
        got.extend(store.apply_batch(&rules, chunk).await.unwrap());
    }
    assert_eq!(got, memory_run(&rules, &events).await);
    let mut con = server.connection();
    let mut names: Vec<String> = redis::cmd("KEYS").arg("cttl:*").query(&mut con).unwrap();
    names.retain(|k| k != "cttl:mode");
    let states = names.iter().filter(|k| k.ends_with(":s")).count();
    let blocks = names
        .iter()
        .filter(|k| k.starts_with("cttl:block:"))
        .count();
    let logs = names.iter().filter(|k| k.ends_with(":l")).count();
    let records = names.iter().filter(|k| k.ends_with(":r")).count();
    assert_eq!(states, 97, "one state string per caller: {names:?}");
    assert!(logs > 0, "no log kept apart: {names:?}");
    assert!(records > 0, "no records kept apart: {names:?}");
    assert_eq!(
        states + blocks + logs + records,
        names.len(),
        "unexpected keys: {names:?}"
    );
    assert_all_expire(&server, &mut con, &names).await;
}

/// The two modes keep different keys: a store refuses a key prefix the
/// other mode claimed, instead of counting only its own share of a
/// caller's calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_holds_one_mode() {
    let server = RedisServer::start(&[]);
    let _script = RedisStore::connect(config(vec![server.url()], "one:"))
        .await
        .unwrap();
    let err = CachedStore::connect(config(vec![server.url()], "one:"), 10)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("--redis-mode script"), "{err}");
    let _cached = CachedStore::connect(config(vec![server.url()], "two:"), 10)
        .await
        .unwrap();
    let err = RedisStore::connect(config(vec![server.url()], "two:"))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("--redis-mode cached"), "{err}");
    // The same mode again is fine.
    CachedStore::connect(config(vec![server.url()], "two:"), 10)
        .await
        .unwrap();
    // A prefix the cached mode kept in an older layout is refused too.
    let mut con = server.connection();
    let _: () = redis::cmd("SET")
        .arg("three:mode")
        .arg("cached")
        .query(&mut con)
        .unwrap();
    let err = CachedStore::connect(config(vec![server.url()], "three:"), 10)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("another layout"), "{err}");
}

/// A flooding caller's log kept apart grows by appends and is compacted
/// once mostly trimmed: its string stays within a few windows' worth of
/// times, and every decision equals memory's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_flood_log_is_appended_and_compacted() {
    let server = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["s:sliding:1s:50".into()]).unwrap();
    let mut store = CachedStore::connect(config(vec![server.url()], "flood:"), 1_000)
        .await
        .unwrap()
        .with_log_apart_above(16);
    let events: Vec<CallEvent> = (0..6_000i64)
        .map(|i| ev("+34911000009", &format!("f{i}"), T0 + i * 10))
        .collect();
    let mut con = server.connection();
    let mut got = Vec::new();
    let mut longest = 0usize;
    for chunk in events.chunks(37) {
        got.extend(store.apply_batch(&rules, chunk).await.unwrap());
        let len: usize = redis::cmd("STRLEN")
            .arg("flood:{+34911000009}:l")
            .query(&mut con)
            .unwrap();
        longest = longest.max(len);
    }
    assert_eq!(got, memory_run(&rules, &events).await);
    // The retention (1 s + grace) holds `live` times at 10 ms apart; the
    // string may hold as many trimmed ones again before it is compacted.
    let live = (rules.retention_ms() / 10 + 1) as usize;
    assert!(longest > 0, "the log never moved apart");
    assert!(
        longest <= 8 * (2 * live + 16 + 37),
        "the log string grew to {longest} bytes for {live} live times: not compacted"
    );
}

//! Reliability of the stream processor and the engine under hostile input
//! (issue: no bad input, broker failure or misconfiguration may stop the
//! consumer, lose a call or switch rules off).

use crate::common;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use callguard::engine::event::{CallEvent, MAX_TS_MS, MIN_TS_MS};
use callguard::engine::rules::RuleSet;
use callguard::online::consumer::ConsumeConfig;
use callguard::online::metrics::{Health, Metrics};
use callguard::store::memory::MemoryStore;
use common::kafka::{produce_raw, read_decisions, read_topic};
use serde_json::{json, Value};

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Runs the consumer in process on a mock cluster until `expected` call ids
/// are decided; returns the decision records and the dead letters.
async fn consume(
    messages: &[(String, Value)],
    rules: RuleSet,
    expected: usize,
) -> (Vec<Value>, Vec<common::kafka::Read>, Arc<Metrics>) {
    let raw: Vec<(String, Vec<u8>)> = messages
        .iter()
        .map(|(k, v)| (k.clone(), v.to_string().into_bytes()))
        .collect();
    consume_raw(&raw, rules, expected, |_| {}).await
}

/// [`consume`] with raw payloads and a hook to adjust the configuration.
async fn consume_raw(
    raw: &[(String, Vec<u8>)],
    rules: RuleSet,
    expected: usize,
    adjust: impl FnOnce(&mut ConsumeConfig),
) -> (Vec<Value>, Vec<common::kafka::Read>, Arc<Metrics>) {
    let messages = raw;
    let (_kafka, brokers) = common::kafka::mock_cluster(&[
        ("calls", 2),
        ("call-decisions", 2),
        ("call-features", 2),
        ("calls-dlq", 1),
    ]);
    let msgs: Vec<(Option<&[u8]>, &[u8])> = raw
        .iter()
        .map(|(k, v)| (Some(k.as_bytes()), v.as_slice()))
        .collect();
    produce_raw(&brokers, "calls", &msgs).await;
    let mut config = ConsumeConfig::new(
        &brokers,
        "g",
        "calls",
        "call-decisions",
        "call-features",
        "calls-dlq",
    );
    adjust(&mut config);
    let run = common::kafka::in_process(config, MemoryStore::keeping_all(), rules);
    let decisions = read_decisions(
        &brokers,
        "call-decisions",
        expected,
        Duration::from_secs(60),
    )
    .await;
    let dead = messages.len() - expected;
    let mut n = 0;
    let dlq = read_topic(&brokers, "calls-dlq", Duration::from_secs(30), |_| {
        n += 1;
        n >= dead
    })
    .await;
    let metrics = run.metrics.clone();
    run.stop().await;
    (decisions, dlq, metrics)
}

/// Defect 1: one event whose time is in microseconds (or an hour ahead of
/// the clock) must not move the caller's latest time: it is a dead letter
/// with kind `ts_out_of_range`, and the caller's real calls are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn far_future_timestamps_are_dead_letters_and_do_not_switch_rules_off() {
    let rules = RuleSet::from_args(None, &["minute:sliding:60s:10".into()]).unwrap();
    let caller = "+34911000123";
    let start = now_ms() - 3_600_000;
    let mut messages = vec![
        // Microseconds: beyond 2100.
        (
            caller.to_string(),
            json!({"call_id": "us", "caller": caller, "ts": start * 1000}),
        ),
        // An hour ahead of the wall clock: within the absolute range.
        (
            caller.to_string(),
            json!({"call_id": "ahead", "caller": caller, "ts": now_ms() + 3_600_000}),
        ),
    ];
    for i in 0..30 {
        messages.push((
            caller.to_string(),
            json!({"call_id": format!("c{i}"), "caller": caller, "ts": start + 1_000 * i}),
        ));
    }
    let (decisions, dlq, metrics) = consume(&messages, rules, 30).await;
    let by_id: std::collections::HashMap<&str, &Value> = decisions
        .iter()
        .map(|d| (d["call_id"].as_str().unwrap(), d))
        .collect();
    assert_eq!(by_id.len(), 30, "every real call is decided");
    for i in 0..30 {
        let d = by_id[format!("c{i}").as_str()];
        assert_eq!(
            d["count_minute"],
            i + 1,
            "call c{i} counts what came before it"
        );
        let expected = if i < 10 { "allow" } else { "reject" };
        assert_eq!(d["decision"], expected, "call c{i}");
    }
    assert_eq!(dlq.len(), 2);
    for m in &dlq {
        assert_eq!(m.headers["callguard.error_kind"], "ts_out_of_range");
    }
    let text = metrics.encode();
    assert!(
        text.contains("callguard_dlq_total{kind=\"ts_out_of_range\"} 2"),
        "{text}"
    );
}

/// Defect 2: the engine's arithmetic at the ends of `i64` does not
/// overflow (library callers may pass any time; the decoder never does).
#[test]
fn extreme_times_do_not_overflow_the_engine() {
    let rules = RuleSet::from_args(
        None,
        &[
            "f:fixed:31d:2".into(),
            "s:sliding:31d:2".into(),
            "a:sliding-approx:31d:2".into(),
        ],
    )
    .unwrap();
    let mut store = MemoryStore::new();
    for (i, ts) in [i64::MIN, i64::MIN + 1, 0, i64::MAX - 1, i64::MAX, i64::MAX]
        .into_iter()
        .enumerate()
    {
        let v = store.apply(
            &rules,
            &CallEvent {
                call_id: format!("x{i}").into(),
                caller: "+34911000001".into(),
                ts_ms: ts,
                callee: Some("+34911000002".into()),
                ..Default::default()
            },
        );
        assert!(v.record.counts.iter().all(|&c| c >= 1), "{v:?}");
    }
}

/// Defect 1, everywhere: the shared decoder refuses times outside
/// 2000-01-01 .. 2100-01-01, with their own error kind.
#[test]
fn decoder_refuses_times_outside_the_documented_range() {
    let d = callguard::engine::event::Decoder::default();
    let decode = |ts: Value| {
        d.decode_json(
            json!({"call_id": "a", "caller": "+34911000001", "ts": ts})
                .to_string()
                .as_bytes(),
        )
    };
    assert_eq!(decode(json!(MIN_TS_MS)).unwrap().ts_ms, MIN_TS_MS);
    assert_eq!(decode(json!(MAX_TS_MS - 1)).unwrap().ts_ms, MAX_TS_MS - 1);
    for bad in [
        json!(MIN_TS_MS - 1),
        json!(MAX_TS_MS),
        json!(1_764_547_200_000_000i64),
        json!(1_764_547_200i64),
        json!(i64::MAX),
        json!(i64::MIN),
        json!("3000-01-01T00:00:00Z"),
    ] {
        let e = decode(bad.clone()).expect_err(&bad.to_string());
        assert_eq!(e.kind(), "ts_out_of_range", "{bad}: {e}");
    }
}

/// Defect 5: `consume` keeps its windows in Redis unless told otherwise; a
/// Redis URL with `--store memory` is an error, not a silent in-process
/// store.
#[test]
fn consume_uses_redis_by_default_and_refuses_a_url_with_memory() {
    use std::process::Command;
    let closed = common::free_port();
    let url = format!("redis://127.0.0.1:{closed}");
    let run = |extra: &[&str]| {
        let mut child = Command::new(common::bin())
            .args(["consume", "--brokers", "mock", "--rule", "m:sliding:60s:5"])
            .args(["--metrics-addr", "127.0.0.1:0", "--redis-timeout-ms", "300"])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // A consumer that started on memory would run until killed.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        child.wait_with_output().unwrap()
    };
    let o = run(&["--redis-url", &url]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "consume must not run without its Redis"
    );
    assert!(err.contains("connecting to Redis"), "{err}");
    let o = run(&["--redis-url", &url, "--store", "memory"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("--store memory"), "{err}");
}

/// Defect 10: `--help` never prints secrets taken from the environment,
/// and a malformed Kafka setting is not echoed.
#[test]
fn help_and_errors_do_not_print_secrets() {
    use std::process::Command;
    let o = Command::new(common::bin())
        .args(["consume", "--help"])
        .env("CALLGUARD_REDIS_URL", "redis://cg:s3cretpw@127.0.0.1:6379")
        .env("CALLGUARD_KAFKA_SETTINGS", "sasl.password=hunter2")
        .output()
        .unwrap();
    assert!(o.status.success());
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(help.contains("--redis-url"), "{help}");
    for secret in ["s3cretpw", "hunter2"] {
        assert!(!help.contains(secret), "--help shows {secret}:\n{help}");
    }
    let o = Command::new(common::bin())
        .args(["consume", "--brokers", "mock", "--rule", "m:sliding:60s:5"])
        .args(["-X", "hunter2-typed-without-key"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("bad Kafka setting"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

/// Defect 3: a message too large for the broker is no poison pill. Its dead
/// letter is cut to the payload limit (and says so), so it can always be
/// produced; the valid events around it are decided and the consumer keeps
/// running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_is_a_truncated_dead_letter_not_a_poison_pill() {
    let rules = RuleSet::from_args(None, &["minute:sliding:60s:10".into()]).unwrap();
    let caller = "+34911000777";
    let t = now_ms() - 60_000;
    let event = |id: &str, ts: i64| {
        (
            caller.to_string(),
            json!({"call_id": id, "caller": caller, "ts": ts})
                .to_string()
                .into_bytes(),
        )
    };
    let mut huge = br#"{"call_id":"big","caller":"+34911000777","ts":1,"pad":""#.to_vec();
    huge.resize(300_000, b'x');
    huge.extend_from_slice(b"\"}");
    let raw = vec![
        event("before", t),
        (caller.to_string(), huge.clone()),
        event("after", t + 1),
    ];
    let (decisions, dlq, metrics) = consume_raw(&raw, rules, 2, |c| {
        // What a broker with message.max.bytes = 100000 refuses.
        c.kafka_settings = vec![("message.max.bytes".into(), "100000".into())];
    })
    .await;
    let ids: std::collections::HashSet<&str> = decisions
        .iter()
        .map(|d| d["call_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["before", "after"].into_iter().collect());
    assert_eq!(dlq.len(), 1);
    let dead = &dlq[0];
    assert_eq!(dead.headers["callguard.error_kind"], "oversized");
    assert_eq!(
        dead.headers["callguard.truncated_from"],
        huge.len().to_string()
    );
    assert_eq!(dead.payload.len(), 65_536);
    assert_eq!(dead.payload[..], huge[..65_536]);
    assert!(metrics.encode().contains("callguard_dlq_failures_total 0"));
}

/// Defects 7 and 11 under cooperative rebalancing: when a second member
/// joins, the first keeps some partitions, so it stays ready (`/readyz`),
/// and what it read from the partitions it keeps is not dropped; every call
/// is decided once in effect, equal to the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cooperative_rebalance_keeps_the_first_member_ready_and_loses_nothing() {
    use callguard::store::redis::{RedisConfig, RedisStore};
    let redis = common::RedisServer::start(&[]);
    let (_kafka, brokers) = common::kafka::mock_cluster(&[
        ("calls", 4),
        ("call-decisions", 2),
        ("call-features", 2),
        ("calls-dlq", 1),
    ]);
    let rules = RuleSet::from_args(None, &["minute:sliding:60s:5".into()]).unwrap();
    // 40 callers, 100 calls each, in time order per caller.
    let start = now_ms() - 3_600_000;
    let mut events = Vec::new();
    for i in 0..100 {
        for c in 0..40 {
            events.push(CallEvent::new(
                format!("c{c}-{i}"),
                format!("+3491100{c:04}"),
                start + i * 2_000 + c,
            ));
        }
    }
    let member = |store: RedisStore| {
        let mut config = ConsumeConfig::new(
            &brokers,
            "coop",
            "calls",
            "call-decisions",
            "call-features",
            "calls-dlq",
        );
        config.batch_size = 50;
        config.kafka_settings = vec![
            (
                "partition.assignment.strategy".into(),
                "cooperative-sticky".into(),
            ),
            ("session.timeout.ms".into(), "6000".into()),
        ];
        common::kafka::in_process(config, store, rules.clone())
    };
    let wait_ready = |h: Arc<Health>| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !h.ready() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        h.ready()
    };
    let connect = || {
        RedisStore::connect(RedisConfig {
            urls: vec![redis.url()],
            ..RedisConfig::default()
        })
    };
    let first = member(connect().await.unwrap());
    let first_health = first.health.clone();
    assert!(
        wait_ready(first_health.clone()).await,
        "first member never ready"
    );
    // Half the calls while it is alone, then a second member joins.
    let half = events.len() / 2;
    callguard::online::produce::produce(events[..half].iter(), &brokers, &[], "calls")
        .await
        .unwrap();
    let second = member(connect().await.unwrap());
    let second_health = second.health.clone();
    let mut first_unready = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !second_health.ready() && std::time::Instant::now() < deadline {
        first_unready += usize::from(!first_health.ready());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(second_health.ready(), "second member never got partitions");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        first_health.ready(),
        "the first member keeps partitions: ready"
    );
    assert_eq!(
        first_unready, 0,
        "readiness dropped during a cooperative rebalance"
    );
    callguard::online::produce::produce(events[half..].iter(), &brokers, &[], "calls")
        .await
        .unwrap();
    let records = read_decisions(
        &brokers,
        "call-decisions",
        events.len(),
        Duration::from_secs(120),
    )
    .await;
    first.stop().await;
    second.stop().await;
    common::assert_records_equal_replay(&records, &common::replay_records(&events, &rules));
}

/// Defect 8: Redis out of memory is a store failure the default `block`
/// policy waits out (counted as `kind="oom"`), not a fatal error: once
/// memory is available again every call is decided, equal to the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_out_of_memory_is_waited_out_under_block() {
    use callguard::store::redis::{RedisConfig, RedisStore};
    let redis = common::RedisServer::start(&["--maxmemory-policy", "noeviction"]);
    // Room for a few hundred callers' state, not for all 3,000.
    redis.cap_memory_above_use(400_000);

    let (_kafka, brokers) = common::kafka::mock_cluster(&[
        ("calls", 2),
        ("call-decisions", 2),
        ("call-features", 2),
        ("calls-dlq", 1),
    ]);
    let rules = RuleSet::from_args(None, &["minute:sliding:60s:3".into()]).unwrap();
    let start = now_ms() - 600_000;
    let events: Vec<CallEvent> = (0..3_000)
        .map(|i| CallEvent {
            call_id: format!("c{i}").into(),
            caller: format!("+349110{:05}", i % 1_500).into(),
            ts_ms: start + i,
            callee: Some(format!("+346000{i:05}").into()),
            ..Default::default()
        })
        .collect();
    callguard::online::produce::produce(events.iter(), &brokers, &[], "calls")
        .await
        .unwrap();
    let store = RedisStore::connect(RedisConfig {
        urls: vec![redis.url()],
        ..RedisConfig::default()
    })
    .await
    .unwrap();
    let config = ConsumeConfig::new(
        &brokers,
        "oom",
        "calls",
        "call-decisions",
        "call-features",
        "calls-dlq",
    );
    let run = common::kafka::in_process(config, store, rules.clone());
    let metrics = run.metrics.clone();
    // Wait until the consumer is blocked on OOM, and still running.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !metrics.encode().contains("kind=\"oom\"") && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let text = metrics.encode();
    if run.task.is_finished() {
        let e = run.task.await.unwrap().unwrap_err();
        panic!("consumer stopped: {}", callguard::error::chain(&e));
    }
    assert!(
        text.contains("callguard_store_errors_total{kind=\"oom\"}"),
        "finished: {} {text}",
        run.task.is_finished()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !run.task.is_finished(),
        "an out-of-memory Redis must not stop the consumer"
    );
    let ok = common::raw_command(redis.port, "CONFIG SET maxmemory 0").unwrap();
    assert!(ok.starts_with("+OK"), "{ok}");
    let records = read_decisions(
        &brokers,
        "call-decisions",
        events.len(),
        Duration::from_secs(120),
    )
    .await;
    run.stop().await;
    common::assert_records_equal_replay(&records, &common::replay_records(&events, &rules));
}

/// Defect 4: callees are normalised like callers, and one that cannot be
/// (garbage, an extension without a country code, 50 KB of text) leaves
/// the call valid and the feature without it.
#[test]
fn callees_are_normalised_and_bad_ones_dropped() {
    let d = callguard::engine::event::Decoder::default();
    let decode = |callee: Value| {
        d.decode_json(
            json!({"call_id": "a", "caller": "+34911000001", "ts": MIN_TS_MS, "callee": callee})
                .to_string()
                .as_bytes(),
        )
        .unwrap()
        .callee
    };
    assert_eq!(
        decode(json!("0034 600-000-001")),
        Some("+34600000001".into())
    );
    // National numbers need a country code, as for callers.
    assert_eq!(decode(json!(600000001i64)), None);
    let spain =
        callguard::engine::event::Decoder::new(Default::default(), Some("34".into())).unwrap();
    let national = spain
        .decode_json(
            br#"{"call_id":"a","caller":"+34911000001","ts":946684800000,"callee":600000001}"#,
        )
        .unwrap();
    assert_eq!(national.callee.as_deref(), Some("+34600000001"));
    assert_eq!(decode(json!("s")), None);
    assert_eq!(decode(json!("100")), None);
    assert_eq!(decode(json!("+34".repeat(20_000))), None);
}

/// Defect 4 against a real Redis: 300 calls with 50 KB callees leave Redis
/// memory flat, and 3,000 distinct valid callees in a minute saturate the
/// feature at the cap (1,000 by default) instead of growing the set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callee_sets_stay_bounded_in_redis() {
    use callguard::store::redis::{RedisConfig, RedisStore};
    let redis = common::RedisServer::start(&[]);
    let used = || redis.used_memory();
    let mut store = RedisStore::connect(RedisConfig {
        urls: vec![redis.url()],
        ..RedisConfig::default()
    })
    .await
    .unwrap();
    let rules = RuleSet::from_args(None, &["minute:sliding:60s:100000".into()]).unwrap();
    let decoder = callguard::engine::event::Decoder::default();
    let start = now_ms() - 600_000;
    let before = used();
    let huge: Vec<CallEvent> = (0..300)
        .map(|i| {
            let callee = format!("+34{i:03}{}", "9".repeat(50_000));
            let payload = json!({"call_id": format!("h{i}"), "caller": "+34911000001", "ts": start + i, "callee": callee});
            decoder.decode_json(payload.to_string().as_bytes()).unwrap()
        })
        .collect();
    for chunk in huge.chunks(50) {
        store.apply_batch(&rules, chunk).await.unwrap();
    }
    let grown = used() - before;
    assert!(
        grown < 1_000_000,
        "300 huge callees grew Redis by {grown} bytes"
    );

    let many: Vec<CallEvent> = (0..3_000)
        .map(|i| CallEvent {
            call_id: format!("m{i}").into(),
            caller: "+34911000002".into(),
            ts_ms: start + 10 * i,
            callee: Some(format!("+3460{i:07}").into()),
            ..Default::default()
        })
        .collect();
    let mut last = None;
    for chunk in many.chunks(500) {
        last = store.apply_batch(&rules, chunk).await.unwrap().pop();
    }
    assert_eq!(last.unwrap().distinct_callees, Some(1_000));
    let card = common::raw_command(redis.port, "ZCARD cg:{+34911000002}:c").unwrap();
    assert_eq!(card.trim(), ":1000");
}

/// A flooding caller leaves thousands of records and logged calls behind
/// when its window moves on; the store drops them at most 256 per call in
/// time order (so no single script call stalls Redis), until none is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_s_old_records_are_dropped_a_bounded_batch_per_call() {
    use callguard::store::redis::{RedisConfig, RedisStore};
    let redis = common::RedisServer::start(&[]);
    let mut store = RedisStore::connect(RedisConfig {
        urls: vec![redis.url()],
        ..RedisConfig::default()
    })
    .await
    .unwrap();
    // Attempts, one sliding rule and D = retention: the log is the index.
    let rules = RuleSet::from_args(None, &["s:sliding:1s:5".into()])
        .unwrap()
        .with_dedup(1)
        .unwrap();
    let start = now_ms() - 600_000;
    let call = |i: i64, ts: i64| CallEvent::new(format!("f{i}"), "+34911000003", ts);
    let flood: Vec<CallEvent> = (0..2_000).map(|i| call(i, start + i)).collect();
    for chunk in flood.chunks(500) {
        store.apply_batch(&rules, chunk).await.unwrap();
    }
    let mut con = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let kept = |con: &mut redis::Connection| -> (usize, i64) {
        let fields: Vec<String> = redis::cmd("HKEYS")
            .arg("cg:{+34911000003}:m")
            .query(con)
            .unwrap();
        let logged: i64 = redis::cmd("ZCARD")
            .arg("cg:{+34911000003}:l")
            .query(con)
            .unwrap();
        (
            fields.iter().filter(|f| f.starts_with("r:")).count(),
            logged,
        )
    };
    assert_eq!(kept(&mut con), (2_000, 2_000));
    // Far later, one call at a time: each drops 256 old ones and adds itself.
    let later = start + 100_000;
    let mut last = None;
    for k in 1..=8i64 {
        let v = store
            .apply_batch(&rules, &[call(10_000 + k, later + k)])
            .await
            .unwrap();
        let expect = (2_000 - 255 * k).max(k) as usize;
        if k < 8 {
            assert_eq!(kept(&mut con), (expect, expect as i64), "after call {k}");
        }
        last = v.into_iter().next();
    }
    // All of the flood is gone; the new calls count only each other.
    assert_eq!(kept(&mut con), (8, 8));
    assert_eq!(last.unwrap().record.counts.as_slice(), [8]);
}

/// Pseudonymised numbers: with `--hash-numbers`, `replay` (key from the
/// environment) and the consumer (the same key) give the same records, with
/// every caller and callee a pseudonym; the denylist still matches the real
/// number; no real number reaches Redis, the decisions or the features.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hashed_numbers_agree_online_and_offline_and_never_leave_the_process() {
    use callguard::engine::event::{Decoder, NumberHasher};
    use callguard::store::redis::{RedisConfig, RedisStore};
    const KEY: &str = "a test key of thirty-two bytes!!";
    let dir = tempfile::tempdir().unwrap();
    let rules_path = common::rules_file(dir.path(), "deny = [\"+34911000009\"]\n[[rule]]\nname = \"minute\"\nkind = \"sliding\"\nwindow = \"60s\"\nlimit = 3\n");
    let start = now_ms() - 600_000;
    let mut csv = String::from("call_id,caller,callee,ts\n");
    let mut messages = Vec::new();
    for i in 0..300i64 {
        let caller = format!("+3491100{:04}", i % 12);
        let callee = format!("+3460000{:04}", i % 7);
        let ts = start + i * 500;
        csv.push_str(&format!("c{i},{caller},{callee},{ts}\n"));
        messages.push((
            caller.clone(),
            json!({"call_id": format!("c{i}"), "caller": caller, "callee": callee, "ts": ts}),
        ));
    }
    let input = dir.path().join("calls.csv");
    std::fs::write(&input, &csv).unwrap();
    let replayed = dir.path().join("decisions.csv");
    let features = dir.path().join("features.csv");
    for (cmd, out) in [("replay", &replayed), ("features", &features)] {
        let o = std::process::Command::new(common::bin())
            .args([cmd, "--hash-numbers", "-i"])
            .arg(&input)
            .arg("--rules")
            .arg(&rules_path)
            .arg("-o")
            .arg(out)
            .env("CALLGUARD_HASH_KEY", KEY)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let decisions = std::fs::read_to_string(&replayed).unwrap();
    let feature_text = std::fs::read_to_string(&features).unwrap();
    for text in [&decisions, &feature_text] {
        assert!(!text.contains("+34"), "a real number in an output:\n{text}");
    }
    assert!(
        decisions.contains(",denylist,"),
        "the denylist matches the real number"
    );
    let hasher = NumberHasher::new(KEY.as_bytes()).unwrap();
    assert!(decisions.contains(&hasher.hash("+34911000009")));

    // Online: the same events, the same key, a real Redis.
    let redis = common::RedisServer::start(&[]);
    let (_kafka, brokers) = common::kafka::mock_cluster(&[
        ("calls", 2),
        ("call-decisions", 2),
        ("call-features", 2),
        ("calls-dlq", 1),
    ]);
    let raw: Vec<(String, Vec<u8>)> = messages
        .iter()
        .map(|(k, v)| (k.clone(), v.to_string().into_bytes()))
        .collect();
    let msgs: Vec<(Option<&[u8]>, &[u8])> = raw
        .iter()
        .map(|(k, v)| (Some(k.as_bytes()), v.as_slice()))
        .collect();
    produce_raw(&brokers, "calls", &msgs).await;
    let mut config = ConsumeConfig::new(
        &brokers,
        "g-hash",
        "calls",
        "call-decisions",
        "call-features",
        "calls-dlq",
    );
    config.decoder = Decoder {
        hasher: Some(hasher.clone()),
        ..Decoder::default()
    };
    let store = RedisStore::connect(RedisConfig {
        urls: vec![redis.url()],
        ..RedisConfig::default()
    })
    .await
    .unwrap();
    let rules = RuleSet::from_file(&rules_path).unwrap();
    let run = common::kafka::in_process(config, store, rules);
    let online = read_decisions(&brokers, "call-decisions", 300, Duration::from_secs(60)).await;
    run.stop().await;
    let online = common::kafka::by_call_id(&online);
    assert_eq!(online.len(), 300);
    let mut lines = decisions.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    for line in lines {
        let f: Vec<&str> = line.split(',').collect();
        let o = &online[f[0]];
        assert_eq!(
            o["caller"],
            f[col("caller")],
            "call {}: the same pseudonym online",
            f[0]
        );
        assert_eq!(o["decision"], f[col("decision")], "call {}", f[0]);
        assert_eq!(o["reason"], f[col("reason")], "call {}", f[0]);
        assert_eq!(
            o["count_minute"].to_string(),
            f[col("count_minute")],
            "call {}",
            f[0]
        );
    }
    let keys = common::raw_command(redis.port, "KEYS *").unwrap();
    assert!(keys.contains("{h"), "{keys}");
    assert!(
        !keys.contains("+34"),
        "a real number in a Redis key: {keys}"
    );
}

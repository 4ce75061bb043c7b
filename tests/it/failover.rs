//! Redis failover under `serve` and `consume`: a primary, two replicas and
//! three sentinels on loopback (Debian's `redis-server` and
//! `redis-sentinel`). The replicas are cut off the primary while calls are
//! decided, so those writes reach the primary only (replication lagging);
//! then the primary is killed and a replica promoted.
//!
//! With `--redis-wait-replicas 1` no decided call is lost: every call
//! answered before the failover is answered `duplicate` with the same
//! record after it, and `consume`'s records equal `replay`'s. Without it
//! the calls decided while cut off are lost, and are counted here, so
//! the test also shows what the flag buys.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::kafka::TOPICS;
use common::sentinel::{wait_until, Ha};
use common::{HttpConn, Killed};
use serde_json::Value;

/// A `serve` on the highly available Redis, ready.
fn start_serve(ha: &Ha, wait: u32, mode: &str) -> (Killed, u16) {
    let port = common::free_port();
    let child = Command::new(common::bin())
        .args([
            "serve",
            "--rule",
            "m:sliding:60s:1000",
            "--redis-mode",
            mode,
        ])
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .args(ha.args())
        .args(["--redis-wait-replicas", &wait.to_string()])
        .args(["--redis-timeout-ms", "600"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start callguard serve");
    let child = Killed(child);
    wait_until(Duration::from_secs(20), "serve to be ready", || {
        common::http_get(port, "/readyz").is_some_and(|r| r.contains(" 200 "))
    });
    (child, port)
}

fn check(port: u16, id: &str, caller: &str) -> (u16, Value) {
    let r = HttpConn::connect(port).post(
        "/v1/check",
        &format!(r#"{{"call_id":"{id}","caller":"{caller}"}}"#),
    );
    let body = serde_json::from_str(&r.body).unwrap_or(Value::Null);
    (r.status, body)
}

/// What one failover under `serve` did.
struct ServeOutcome {
    /// Calls answered with a decision before the failover.
    decided: usize,
    /// Checks answered 503 while the replicas were paused.
    refused_in_pause: usize,
    /// Decided calls that came back as new calls after the failover: their
    /// decision was lost with the primary.
    lost: Vec<String>,
    /// The calls decided while cut off whose caller lives on the primary
    /// that was killed (all of them with Sentinel).
    on_victim: Vec<String>,
}

fn serve_through_failover(mut ha: Ha, wait: u32, mode: &str) -> ServeOutcome {
    let (serve, port) = start_serve(&ha, wait, mode);
    let caller = |i: usize| format!("+3491100{:04}", i % 5);
    let mut answered: Vec<(String, Value)> = Vec::new();
    for i in 0..20 {
        let id = format!("before-{i}");
        let (status, body) = check(port, &id, &caller(i));
        assert_eq!(status, 200, "{body}");
        answered.push((id, body));
    }
    ha.cut_replication();
    let mut refused_in_pause = 0;
    for i in 0..10 {
        let id = format!("paused-{i}");
        let (status, body) = check(port, &id, &caller(i));
        match status {
            200 => answered.push((id, body)),
            503 => refused_in_pause += 1,
            other => panic!("check answered {other}: {body}"),
        }
    }
    let on_victim = (0..10)
        .filter(|&i| ha.on_victim(&caller(i)))
        .map(|i| format!("paused-{i}"))
        .collect();
    ha.fail_over();
    // Every call answered before the failover, sent again: a retransmission.
    let mut lost = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    for (id, first) in &answered {
        let again = loop {
            let (status, body) = check(port, id, first["caller"].as_str().unwrap());
            if status == 200 {
                break body;
            }
            assert!(
                Instant::now() < deadline,
                "serve did not recover: {status} {body}"
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        if again["duplicate"] == true {
            assert_eq!(
                again["count_m"], first["count_m"],
                "{id}: {again} vs {first}"
            );
            assert_eq!(again["ts_ms"], first["ts_ms"], "{id}");
        } else {
            lost.push(id.clone());
        }
    }
    drop(serve);
    ServeOutcome {
        decided: answered.len(),
        refused_in_pause,
        lost,
        on_victim,
    }
}

/// With `--redis-wait-replicas 1`, a check whose writes no replica has
/// acknowledged is answered 503, never as decided; so a failover loses
/// no answered decision, in both modes.
#[test]
fn serve_with_wait_replicas_loses_no_answered_decision_sentinel() {
    for mode in ["cached", "script"] {
        assert_no_answered_decision_lost(serve_through_failover(Ha::sentinel(), 1, mode), mode);
    }
}

/// The same on a Cluster whose primaries have a replica each: `WAIT` goes
/// to every primary, the killed primary's replica is promoted.
#[test]
fn serve_with_wait_replicas_loses_no_answered_decision_cluster() {
    let out = serve_through_failover(Ha::cluster(), 1, "cached");
    assert_no_answered_decision_lost(out, "cached");
}

fn assert_no_answered_decision_lost(out: ServeOutcome, mode: &str) {
    assert_eq!(
        out.refused_in_pause, 10,
        "{mode}: every check while no replica acknowledges is 503"
    );
    assert_eq!(out.decided, 20, "{mode}");
    assert!(out.lost.is_empty(), "{mode}: lost {:?}", out.lost);
}

/// Without it, Redis replicates asynchronously: the calls decided while
/// the replicas lagged are lost with the primary and decided again as new
/// calls after the failover (the loss `--redis-wait-replicas` prevents):
/// all of them with Sentinel, those whose caller lived on the killed
/// primary on a Cluster.
#[test]
fn serve_without_wait_replicas_loses_the_unreplicated_decisions() {
    for ha in [Ha::sentinel(), Ha::cluster()] {
        let cluster = matches!(ha, Ha::Cluster { .. });
        let out = serve_through_failover(ha, 0, "cached");
        assert_eq!(out.refused_in_pause, 0, "no check waits for replicas");
        assert_eq!(out.decided, 30);
        assert!(!out.on_victim.is_empty(), "a caller on the killed primary");
        assert_eq!(
            out.lost, out.on_victim,
            "cluster {cluster}: exactly the calls decided while cut off on the killed primary are lost"
        );
    }
}

/// What one failover under `consume` did: the decisions it produced, and
/// how many of them differ from `replay` of the same calls.
async fn consume_through_failover(
    mut ha: Ha,
    wait: u32,
    mode: &str,
    group_id: &str,
) -> (usize, usize) {
    use callguard::engine::rules::RuleSet;
    use callguard::offline::read::{read_call_log, ReadOptions};
    use common::kafka::{by_call_id, read_decisions};

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calls.csv");
    let calls = callguard::offline::generate::generate(3_000, 29);
    callguard::offline::generate::write_csv(&path, &calls).unwrap();
    let mut log = read_call_log(&path, &ReadOptions::default()).unwrap();
    log.sort_by_time();
    let events: Vec<_> = log.events.iter().map(|(_, e)| e.clone()).collect();
    let rules_path = std::path::Path::new("tests/golden/stream-rules.toml");
    let rules = RuleSet::from_file(rules_path).unwrap();
    let expected = common::replay_records(&events, &rules);

    let (_kafka, brokers) = common::kafka::mock_cluster(&TOPICS.map(|t| (t, 2)));
    let consume = Killed(
        Command::new(common::bin())
            .args(["consume", "--brokers", &brokers, "--group", group_id])
            .args(["--store", "redis", "--redis-mode", mode])
            .arg("--rules")
            .arg(rules_path)
            .args(ha.args())
            .args(["--redis-wait-replicas", &wait.to_string()])
            .args(["--redis-timeout-ms", "600", "--metrics-addr", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("consume.log")).unwrap())
            .spawn()
            .expect("start callguard consume"),
    );
    let produce = |part: &[callguard::engine::event::CallEvent]| {
        let part = part.to_vec();
        let brokers = brokers.clone();
        async move {
            callguard::online::produce::produce(part.iter(), &brokers, &[], "calls")
                .await
                .unwrap()
        }
    };
    let third = events.len() / 3;
    let decided = |n: usize| {
        let brokers = brokers.clone();
        async move {
            let records =
                read_decisions(&brokers, "call-decisions", n, Duration::from_secs(60)).await;
            by_call_id(&records).len()
        }
    };
    produce(&events[..third]).await;
    assert_eq!(decided(third).await, third, "the first third decided");
    ha.cut_replication();
    let cut = Instant::now();
    produce(&events[third..2 * third]).await;
    if wait == 0 {
        // Decided on the primary alone, and produced.
        assert_eq!(decided(2 * third).await, 2 * third);
    } else {
        // Held back: no replica acknowledges.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    eprintln!("primary killed {:?} after the cut", cut.elapsed());
    tokio::task::block_in_place(|| ha.fail_over());
    produce(&events[2 * third..]).await;
    let records = read_decisions(
        &brokers,
        "call-decisions",
        events.len(),
        Duration::from_secs(120),
    )
    .await;
    drop(consume);
    let got = by_call_id(&records);
    if got.len() != expected.len() {
        let log = std::fs::read_to_string(dir.path().join("consume.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        eprintln!("consume's log, last lines first:\n{}", tail.join("\n"));
    }
    assert_eq!(got.len(), expected.len(), "every call decided");
    let differ = expected
        .iter()
        .filter(|(id, want)| got.get(*id) != Some(want))
        .count();
    (got.len(), differ)
}

/// `consume` with `--redis-wait-replicas 1` through a failover: it holds
/// the batches no replica acknowledged (storing no offset), moves to the
/// promoted replica, and every call gets one record equal to `replay`'s:
/// Sentinel in both modes, and a Cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_with_wait_replicas_through_failover_equals_replay() {
    for (ha, mode) in [
        (Ha::sentinel as fn() -> Ha, "cached"),
        (Ha::sentinel, "script"),
        (Ha::cluster as fn() -> Ha, "cached"),
    ] {
        let ha = tokio::task::block_in_place(ha);
        let cluster = matches!(ha, Ha::Cluster { .. });
        let group = format!("failover-wait-{mode}-{cluster}");
        let (decided, differ) = consume_through_failover(ha, 1, mode, &group).await;
        assert_eq!(
            differ, 0,
            "{mode}, cluster {cluster}: {differ} of {decided} records differ from replay"
        );
    }
}

/// Without it the windows the lost writes held are gone: later calls of
/// those callers are counted from older state, and decided differently
/// from `replay`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_without_wait_replicas_diverges_after_failover() {
    let ha = tokio::task::block_in_place(Ha::sentinel);
    let (decided, differ) = consume_through_failover(ha, 0, "cached", "failover-nowait").await;
    eprintln!("without --redis-wait-replicas: {differ} of {decided} records differ from replay");
    assert!(differ > 0, "the lost writes change later decisions");
}

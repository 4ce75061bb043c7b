//! Rules keyed by callee across instances, against real components: two
//! `consume` members on a 4-partition topic in tansu and one `serve`, all
//! on one redis-server, under a TDoS (thousands of calls from hundreds of
//! spoofed callers to one victim) mixed with a generated day of traffic.
//! The victim's admitted calls per bucket never exceed the limit, fall
//! short of it by no more than the documented bound, and every other call
//! is decided as `replay` decides it. Also: the local fallback's share
//! while Redis is down.

use crate::common;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use callguard::engine::aggregate::{block_cap, reserve_of};
use callguard::engine::event::CallEvent;
use callguard::engine::rules::RuleSet;
use callguard::offline::generate::{add_tdos, generate, TDOS_VICTIM};
use common::kafka::{by_call_id, read_decisions, signal, spawn_consumer, TOPICS};
use common::{free_port, http_get, HttpConn, RedisServer, Tansu};
use serde_json::Value;

const RULES: &str = r#"
[[rule]]
name = "minute"
kind = "sliding"
window = "60s"
limit = 20

[[rule]]
name = "tdos"
key = "callee"
kind = "fixed"
window = "10s"
limit = 50
"#;

const LIMIT: u64 = 50;
const WINDOW_MS: i64 = 10_000;
/// Every instance is started with `--expected-instances 3`: each holds a
/// reserve slot.
const INSTANCES: u32 = 3;

/// A generated day with a TDoS in it, in time order, call ids `c<i>`.
fn events() -> Vec<CallEvent> {
    let mut calls = generate(3_000, 5);
    add_tdos(&mut calls, 2_400, 5);
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut e = common::ev(&c.caller, &format!("c{i}"), c.ts_ms);
            e.callee = Some(c.callee.as_str().into());
            e
        })
        .collect()
}

fn json(e: &CallEvent) -> String {
    serde_json::json!({
        "call_id": e.call_id.as_str(),
        "caller": e.caller.as_str(),
        "callee": e.callee.as_deref(),
        "ts": e.ts_ms,
    })
    .to_string()
}

/// Callers whose calls `serve` checks (a third of them); the others go
/// through Kafka. A caller's calls all take one path, in time order.
fn to_serve(e: &CallEvent) -> bool {
    e.caller.bytes().map(u64::from).sum::<u64>() % 3 == 0
}

pub(crate) fn spawn_serve(port: u16, redis: &str, rules: &Path, extra: &[&str]) -> Child {
    Command::new(common::bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--store", "redis", "--redis-url", redis])
        .arg("--rules")
        .arg(rules)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start callguard serve")
}

/// A trunk's numbers split between two `serve` instances on one Redis:
/// its account rule counts them together (the account as a query
/// parameter or in the body), never past the limit, and a check without
/// an account is not counted by it.
#[test]
fn two_instances_hold_an_account_limit_over_a_trunk_s_numbers() {
    let redis = RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let rules = common::rules_file(dir.path(), "[[rule]]\nname = \"trunk\"\nkey = \"account\"\nkind = \"fixed\"\nwindow = \"1h\"\nlimit = 3\n");
    let ports = [free_port(), free_port()];
    let mut children: Vec<Child> = ports
        .iter()
        .map(|&p| spawn_serve(p, &redis.url(), &rules, &[]))
        .collect();
    for p in ports {
        wait_ready(p, "serve");
    }
    let t0 = 1_764_590_400_000i64;
    let mut conns: Vec<HttpConn> = ports.iter().map(|&p| HttpConn::connect(p)).collect();
    let mut decided = Vec::new();
    for k in 0..6i64 {
        // Numbers 00-03 of the trunk, the even ones on the first instance.
        let caller = format!("%2B349110001{:02}", k % 4);
        let path = format!(
            "/v1/check?call_id=t{k}&caller={caller}&ts={}&account=trunk-7",
            t0 + k
        );
        let r = conns[(k % 2) as usize].get(&path);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        decided.push((
            v["decision"].as_str().unwrap().to_string(),
            v["reason"].clone(),
        ));
    }
    let allowed = decided.iter().filter(|(d, _)| d == "allow").count();
    assert_eq!(allowed, 3, "{decided:?}");
    assert!(
        decided[..3].iter().all(|(d, _)| d == "allow")
            && decided[3..].iter().all(|(_, r)| r == "trunk"),
        "{decided:?}"
    );
    // In the body too, and another trunk is counted apart.
    let body = serde_json::json!({"call_id": "u1", "caller": "+34911000200", "ts": t0 + 10, "account": "trunk-8"});
    let v = conns[0].post("/v1/check", &body.to_string()).json();
    assert_eq!(v["count_trunk"], 1, "{v}");
    // No account: the rule does not see the call.
    let body = serde_json::json!({"call_id": "u2", "caller": "+34911000100", "ts": t0 + 11});
    let v = conns[1].post("/v1/check", &body.to_string()).json();
    assert_eq!(v["decision"], "allow", "{v}");
    assert_eq!(v["count_trunk"], serde_json::Value::Null, "{v}");
    for c in &mut children {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A PBX trunk's channel limit (a concurrent rule keyed by account) held
/// by three `serve` instances on one Redis while one is SIGKILLed: the
/// trunk's calls from several numbers, checked on any instance, count
/// together; the killed instance's open call keeps its slot (the pools
/// live in Redis) until its end, told to another instance with only the
/// call's identity, frees it; a call whose end never comes is let go at
/// its `max_duration`; the killed instance, started again, counts the
/// same. Both Redis modes.
#[test]
fn three_instances_hold_an_account_s_channels_while_one_is_sigkilled() {
    for mode in ["cached", "script"] {
        let redis = RedisServer::start(&[]);
        let dir = tempfile::tempdir().unwrap();
        let rules = common::rules_file(
            dir.path(),
            "[[rule]]\nname = \"minute\"\nkind = \"sliding\"\nwindow = \"1m\"\nlimit = 5\n\
             [[rule]]\nname = \"channels\"\nkind = \"concurrent\"\nkey = \"account\"\n\
             limit = 3\nmax_duration = \"30s\"\n",
        );
        let extra = ["--redis-mode", mode];
        let ports = [free_port(), free_port(), free_port()];
        let mut children: Vec<Child> = ports
            .iter()
            .map(|&p| spawn_serve(p, &redis.url(), &rules, &extra))
            .collect();
        for p in ports {
            wait_ready(p, "serve");
        }
        let t0 = 1_764_590_400_000i64;
        let check = |port: u16, id: &str, number: u32, dt: i64| -> (String, String, i64, Value) {
            let body = serde_json::json!({
                "call_id": id, "caller": format!("+349110003{number:02}"),
                "ts": t0 + dt, "account": "trunk-9",
            });
            let r = HttpConn::connect(port).post("/v1/check", &body.to_string());
            assert_eq!(r.status, 200, "{mode}: {}", r.body);
            let v = r.json();
            (
                v["decision"].as_str().unwrap().to_string(),
                v["reason"].as_str().unwrap().to_string(),
                v["count_channels"].as_i64().unwrap(),
                v["retry_after_ms"].clone(),
            )
        };
        let allow = |n: i64| ("allow".to_string(), "ok".to_string(), n, Value::Null);
        let reject = |n: i64, retry: i64| {
            (
                "reject".to_string(),
                "channels".to_string(),
                n,
                Value::from(retry),
            )
        };
        let [a, b, c] = ports;
        assert_eq!(check(a, "c1", 1, 0), allow(1), "{mode}");
        assert_eq!(check(b, "c2", 2, 1_000), allow(2), "{mode}");
        assert_eq!(check(c, "c3", 3, 2_000), allow(3), "{mode}");
        // Full: until c1's max_duration (30 s after it started).
        assert_eq!(check(a, "c4", 4, 3_000), reject(4, 27_000), "{mode}");
        // b answered c2, so holds it in Redis: killed, its call still counts.
        let _ = children[1].kill();
        let _ = children[1].wait();
        assert_eq!(check(c, "c5", 5, 4_000), reject(4, 26_000), "{mode}");
        // c2 ends, told to a: the end names only the call and its caller.
        let end =
            serde_json::json!({ "call_id": "c2", "caller": "+34911000302", "ts": t0 + 5_000 });
        let r = HttpConn::connect(a).post("/v1/end", &end.to_string());
        assert_eq!(r.status, 200, "{mode}: {}", r.body);
        assert_eq!(
            check(c, "c6", 6, 5_000),
            allow(3),
            "{mode}: c2's slot is free"
        );
        assert_eq!(check(a, "c7", 7, 6_000), reject(4, 24_000), "{mode}");
        // c1 never ends: let go at 30 s.
        assert_eq!(check(c, "c8", 8, 29_999), reject(4, 1), "{mode}");
        assert_eq!(check(a, "c9", 9, 30_000), allow(3), "{mode}");
        // The killed instance started again counts the same.
        children[1] = spawn_serve(b, &redis.url(), &rules, &extra);
        wait_ready(b, "serve");
        assert_eq!(check(b, "c10", 10, 30_001), reject(4, 1_999), "{mode}");
        // A call seen again gets its answer again, on any instance.
        assert_eq!(check(b, "c6", 6, 5_000), allow(3), "{mode}");
        for child in &mut children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub(crate) fn wait_ready(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !http_get(port, "/readyz").is_some_and(|r| r.contains(" 200 ")) {
        assert!(Instant::now() < deadline, "{what} not ready on {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Posts each event to `serve` in order; stops after `stop_after` (the
/// process is then killed) and returns the answers and the events left.
fn check_all(
    port: u16,
    events: Vec<CallEvent>,
    stop_after: Option<usize>,
) -> (Vec<Value>, Vec<CallEvent>) {
    let mut conn = HttpConn::connect(port);
    let mut answers = Vec::new();
    let mut left = Vec::new();
    for (i, e) in events.into_iter().enumerate() {
        if stop_after.is_some_and(|n| i >= n) {
            left.push(e);
            continue;
        }
        let r = conn.post("/v1/check", &json(&e));
        assert!(
            r.status != 503 && r.status < 500,
            "check {}: {} {}",
            e.call_id,
            r.status,
            r.body
        );
        answers.push(r.json());
    }
    (answers, left)
}

/// Where the calls no member decided are: how many are not in the
/// `calls` topic at all, and per partition how many are there (at which
/// offsets) beside the partition's length and the group's committed
/// offset. Read after the members stopped (their last commit is in).
async fn where_missing(brokers: &str, group: &str, missing: &[&str], sent: usize) -> String {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let read = common::kafka::read_topic(brokers, "calls", Duration::from_secs(30), {
        let mut n = 0;
        move |_| {
            n += 1;
            n >= sent
        }
    })
    .await;
    let missing: std::collections::HashSet<&str> = missing.iter().copied().collect();
    let mut found = 0;
    // Per partition: messages, missing ones there (count, first, last offset).
    let mut parts: std::collections::BTreeMap<i32, (usize, usize, i64, i64)> = Default::default();
    for m in &read {
        let p = parts
            .entry(m.partition)
            .or_insert((0, 0, i64::MAX, i64::MIN));
        p.0 += 1;
        let id = serde_json::from_slice::<Value>(&m.payload).ok();
        let id = id.as_ref().and_then(|v| v["call_id"].as_str());
        if id.is_some_and(|id| missing.contains(id)) {
            found += 1;
            p.1 += 1;
            p.2 = p.2.min(m.offset);
            p.3 = p.3.max(m.offset);
        }
    }
    let c: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .create()
        .expect("a consumer to read the group's offsets");
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in parts.keys() {
        tpl.add_partition("calls", *p);
    }
    let committed = c.committed_offsets(tpl, Duration::from_secs(10));
    let committed = |p: i32| {
        committed
            .as_ref()
            .ok()
            .and_then(|t| t.find_partition("calls", p))
            .map(|e| format!("{:?}", e.offset()))
            .unwrap_or_else(|| "?".into())
    };
    let per: Vec<String> = parts
        .iter()
        .map(|(p, (n, k, lo, hi))| {
            let at = if *k > 0 {
                format!(" at offsets {lo}..={hi}")
            } else {
                String::new()
            };
            format!(
                "partition {p}: {n} messages, {k} missing{at}, committed {}",
                committed(*p)
            )
        })
        .collect();
    format!(
        "{} not in the calls topic; {}",
        missing.len() - found,
        per.join("; ")
    )
}

/// The three-instance run; with `kill_serve`, `serve` is SIGKILLed after
/// half of its calls and the rest go through Kafka, as a switch would
/// fail over. Returns the victim's admitted calls per bucket, online and
/// offline.
async fn three_instances(kill_serve: bool) {
    let redis = RedisServer::start(&[]);
    let tansu = Tansu::start();
    let brokers = tansu.with_topics(&TOPICS.map(|t| (t, if t == "calls" { 4 } else { 1 })));
    let dir = tempfile::tempdir().unwrap();
    let rules_path = common::rules_file(dir.path(), RULES);
    let rules = RuleSet::from_file(&rules_path).unwrap();
    let all = events();
    let (served, kafka): (Vec<CallEvent>, Vec<CallEvent>) = all.iter().cloned().partition(to_serve);
    assert!(served
        .iter()
        .any(|e| e.callee.as_deref() == Some(TDOS_VICTIM)));

    let group = format!("agg-{kill_serve}");
    let ports = [free_port(), free_port()];
    let mut members: Vec<Child> = ports
        .iter()
        .map(|p| {
            let addr = format!("127.0.0.1:{p}");
            let instances = INSTANCES.to_string();
            let extra = [
                "--metrics-addr",
                addr.as_str(),
                "-X",
                "session.timeout.ms=6000",
                "--batch-size",
                "64",
                "--expected-instances",
                instances.as_str(),
            ];
            spawn_consumer(&brokers, &redis.url(), &group, &rules_path, &extra)
        })
        .collect();
    for p in ports {
        wait_ready(p, "consume member");
    }
    let serve_port = free_port();
    let mut serve = spawn_serve(
        serve_port,
        &redis.url(),
        &rules_path,
        &["--expected-instances", &INSTANCES.to_string()],
    );
    wait_ready(serve_port, "serve");

    // Kafka and serve at once: the three instances take credits of the
    // same buckets concurrently.
    let producing = {
        let (brokers, kafka) = (brokers.clone(), kafka.clone());
        tokio::spawn(async move {
            callguard::online::produce::produce(kafka.iter(), &brokers, &[], "calls")
                .await
                .unwrap()
        })
    };
    let stop_after = kill_serve.then_some(served.len() / 2);
    let checking = std::thread::spawn(move || check_all(serve_port, served, stop_after));
    let (answers, left) = tokio::task::spawn_blocking(move || checking.join().unwrap())
        .await
        .unwrap();
    if kill_serve {
        let _ = serve.kill();
        let _ = serve.wait();
        // The switch fails over: the rest of serve's callers through Kafka.
        callguard::online::produce::produce(left.iter(), &brokers, &[], "calls")
            .await
            .unwrap();
    }
    producing.await.unwrap();
    let expected_kafka = kafka.len() + left.len();
    let records = read_decisions(
        &brokers,
        "call-decisions",
        expected_kafka,
        Duration::from_secs(300),
    )
    .await;
    // What the members leased, from their metrics: a credit for every
    // call the tdos rule admitted (from their reserve slots, most callees
    // being called once, or from Redis), and credits refused at the
    // victim's limit.
    let mut leased: HashMap<String, f64> = HashMap::new();
    for p in ports {
        let text = http_get(p, "/metrics").unwrap();
        for line in text.lines().filter(|l| l.starts_with("callguard_lease_")) {
            let (name, value) = line.rsplit_once(' ').unwrap();
            *leased.entry(name.to_string()).or_default() += value.parse::<f64>().unwrap();
        }
    }
    eprintln!("consume members leased: {leased:?}");
    let got = |k: &str| leased.get(k).copied().unwrap_or(0.0);
    assert!(got("callguard_lease_calls_total") > 0.0, "{leased:?}");
    // (Distinct calls: a call redelivered after a rebalance is decided
    // again from the gate's memory, taking no second credit.)
    let admitted_by_tdos = by_call_id(&records)
        .values()
        .filter(|r| r["reason"] != "tdos")
        .count() as f64;
    let reserve = reserve_of(LIMIT, INSTANCES) as f64;
    let reserved = got("callguard_lease_counters_total{kind=\"reserve\"}") * reserve;
    assert!(
        got("callguard_lease_credits_total{kind=\"granted\"}") + reserved >= admitted_by_tdos,
        "{admitted_by_tdos} calls admitted by the tdos rule: {leased:?}"
    );
    assert!(
        got("callguard_lease_counters_total{kind=\"increment\"}") > 0.0,
        "{leased:?}"
    );
    // Most callees are called once: their credit came from the member's
    // reserve slot, without a Redis call.
    assert!(
        got("callguard_lease_counters_total{kind=\"reserve\"}") > 100.0,
        "{leased:?}"
    );
    assert!(
        got("callguard_lease_credits_total{kind=\"short\"}") > 0.0,
        "{leased:?}"
    );
    assert!(got("callguard_lease_seconds_total") > 0.0, "{leased:?}");
    let _ = serve.kill();
    let _ = serve.wait();
    for m in &mut members {
        signal(m, "TERM");
        let _ = m.wait();
    }

    let mut online = by_call_id(&records);
    if online.len() != expected_kafka {
        // Which side lost them: the broker (not in `calls`), or the
        // members (read past them)? And where they sit against the
        // group's committed offsets.
        let sent: Vec<&CallEvent> = kafka.iter().chain(&left).collect();
        let missing: Vec<&str> = sent
            .iter()
            .map(|e| e.call_id.as_str())
            .filter(|id| !online.contains_key(*id))
            .collect();
        panic!(
            "every Kafka call decided once: {} of {expected_kafka} decided; of the {} missing \
             ({:?}...): {}",
            online.len(),
            missing.len(),
            &missing[..missing.len().min(5)],
            where_missing(&brokers, &group, &missing, sent.len()).await
        );
    }
    for a in answers {
        online.insert(a["call_id"].as_str().unwrap().to_string(), a);
    }
    assert_eq!(online.len(), all.len(), "every call decided");

    // The victim: never above the limit in a bucket; short of it by at most
    // the credits the other instances can hold (a block each, after their
    // batch), every slot's reserve, and the killed one's in-flight check.
    let mut admitted: HashMap<i64, u64> = HashMap::new();
    let mut rejected: HashMap<i64, u64> = HashMap::new();
    let mut exact: HashMap<i64, u64> = HashMap::new();
    let offline = common::replay_records(&all, &rules);
    for e in all
        .iter()
        .filter(|e| e.callee.as_deref() == Some(TDOS_VICTIM))
    {
        let b = e.ts_ms.div_euclid(WINDOW_MS);
        let got = &online[e.call_id.as_str()];
        match got["decision"].as_str() {
            Some("allow") => *admitted.entry(b).or_default() += 1,
            _ => {
                assert_eq!(got["reason"], "tdos", "{got}");
                *rejected.entry(b).or_default() += 1
            }
        }
        if offline[e.call_id.as_str()]["decision"] == "allow" {
            *exact.entry(b).or_default() += 1;
        }
    }
    let bound = 2 * block_cap(LIMIT)
        + u64::from(INSTANCES) * reserve_of(LIMIT, INSTANCES)
        + u64::from(kill_serve);
    let mut shortfall = 0;
    for (b, &n) in &admitted {
        assert!(
            n <= LIMIT,
            "bucket {b}: {n} calls admitted to the victim, limit {LIMIT}"
        );
        if rejected.get(b).copied().unwrap_or(0) > 0 {
            assert!(
                LIMIT - n <= bound,
                "bucket {b}: {n} admitted with calls rejected: short by more than {bound}"
            );
            shortfall += LIMIT - n;
        }
    }
    let (on, off): (u64, u64) = (admitted.values().sum(), exact.values().sum());
    eprintln!(
        "victim: {on} admitted online, {off} offline, over {} buckets; shortfall {shortfall} \
         (bound {bound} a bucket); {} rejected",
        exact.len(),
        rejected.values().sum::<u64>()
    );
    assert!(on <= off, "online admitted more than the exact count");

    // Every other call as replay decides it (its tdos count is the
    // instance's view of its callee: left out).
    let mut differ = 0;
    for e in all
        .iter()
        .filter(|e| e.callee.as_deref() != Some(TDOS_VICTIM))
    {
        let want = &offline[e.call_id.as_str()];
        let got = &online[e.call_id.as_str()];
        for (k, v) in want.as_object().unwrap() {
            if k != "count_tdos" && got.get(k) != Some(v) {
                if differ < 3 {
                    eprintln!(
                        "call {}: {k} = {:?}, replay says {v}",
                        e.call_id,
                        got.get(k)
                    );
                }
                differ += 1;
            }
        }
    }
    assert_eq!(differ, 0, "{differ} fields differ from replay");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_hold_a_callee_limit_together() {
    three_instances(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_hold_a_callee_limit_with_one_killed_midway() {
    three_instances(true).await;
}

/// `--on-store-error local --expected-instances 3`: with Redis stopped a
/// `serve` admits a third of the callee's limit per bucket on its own,
/// every record degraded; after Redis is back (a restart), the credits
/// come from Redis again.
#[test]
fn the_local_fallback_takes_its_share_of_a_callee_limit() {
    let redis = RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let rules_path = common::rules_file(dir.path(), &RULES.replace("limit = 50", "limit = 30"));
    let port = free_port();
    let mut serve = spawn_serve(
        port,
        &redis.url(),
        &rules_path,
        &["--on-store-error", "local", "--expected-instances", "3"],
    );
    wait_ready(port, "serve");
    let mut conn = HttpConn::connect(port);
    let t0 = 1_764_590_400_000i64;
    let mut check = |id: &str, caller: &str, dt: i64| {
        let body = serde_json::json!({"call_id": id, "caller": caller, "callee": TDOS_VICTIM, "ts": t0 + dt});
        let r = conn.post("/v1/check", &body.to_string());
        assert!(
            r.status != 503 && r.status < 500,
            "{}: {}",
            r.status,
            r.body
        );
        r.json()
    };
    let v = check("up0", "+442000000001", 0);
    assert_eq!(
        (v["degraded"].as_bool(), v["count_tdos"].as_u64()),
        (Some(false), Some(1))
    );
    let (redis_port, redis_dir) = redis.stop();
    let mut allowed = 0;
    for i in 0..40 {
        let v = check(
            &format!("down{i}"),
            &format!("+4420000{:05}", 100 + i),
            1 + i,
        );
        assert_eq!(v["degraded"], true, "{v}");
        if v["decision"] == "allow" {
            allowed += 1;
        } else {
            assert_eq!(v["reason"], "tdos", "{v}");
            assert!(v["retry_after_ms"].as_i64().is_some_and(|r| r > 0), "{v}");
        }
    }
    assert_eq!(allowed, 10, "a third of 30 while alone");
    let _redis = RedisServer::start_in(redis_port, redis_dir, &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    loop {
        n += 1;
        let v = check(&format!("back{n}"), &format!("+4421000{n:05}"), 5_000 + n);
        if v["degraded"] == false {
            // Redis kept its counter (the server restarted from its dump,
            // or started empty): the count is Redis's, not the local one.
            assert_eq!(v["reason"], "ok", "{v}");
            break;
        }
        assert!(Instant::now() < deadline, "still local: {v}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = serve.kill();
    let _ = serve.wait();
}

/// Offline: `tune` sweeps a caller's rule beside a callee limit as
/// `replay` decides at each N (the callee limit counts before the
/// caller's rules, the same for every N), `features` writes its counts, and
/// a sweep of the callee rule itself equals `replay` at each N too.
#[test]
fn tune_and_features_take_callee_limits_as_replay_does() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("calls.csv");
    let o = Command::new(common::bin())
        .args(["generate", "--rows", "6000", "--tdos", "1200", "-o"])
        .arg(&csv)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The example rules with one rule's limit changed (`from` is its line).
    let rules_with = |from: &str, limit: u64| {
        let path = dir
            .path()
            .join(format!("rules-{}-{limit}.toml", from.len()));
        std::fs::write(&path, RULES.replace(from, &format!("limit = {limit}"))).unwrap();
        path
    };
    let run = |args: &[&str], rules: &Path| {
        let o = Command::new(common::bin())
            .args(args)
            .arg("--rules")
            .arg(rules)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    let table = dir.path().join("sweep.csv");
    let (input, sweep_out) = (csv.to_str().unwrap(), table.to_str().unwrap());
    // `tune`'s rejected calls per N, from its table.
    let sweep = |rule: &str, limits: &str, rules: &Path| -> Vec<u64> {
        let args = [
            "tune", "-i", input, "--sweep", rule, "--limits", limits, "-o", sweep_out,
        ];
        run(&args, rules);
        std::fs::read_to_string(&table)
            .unwrap()
            .lines()
            .skip(1)
            .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
            .collect()
    };
    // `replay`'s decisions with `rules`, as text.
    let replay = |rules: &Path, name: &str| -> String {
        let out = dir.path().join(name);
        run(&["replay", "-i", input, "-o", out.to_str().unwrap()], rules);
        std::fs::read_to_string(&out).unwrap()
    };
    let rejects = |text: &str| text.lines().filter(|l| l.contains(",reject,")).count() as u64;
    let rejected = sweep("minute", "1..12", &rules_with("limit = 20", 20));
    for n in [1u64, 3, 12] {
        let text = replay(&rules_with("limit = 20", n), &format!("d{n}.csv"));
        let by_tdos = text.lines().filter(|l| l.contains(",reject,tdos,")).count();
        assert!(
            by_tdos > 50,
            "N = {n}: {by_tdos} rejected by the callee limit"
        );
        assert_eq!(rejected[n as usize - 1], rejects(&text), "N = {n}");
    }
    let features = dir.path().join("features.csv");
    run(
        &["features", "-i", input, "-o", features.to_str().unwrap()],
        &rules_with("limit = 20", 20),
    );
    let text = std::fs::read_to_string(&features).unwrap();
    let header: Vec<&str> = text.lines().next().unwrap().split(',').collect();
    let col = header
        .iter()
        .position(|h| *h == "count_tdos")
        .expect("a count_tdos column");
    let peak = text
        .lines()
        .skip(1)
        .filter_map(|l| l.split(',').nth(col)?.parse::<u64>().ok())
        .max();
    assert_eq!(
        peak,
        Some(LIMIT + 1),
        "a rejected call counts the limit plus one"
    );
    // The callee rule itself: every N replayed with its own gate.
    let rejected = sweep("tdos", "20..60", &rules_with("limit = 50", 50));
    assert_eq!(rejected.len(), 41);
    for n in [20u64, 50, 60] {
        let text = replay(&rules_with("limit = 50", n), &format!("t{n}.csv"));
        assert_eq!(rejected[n as usize - 20], rejects(&text), "tdos N = {n}");
    }
    assert!(
        rejected[0] > rejected[40],
        "a higher callee limit rejects less"
    );
}

/// Under `--redis-wait-replicas`, credits wait for the replicas like the
/// windows do: a server without the replicas asked for fails the lease
/// (transient: the batch is tried again), one asked for none grants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_wait_for_replicas_when_asked() {
    use callguard::engine::aggregate::{CounterId, LeaseRequest};
    use callguard::store::redis::aggregate::lease::RedisLedger;
    use callguard::store::redis::RedisConfig;
    let redis = RedisServer::start(&[]);
    let request = LeaseRequest {
        counter: CounterId {
            rule: "tdos".into(),
            window_ms: WINDOW_MS,
            key: TDOS_VICTIM.into(),
            bucket: 1,
        },
        approx: false,
        limit: LIMIT,
        want: 1,
        give_back: 0,
        ttl_ms: 3 * WINDOW_MS,
        now_ms: 0,
        cold: false,
    };
    let config = |n: u32| RedisConfig {
        urls: vec![redis.url()],
        wait_replicas: n,
        timeout: Duration::from_millis(400),
        ..RedisConfig::default()
    };
    // Through the script (credits held before) and by plain increments
    // (a counter held nothing of). A lease failed by `WAIT` took its credit
    // in Redis all the same (lost: fewer calls admitted, never more).
    for (cold, total) in [(false, 1), (true, 3)] {
        let request = LeaseRequest {
            cold,
            ..request.clone()
        };
        let granted = RedisLedger::new(config(0))
            .lease(std::slice::from_ref(&request))
            .await
            .unwrap();
        assert_eq!((granted[0].granted, granted[0].total), (1, total));
        let err = RedisLedger::new(config(1))
            .lease(std::slice::from_ref(&request))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), "transient", "cold {cold}: {err}");
    }
}

/// Counters this instance holds nothing of are leased by plain increments
/// (not the script). Four ledgers leasing the same counters at once, each
/// asking for 1 to 4 credits a time, are never granted more than the limit
/// between them; what an increment took past the limit is taken back (the
/// count in Redis ends equal to the credits granted); the hashes have a
/// TTL, and those with many counters in a call are kept as hash tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plain_increments_never_grant_past_the_limit() {
    use callguard::engine::aggregate::{CounterId, LeaseRequest};
    use callguard::store::redis::aggregate::lease::{RedisLedger, MARK_FROM};
    use callguard::store::redis::RedisConfig;
    const KEYS: usize = 400;
    const LIMIT_HERE: u64 = 10;
    let redis = RedisServer::start(&[]);
    let config = RedisConfig {
        urls: vec![redis.url()],
        ..RedisConfig::default()
    };
    let request = |key: usize, want: u64, approx: bool| LeaseRequest {
        counter: CounterId {
            rule: "tdos".into(),
            window_ms: WINDOW_MS,
            key: format!("+3491{key:07}").into(),
            bucket: 7,
        },
        approx,
        limit: LIMIT_HERE,
        want,
        give_back: 0,
        ttl_ms: 3 * WINDOW_MS,
        now_ms: 0,
        cold: true,
    };
    let tasks = (0..4u64).map(|t| {
        let mut ledger = RedisLedger::new(config.clone());
        tokio::spawn(async move {
            let mut granted = vec![0u64; KEYS];
            for round in 0..20u64 {
                let requests: Vec<LeaseRequest> = (0..KEYS)
                    .map(|k| request(k, 1 + (t + round + k as u64) % 4, k % 3 == 0))
                    .collect();
                let leases = ledger.lease(&requests).await.unwrap();
                for (k, lease) in leases.iter().enumerate() {
                    assert!(lease.granted <= requests[k].want);
                    assert!(lease.total <= LIMIT_HERE, "{lease:?}");
                    granted[k] += lease.granted;
                }
            }
            granted
        })
    });
    let mut total = [0u64; KEYS];
    for task in futures::future::join_all(tasks).await {
        for (k, g) in task.unwrap().into_iter().enumerate() {
            total[k] += g;
        }
    }
    let mut con = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let ledger = RedisLedger::new(config.clone());
    let hash_of = |k: usize| ledger.hash_key("tdos", WINDOW_MS, &format!("+3491{k:07}"), 7);
    let mut per_hash: HashMap<String, usize> = HashMap::new();
    for k in 0..KEYS {
        *per_hash.entry(hash_of(k)).or_default() += 1;
    }
    for (k, &granted) in total.iter().enumerate() {
        // 4 ledgers x 20 rounds x at least one credit: far past the limit.
        assert_eq!(granted, LIMIT_HERE, "key {k}: granted {granted}");
        let hash = hash_of(k);
        let count: u64 = redis::cmd("HGET")
            .arg(&hash)
            .arg(format!("+3491{k:07}"))
            .query(&mut con)
            .unwrap();
        assert_eq!(count, granted, "key {k}: Redis counts {count}");
        let ttl: i64 = redis::cmd("PTTL").arg(&hash).query(&mut con).unwrap();
        assert!(
            ttl > 0 && ttl <= 3 * WINDOW_MS + 60_000,
            "{hash}: PTTL {ttl}"
        );
        let encoding: String = redis::cmd("OBJECT")
            .arg("ENCODING")
            .arg(&hash)
            .query(&mut con)
            .unwrap();
        let many = per_hash[&hash] >= MARK_FROM;
        let want = if many { "hashtable" } else { "listpack" };
        assert_eq!(encoding, want, "{hash}: {} counters", per_hash[&hash]);
    }
    // A sliding-approx lease reads the previous bucket's count.
    let mut one = RedisLedger::new(config);
    let mut next = request(0, 1, true);
    next.counter.bucket = 8;
    let lease = one.lease(&[next]).await.unwrap();
    assert_eq!((lease[0].granted, lease[0].prev), (1, LIMIT_HERE));
    // A hash with one counter in the call is left packed.
    let sparse = one.hash_key("tdos", WINDOW_MS, "+34910000000", 8);
    let encoding: String = redis::cmd("OBJECT")
        .arg("ENCODING")
        .arg(&sparse)
        .query(&mut con)
        .unwrap();
    assert_eq!(encoding, "listpack", "{sparse}");
}

/// Reserve slots on a real redis-server, three instances' ledgers (two
/// slots): A and B hold the slots and spend their reserves of the victim's
/// bucket; A crashes (dropped, its lease left to run out); C then takes
/// A's slot, and its span starts at A's horizon, so it spends no reserve
/// in that bucket (a later one it does). Never more than the limit in the
/// bucket; C admits nothing there once A and B took it all. The count of
/// slots is the first instance's: D, started with 5, follows 2 and finds
/// both slots held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_holder_of_a_reserve_slot_spends_nothing_its_predecessor_could_have() {
    use callguard::engine::record::Decision;
    use callguard::store::gated::{Gated, Ledger};
    use callguard::store::memory::MemoryStore;
    use callguard::store::redis::aggregate::lease::RedisLedger;
    use callguard::store::redis::aggregate::slot::{Slots, AHEAD_MS};
    use callguard::store::redis::RedisConfig;
    use callguard::store::WindowStore;
    const LIMIT_HERE: u64 = 64;
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_toml(&format!(
        "[[rule]]\nname = \"tdos\"\nkey = \"callee\"\nkind = \"fixed\"\nwindow = \"10s\"\nlimit = {LIMIT_HERE}\n"
    ))
    .unwrap();
    let config = RedisConfig {
        urls: vec![redis.url()],
        key_prefix: "slots:".into(),
        ..RedisConfig::default()
    };
    let lease = Duration::from_millis(400);
    let instance = |expected: u32| {
        let slots = Slots::new(expected).with_lease(lease);
        Gated::new(
            MemoryStore::new(),
            Ledger::Redis(Box::new(RedisLedger::with_slots(config.clone(), slots))),
        )
    };
    let t0 = 1_764_547_200_000i64;
    let calls = |from: usize, n: usize, t: i64| -> Vec<CallEvent> {
        (from..from + n)
            .map(|i| {
                let mut e = common::ev(
                    &format!("+3460{i:07}"),
                    &format!("c{i}"),
                    t + i as i64 % 900,
                );
                e.callee = Some(TDOS_VICTIM.into());
                e
            })
            .collect()
    };
    let admitted = |v: &[callguard::engine::record::Verdict]| {
        v.iter()
            .filter(|v| v.record.decision == Decision::Allow)
            .count() as u64
    };
    let (mut a, mut b) = (instance(2), instance(2));
    let mut total = 0;
    for round in 0..4 {
        let batch = calls(round * 100, 20, t0);
        total += admitted(&a.apply_batch(&rules, &batch).await.unwrap());
        let batch = calls(round * 100 + 50, 20, t0);
        total += admitted(&b.apply_batch(&rules, &batch).await.unwrap());
    }
    assert_eq!(
        total, LIMIT_HERE,
        "A and B between them take the whole limit"
    );
    let reserve = reserve_of(LIMIT_HERE, 2);
    assert_eq!(
        a.stats().lease.reserved,
        1,
        "A spent its reserve of the victim"
    );
    assert_eq!(b.stats().lease.reserved, 1);
    drop(a);
    // D follows the recorded count, and finds no free slot while A's lease
    // runs.
    let mut d = RedisLedger::with_slots(config.clone(), Slots::new(5).with_lease(lease));
    let r = d.reserves(t0, 60_000).await.unwrap();
    assert_eq!((r.slots, r.span), (2, None));
    tokio::time::sleep(lease * 2).await;
    let mut c = instance(2);
    let late = calls(1_000, 30, t0);
    let got = c.apply_batch(&rules, &late).await.unwrap();
    assert_eq!(admitted(&got), 0, "C spends no reserve in A's buckets");
    assert_eq!(c.stats().lease.reserved, 0);
    // Past A's horizon (its newest call plus AHEAD_MS): C's own reserve.
    let fresh = calls(2_000, 1, t0 + AHEAD_MS + 60_000);
    let got = c.apply_batch(&rules, &fresh).await.unwrap();
    assert_eq!(admitted(&got), 1);
    assert_eq!(c.stats().lease.reserved, 1, "reserve {reserve}");
}

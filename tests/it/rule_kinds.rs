//! The rules a fraud team writes, end to end through the `serve` binary on a
//! real redis-server (both Redis modes): a night-time IRSF rule over a
//! callees file with a warning level, a token bucket, a shadow rule keyed
//! by caller and callee and a distinct-callees rule; their counts, reasons,
//! warnings and Retry-After as the switch sees them; the callees file
//! reloaded with the rules, and a broken one keeping the rules in force.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::scenarios::T0;
use common::{HttpConn, HttpResponse, RedisServer};

const RULES: &str = r#"
timezone = "Europe/Madrid"

[[rule]]
name = "irsf_night"
kind = "sliding"
window = "1h"
limit = 2
warn = 1
callees_file = "ranges.txt"
hours = "22:00-07:00"

[[rule]]
name = "pbx_burst"
kind = "token-bucket"
rate = "1/s"
burst = 3

[[rule]]
name = "same_callee"
key = "caller+callee"
kind = "sliding"
window = "1h"
limit = 4
shadow = true

[[rule]]
name = "spray"
kind = "distinct-callees"
window = "10m"
limit = 5
"#;

struct Serve {
    child: std::process::Child,
    port: u16,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path, redis: &RedisServer, mode: &str) -> Serve {
    let port = common::free_port();
    let child = std::process::Command::new(common::bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--redis-url", &redis.url(), "--redis-mode", mode])
        .args(["--key-prefix", &format!("{mode}:")])
        .args(["--reject-status", "429"])
        .arg("--rules")
        .arg(dir.join("rules.toml"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start serve");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !common::http_get(port, "/readyz").is_some_and(|r| r.contains(" 200 ")) {
        assert!(Instant::now() < deadline, "serve not ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    Serve { child, port }
}

fn check(conn: &mut HttpConn, id: &str, caller: &str, callee: &str, ts: i64) -> HttpResponse {
    let body = serde_json::json!({"call_id": id, "caller": caller, "callee": callee, "ts": ts});
    conn.post("/v1/check", &body.to_string())
}

/// (decision, reason, warn, count per rule) of an answer.
fn seen(r: &HttpResponse) -> (String, String, serde_json::Value, [serde_json::Value; 4]) {
    let v = r.json();
    let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
    let counts = ["irsf_night", "pbx_burst", "same_callee", "spray"]
        .map(|n| v[format!("count_{n}")].clone());
    (s("decision"), s("reason"), v["warn"].clone(), counts)
}

fn run(mode: &str) {
    let redis = RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("rules.toml"), RULES).unwrap();
    std::fs::write(dir.path().join("ranges.txt"), "# premium ranges\n+882\n").unwrap();
    let served = start(dir.path(), &redis, mode);
    let mut conn = HttpConn::connect(served.port);
    let null = serde_json::Value::Null;
    let n = |x: u64| serde_json::json!(x);
    // T0 is 01:00 in Madrid: night. Three calls to a premium range, 10 s apart.
    let a = "+34911000001";
    let r = check(&mut conn, "a1", a, "+88210000001", T0);
    assert_eq!(
        seen(&r),
        (
            "allow".into(),
            "ok".into(),
            null.clone(),
            [n(1), n(1), n(1), n(1)]
        )
    );
    let r = check(&mut conn, "a2", a, "+88210000001", T0 + 10_000);
    assert_eq!(
        seen(&r),
        (
            "allow".into(),
            "ok".into(),
            "irsf_night".into(),
            [n(2), n(1), n(2), n(1)]
        ),
        "over the warn level: a warning"
    );
    let r = check(&mut conn, "a3", a, "+88210000001", T0 + 20_000);
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(seen(&r).1, "irsf_night");
    // The call at +10 s leaves the hour at +3610 s: 3590 s after this one.
    assert_eq!(r.header("retry-after"), Some("3590"));
    // A callee outside the ranges: the IRSF rule does not see it.
    let r = check(&mut conn, "a4", a, "+34910000001", T0 + 30_000);
    assert_eq!(
        seen(&r),
        (
            "allow".into(),
            "ok".into(),
            null.clone(),
            [null.clone(), n(1), n(1), n(2)]
        )
    );
    // Daytime (13:00 in Madrid): the night rule does not see the call.
    let d = "+34911000004";
    for i in 0..3 {
        let r = check(
            &mut conn,
            &format!("d{i}"),
            d,
            "+88210000001",
            T0 + 12 * 3_600_000 + i * 10_000,
        );
        assert_eq!(seen(&r).3[0], null, "day call {i}");
        assert_eq!(r.status, 200);
    }
    // A PBX burst: four calls in one millisecond, rate 1/s, burst 3.
    let b = "+34911000002";
    for i in 0..4 {
        let r = check(
            &mut conn,
            &format!("b{i}"),
            b,
            &format!("+3491000010{i}"),
            T0,
        );
        assert_eq!(seen(&r).3[1], n(i as u64 + 1), "burst call {i}");
        if i == 3 {
            assert_eq!((r.status, seen(&r).1.as_str()), (429, "pbx_burst"));
            // TAT = T0 + 4 s; a call passes from T0 + 2 s on.
            assert_eq!(r.header("retry-after"), Some("2"));
        }
    }
    // The same callee five times: over the shadow rule, allowed and flagged.
    let c = "+34911000003";
    for i in 0..5 {
        let r = check(
            &mut conn,
            &format!("c{i}"),
            c,
            "+34910000200",
            T0 + i * 10_000,
        );
        let v = r.json();
        assert_eq!(r.status, 200, "{v}");
        assert_eq!(v["count_same_callee"], i + 1);
        assert_eq!(v["shadow"], i == 4, "{v}");
        if i == 4 {
            assert_eq!(v["reason"], "same_callee");
        }
    }
    // A spray: the sixth distinct callee in ten minutes is rejected.
    let s = "+34911000005";
    for i in 0..6 {
        let r = check(
            &mut conn,
            &format!("s{i}"),
            s,
            &format!("+3491000030{i}"),
            T0 + i * 5_000,
        );
        assert_eq!(seen(&r).3[3], n(i as u64 + 1));
        assert_eq!(r.status == 429, i == 5, "{}", r.body);
    }
    // The warning is counted.
    let metrics = common::http_get(served.port, "/metrics").unwrap();
    assert!(
        metrics.contains("callguard_warnings_total{rule=\"irsf_night\"} 1"),
        "{metrics}"
    );

    // The ranges file changes: the rules are reloaded with it.
    let version =
        check(&mut conn, "v0", "+34911000009", "+34910000009", T0).json()["rules_version"].clone();
    std::fs::write(dir.path().join("ranges.txt"), "+882\n+53\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut k = 0;
    let new_version = loop {
        k += 1;
        let v = check(
            &mut conn,
            &format!("v{k}"),
            "+34911000009",
            "+34910000009",
            T0,
        )
        .json();
        if v["rules_version"] != version {
            break v["rules_version"].clone();
        }
        assert!(
            Instant::now() < deadline,
            "the ranges file was not reloaded"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let e = "+34911000006";
    for i in 0..3 {
        let r = check(
            &mut conn,
            &format!("e{i}"),
            e,
            "+5350000001",
            T0 + i * 1_000,
        );
        assert_eq!(seen(&r).3[0], n(i as u64 + 1), "a Cuban number now counts");
    }
    // A broken ranges file: the reload fails, the rules in force stay.
    std::fs::write(dir.path().join("ranges.txt"), "+882\nnot-a-prefix\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let stats = common::http_get(served.port, "/v1/stats").unwrap_or_default();
        if stats.contains("not-a-prefix") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the failed reload is not shown: {stats}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let r = check(&mut conn, "e9", e, "+5350000001", T0 + 5_000);
    assert_eq!(r.json()["rules_version"], new_version);
    assert_eq!(seen(&r).3[0], n(4));
    // Fixed: the next reload succeeds, and the error is no longer shown
    // (the count of failed reloads stays).
    std::fs::write(dir.path().join("ranges.txt"), "+882\n+53\n+7\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let stats = common::http_get(served.port, "/v1/stats").unwrap_or_default();
        let body = stats.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        if v["rules"]["version"] != new_version && v["rules"]["version"].is_string() {
            assert_eq!(v["rules"]["last_error"], serde_json::Value::Null, "{stats}");
            assert!(v["rules"]["failed_reloads"].as_u64() >= Some(1), "{stats}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the fixed file was not reloaded: {stats}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn every_rule_kind_through_serve_in_cached_mode() {
    run("cached");
}

#[test]
fn every_rule_kind_through_serve_in_script_mode() {
    run("script");
}

/// `data/rules-fraud.toml` on the generated traffic each of its rules is
/// for: the IRSF night calls are rejected by `irsf_night`, the harassment
/// loops flagged by the shadow `same_callee`, the PBX bursts never
/// rejected by the token bucket, and no ordinary subscriber rejected.
#[test]
fn the_example_fraud_rules_catch_the_traffic_they_are_for() {
    use callguard::engine::event::CallEvent;
    use callguard::engine::record::Decision;
    use callguard::engine::rules::RuleSet;
    use callguard::store::memory::MemoryStore;
    let rules = RuleSet::from_file(Path::new("data/rules-fraud.toml")).unwrap();
    use callguard::engine::event::EventKind;
    let calls = callguard::offline::generate::generate(20_000, 1);
    let mut store = MemoryStore::new();
    let mut tally: std::collections::HashMap<(&str, String, bool), usize> = Default::default();
    let mut per_population: std::collections::HashMap<&str, usize> = Default::default();
    // Each call and its end, in time order (an end before a call at the
    // same millisecond), as a replay orders them.
    let mut events: Vec<(i64, u8, usize, CallEvent)> = Vec::new();
    for (i, c) in calls.iter().enumerate() {
        let e = CallEvent {
            call_id: format!("c{i}").into(),
            caller: c.caller.as_str().into(),
            ts_ms: c.ts_ms,
            callee: Some(c.callee.as_str().into()),
            duration_ms: Some(c.duration_ms()),
            label: Some(c.fraud),
            account: c.account.as_deref().map(Into::into),
            ..Default::default()
        };
        let end = CallEvent {
            kind: EventKind::End,
            ts_ms: c.ts_ms + c.duration_ms(),
            duration_ms: None,
            talk_ms: Some(c.talk_ms),
            ..e.clone()
        };
        events.push((end.ts_ms, 0, i, end));
        events.push((c.ts_ms, 1, i, e));
    }
    events.sort_by_key(|(t, kind, i, _)| (*t, *kind, *i));
    // The rules keyed by account decided first, in processing order, as a
    // replay does.
    let gated = |set: &RuleSet| -> Vec<(usize, CallEvent)> {
        let mut evs: Vec<CallEvent> = events.iter().map(|(_, _, _, e)| e.clone()).collect();
        callguard::engine::aggregate::Gate::new().run(
            &mut callguard::engine::aggregate::MemoryLedger::new(),
            set,
            &mut evs,
        );
        events.iter().map(|(_, _, i, _)| *i).zip(evs).collect()
    };
    let mut premium_peak = 0u64;
    let channels = rules.rule_index("premium_channels").unwrap();
    for (i, e) in &gated(&rules) {
        let v = store.apply(&rules, e);
        if v.end {
            continue;
        }
        let c = &calls[*i];
        if c.population == "irsf" {
            premium_peak = premium_peak.max(v.record.counts[channels]);
        }
        let r = &v.record;
        let key = match r.decision {
            Decision::Reject => r.reason.to_string(),
            Decision::Allow if r.shadow => format!("shadow:{}", r.reason),
            Decision::Allow => "ok".into(),
        };
        *tally
            .entry((c.population, key, r.warn.is_some()))
            .or_default() += 1;
        *per_population.entry(c.population).or_default() += 1;
    }
    let count = |pop: &str, key: &str| {
        tally
            .iter()
            .filter(|((p, k, _), _)| *p == pop && k == key)
            .map(|(_, n)| n)
            .sum::<usize>()
    };
    let share = |pop: &str, key: &str| count(pop, key) as f64 / per_population[pop] as f64;
    assert!(share("irsf", "irsf_night") > 0.9, "{tally:?}");
    // A hacked PBX dials from several of its trunk's numbers: the trunk's
    // account rule stops what each number's limit lets through, and only
    // that (ordinary PBX trunks call no premium range).
    assert!(count("irsf", "trunk_night") > 0, "{tally:?}");
    assert!(
        tally
            .keys()
            .all(|(p, k, _)| k != "trunk_night" || *p == "irsf"),
        "{tally:?}"
    );
    assert!(share("harasser", "shadow:same_callee") > 0.5, "{tally:?}");
    assert_eq!(count("pbx_burst", "pbx_burst"), 0, "{tally:?}");
    let warned_irsf: usize = tally
        .iter()
        .filter(|((p, _, w), _)| *p == "irsf" && *w)
        .map(|(_, n)| n)
        .sum();
    assert!(
        warned_irsf > 0,
        "the IRSF warning level never fired: {tally:?}"
    );
    assert_eq!(
        count("subscriber", "ok"),
        per_population["subscriber"],
        "{tally:?}"
    );
    // `irsf_night` and `trunk_night` stop the hacked PBX after 3 calls, so
    // few are open at once; with them report-only (shadow), the PBX holds
    // many premium calls open and `premium_channels` rejects it past 10,
    // and nobody else (no one else calls premium ranges).
    assert!(premium_peak >= 1, "{premium_peak}");
    let mut spec = rules.spec();
    for name in ["irsf_night", "trunk_night"] {
        let night = rules.rule_index(name).unwrap();
        spec.rules[night].shadow = true;
    }
    let shadowed = RuleSet::build(spec).unwrap();
    let mut store = MemoryStore::new();
    let mut by_channels: std::collections::HashMap<&str, usize> = Default::default();
    let mut by_sums: std::collections::HashMap<(String, &str), usize> = Default::default();
    for (i, e) in &gated(&shadowed) {
        let v = store.apply(&shadowed, e);
        if !v.end && v.record.reason == "premium_channels" && !v.record.shadow {
            *by_channels.entry(calls[*i].population).or_default() += 1;
        }
        if !v.end && ["premium_talk", "spend"].contains(&v.record.reason.as_str()) {
            *by_sums
                .entry((v.record.reason.to_string(), calls[*i].population))
                .or_default() += 1;
        }
    }
    // So do the talk and spend caps, the IRSF callers' minutes and money
    // (everyone else's stays below them).
    assert!(
        by_sums.keys().all(|(_, p)| *p == "irsf")
            && by_sums.keys().any(|(r, _)| r == "premium_talk")
            && by_sums.keys().any(|(r, _)| r == "spend"),
        "{by_sums:?}"
    );
    assert!(
        by_channels.get("irsf").is_some_and(|&n| n > 0),
        "{by_channels:?}"
    );
    assert_eq!(by_channels.len(), 1, "{by_channels:?}");
}

/// `features` exports the new counts (empty where a rule does not see the
/// call) and the `warn` column, as `replay` decides.
#[test]
fn features_export_the_new_counts_and_warnings() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("features.csv");
    let o = std::process::Command::new(common::bin())
        .args([
            "features",
            "-i",
            "data/calls.csv",
            "--rules",
            "data/rules-fraud.toml",
            "-o",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut reader = csv::Reader::from_path(&out).unwrap();
    let header = reader.headers().unwrap().clone();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("no column {name}: {header:?}"))
    };
    let (irsf, spray, pbx, pair, warn) = (
        col("count_irsf_night"),
        col("count_spray"),
        col("count_pbx_burst"),
        col("count_same_callee"),
        col("warn"),
    );
    let rows: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
    assert_eq!(rows.len(), 20_000);
    let filled = |i: usize| rows.iter().filter(|r| !r[i].is_empty()).count();
    // The IRSF rule sees the night calls to premium ranges only (400).
    assert_eq!(filled(irsf), 400);
    // Every generated call names a callee: the others see every call.
    assert_eq!(
        (filled(spray), filled(pbx), filled(pair)),
        (20_000, 20_000, 20_000)
    );
    let warned: std::collections::HashSet<&str> = rows.iter().map(|r| &r[warn]).collect();
    assert!(
        warned.contains("minute") && warned.contains("irsf_night"),
        "{warned:?}"
    );
}

/// Under `--hash-numbers` a rule's callee prefixes and a rate table's
/// prefixes still match the real callees: `replay` of the fraud rules with
/// pseudonymised numbers decides and prices every call as it does without
/// (the pseudonyms aside).
#[test]
fn callee_prefixes_match_real_callees_under_pseudonyms() {
    let dir = tempfile::tempdir().unwrap();
    let run = |hash: bool| {
        let out = dir.path().join(format!("d-{hash}.csv"));
        let mut cmd = std::process::Command::new(common::bin());
        cmd.args([
            "replay",
            "-i",
            "data/calls.csv",
            "--rules",
            "data/rules-fraud.toml",
            "-o",
        ])
        .arg(&out);
        if hash {
            cmd.arg("--hash-numbers")
                .env("CALLGUARD_HASH_KEY", "0123456789abcdef0123456789abcdef");
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let mut reader = csv::Reader::from_path(&out).unwrap();
        let header = reader.headers().unwrap().clone();
        reader
            .records()
            .map(|r| {
                let r = r.unwrap();
                // Every column but the caller (a pseudonym under hashing).
                header
                    .iter()
                    .zip(r.iter())
                    .filter(|(h, _)| *h != "caller")
                    .map(|(h, v)| format!("{h}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect::<Vec<String>>()
    };
    let (plain, hashed) = (run(false), run(true));
    assert_eq!(plain.len(), 20_000);
    let irsf_rejects = hashed
        .iter()
        .filter(|r| r.contains("reason=irsf_night"))
        .count();
    assert!(
        irsf_rejects > 300,
        "{irsf_rejects} IRSF rejects under pseudonyms"
    );
    // Calls priced by the rate table (an empty count is a sum of 0).
    let priced = hashed
        .iter()
        .filter(|r| r.contains("count_spend=") && !r.contains("count_spend=,"))
        .count();
    assert!(priced > 100, "{priced} calls with a spend under pseudonyms");
    for (p, h) in plain.iter().zip(&hashed) {
        assert_eq!(p, h);
    }
}

/// `data/rules-trunks.toml` (channels, premium talk and spend per trunk,
/// keyed by account) on a generated day with its ends, replayed: the IRSF
/// attacks through hacked PBX trunks are cut by the trunk rules (most of
/// their calls rejected, by those rules), and no PBX or subscriber call
/// is rejected, as every PBX trunk's channels, talk and spend stay within
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_trunk_rules_stop_irsf_and_no_pbx() {
    use callguard::engine::record::Decision;
    use callguard::engine::rules::RuleSet;
    use callguard::offline::order::OrderedLog;
    use callguard::store::memory::MemoryStore;
    let (_dir, path) = common::generated_csv(20_000, 1);
    let rules = RuleSet::from_file(Path::new("data/rules-trunks.toml")).unwrap();
    let log = OrderedLog::open(&path, &Default::default())
        .unwrap()
        .with_ends()
        .read_all()
        .unwrap();
    let verdicts = callguard::offline::replay::run(&log, &rules, &mut MemoryStore::new())
        .await
        .unwrap();
    let population: std::collections::HashMap<String, String> = csv::Reader::from_path(&path)
        .unwrap()
        .deserialize::<std::collections::HashMap<String, String>>()
        .map(|r| {
            let r = r.unwrap();
            (r["call_id"].clone(), r["population"].clone())
        })
        .collect();
    let mut tally: std::collections::HashMap<(&str, bool), usize> = Default::default();
    let mut by_trunk_rules = 0;
    for v in verdicts.iter().filter(|v| !v.end) {
        let p = population[v.record.call_id.as_str()].as_str();
        let rejected = v.record.decision == Decision::Reject;
        *tally.entry((p, rejected)).or_default() += 1;
        if rejected && p == "irsf" && v.record.reason.starts_with("trunk_") {
            by_trunk_rules += 1;
        }
    }
    let got = |p: &str, r: bool| tally.get(&(p, r)).copied().unwrap_or(0);
    let irsf = got("irsf", true) + got("irsf", false);
    assert!(irsf > 100, "{tally:?}");
    assert!(
        got("irsf", true) * 2 > irsf,
        "IRSF mostly rejected: {tally:?}"
    );
    assert_eq!(
        by_trunk_rules,
        got("irsf", true),
        "by the trunk rules: {tally:?}"
    );
    for p in ["pbx", "subscriber", "harasser"] {
        assert!(got(p, false) > 0 && got(p, true) == 0, "{p}: {tally:?}");
    }
}

//! The status page as a person sees it: `consume` runs on a real broker
//! (tansu) and Redis, Debian's Chromium loads `/` headless, and the numbers
//! it renders must be those of `/v1/stats` and of `/metrics`.
//!
//! `CALLGUARD_SCREENSHOT=docs/status-page.png cargo test --test it
//! status_page` refreshes the docs' screenshot from the same run.

use crate::common;

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::kafka::TOPICS;
use common::kafka::{produce_raw, read_decisions, signal, spawn_consumer};
use common::{http_get, Tansu};
use serde_json::Value;

/// Chromium, headless, with what keeps it off the network (the flags the
/// machine's notes name), on a fresh profile.
fn chromium(profile: &Path, args: &[&str]) -> std::process::Output {
    Command::new("timeout")
        .arg("120")
        .arg("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--window-size=1280,900",
            // Long enough for the first fetch of /v1/stats and its render.
            "--virtual-time-budget=4000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .output()
        .expect("run chromium")
}

/// The text of the element with `id` in a dumped DOM.
fn text_of(dom: &str, id: &str) -> String {
    let marker = format!("id=\"{id}\"");
    let at = dom
        .find(&marker)
        .unwrap_or_else(|| panic!("no #{id} in the page"));
    let start = dom[at..].find('>').expect("tag closes") + at + 1;
    let end = dom[start..].find('<').expect("element closes") + start;
    dom[start..end].to_string()
}

/// The rows of table body `id`: the texts of each row's cells.
fn table_of(dom: &str, id: &str) -> Vec<Vec<String>> {
    let marker = format!("<tbody id=\"{id}\">");
    let start = dom.find(&marker).expect("table") + marker.len();
    let end = dom[start..].find("</tbody>").expect("table closes") + start;
    dom[start..end]
        .split("<tr>")
        .skip(1)
        .map(|row| {
            row.split("<td")
                .skip(1)
                .map(|cell| {
                    let open = cell.find('>').expect("cell") + 1;
                    let close = cell.find("</td>").expect("cell closes");
                    cell[open..close].to_string()
                })
                .collect()
        })
        .collect()
}

/// A rendered integer ("1,234") as a number.
fn int(s: &str) -> u64 {
    s.replace(',', "")
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("not an integer: {s:?}"))
}

fn body(response: &str) -> &str {
    response.split_once("\r\n\r\n").map_or("", |(_, b)| b)
}

/// Sums the samples of `metric` in a Prometheus exposition whose labels
/// contain every one of `labels`.
fn metric_sum(text: &str, metric: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(metric) && !l.starts_with('#'))
        .filter(|l| {
            let name_end = l.find(['{', ' ']).unwrap_or(l.len());
            &l[..name_end] == metric
        })
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn stats(port: u16) -> Value {
    let r = http_get(port, "/v1/stats").expect("/v1/stats answers");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    serde_json::from_str(body(&r)).expect("stats JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_renders_what_stats_and_metrics_say() {
    common::require("chromium");
    let redis = common::RedisServer::start(&[]);
    let tansu = Tansu::start();
    let brokers = tansu.with_topics(&TOPICS.map(|t| (t, if t == "calls" { 2 } else { 1 })));
    let dir = tempfile::tempdir().unwrap();
    let rules = common::rules_file(
        dir.path(),
        "[[rule]]\nname = \"minute\"\nkind = \"sliding\"\nwindow = \"1m\"\nlimit = 5\n",
    );
    // A robocaller (30 calls), a redialler (12) and 20 callers once each,
    // at the wall clock (the page counts per second of decision); three
    // malformed messages.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let mut msgs: Vec<(String, String)> = Vec::new();
    let mut call = |caller: &str, i: usize| {
        let id = format!("c{}", msgs.len());
        let ts = now - 5_000 + 10 * i as i64;
        msgs.push((
            caller.to_string(),
            format!(r#"{{"call_id":"{id}","caller":"{caller}","ts":{ts}}}"#),
        ));
    };
    for i in 0..30 {
        call("+34600000001", i);
    }
    for i in 0..12 {
        call("+34600000002", i);
    }
    for i in 0..20 {
        call(&format!("+349110000{i:02}"), i);
    }
    let valid = msgs.len() as u64;
    for bad in [
        r#"{"call_id":"x1""#,
        r#"{"caller":"+34600000009","ts":1}"#,
        "garbage",
    ] {
        msgs.push(("+34600000009".into(), bad.to_string()));
    }
    let raw: Vec<(Option<&[u8]>, &[u8])> = msgs
        .iter()
        .map(|(k, v)| (Some(k.as_bytes()), v.as_bytes()))
        .collect();
    produce_raw(&brokers, "calls", &raw).await;

    let port = common::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = spawn_consumer(
        &brokers,
        &redis.url(),
        "g-status",
        &rules,
        &["--metrics-addr", &addr],
    );
    let records = read_decisions(
        &brokers,
        "call-decisions",
        valid as usize,
        Duration::from_secs(120),
    )
    .await;
    // Every call decided and the lag of both partitions reported (librdkafka's
    // statistics come every 5 s) and caught up.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = stats(port);
        let lag = s["lag"].as_array().cloned().unwrap_or_default();
        let calls_lag: Vec<_> = lag.iter().filter(|l| l["topic"] == "calls").collect();
        if s["decided"] == valid
            && s["dead_letters"] == 3
            && calls_lag.len() == 2
            && calls_lag.iter().all(|l| l["lag"] == 0)
        {
            break;
        }
        if Instant::now() > deadline {
            let mut brief = s.clone();
            brief["series"] = Value::Null;
            panic!("never settled: {brief}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let page = http_get(port, "/").unwrap();
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(page.contains("text/html"));
    // Self-contained: nothing is fetched from anywhere but this server.
    let html = body(&page);
    for outside in ["http://", "https://", "src=", "<link", "@import", "url("] {
        assert!(
            !html.contains(outside),
            "the page refers outside: {outside}"
        );
    }

    let url = format!("http://{addr}/");
    let profile = tempfile::tempdir().unwrap();
    let dumped = chromium(profile.path(), &["--dump-dom", &url]);
    let dom = String::from_utf8_lossy(&dumped.stdout).to_string();
    assert!(
        dom.contains("data-stats-time"),
        "the page never rendered stats; chromium said: {}",
        String::from_utf8_lossy(&dumped.stderr)
    );
    let s = stats(port);
    let metrics = body(&http_get(port, "/metrics").unwrap()).to_string();

    // Totals: page = /v1/stats = /metrics = what was sent.
    let decided = int(&text_of(&dom, "decided"));
    assert_eq!(decided, valid);
    assert_eq!(s["decided"], decided);
    assert_eq!(
        metric_sum(&metrics, "callguard_events_total", &[]),
        decided as f64
    );
    let rejected = int(&text_of(&dom, "rejected"));
    assert_eq!(
        rejected,
        25 + 7,
        "robocaller 25 over the limit, redialler 7"
    );
    assert_eq!(s["rejected"], rejected);
    assert_eq!(
        metric_sum(&metrics, "callguard_events_total", &["decision=\"reject\""]),
        rejected as f64
    );
    let dead = int(&text_of(&dom, "dead-letters"));
    assert_eq!(dead, 3);
    assert_eq!(s["dead_letters"], dead);
    assert_eq!(
        metric_sum(&metrics, "callguard_dlq_total", &[]),
        dead as f64
    );

    // Rejects per rule.
    let per_rule = table_of(&dom, "per-rule");
    assert_eq!(per_rule.len(), 1, "{per_rule:?}");
    assert_eq!(per_rule[0][0], "minute");
    assert_eq!(int(&per_rule[0][1]), rejected);
    assert_eq!(
        metric_sum(
            &metrics,
            "callguard_events_total",
            &["decision=\"reject\"", "reason=\"minute\""]
        ),
        rejected as f64
    );

    // The top rejected callers, as the records say.
    let mut per_caller: HashMap<String, u64> = HashMap::new();
    for r in &records {
        if r["decision"] == "reject" {
            *per_caller
                .entry(r["caller"].as_str().unwrap().to_string())
                .or_default() += 1;
        }
    }
    let top = table_of(&dom, "top");
    let shown: Vec<(String, u64)> = top.iter().map(|r| (r[0].clone(), int(&r[1]))).collect();
    assert_eq!(
        shown,
        vec![
            ("+34600000001".to_string(), 25),
            ("+34600000002".to_string(), 7)
        ]
    );
    for (caller, n) in &shown {
        assert_eq!(per_caller.get(caller), Some(n));
    }
    assert_eq!(s["top_rejected"][0]["caller"], "+34600000001");

    // Lag per partition: the page, the JSON and the gauges.
    let lag = table_of(&dom, "lag");
    let calls_rows: Vec<_> = lag.iter().filter(|r| r[0] == "calls").collect();
    assert_eq!(calls_rows.len(), 2, "{lag:?}");
    for row in calls_rows {
        assert_eq!(int(&row[2]), 0);
        let gauge = metric_sum(
            &metrics,
            "callguard_consumer_lag",
            &["topic=\"calls\"", &format!("partition=\"{}\"", row[1])],
        );
        assert_eq!(gauge, 0.0);
    }

    // The rule set in force is the one that decided.
    let version = text_of(&dom, "rules-version");
    assert_eq!(s["rules"]["version"], version.as_str());
    assert!(records
        .iter()
        .all(|r| r["rules_version"] == version.as_str()));
    assert!(text_of(&dom, "rules-list").contains("minute:sliding:1m:5"));
    assert_eq!(text_of(&dom, "role"), "consume");
    assert_eq!(text_of(&dom, "ready"), "ready");

    // Store latency: a number of milliseconds, as the JSON has one.
    let p99: f64 = text_of(&dom, "store-p99").parse().expect("p99 in ms");
    assert!(p99 > 0.0 && s["store_p99_ms"].as_f64().is_some());
    // The chart: one point per second of the last five minutes, and the
    // rejects drawn.
    let points = dom
        .split("id=\"line-rejected\"")
        .nth(1)
        .and_then(|rest| rest.split("points=\"").nth(1))
        .and_then(|rest| rest.split('"').next())
        .expect("rejects line");
    assert_eq!(points.split(' ').count(), 300);
    assert!(int(&text_of(&dom, "chart-peak")) >= 1);

    // What a person sees: a screenshot (kept when asked for).
    let shot = std::env::var("CALLGUARD_SCREENSHOT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| dir.path().join("status.png"));
    let taken = chromium(
        profile.path(),
        &[&format!("--screenshot={}", shot.display()), &url],
    );
    let png = std::fs::read(&shot)
        .unwrap_or_else(|_| panic!("no screenshot: {}", String::from_utf8_lossy(&taken.stderr)));
    assert!(png.starts_with(b"\x89PNG") && png.len() > 20_000);

    signal(&child, "TERM");
    assert!(child.wait().unwrap().success());
}

/// `serve`'s page as a person sees it: no consumer-lag panel (serve reads
/// no topic); a rule's warnings counted beside its rejects; and while the
/// store is down and `--on-store-error allow` decides, a banner says how
/// many calls were decided without it, beside the unusable callers and
/// ignored fields counted.
#[test]
fn the_serve_page_shows_warnings_fallbacks_and_no_lag() {
    let redis = common::RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let rules = common::rules_file(
        dir.path(),
        "[[rule]]\nname = \"minute\"\nkind = \"sliding\"\nwindow = \"60s\"\nlimit = 5\nwarn = 2\n",
    );
    let port = common::free_port();
    let mut serve = Command::new(common::bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args([
            "--store",
            "redis",
            "--redis-url",
            &redis.url(),
            "--on-store-error",
            "allow",
        ])
        .arg("--rules")
        .arg(&rules)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !http_get(port, "/readyz").is_some_and(|r| r.contains(" 200 ")) {
        assert!(Instant::now() < deadline, "serve not ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut conn = common::HttpConn::connect(port);
    // Four calls of one caller: the third and fourth are over the warn level.
    for i in 0..4 {
        let r = conn.post(
            "/v1/check",
            &format!(r#"{{"call_id":"w{i}","caller":"+34911000021","calee":"x"}}"#),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let r = conn.post("/v1/check", r#"{"call_id":"b1","caller":"anonymous"}"#);
    assert_eq!(r.json()["caller"], "bad_caller");
    // The store goes down: the policy decides, flagged degraded.
    let _stopped = redis.stop();
    let mut degraded = 0;
    for i in 0..3 {
        let r = common::HttpConn::connect(port).post(
            "/v1/check",
            &format!(r#"{{"call_id":"d{i}","caller":"+34911000022"}}"#),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        degraded += u64::from(r.json()["degraded"] == true);
    }
    assert_eq!(degraded, 3);

    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://127.0.0.1:{port}/");
    let dumped = chromium(profile.path(), &["--dump-dom", &url]);
    let dom = String::from_utf8_lossy(&dumped.stdout).to_string();
    assert!(dom.contains("data-stats-time"), "the page never rendered");
    assert_eq!(text_of(&dom, "role"), "serve");
    assert!(
        dom.contains("<section id=\"lag-section\" hidden"),
        "a lag panel for serve"
    );
    let banner = text_of(&dom, "degraded-banner");
    assert!(
        banner.starts_with("3 calls in the last minute were decided without the window store"),
        "{banner}"
    );
    let per_rule = table_of(&dom, "per-rule");
    assert_eq!(
        per_rule,
        vec![vec!["minute", "0", "0", "2"]],
        "{per_rule:?}"
    );
    assert_eq!(int(&text_of(&dom, "fallbacks")), 3);
    assert_eq!(int(&text_of(&dom, "bad-callers")), 1);
    assert_eq!(int(&text_of(&dom, "ignored-fields")), 4);
    let _ = serve.kill();
    let _ = serve.wait();
}

//! `callguard serve`, the check API, against a real redis-server: parity
//! with replay over HTTP (POST and GET), idempotency under racing
//! retransmissions, reject statuses with Retry-After, block keys, invalid
//! input, a failing store.

use crate::common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use callguard::engine::event::CallEvent;
use callguard::engine::record::Decision;
use callguard::engine::rules::RuleSet;
use callguard::online::consumer::StoreErrorPolicy;
use callguard::online::metrics::{Health, KindLabel, Metrics};
use callguard::online::produce::event_json;
use callguard::online::serve::{self, ServeConfig};
use callguard::store::cached::CacheLimit;
use callguard::store::redis::RedisConfig;
use callguard::store::{AnyStore, WindowStore};
use common::scenarios::T0;
use common::{query_escape, random, HttpConn, RedisServer};

/// A check API running in process on a free port, stopped on drop.
struct Served {
    port: u16,
    /// The admin listener (`/metrics`, `/healthz`, `/readyz` only).
    admin_port: u16,
    metrics: Arc<Metrics>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    rt: tokio::runtime::Runtime,
}

impl Served {
    fn start(config: ServeConfig, redis: RedisConfig, rules: RuleSet) -> Self {
        Self::start_with(config, redis, rules, false)
    }

    /// [`Served::start`] on the window script (`cached = false`) or the
    /// cached store.
    fn start_with(config: ServeConfig, redis: RedisConfig, rules: RuleSet, cached: bool) -> Self {
        Self::start_on(config, rules, async move {
            AnyStore::connect_redis(redis, cached.then_some(CacheLimit::callers(1_000)))
                .await
                .expect("connect to Redis")
        })
    }

    /// [`Served::start`] on the store `connect` makes.
    fn start_on(
        config: ServeConfig,
        rules: RuleSet,
        connect: impl std::future::Future<Output = AnyStore>,
    ) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let metrics = Arc::new(Metrics::new());
        let served_metrics = metrics.clone();
        let (port, admin_port) = rt.block_on(async {
            let store = connect.await;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let admin_port = admin.local_addr().unwrap().port();
            let (_tx, rx) = tokio::sync::watch::channel(rules);
            tokio::spawn(async move {
                let _keep = _tx;
                serve::run(
                    serve::Listeners {
                        api: listener,
                        admin: Some(admin),
                    },
                    config,
                    store,
                    rx,
                    served_metrics,
                    Arc::new(Health::default()),
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
                .unwrap();
            });
            (port, admin_port)
        });
        Served {
            port,
            admin_port,
            metrics,
            stop: Some(stop),
            rt,
        }
    }

    fn conn(&self) -> HttpConn {
        HttpConn::connect(self.port)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = &self.rt;
    }
}

fn redis_config(server: &RedisServer) -> RedisConfig {
    RedisConfig {
        urls: vec![server.url()],
        ttl_slack: Duration::ZERO,
        ..RedisConfig::default()
    }
}

/// No skew check: the test events lie in the past or near future of T0.
fn config() -> ServeConfig {
    ServeConfig {
        max_future_skew: None,
        ..ServeConfig::default()
    }
}

fn get_path(e: &CallEvent) -> String {
    let mut p = format!(
        "/v1/check?call_id={}&caller={}&ts={}",
        query_escape(&e.call_id),
        query_escape(&e.caller),
        e.ts_ms
    );
    if let Some(c) = &e.callee {
        p.push_str(&format!("&callee={}", query_escape(c)));
    }
    p
}

/// The record without `duplicate`, for comparing with a replay's.
fn record(mut v: serde_json::Value) -> serde_json::Value {
    let fields = v.as_object_mut().unwrap();
    fields.remove("duplicate");
    fields.remove("ratelimit");
    v
}

#[test]
fn checks_over_http_equal_replay_post_and_get() {
    let redis = RedisServer::start(&[]);
    // The first three random cases with rejects and redeliveries (found by
    // search, so they survive changes to the generator), in both modes.
    let seeds: Vec<u64> = (1..500u64)
        .filter(|&seed| {
            let (rules, events) = random::case(seed, 500, 5);
            let mut memory = callguard::store::memory::MemoryStore::new();
            let v: Vec<_> = events.iter().map(|e| memory.apply(&rules, e)).collect();
            v.iter().any(|v| v.record.decision == Decision::Reject) && v.iter().any(|v| v.duplicate)
        })
        .take(3)
        .collect();
    let cases = [false, true]
        .into_iter()
        .flat_map(|cached| seeds.iter().map(move |&seed| (seed, cached)));
    for (seed, cached) in cases {
        let (rules, events) = random::case(seed, 500, 5);
        let prefix = format!("s{seed}{cached}:");
        let served = Served::start_with(
            config(),
            RedisConfig {
                key_prefix: prefix,
                ..redis_config(&redis)
            },
            rules.clone(),
            cached,
        );
        // The replay's record of each event, in order (a call id redelivered
        // after a short idempotency horizon is decided again).
        let schema = callguard::engine::record::Schema::decisions(&rules);
        let mut memory = callguard::store::memory::MemoryStore::new();
        let expected: Vec<serde_json::Value> = events
            .iter()
            .map(|event| {
                let verdict = memory.apply(&rules, event);
                schema.to_json(callguard::engine::record::Row {
                    event,
                    verdict: &verdict,
                })
            })
            .collect();
        let mut conn = served.conn();
        let (mut rejects, mut dups) = (0, 0);
        for (i, e) in events.iter().enumerate() {
            let r = if i % 2 == 0 {
                conn.post("/v1/check", &event_json(e))
            } else {
                conn.get(&get_path(e))
            };
            assert_eq!(r.status, 200, "seed {seed} event #{i}: {}", r.body);
            let got = r.json();
            dups += usize::from(got["duplicate"] == true);
            rejects += usize::from(got["decision"] == "reject");
            assert_eq!(record(got), expected[i], "seed {seed} event #{i} {e:?}");
        }
        assert!(
            rejects > 0 && dups > 0,
            "seed {seed}: {rejects} rejects, {dups} duplicates"
        );
    }
}

#[test]
fn racing_retransmissions_of_a_call_are_decided_once() {
    for cached in [false, true] {
        racing_retransmissions(cached);
    }
}

fn racing_retransmissions(cached: bool) {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["minute:sliding:60s:5".into()]).unwrap();
    let served = Served::start_with(config(), redis_config(&redis), rules, cached);
    let threads = 12;
    for call in 0..10 {
        let barrier = Arc::new(Barrier::new(threads));
        let answers: Vec<serde_json::Value> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let barrier = barrier.clone();
                    let port = served.port;
                    s.spawn(move || {
                        let mut conn = HttpConn::connect(port);
                        let body = serde_json::json!({
                            "call_id": format!("invite-{call}@10.0.0.1"),
                            "caller": "+34911000001",
                            "callee": "+34600000001",
                            "ts": T0 + call * 1000,
                        })
                        .to_string();
                        barrier.wait();
                        let r = conn.post("/v1/check", &body);
                        assert_eq!(r.status, 200, "{}", r.body);
                        r.json()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let firsts = answers.iter().filter(|a| a["duplicate"] == false).count();
        assert_eq!(
            firsts, 1,
            "call {call}: one request decides, the others get its record"
        );
        let records: Vec<_> = answers.into_iter().map(record).collect();
        assert!(
            records.windows(2).all(|w| w[0] == w[1]),
            "call {call}: {records:?}"
        );
        // Each call was counted once: the count climbs by one per call.
        assert_eq!(records[0]["count_minute"], call + 1, "call {call}");
        let expect = if call < 5 { "allow" } else { "reject" };
        assert_eq!(records[0]["decision"], expect, "call {call}");
    }
}

#[test]
fn rejects_answer_the_configured_status_with_retry_after() {
    for cached in [false, true] {
        rejects_with_retry_after(cached);
    }
}

fn rejects_with_retry_after(cached: bool) {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["burst:sliding:10s:2".into()]).unwrap();
    let served = Served::start_with(
        ServeConfig {
            reject_status: Some(axum::http::StatusCode::TOO_MANY_REQUESTS),
            ..config()
        },
        RedisConfig {
            block_keys: true,
            ..redis_config(&redis)
        },
        rules,
        cached,
    );
    let mut conn = served.conn();
    let check = |conn: &mut HttpConn, id: &str, dt: i64| {
        conn.get(&format!(
            "/v1/check?call_id={id}&caller=%2B34911000002&ts={}",
            T0 + dt
        ))
    };
    for (id, dt, left) in [("a", 0, "1"), ("b", 1_000, "0")] {
        let r = check(&mut conn, id, dt);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.json()["retry_after_ms"], serde_json::Value::Null);
        assert_eq!(r.header("retry-after"), None);
        // The rate-limit headers: the burst rule, its calls left, and its
        // window as the reset.
        assert_eq!(r.header("x-ratelimit-limit"), Some("2"));
        assert_eq!(r.header("x-ratelimit-remaining"), Some(left));
        assert_eq!(r.header("x-ratelimit-reset"), Some("10"));
        assert_eq!(r.header("ratelimit-policy"), Some("\"burst\";q=2;w=10"));
    }
    // Third call at +2 s: over the limit until the call at +1 s leaves the
    // 10 s window, at +11 s: 9,000 ms from now.
    let r = check(&mut conn, "c", 2_000);
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let body = r.json();
    assert_eq!(body["decision"], "reject");
    assert_eq!(body["reason"], "burst");
    assert_eq!(body["retry_after_ms"], 9_000);
    assert_eq!(r.header("retry-after"), Some("9"));
    assert_eq!(r.header("ratelimit"), Some("\"burst\";r=0;t=9"));
    assert_eq!(r.header("x-ratelimit-reset"), Some("9"));
    // The same in the body, for clients that read only bodies (Kamailio).
    assert_eq!(
        body["ratelimit"],
        serde_json::json!({"rule": "burst", "limit": 2, "remaining": 0, "reset": 9})
    );
    // The block key says why, and expires with the retry-after.
    let key = "cg:block:{+34911000002}";
    let got = common::raw_command(redis.port, &format!("GET {key}")).unwrap();
    assert!(got.contains("burst"), "{got}");
    let pttl: i64 = common::raw_command(redis.port, &format!("PTTL {key}"))
        .unwrap()
        .trim_start_matches(':')
        .trim()
        .parse()
        .unwrap();
    assert!((8_000..=9_000).contains(&pttl), "PTTL {pttl}");
    // A retransmission answers the same, status included.
    let again = check(&mut conn, "c", 2_000);
    assert_eq!(again.status, 429);
    assert_eq!(record(again.json()), record(body));
    // Retry-After rounds up: at +2.5 s, the rejected call at +2 s (recorded:
    // `attempts`) is the second newest; it leaves at +12 s, 9,500 ms later.
    let r = check(&mut conn, "d", 2_500);
    assert_eq!(r.json()["retry_after_ms"], 9_500);
    assert_eq!(r.header("retry-after"), Some("10"));
}

/// Every answer's rate-limit headers name the rule nearest its limit in
/// the record of the same call (the one that rejected it, else the fewest
/// calls left) with its limit, calls left and reset; retransmissions get
/// the same.
#[test]
fn rate_limit_headers_agree_with_the_record() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(
        None,
        &["burst:fixed:1s:3".into(), "minute:sliding:60s:7".into()],
    )
    .unwrap();
    let served = Served::start_with(config(), redis_config(&redis), rules, true);
    let mut conn = served.conn();
    let limits = [("burst", 3u64, 1i64), ("minute", 7, 60)];
    let mut checked = 0;
    for i in 0..30i64 {
        let caller = if i % 3 == 0 {
            "%2B34911000031"
        } else {
            "%2B34911000032"
        };
        let id = format!("h{}", i - i64::from(i % 7 == 6));
        let r = conn.get(&format!(
            "/v1/check?call_id={id}&caller={caller}&ts={}",
            T0 + i * 350
        ));
        assert_eq!(r.status, 200, "{}", r.body);
        let body = r.json();
        let counts: Vec<u64> = limits
            .iter()
            .map(|(name, _, _)| body[format!("count_{name}")].as_u64().unwrap())
            .collect();
        let reason = body["reason"].as_str().unwrap();
        let (rule, left) = match limits.iter().position(|(n, _, _)| *n == reason) {
            Some(k) => (k, limits[k].1.saturating_sub(counts[k])),
            None => (0..limits.len())
                .map(|k| (k, limits[k].1.saturating_sub(counts[k])))
                .min_by_key(|(_, left)| *left)
                .unwrap(),
        };
        let (name, limit, window_s) = limits[rule];
        let reset = match body["retry_after_ms"].as_i64() {
            Some(ms) if body["decision"] == "reject" => (ms as u64).div_ceil(1000),
            _ => window_s as u64,
        };
        assert_eq!(
            r.header("x-ratelimit-limit"),
            Some(limit.to_string().as_str()),
            "{body}"
        );
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            Some(left.to_string().as_str()),
            "{body}"
        );
        assert_eq!(
            r.header("x-ratelimit-reset"),
            Some(reset.to_string().as_str()),
            "{body}"
        );
        assert_eq!(
            r.header("ratelimit"),
            Some(format!("\"{name}\";r={left};t={reset}").as_str()),
            "{body}"
        );
        assert_eq!(
            body["ratelimit"],
            serde_json::json!({"rule": name, "limit": limit, "remaining": left, "reset": reset}),
            "the body's copy of the headers"
        );
        checked += usize::from(body["decision"] == "reject");
    }
    assert!(
        checked >= 3,
        "the sequence reaches the limits ({checked} rejects)"
    );
}

#[test]
fn invalid_checks_answer_400_with_the_dead_letter_kind() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["m:sliding:60s:5".into()]).unwrap();
    let served = Served::start(
        ServeConfig {
            max_body_bytes: 2048,
            ..ServeConfig::default()
        },
        redis_config(&redis),
        rules,
    );
    let mut conn = served.conn();
    let cases = [
        (
            r#"{"caller":"+34911000003","ts":1764547200000}"#,
            "missing_field",
        ),
        (r#"{"call_id":"x","caller":"+34911","#, "bad_json"),
        (
            r#"{"call_id":"x","caller":"+34911000003","ts":"noon"}"#,
            "bad_timestamp",
        ),
        (
            r#"{"call_id":"x","caller":"+34911000003","ts":4102444800000}"#,
            "ts_out_of_range",
        ),
        (r#"{"call_id":["x"],"caller":"+34911000003"}"#, "wrong_type"),
    ];
    for (body, kind) in cases {
        let r = conn.post("/v1/check", body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let v = r.json();
        assert_eq!(v["kind"], kind, "{body}: {v}");
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    }
    let r = conn.get("/v1/check?caller=%2B34911000003");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["kind"], "missing_field");
    // Counted as invalid checks (serve has no dead-letter topic).
    let label = |kind: &str| callguard::online::metrics::KindLabel { kind: kind.into() };
    let m = &served.metrics;
    assert_eq!(
        m.invalid_checks
            .get_or_create(&label("missing_field"))
            .get(),
        2
    );
    assert_eq!(m.invalid_checks.get_or_create(&label("bad_json")).get(), 1);
    assert_eq!(m.dlq.get_or_create(&label("missing_field")).get(), 0);
    // Oversized bodies are refused before decoding.
    let mut big = HttpConn::connect(served.port);
    let r = big.post(
        "/v1/check",
        &format!(r#"{{"call_id":"{}"}}"#, "x".repeat(4096)),
    );
    assert_eq!(r.status, 413);
    // Without `ts` the server's clock decides the time.
    let before = chrono::Utc::now().timestamp_millis();
    let r = conn.post("/v1/check", r#"{"call_id":"now","caller":"+34911000003"}"#);
    let after = chrono::Utc::now().timestamp_millis();
    assert_eq!(r.status, 200, "{}", r.body);
    let ts = r.json()["ts_ms"].as_i64().unwrap();
    assert!(
        (before..=after).contains(&ts),
        "{before} <= {ts} <= {after}"
    );
}

/// A call whose caller is unusable (missing, garbage, national without a
/// country code) is decided, never refused: by default every such call
/// counts under the one caller `bad_caller`; `--on-bad-caller reject` and
/// `allow` decide it with reason `bad_caller`. A `+` sent unescaped in a GET
/// is the `+` it was.
#[test]
fn unusable_callers_are_decided_under_the_bad_caller_policy() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["m:sliding:60s:2".into()]).unwrap();
    let unusable = [
        r#""caller":"0955000002""#,
        r#""caller":"anonymous""#,
        r#""caller":"+34{91}""#,
        r#""caller":"""#,
        r#""caller":true"#,
        r#""from":"+34911000001""#,
    ];
    for policy in ["shared", "reject", "allow"] {
        let served = Served::start(
            config(),
            RedisConfig {
                key_prefix: format!("cg:{policy}:"),
                ..redis_config(&redis)
            },
            rules
                .with_bad_caller(match policy {
                    "shared" => callguard::engine::rules::BadCallerPolicy::Shared,
                    "reject" => callguard::engine::rules::BadCallerPolicy::Reject,
                    _ => callguard::engine::rules::BadCallerPolicy::Allow,
                })
                .unwrap(),
        );
        let mut conn = served.conn();
        let answers: Vec<serde_json::Value> = unusable
            .iter()
            .enumerate()
            .map(|(i, caller)| {
                let body = format!(
                    r#"{{"call_id":"{policy}{i}",{caller},"ts":{}}}"#,
                    T0 + i as i64
                );
                let r = conn.post("/v1/check", &body);
                assert_eq!(r.status, 200, "{policy} {body}: {}", r.body);
                r.json()
            })
            .collect();
        for (i, a) in answers.iter().enumerate() {
            assert_eq!(a["caller"], "bad_caller", "{policy} {i}: {a}");
            let (decision, reason) = match policy {
                // Limit 2 in a minute: the third unusable caller on is over it.
                "shared" if i >= 2 => ("reject", "m"),
                "shared" => ("allow", "ok"),
                "reject" => ("reject", "bad_caller"),
                _ => ("allow", "bad_caller"),
            };
            assert_eq!(
                (a["decision"].as_str(), a["reason"].as_str()),
                (Some(decision), Some(reason)),
                "{policy} {i}: {a}"
            );
            if policy == "reject" {
                assert_eq!(a["retry_after_ms"], serde_json::Value::Null, "{a}");
            }
        }
        assert_eq!(
            served.metrics.bad_callers.get(),
            unusable.len() as u64,
            "{policy}"
        );
        // Each unusable caller is a field dropped, the call kept, counted.
        let dropped = |field: &str| {
            let label = callguard::online::metrics::FieldLabel {
                field: field.into(),
            };
            served.metrics.dropped_fields.get_or_create(&label).get()
        };
        assert_eq!(dropped("caller"), unusable.len() as u64, "{policy}");
        let r = conn.post(
            "/v1/check",
            &format!(
                r#"{{"call_id":"{policy}-l","caller":"+34911000009","ts":{T0},"label":"maybe"}}"#
            ),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(dropped("label"), 1, "{policy}");
        // A real caller is decided on its own windows, whatever the policy;
        // its `+` unescaped in a GET reads as a space, and is taken back.
        let r = conn.get(&format!(
            "/v1/check?call_id={policy}-ok&caller=+34911000001&ts={T0}"
        ));
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(
            (v["caller"].as_str(), v["decision"].as_str()),
            (Some("+34911000001"), Some("allow")),
            "{v}"
        );
    }
}

/// Fields callguard does not read (a misspelled `calee`, `ts_ms`) are
/// named in the answer and counted; under `--strict-fields` the check is
/// refused with them and the known fields listed.
#[test]
fn unread_fields_are_named_in_the_answer_or_refused_when_strict() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["m:sliding:60s:5".into()]).unwrap();
    let lenient = Served::start(config(), redis_config(&redis), rules.clone());
    let strict = Served::start(
        ServeConfig {
            strict_fields: true,
            ..config()
        },
        redis_config(&redis),
        rules,
    );
    let body = format!(
        r#"{{"call_id":"t1","caller":"+34911000005","ts":{T0},"calee":"+34911999999","ts_ms":1}}"#
    );
    let r = lenient.conn().post("/v1/check", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["ignored"], serde_json::json!(["calee", "ts_ms"]), "{v}");
    assert_eq!(v["callee"], serde_json::Value::Null, "{v}");
    let r = lenient.conn().get(&format!(
        "/v1/check?call_id=t2&caller=%2B34911000005&ts={T0}&calee=1"
    ));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["ignored"], serde_json::json!(["calee"]));
    assert_eq!(lenient.metrics.ignored_fields.get(), 3);
    // A check with only known fields says nothing of them.
    let r = lenient.conn().post(
        "/v1/check",
        &format!(r#"{{"call_id":"t3","caller":"+34911000005","ts":{T0}}}"#),
    );
    assert_eq!(r.json().get("ignored"), None, "{}", r.body);

    let r = strict.conn().post("/v1/check", &body.replace("t1", "s1"));
    assert_eq!(r.status, 400, "{}", r.body);
    let v = r.json();
    assert_eq!(v["kind"], "unknown_field", "{v}");
    assert_eq!(v["ignored"], serde_json::json!(["calee", "ts_ms"]), "{v}");
    assert_eq!(
        v["known"],
        serde_json::json!([
            "call_id",
            "caller",
            "ts",
            "callee",
            "duration_ms",
            "label",
            "event",
            "talk_ms",
            "account"
        ]),
        "{v}"
    );
    // Refused: the call was not decided, so sent right it is new.
    let r = strict.conn().post(
        "/v1/check",
        &format!(r#"{{"call_id":"s1","caller":"+34911000005","ts":{T0},"callee":"+34911999999"}}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["duplicate"], false, "{}", r.body);
}

#[test]
fn a_failing_store_answers_503_under_block_and_degraded_records_otherwise() {
    let redis = RedisServer::start(&[]);
    // (A concurrent rule, so call ends go to the store too.)
    let rules = RuleSet::from_args(
        None,
        &["m:sliding:60s:5".into(), "ch:concurrent:1h:10".into()],
    )
    .unwrap();
    let blocking = Served::start(config(), redis_config(&redis), rules.clone());
    let allowing = Served::start(
        ServeConfig {
            on_store_error: StoreErrorPolicy::Allow,
            ..config()
        },
        redis_config(&redis),
        rules,
    );
    let body = |id: &str| format!(r#"{{"call_id":"{id}","caller":"+34911000004","ts":{T0}}}"#);
    assert_eq!(blocking.conn().post("/v1/check", &body("ok")).status, 200);
    let (port, dir) = redis.stop();
    let r = blocking.conn().post("/v1/check", &body("down-1"));
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["kind"], "unavailable");
    // With the connection refused nothing was sent: the answer says the
    // call was not applied (a lost connection mid-call says "unknown").
    for i in 0..5 {
        let r = blocking
            .conn()
            .post("/v1/check", &body(&format!("refused-{i}")));
        assert_eq!(r.status, 503, "{}", r.body);
        assert_eq!(r.json()["applied"], "no", "{}", r.body);
    }
    let r = allowing.conn().post("/v1/check", &body("down-2"));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["decision"], "allow");
    assert_eq!(v["degraded"], true);
    assert_eq!(v["reason"], "store_error");
    // A call's end has no degraded stand-in: 503 under either policy (the
    // rule's max_duration frees the slot).
    for served in [&blocking, &allowing] {
        let r = served.conn().post("/v1/end", &body("ok"));
        assert_eq!(r.status, 503, "{}", r.body);
        assert_eq!(r.json()["kind"], "unavailable", "{}", r.body);
    }
    // Back up: decided again.
    let _redis = RedisServer::start_in(port, dir, &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = blocking.conn().post("/v1/check", &body("up"));
        if r.status == 200 {
            assert_eq!(r.json()["degraded"], false);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "still {}", r.status);
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `--on-store-error local`, in both Redis modes: with Redis stopped every
/// check is answered (no 503) from the instance's own windows (from the
/// cached store's state of the caller, else from the start of the outage)
/// and flagged degraded; once Redis is back,
/// decisions come from Redis again and the local state is dropped.
#[test]
fn local_fallback_decides_on_its_own_windows_while_redis_is_down() {
    let rules = RuleSet::from_args(None, &["m:sliding:60s:2".into()]).unwrap();
    for cached in [false, true] {
        let redis = RedisServer::start(&[]);
        let served = Served::start_with(
            ServeConfig {
                on_store_error: StoreErrorPolicy::Local,
                ..config()
            },
            redis_config(&redis),
            rules.clone(),
            cached,
        );
        let mut conn = served.conn();
        let check = |conn: &mut HttpConn, id: &str, caller: &str, dt: i64| {
            let body = serde_json::json!({"call_id": id, "caller": caller, "ts": T0 + dt});
            conn.post("/v1/check", &body.to_string())
        };
        let v = check(&mut conn, "before", "+34911000031", 0).json();
        assert_eq!(
            (v["count_m"].as_u64(), v["degraded"].as_bool()),
            (Some(1), Some(false))
        );
        let (port, dir) = redis.stop();
        // Down: a caller's calls counted locally, from the outage's start.
        let mut seen = Vec::new();
        for i in 0..3 {
            let r = check(
                &mut conn,
                &format!("down{i}"),
                "+34911000031",
                1_000 + i * 1_000,
            );
            assert_eq!(r.status, 200, "cached {cached}, call {i}: {}", r.body);
            let v = r.json();
            assert_eq!(v["degraded"], true, "{v}");
            seen.push((
                v["count_m"].as_u64().unwrap(),
                v["decision"].as_str().unwrap().to_string(),
            ));
        }
        // The cached store's instance goes on from the caller as it holds
        // it (the call before the outage counted); the script store's
        // starts afresh.
        let expected: [(u64, String); 3] = if cached {
            [
                (2, "allow".into()),
                (3, "reject".into()),
                (4, "reject".into()),
            ]
        } else {
            [
                (1, "allow".into()),
                (2, "allow".into()),
                (3, "reject".into()),
            ]
        };
        assert_eq!(seen, expected, "cached {cached}");
        let v = check(&mut conn, "down3", "+34911000031", 4_000).json();
        assert_eq!(v["reason"], "m", "a real reason, not store_error: {v}");
        assert_eq!(served.metrics.fallback_decisions.get(), 4);
        // Back up: decided by Redis again.
        let _redis = RedisServer::start_in(port, dir, &[]);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let v = check(&mut conn, "up", "+34911000032", 5_000).json();
            if v["degraded"] == false {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "still local: {v}");
            std::thread::sleep(Duration::from_millis(200));
        }
        let after = served.metrics.fallback_decisions.get();
        let v = check(&mut conn, "up2", "+34911000033", 6_000).json();
        assert_eq!(v["degraded"], false, "{v}");
        assert_eq!(served.metrics.fallback_decisions.get(), after);
    }
}

/// The topics `serve --brokers` publishes to, on `brokers`.
fn topics(brokers: &str) -> callguard::online::serve::ServeTopics {
    callguard::online::serve::ServeTopics {
        brokers: brokers.to_string(),
        settings: vec![],
        events: "calls".into(),
        decisions: "call-decisions".into(),
        features: "call-features".into(),
    }
}

#[test]
fn decided_calls_are_produced_like_consumed_ones() {
    let redis = RedisServer::start(&[]);
    let (_kafka, brokers) =
        common::kafka::mock_cluster(&[("calls", 4), ("call-decisions", 4), ("call-features", 4)]);
    let rules = RuleSet::from_args(
        None,
        &["burst:fixed:1s:2".into(), "minute:sliding:60s:5".into()],
    )
    .unwrap();
    let served = Served::start(
        ServeConfig {
            topics: Some(topics(&brokers)),
            ..config()
        },
        redis_config(&redis),
        rules.clone(),
    );
    let (_, events) = random::case(5, 300, 4);
    let mut conn = served.conn();
    let mut answered = std::collections::HashMap::new();
    for e in &events {
        let v = conn.post("/v1/check", &event_json(e)).json();
        if v["duplicate"] == false {
            answered.insert(e.call_id.to_string(), record(v));
        }
    }
    assert!(answered.len() > 200, "{} decided", answered.len());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let timeout = Duration::from_secs(30);
    let n = answered.len();
    let decisions = rt.block_on(common::kafka::read_decisions(
        &brokers,
        "call-decisions",
        n,
        timeout,
    ));
    let features = rt.block_on(common::kafka::read_decisions(
        &brokers,
        "call-features",
        n,
        timeout,
    ));
    let produced = rt.block_on(common::kafka::read_topic(&brokers, "calls", timeout, {
        let mut seen = 0;
        move |_| {
            seen += 1;
            seen >= n
        }
    }));
    // Exactly the decided calls, once each, with the records answered.
    assert_eq!(decisions.len(), n);
    assert_eq!(common::kafka::by_call_id(&decisions), answered);
    let features = common::kafka::by_call_id(&features);
    assert_eq!(features.len(), n);
    for (id, f) in &features {
        assert_eq!(f["decision"], answered[id]["decision"], "{id}");
        assert_eq!(f["retry_after_ms"], answered[id]["retry_after_ms"], "{id}");
    }
    // The events topic replays to the same records (a caller's events are
    // in one partition, in the order they were decided).
    assert_eq!(produced.len(), n);
    let decoder = callguard::engine::event::Decoder::default();
    let replayed: Vec<CallEvent> = produced
        .iter()
        .map(|m| decoder.decode_json(&m.payload).unwrap())
        .collect();
    assert_eq!(common::replay_records(&replayed, &rules), answered);
}

/// Finding 6 of the serve issue: a check whose store call timed out after
/// it was sent is answered 503 `"applied": "unknown"` (Redis may yet apply
/// it), and with `--brokers` its record still reaches Kafka exactly once:
/// published when its retry comes back `duplicate`, never again after.
#[test]
fn a_call_applied_after_its_503_is_published_once_on_retry() {
    let redis = RedisServer::start(&[]);
    let (_kafka, brokers) =
        common::kafka::mock_cluster(&[("calls", 2), ("call-decisions", 2), ("call-features", 2)]);
    let rules = RuleSet::from_args(None, &["m:sliding:60s:5".into()]).unwrap();
    let served = Served::start_with(
        ServeConfig {
            topics: Some(topics(&brokers)),
            ..config()
        },
        RedisConfig {
            timeout: Duration::from_millis(300),
            ..redis_config(&redis)
        },
        rules,
        true,
    );
    let check = |id: &str| {
        served.conn().get(&format!(
            "/v1/check?call_id={id}&caller=%2B34911000301&ts={}",
            T0
        ))
    };
    assert_eq!(check("warm-up").status, 200);
    // Writes wait 1.5 s in Redis: the call's store call times out at 300
    // ms, and Redis applies it afterwards.
    common::raw_command(redis.port, "CLIENT PAUSE 1500 WRITE").unwrap();
    let first = check("late");
    assert_eq!(first.status, 503, "{}", first.body);
    assert_eq!(first.json()["applied"], "unknown", "{}", first.body);
    std::thread::sleep(Duration::from_millis(2_000));
    let retried = check("late");
    assert_eq!(retried.status, 200, "{}", retried.body);
    assert_eq!(
        retried.json()["duplicate"],
        true,
        "Redis applied it: {}",
        retried.body
    );
    assert_eq!(retried.json()["count_m"], 2);
    assert_eq!(check("late").json()["duplicate"], true);
    assert_eq!(check("after").json()["count_m"], 3);
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Everything the topic holds after a while (a wrongly repeated record
    // would be there too).
    let more = rt.block_on(common::kafka::read_topic(
        &brokers,
        "call-decisions",
        Duration::from_secs(8),
        |_| false,
    ));
    let ids: Vec<String> = more
        .iter()
        .map(|m| serde_json::from_slice::<serde_json::Value>(&m.payload).unwrap())
        .map(|v| v["call_id"].as_str().unwrap().to_string())
        .collect();
    let count = |id: &str| ids.iter().filter(|i| *i == id).count();
    assert_eq!(
        (count("warm-up"), count("late"), count("after")),
        (1, 1, 1),
        "each decided call once: {ids:?}"
    );
    let published = more
        .iter()
        .map(|m| serde_json::from_slice::<serde_json::Value>(&m.payload).unwrap())
        .find(|v| v["call_id"] == "late")
        .unwrap();
    assert_eq!(published, record(retried.json()));
}

#[test]
fn the_binary_takes_its_settings_from_the_environment_and_reloads_rules() {
    let redis = RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    let write = |limit: u32| {
        std::fs::write(
            &rules,
            format!(
                "[[rule]]\nname = \"m\"\nkind = \"sliding\"\nwindow = \"60s\"\nlimit = {limit}\n"
            ),
        )
        .unwrap()
    };
    write(1);
    let port = common::free_port();
    let mut child = std::process::Command::new(common::bin())
        .arg("serve")
        .env("CALLGUARD_LISTEN", format!("127.0.0.1:{port}"))
        .env("CALLGUARD_REDIS_URL", redis.url())
        .env("CALLGUARD_RULES", &rules)
        .env("CALLGUARD_REJECT_STATUS", "403")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !common::http_get(port, "/readyz").is_some_and(|r| r.contains(" 200 ")) {
        assert!(std::time::Instant::now() < deadline, "serve not ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut conn = HttpConn::connect(port);
    let check = |conn: &mut HttpConn, id: &str| {
        conn.post(
            "/v1/check",
            &format!(r#"{{"call_id":"{id}","caller":"+34911000009"}}"#),
        )
    };
    assert_eq!(check(&mut conn, "a").status, 200);
    let second = check(&mut conn, "b");
    assert_eq!(second.status, 403, "limit 1: {}", second.body);
    let first_version = second.json()["rules_version"].clone();
    // A changed rules file is picked up without a restart.
    write(100);
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut n = 0;
    loop {
        n += 1;
        let r = check(&mut conn, &format!("c{n}"));
        if r.json()["rules_version"] != first_version {
            assert_eq!(r.status, 200, "limit 100: {}", r.body);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "rules not reloaded");
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Two `serve` instances in cached mode behind one balancer, on one Redis
/// and prefix, deciding the same callers in turns: each write is checked
/// against the version its instance read, so the counts climb by one per
/// call whichever instance answers, and the refused writes show in
/// `callguard_store_conflicts_total`.
#[test]
fn two_cached_instances_share_their_callers() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["minute:sliding:60s:4".into()]).unwrap();
    let a = Served::start_with(config(), redis_config(&redis), rules.clone(), true);
    let b = Served::start_with(config(), redis_config(&redis), rules, true);
    let (mut ca, mut cb) = (a.conn(), b.conn());
    for i in 0..8i64 {
        let conn = if i % 2 == 0 { &mut ca } else { &mut cb };
        let body = serde_json::json!({
            "call_id": format!("shared-{i}"),
            "caller": "+34911000077",
            "ts": T0 + i * 1_000,
        })
        .to_string();
        let r = conn.post("/v1/check", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["count_minute"], i + 1, "call {i}: {v}");
        let expect = if i < 4 { "allow" } else { "reject" };
        assert_eq!(v["decision"], expect, "call {i}: {v}");
    }
    let conflicts = a.metrics.store_conflicts.get() + b.metrics.store_conflicts.get();
    assert!(conflicts >= 6, "{conflicts} conflicts counted");
}

/// A check left undecided because another instance changed its caller
/// under the commit (here at once: the store gives up after one round) is
/// tried again in the next batch, on the state Redis returned with the
/// refusal, and answered as one instance alone would answer it: not a 503,
/// not a duplicate, counted once.
#[test]
fn a_check_contended_at_the_store_is_decided_in_a_later_batch() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["minute:sliding:60s:3".into()]).unwrap();
    let one_round = redis_config(&redis);
    let a = Served::start_on(config(), rules.clone(), async move {
        let store = callguard::store::cached::CachedStore::connect(one_round, 1_000)
            .await
            .expect("connect to Redis")
            .with_max_rounds(1);
        AnyStore::Cached(Box::new(store))
    });
    let b = Served::start_with(config(), redis_config(&redis), rules, true);
    let check = |served: &Served, i: i64| {
        let body = serde_json::json!({
            "call_id": format!("again-{i}"),
            "caller": "+34911000078",
            "ts": T0 + i * 1_000,
        })
        .to_string();
        let r = served.conn().post("/v1/check", &body);
        assert_eq!(r.status, 200, "call {i}: {}", r.body);
        r.json()
    };
    check(&a, 0);
    check(&b, 1);
    // a holds the caller as it wrote it: its commit is refused.
    let conflicts = a.metrics.store_conflicts.get();
    for i in 2..5 {
        let v = check(&a, i);
        assert_eq!(v["count_minute"], i + 1, "call {i}: {v}");
        assert_eq!(v["duplicate"], false, "call {i}: {v}");
        let expect = if i < 3 { "allow" } else { "reject" };
        assert_eq!(v["decision"], expect, "call {i}: {v}");
    }
    assert_eq!(a.metrics.store_conflicts.get(), conflicts + 1);
}

/// The cached store's memory shows in the metrics: each check's caller is
/// one lookup, a hit when held; the gauges hold the callers and their
/// bytes.
#[test]
fn the_cache_shows_in_the_metrics() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["minute:sliding:60s:4".into()]).unwrap();
    let a = Served::start_with(config(), redis_config(&redis), rules, true);
    let mut conn = a.conn();
    for (i, caller) in ["+34911000001", "+34911000001", "+34911000002"]
        .into_iter()
        .enumerate()
    {
        let body =
            serde_json::json!({"call_id": format!("m{i}"), "caller": caller, "ts": T0 + i as i64})
                .to_string();
        let r = conn.post("/v1/check", &body);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let m = &a.metrics;
    let lookups = |kind: &str| {
        m.cache_lookups
            .get_or_create(&KindLabel { kind: kind.into() })
            .get()
    };
    assert_eq!((lookups("hit"), lookups("miss")), (1, 2));
    assert_eq!(m.cache_callers.get(), 2);
    assert!(m.cache_bytes.get() > 0);
    assert_eq!((m.cache_evictions.get(), m.cache_rereads.get()), (0, 0));
}

/// A flooding caller checked on two cached instances at once (a load
/// balancer that does not route by caller) is decided on every check:
/// none answers 503, and no more calls are allowed than the limit. The
/// caller holds thousands of records (earlier calls within the
/// idempotency horizon), which every refused commit used to read back
/// whole while the other instance wrote again, so after its rounds some
/// checks were answered 503 and, behind a switch that fails open, let
/// through.
#[test]
fn a_flooding_caller_on_two_cached_instances_is_decided_on_every_check() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["minute:sliding:60s:10".into()]).unwrap();
    let hot = "+34911000066";
    // Earlier calls: out of the window, still within the horizon.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut store =
            AnyStore::connect_redis(redis_config(&redis), Some(CacheLimit::callers(10)))
                .await
                .unwrap();
        let earlier: Vec<CallEvent> = (0..6_000)
            .map(|i| CallEvent::new(format!("old-{i}"), hot, T0 - 3_600_000 + i))
            .collect();
        for batch in earlier.chunks(1_000) {
            store.apply_batch(&rules, batch).await.unwrap();
        }
    });
    let a = Served::start_with(config(), redis_config(&redis), rules.clone(), true);
    let b = Served::start_with(config(), redis_config(&redis), rules, true);
    // All at one time, so the count at each call is every call decided
    // before it, whichever instance decided it first.
    let start = Arc::new(Barrier::new(4));
    let clients: Vec<_> = [a.port, a.port, b.port, b.port]
        .into_iter()
        .enumerate()
        .map(|(c, port)| {
            let start = start.clone();
            std::thread::spawn(move || {
                let mut conn = HttpConn::connect(port);
                start.wait();
                let mut answers = Vec::new();
                for i in 0..300 {
                    let body = serde_json::json!({
                        "call_id": format!("flood-{c}-{i}"),
                        "caller": hot,
                        "ts": T0,
                    })
                    .to_string();
                    let r = conn.post("/v1/check", &body);
                    answers.push((r.status, r.body));
                }
                answers
            })
        })
        .collect();
    let answers: Vec<(u16, String)> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    let failed: Vec<&(u16, String)> = answers.iter().filter(|(s, _)| *s != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {} checks not decided, e.g. {:?}",
        failed.len(),
        answers.len(),
        failed.first()
    );
    let allowed = answers
        .iter()
        .filter(|(_, body)| {
            serde_json::from_str::<serde_json::Value>(body).unwrap()["decision"] == "allow"
        })
        .count();
    assert_eq!(
        allowed, 10,
        "allowed calls of a caller limited to 10 a minute"
    );
    let conflicts = a.metrics.store_conflicts.get() + b.metrics.store_conflicts.get();
    assert!(
        conflicts > 0,
        "the instances never met: the test proves nothing"
    );
}

/// Finding 4 of the serve issue: one check with a time ahead of the clock
/// (within `--max-future-skew-s`) became its caller's latest, and every
/// later call was then late, counted 1 and allowed. Such a time is now
/// decided at the server clock, so the caller's later calls count.
#[test]
fn a_time_ahead_of_the_clock_cannot_switch_a_callers_limit_off() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["minute:sliding:60s:3".into()]).unwrap();
    assert!(rules.grace_ms < 290_000);
    let served = Served::start(ServeConfig::default(), redis_config(&redis), rules);
    let mut conn = served.conn();
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    let before = now();
    let ahead = before + 290_000;
    let r = conn.get(&format!(
        "/v1/check?call_id=f1&caller=%2B34911000009&ts={ahead}"
    ));
    assert_eq!(r.status, 200, "{}", r.body);
    let ts = r.json()["ts_ms"].as_i64().unwrap();
    assert!(
        (before..=now()).contains(&ts),
        "decided at {ts}, not at the clock"
    );
    let decisions: Vec<(String, i64)> = (2..=6)
        .map(|i| {
            let r = conn.get(&format!("/v1/check?call_id=f{i}&caller=%2B34911000009"));
            assert_eq!(r.status, 200, "{}", r.body);
            let b = r.json();
            (
                b["decision"].as_str().unwrap().to_string(),
                b["count_minute"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        decisions,
        [
            ("allow".to_string(), 2),
            ("allow".to_string(), 3),
            ("reject".to_string(), 4),
            ("reject".to_string(), 5),
            ("reject".to_string(), 6)
        ]
    );
    assert_eq!(served.metrics.clamped.get(), 1);
    // A time ahead by no more than the grace is kept as sent.
    let near = now() + 1_000;
    let r = conn.get(&format!(
        "/v1/check?call_id=n1&caller=%2B34911000010&ts={near}"
    ));
    assert_eq!(r.json()["ts_ms"].as_i64(), Some(near));
}

/// Whether the server closed `s` within `within` (a read returns end of
/// file, or the connection is reset), reading and dropping what it sends.
fn closed_within(s: &mut std::net::TcpStream, within: Duration) -> bool {
    use std::io::Read;
    let until = std::time::Instant::now() + within;
    let mut buf = [0u8; 4096];
    while std::time::Instant::now() < until {
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => {}
        }
    }
    false
}

fn shed(served: &Served, kind: &str) -> u64 {
    served
        .metrics
        .connections_shed
        .get_or_create(&callguard::online::metrics::KindLabel { kind: kind.into() })
        .get()
}

/// Finding 1 of the serve issue (and part of 8): connections are capped,
/// slow and idle ones closed, the admin listener answers under any load,
/// `HEAD` runs no check, HTTP/2 is not spoken, a 413 is JSON. Bounded: at
/// most 45 connections, every wait a few seconds.
#[test]
fn hostile_connections_are_capped_and_timed_out() {
    use std::io::Write;
    use std::net::TcpStream;
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["m:sliding:60s:5".into()]).unwrap();
    let served = Served::start(
        ServeConfig {
            limits: serve::Limits {
                max_connections: 20,
                header_timeout: Duration::from_millis(500),
            },
            body_timeout: Duration::from_millis(500),
            max_body_bytes: 1024,
            ..config()
        },
        redis_config(&redis),
        rules,
    );
    let connect = || TcpStream::connect(("127.0.0.1", served.port)).unwrap();
    // Twenty silent connections take the cap.
    let mut silent: Vec<TcpStream> = (0..20).map(|_| connect()).collect();
    std::thread::sleep(Duration::from_millis(100));
    // Beyond it, each new connection takes the place of the oldest silent
    // one, and its check is answered (each kept open, so the next one
    // finds the cap full again).
    let mut kept = Vec::new();
    for i in 0..10 {
        let mut conn = served.conn();
        let r = conn.get(&format!(
            "/v1/check?call_id=in{i}&caller=%2B34911000013&ts=1764547200000"
        ));
        assert_eq!(r.status, 200, "{}", r.body);
        kept.push(conn);
    }
    assert!(
        shed(&served, "evicted") >= 10,
        "{}",
        shed(&served, "evicted")
    );
    for s in &mut silent[..10] {
        assert!(
            closed_within(s, Duration::from_millis(400)),
            "the oldest were not evicted"
        );
    }
    // The admin listener answers meanwhile.
    let health = common::http_get(served.admin_port, "/healthz").expect("healthz");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    // The other silent ones are closed after the header deadline.
    for s in &mut silent[10..] {
        assert!(
            closed_within(s, Duration::from_secs(3)),
            "a silent connection stayed open"
        );
    }
    assert!(
        shed(&served, "timeout") >= 10,
        "{}",
        shed(&served, "timeout")
    );
    // Then checks get through again.
    let mut conn = served.conn();
    let r = conn.get("/v1/check?call_id=ok1&caller=%2B34911000011&ts=1764547200000");
    assert_eq!(r.status, 200, "{}", r.body);
    // A header sent too slowly, and a keep-alive connection left idle.
    let mut slow = connect();
    slow.write_all(b"POST /v1/check HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    assert!(closed_within(&mut slow, Duration::from_secs(3)));
    let mut idle = served.conn();
    let r = idle.get("/v1/check?call_id=ok2&caller=%2B34911000011&ts=1764547200001");
    assert_eq!(r.status, 200);
    let mut idle = idle.into_stream();
    assert!(closed_within(&mut idle, Duration::from_secs(3)));
    // A body sent too slowly: 408, and the connection closed.
    let mut drip = connect();
    drip.write_all(b"POST /v1/check HTTP/1.1\r\nHost: x\r\nContent-Length: 60\r\n\r\n{")
        .unwrap();
    let mut answer = String::new();
    {
        use std::io::Read;
        drip.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let _ = drip.read_to_string(&mut answer);
    }
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    // HEAD runs no check (a new connection: the one above has idled out).
    let mut conn = served.conn();
    let r = conn.request("HEAD", "/v1/check?call_id=h1&caller=%2B34911000012", b"");
    assert_eq!(r.status, 405);
    let r = conn.get("/v1/check?call_id=h1&caller=%2B34911000012&ts=1764547200000");
    assert_eq!(r.json()["duplicate"], false, "HEAD decided the call");
    // Over the body limit: 413 with a JSON body.
    let r = conn.post(
        "/v1/check",
        &format!(r#"{{"call_id":"{}"}}"#, "x".repeat(2048)),
    );
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["kind"], "body_too_large");
    // HTTP/2 with prior knowledge is not spoken.
    let mut h2 = connect();
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    let mut reply = Vec::new();
    {
        use std::io::Read;
        h2.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let _ = h2.read_to_end(&mut reply);
    }
    assert!(
        reply.is_empty() || reply.starts_with(b"HTTP/1.1"),
        "answered {:?}",
        &reply[..reply.len().min(16)]
    );
}

/// Held connections (silent ones and slowloris headers) cannot lock the
/// checks out, whatever their number: at the cap a new connection takes
/// the place of the oldest one with no request in flight, so every check
/// and `/healthz` on the check API's own port is answered, long before the
/// header deadline would have freed a place. Only when every connection
/// has a request in flight is a new one refused.
#[test]
fn held_connections_do_not_lock_checks_out() {
    use std::io::Write;
    use std::net::TcpStream;
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["m:sliding:60s:5".into()]).unwrap();
    let served = Served::start(
        ServeConfig {
            limits: serve::Limits {
                max_connections: 64,
                // Far longer than the test: only eviction frees places.
                header_timeout: Duration::from_secs(120),
            },
            ..config()
        },
        redis_config(&redis),
        rules,
    );
    let connect = || TcpStream::connect(("127.0.0.1", served.port)).unwrap();
    let mut held: Vec<TcpStream> = (0..60).map(|_| connect()).collect();
    for _ in 0..30 {
        let mut s = connect();
        s.write_all(b"POST /v1/check HTTP/1.1\r\nHost: x\r\n")
            .unwrap();
        held.push(s);
    }
    let mut kept = Vec::new();
    for i in 0..20 {
        let mut conn = served.conn();
        let r = conn.get(&format!(
            "/v1/check?call_id=held{i}&caller=%2B34911000014&ts=1764547200000"
        ));
        assert_eq!(r.status, 200, "check {i}: {}", r.body);
        kept.push(conn);
        let health = common::http_get(served.port, "/healthz").expect("healthz on the API port");
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    }
    // 90 held on a cap of 64, then 20 checks kept open: each connection
    // past the cap took an idle one's place; none was refused.
    assert!(
        shed(&served, "evicted") >= 26 + 20,
        "{}",
        shed(&served, "evicted")
    );
    assert_eq!(shed(&served, "cap"), 0);
    drop((held, kept));
}

/// Finding 2 of the serve issue: with Redis stalled, every check is
/// answered 503 within the answer deadline instead of waiting out the
/// store's timeout behind the stuck batch. A call still queued at its
/// deadline is never applied (`"applied": "no"`: retried later, it is
/// decided afresh); the one at the store is flagged `"unknown"` (it was
/// applied once Redis woke: its retry is a duplicate).
#[test]
fn a_stalled_store_is_answered_within_the_deadline() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["m:sliding:60s:5".into()]).unwrap();
    let served = Served::start(
        ServeConfig {
            answer_deadline: Some(Duration::from_millis(300)),
            ..config()
        },
        RedisConfig {
            timeout: Duration::from_secs(5),
            ..redis_config(&redis)
        },
        rules,
    );
    let port = served.port;
    let check = move |i: usize| {
        let mut c = HttpConn::connect(port);
        c.get(&format!(
            "/v1/check?call_id=s{i}&caller=%2B3491100010{i}&ts={}",
            T0 + i as i64
        ))
    };
    assert_eq!(check(9).status, 200, "warm-up");
    common::raw_command(redis.port, "CLIENT PAUSE 2000 ALL").unwrap();
    let started = std::time::Instant::now();
    let answers: Vec<(usize, u16, serde_json::Value, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..5)
            .map(|i| {
                s.spawn(move || {
                    // Staggered, so the first is at the store before the others queue.
                    std::thread::sleep(Duration::from_millis(20 * i as u64));
                    let t = std::time::Instant::now();
                    let r = check(i);
                    (i, r.status, r.json(), t.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        started.elapsed() < Duration::from_millis(1_800),
        "answers waited for Redis"
    );
    for (i, status, body, took) in &answers {
        assert_eq!(*status, 503, "check {i}: {body}");
        assert!(
            *took < Duration::from_millis(1_000),
            "check {i} took {took:?}"
        );
    }
    let applied = |v: &str| answers.iter().filter(|a| a.2["applied"] == v).count();
    assert_eq!(applied("unknown"), 1, "{answers:?}");
    assert_eq!(applied("no"), 4, "{answers:?}");
    // Redis wakes; the batch at the store completes. Retried, the calls
    // given up are decided afresh and the one at the store is a duplicate.
    std::thread::sleep(Duration::from_millis(2_500));
    for (i, _, body, _) in &answers {
        let r = check(*i);
        assert_eq!(r.status, 200, "{}", r.body);
        let dup = r.json()["duplicate"].as_bool().unwrap();
        assert_eq!(dup, body["applied"] == "unknown", "check {i}: {}", r.body);
        assert_eq!(r.json()["count_m"], 1);
    }
}

/// Finding 3 of the serve issue: `/readyz` follows the store while no
/// check comes (a probe a second), both ways, and the first check after
/// Redis is back succeeds (the probe reconnected the idle connection).
#[test]
fn readiness_follows_the_store_while_idle() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["m:sliding:60s:5".into()]).unwrap();
    let served = Served::start(
        config(),
        RedisConfig {
            timeout: Duration::from_millis(500),
            ..redis_config(&redis)
        },
        rules,
    );
    let admin = served.admin_port;
    let ready =
        move || common::http_get(admin, "/readyz").is_some_and(|r| r.starts_with("HTTP/1.1 200"));
    // Within `within`, readiness becomes `want` (polled every 100 ms).
    let becomes = |want: bool, within: Duration| {
        let until = std::time::Instant::now() + within;
        while std::time::Instant::now() < until {
            if ready() == want {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    };
    assert!(becomes(true, Duration::from_secs(3)));
    let (port, dir) = redis.stop();
    assert!(
        becomes(false, Duration::from_secs(5)),
        "still ready with Redis gone"
    );
    let redis = RedisServer::start_in(port, dir, &[]);
    assert!(
        becomes(true, Duration::from_secs(8)),
        "not ready with Redis back"
    );
    let mut conn = served.conn();
    let r = conn.get("/v1/check?call_id=r1&caller=%2B34911000021&ts=1764547200000");
    assert_eq!(r.status, 200, "{}", r.body);
    // Finding 7: Redis came back empty (no persistence): the loss of every
    // window and record is counted and said in the readiness detail.
    assert_eq!(served.metrics.store_data_lost.get(), 1);
    let detail = common::http_get(admin, "/readyz").unwrap_or_default();
    assert!(detail.contains("lost every key"), "{detail}");
    drop(redis);
}

/// Part of finding 3: `serve` started while Redis is down keeps running,
/// answers not-ready (and 503 to checks), and becomes ready, deciding
/// checks, once Redis is up; it does not exit.
#[test]
fn serve_started_without_redis_waits_for_it() {
    let (port, rport) = (common::free_port(), common::free_port());
    let mut child = std::process::Command::new(common::bin())
        .args([
            "serve",
            "--rule",
            "m:sliding:60s:5",
            "--redis-timeout-ms",
            "300",
        ])
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--redis-url")
        .arg(format!("redis://127.0.0.1:{rport}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let status = |path: &str| {
        common::http_get(port, path)
            .and_then(|r| r.split_whitespace().nth(1).map(str::to_string))
            .unwrap_or_default()
    };
    let wait_for = |path: &str, want: &str, within: Duration| {
        let until = std::time::Instant::now() + within;
        while std::time::Instant::now() < until {
            if status(path) == want {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    };
    assert!(
        wait_for("/readyz", "503", Duration::from_secs(10)),
        "no not-ready answer"
    );
    assert!(
        child.try_wait().unwrap().is_none(),
        "serve exited without Redis"
    );
    let check = "/v1/check?call_id=w1&caller=%2B34911000031";
    assert_eq!(status(check), "503");
    let redis = RedisServer::start_in(rport, tempfile::tempdir().unwrap(), &[]);
    assert!(
        wait_for("/readyz", "200", Duration::from_secs(10)),
        "not ready with Redis up"
    );
    assert_eq!(status("/v1/check?call_id=w2&caller=%2B34911000031"), "200");
    let _ = child.kill();
    let _ = child.wait();
    drop(redis);
}

/// `serve` SIGKILLed with calls open, on both Redis modes: the instance
/// that takes over counts them (the slots live in Redis), frees one at its
/// end and the other at its `max_duration`, with nothing of the killed
/// process's.
#[test]
fn slots_held_by_a_killed_instance_come_back_at_their_ends_or_max_duration() {
    use crate::aggregate::{spawn_serve, wait_ready};
    for mode in ["cached", "script"] {
        let redis = RedisServer::start(&[]);
        let dir = tempfile::tempdir().unwrap();
        let rules = common::rules_file(dir.path(), "[[rule]]\nname = \"channels\"\nkind = \"concurrent\"\nlimit = 2\nmax_duration = \"30s\"\n");
        let extra = ["--redis-mode", mode];
        let check = |port: u16, id: &str, dt: i64| -> (String, i64) {
            let body =
                serde_json::json!({ "call_id": id, "caller": "+34911000077", "ts": T0 + dt });
            let r = HttpConn::connect(port).post("/v1/check", &body.to_string());
            assert_eq!(r.status, 200, "{mode}: {}", r.body);
            let v = r.json();
            (
                v["decision"].as_str().unwrap().to_string(),
                v["count_channels"].as_i64().unwrap(),
            )
        };
        let first = common::free_port();
        let mut killed = spawn_serve(first, &redis.url(), &rules, &extra);
        wait_ready(first, "serve");
        assert_eq!(check(first, "k1", 0), ("allow".into(), 1), "{mode}");
        assert_eq!(check(first, "k2", 1_000), ("allow".into(), 2), "{mode}");
        // Answered, so applied: then killed with both calls open.
        let _ = killed.kill();
        let _ = killed.wait();
        let next = common::free_port();
        let mut taken_over = spawn_serve(next, &redis.url(), &rules, &extra);
        wait_ready(next, "serve");
        assert_eq!(
            check(next, "k3", 2_000),
            ("reject".into(), 3),
            "{mode}: the killed instance's two calls hold their slots"
        );
        // k1 ends: its slot comes back.
        let end =
            serde_json::json!({ "call_id": "k1", "caller": "+34911000077", "ts": T0 + 3_000 });
        let r = HttpConn::connect(next).post("/v1/end", &end.to_string());
        assert_eq!(r.status, 200, "{mode}: {}", r.body);
        assert_eq!(check(next, "k4", 4_000), ("allow".into(), 2), "{mode}");
        assert_eq!(check(next, "k5", 5_000), ("reject".into(), 3), "{mode}");
        // k2 never ends: free from its start + 30 s (k4 still open).
        assert_eq!(check(next, "k6", 30_999), ("reject".into(), 3), "{mode}");
        assert_eq!(check(next, "k7", 31_000), ("allow".into(), 2), "{mode}");
        let _ = taken_over.kill();
        let _ = taken_over.wait();
    }
}

/// Concurrent calls across two cached `serve` instances sharing Redis: a
/// caller's calls checked on either count the calls open on both; an end
/// (`POST /v1/end`, `GET /v1/end`, or a check saying `"event": "end"`) on
/// either instance frees its slot; a second end changes nothing; a call
/// whose end never comes holds its slot until `max_duration`; the window
/// script's instance holds the same limit.
#[test]
fn two_instances_hold_a_concurrent_limit_and_free_slots_at_call_ends() {
    let redis = RedisServer::start(&[]);
    let rules = RuleSet::from_args(None, &["channels:concurrent:30s:2".into()]).unwrap();
    let a = Served::start_with(config(), redis_config(&redis), rules.clone(), true);
    let b = Served::start_with(config(), redis_config(&redis), rules.clone(), true);
    let (mut ca, mut cb) = (a.conn(), b.conn());
    let check = |conn: &mut HttpConn, id: &str, dt: i64| {
        let body = serde_json::json!({ "call_id": id, "caller": "+34911000088", "ts": T0 + dt });
        let r = conn.post("/v1/check", &body.to_string());
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        (
            v["decision"].as_str().unwrap().to_string(),
            v["count_channels"].as_i64().unwrap(),
        )
    };
    assert_eq!(check(&mut ca, "x1", 0), ("allow".into(), 1));
    assert_eq!(check(&mut cb, "x2", 1_000), ("allow".into(), 2));
    assert_eq!(
        check(&mut ca, "x3", 2_000),
        ("reject".into(), 3),
        "two open on two instances"
    );
    // x1 ends, told to the other instance.
    let end = serde_json::json!({ "call_id": "x1", "caller": "+34911000088", "ts": T0 + 3_000 });
    let r = cb.post("/v1/end", &end.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(
        (v["ended"].as_bool(), v["call_id"].as_str()),
        (Some(true), Some("x1")),
        "{v}"
    );
    assert!(v.get("decision").is_none(), "an end is not decided: {v}");
    assert_eq!(
        check(&mut ca, "x4", 4_000),
        ("allow".into(), 2),
        "x1's slot is free"
    );
    assert_eq!(check(&mut cb, "x5", 5_000), ("reject".into(), 3));
    // A second end of x1 (at an earlier time) changes nothing; x2 ends by GET.
    let again = serde_json::json!({ "call_id": "x1", "caller": "+34911000088", "ts": T0 + 500 });
    assert_eq!(ca.post("/v1/end", &again.to_string()).status, 200);
    let r = ca.get(&format!(
        "/v1/end?call_id=x2&caller=%2B34911000088&ts={}",
        T0 + 6_000
    ));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        check(&mut cb, "x6", 7_000),
        ("allow".into(), 2),
        "x4 and x6 open"
    );
    // An end sent to /v1/check with "event": "end" is an end too.
    let end4 = serde_json::json!({ "call_id": "x4", "caller": "+34911000088", "ts": T0 + 8_000, "event": "end" });
    let r = cb.post("/v1/check", &end4.to_string());
    assert_eq!(r.json()["ended"], true, "{}", r.body);
    assert_eq!(
        check(&mut ca, "x7", 9_000),
        ("allow".into(), 2),
        "x6 and x7 open"
    );
    // x6 and x7 never end: they hold their slots for max_duration (30 s).
    assert_eq!(check(&mut ca, "x8", 36_999), ("reject".into(), 3));
    assert_eq!(
        check(&mut cb, "x9", 37_000),
        ("allow".into(), 2),
        "x6 timed out"
    );
    // The window script holds the same limit.
    let script = RedisConfig {
        key_prefix: "script:".into(),
        ..redis_config(&redis)
    };
    let s = Served::start_with(config(), script, rules, false);
    let mut cs = s.conn();
    assert_eq!(check(&mut cs, "y1", 0), ("allow".into(), 1));
    assert_eq!(check(&mut cs, "y2", 1_000), ("allow".into(), 2));
    assert_eq!(check(&mut cs, "y3", 2_000), ("reject".into(), 3));
    let end = serde_json::json!({ "call_id": "y1", "caller": "+34911000088", "ts": T0 + 3_000 });
    assert_eq!(cs.post("/v1/end", &end.to_string()).json()["ended"], true);
    assert_eq!(check(&mut cs, "y4", 4_000), ("allow".into(), 2));
}

/// A talk cap through the switch's API, on both Redis modes: an allowed
/// call's end (`POST /v1/end` with its `talk_ms`, told to the other
/// instance) adds its talk; the next check sees it and is rejected with
/// the time until the talk leaves the window; a rejected call's end adds
/// nothing.
#[test]
fn a_talk_cap_counts_the_talk_of_ended_calls_across_instances() {
    for cached in [true, false] {
        let redis = RedisServer::start(&[]);
        let rules = RuleSet::from_toml(
            "[[rule]]\nname = \"talk\"\nkind = \"sliding\"\nwindow = \"1h\"\nsum = \"talk\"\nlimit = \"2m\"\n",
        )
        .unwrap();
        let a = Served::start_with(config(), redis_config(&redis), rules.clone(), cached);
        let b = Served::start_with(config(), redis_config(&redis), rules.clone(), cached);
        let (mut ca, mut cb) = (a.conn(), b.conn());
        let check = |conn: &mut HttpConn, id: &str, dt: i64| {
            let body =
                serde_json::json!({ "call_id": id, "caller": "+34911000077", "ts": T0 + dt });
            let r = conn.post("/v1/check", &body.to_string());
            let v = r.json();
            (
                v["decision"].as_str().unwrap().to_string(),
                v["count_talk"].as_i64().unwrap_or(0),
                v["retry_after_ms"].as_i64(),
            )
        };
        let end = |conn: &mut HttpConn, id: &str, dt: i64, talk_ms: i64| {
            let body = serde_json::json!({ "call_id": id, "caller": "+34911000077", "ts": T0 + dt, "talk_ms": talk_ms });
            let r = conn.post("/v1/end", &body.to_string());
            assert_eq!(r.status, 200, "{}", r.body);
        };
        assert_eq!(check(&mut ca, "t1", 0).0, "allow");
        end(&mut cb, "t1", 100_000, 90_500);
        assert_eq!(check(&mut cb, "t2", 110_000), ("allow".into(), 91, None));
        end(&mut ca, "t2", 150_000, 30_000);
        // 121 s of talk in the hour: over; t1's 91 s leave at 100 s + 1 h.
        let (decision, count, retry) = check(&mut ca, "t3", 160_000);
        assert_eq!(
            (decision.as_str(), count),
            ("reject", 121),
            "cached {cached}"
        );
        assert_eq!(retry, Some(3_600_000 + 100_000 - 160_000));
        // t3 was rejected: its end adds nothing.
        end(&mut cb, "t3", 170_000, 600_000);
        assert_eq!(check(&mut cb, "t4", 180_000).1, 121, "cached {cached}");
    }
}

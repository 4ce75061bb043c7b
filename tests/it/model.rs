//! A rule set's model in the call path (`[model]`): scores equal to
//! onnxruntime's on the `features` rows, the same in every command and
//! store, the decision order of `crate::engine::model`, reloads, and bad
//! models refused with a clear error.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::{self, HttpConn, RedisServer};
use callguard::engine::record::Decision;
use callguard::engine::rules::RuleSet;
use callguard::offline::read::{read_call_log, ReadOptions};
use callguard::store::memory::MemoryStore;
use polars::prelude::*;

fn run_ok(args: &[&std::ffi::OsStr]) -> String {
    let o = std::process::Command::new(common::bin())
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "callguard {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn os(s: &str) -> &std::ffi::OsStr {
    std::ffi::OsStr::new(s)
}

fn parquet(path: &Path) -> DataFrame {
    ParquetReader::new(std::fs::File::open(path).unwrap())
        .finish()
        .unwrap()
}

/// `python3 notebooks/model.py ARGS`, which needs the notebook's packages.
fn python(args: &[&std::ffi::OsStr]) -> std::process::Output {
    let o = std::process::Command::new("python3")
        .arg("notebooks/model.py")
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.code().is_some(),
        "python3 notebooks/model.py was killed"
    );
    o
}

/// The scores of `features` (a `callguard features` table made with the
/// model) against onnxruntime's for the same rows.
fn check_with_onnxruntime(features: &Path, model: &Path) -> String {
    let o = python(&[
        os("check"),
        features.as_os_str(),
        model.as_os_str(),
        os("--inputs"),
        os(common::MODEL_INPUTS),
    ]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "scores differ from onnxruntime's (the notebook's packages: pip install -r notebooks/requirements.txt; scripts/test-all.sh does): {out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// Every call of data/calls.csv scored by `features`, `replay` (in memory
/// and through Redis) equal to onnxruntime's score of the same feature row,
/// nulls fed as NaN; and the decisions of the two stores equal.
#[test]
fn scores_equal_onnxruntime_in_features_and_replay_in_every_store() {
    let redis = RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let rules = common::model_rules(dir.path(), false, 0.5);
    let features = dir.path().join("features.parquet");
    run_ok(&[
        os("features"),
        os("-i"),
        os("data/calls.csv"),
        os("--rules"),
        rules.as_os_str(),
        os("-o"),
        features.as_os_str(),
    ]);
    let out = check_with_onnxruntime(&features, Path::new("data/model.onnx"));
    assert!(out.contains("rows 20000 "), "{out}");
    // Some rows reached the model with a null (a caller's first call).
    let f = parquet(&features);
    assert!(f.column("since_prev_ms").unwrap().null_count() > 100);
    let scores = f.column("score").unwrap().f32().unwrap().clone();
    assert_eq!(scores.null_count(), 0);
    // The model rejected calls the rules allowed.
    let by_model = f
        .column("reason")
        .unwrap()
        .str()
        .unwrap()
        .iter()
        .filter(|r| *r == Some("model"))
        .count();
    assert!(by_model > 100, "{by_model} model rejects");
    let memory = dir.path().join("memory.parquet");
    run_ok(&[
        os("replay"),
        os("-i"),
        os("data/calls.csv"),
        os("--rules"),
        rules.as_os_str(),
        os("-o"),
        memory.as_os_str(),
    ]);
    // Through Redis, in both store modes, each on a prefix of its own.
    let m = parquet(&memory);
    for mode in ["cached", "script"] {
        let in_redis = dir.path().join(format!("redis-{mode}.parquet"));
        run_ok(&[
            os("replay"),
            os("-i"),
            os("data/calls.csv"),
            os("--rules"),
            rules.as_os_str(),
            os("--store"),
            os("redis"),
            os("--redis-url"),
            os(&redis.url()),
            os("--redis-mode"),
            os(mode),
            os("--key-prefix"),
            os(&format!("{mode}:")),
            os("-o"),
            in_redis.as_os_str(),
        ]);
        assert!(
            m.equals_missing(&parquet(&in_redis)),
            "replay in Redis ({mode}) differs from memory"
        );
    }
    // The replay's scores and decisions are the features table's, call by call.
    let by_id = |d: &DataFrame| -> std::collections::HashMap<String, (String, f32)> {
        let ids = d.column("call_id").unwrap().str().unwrap().clone();
        let decision = d.column("decision").unwrap().str().unwrap().clone();
        let score = d.column("score").unwrap().f32().unwrap().clone();
        (0..d.height())
            .map(|i| {
                (
                    ids.get(i).unwrap().to_string(),
                    (decision.get(i).unwrap().to_string(), score.get(i).unwrap()),
                )
            })
            .collect()
    };
    assert_eq!(by_id(&m), by_id(&f));
}

/// The rules alone, the model in shadow and the model enforcing, on the same
/// log: a shadow model changes no decision, only flags; an enforcing one
/// rejects exactly the calls at or above its threshold that the rules
/// allowed (a listed caller aside), with the model's Retry-After.
#[tokio::test]
async fn shadow_never_rejects_and_enforcing_rejects_exactly_at_the_threshold() {
    let dir = tempfile::tempdir().unwrap();
    let log = read_call_log(Path::new("data/calls.csv"), &ReadOptions::default()).unwrap();
    let log = &log;
    let replay = |rules: RuleSet| async move {
        callguard::offline::replay::run(log, &rules, &mut MemoryStore::new())
            .await
            .unwrap()
    };
    let plain = RuleSet::from_file(Path::new("data/rules.toml")).unwrap();
    let shadow_dir = dir.path().join("shadow");
    let enforce_dir = dir.path().join("enforce");
    std::fs::create_dir_all(&shadow_dir).unwrap();
    std::fs::create_dir_all(&enforce_dir).unwrap();
    let shadow = RuleSet::from_file(&common::model_rules(&shadow_dir, true, 0.5)).unwrap();
    let enforcing = RuleSet::from_file(&common::model_rules(&enforce_dir, false, 0.5)).unwrap();
    assert_ne!(shadow.version(), enforcing.version());
    let (a, s, e) = (
        replay(plain).await,
        replay(shadow.clone()).await,
        replay(enforcing.clone()).await,
    );
    let (mut flagged, mut rejected) = (0, 0);
    for ((a, s), e) in a.iter().zip(&s).zip(&e) {
        let (ar, sr, er) = (&a.record, &s.record, &e.record);
        let score = s.score.expect("every attempt scored");
        assert_eq!(e.score, Some(score));
        assert_eq!(a.score, None);
        assert_eq!(sr.decision, ar.decision, "shadow changed {}", ar.call_id);
        assert_eq!(sr.counts, ar.counts);
        let allowed = ar.decision == Decision::Allow && ar.reason != "allowlist";
        if allowed && score >= 0.5 {
            assert_eq!(er.decision, Decision::Reject, "{}", ar.call_id);
            assert_eq!(er.reason, "model");
            assert_eq!(er.retry_after_ms, Some(60_000));
            rejected += 1;
            if !ar.shadow {
                assert!(sr.shadow && sr.reason == "model", "{}", ar.call_id);
                flagged += 1;
            }
        } else {
            assert_eq!(er.decision, ar.decision, "{}", ar.call_id);
            assert_eq!(er.reason, ar.reason);
            assert_eq!(er.retry_after_ms, ar.retry_after_ms);
            assert_eq!(sr.reason, ar.reason);
        }
    }
    assert!(rejected > 100 && flagged > 100, "{rejected} {flagged}");
}

/// Starts `serve` on `rules` and Redis; waits until it is ready.
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

fn serve(rules: &Path, redis: &RedisServer) -> Serve {
    serve_with(rules, redis, &[])
}

fn serve_with(rules: &Path, redis: &RedisServer, extra: &[&str]) -> Serve {
    let port = common::free_port();
    let child = std::process::Command::new(common::bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--redis-url", &redis.url()])
        .args(extra)
        .arg("--rules")
        .arg(rules)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start serve");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !common::http_get(port, "/readyz").is_some_and(|r| r.contains(" 200 ")) {
        assert!(Instant::now() < deadline, "serve not ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    Serve { child, port }
}

fn check(conn: &mut HttpConn, e: &callguard::engine::event::CallEvent) -> serde_json::Value {
    let body = serde_json::json!({
        "call_id": e.call_id.as_str(),
        "caller": e.caller.as_str(),
        "callee": e.callee.as_deref(),
        "ts": e.ts_ms,
    });
    let mut v = conn.post("/v1/check", &body.to_string()).json();
    let fields = v.as_object_mut().unwrap();
    fields.remove("duplicate");
    fields.remove("ratelimit");
    v
}

/// A second model (fewer trees, so other scores) trained by the notebook's
/// script on the features of data/calls.csv, at `to`.
fn train_other_model(dir: &Path, to: &Path) {
    let features = dir.join("plain-features.parquet");
    run_ok(&[
        os("features"),
        os("-i"),
        os("data/calls.csv"),
        os("--rules"),
        os("data/rules.toml"),
        os("-o"),
        features.as_os_str(),
    ]);
    let o = python(&[
        os("train"),
        features.as_os_str(),
        to.as_os_str(),
        os("--inputs"),
        os(common::MODEL_INPUTS),
        os("--trees"),
        os("7"),
        os("--depth"),
        os("2"),
    ]);
    assert!(
        o.status.success(),
        "training failed (the notebook's packages): {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `serve` answers each check with the score and decision replay gives the
/// same calls; a model swapped under it takes effect once, with a new
/// version; a corrupt model file keeps the one in force and is reported.
#[test]
fn serve_scores_as_replay_and_reloads_a_swapped_model_once() {
    let redis = RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model.onnx");
    std::fs::copy("data/model.onnx", &model).unwrap();
    let rules = common::model_rules_of(dir.path(), &model, false, 0.5);
    let set = RuleSet::from_file(&rules).unwrap();
    let log = read_call_log(Path::new("data/calls.csv"), &ReadOptions::default()).unwrap();
    let events: Vec<_> = log.events.iter().map(|(_, e)| e.clone()).collect();
    let (first, rest) = events.split_at(2_000);
    let expected = common::replay_records(first, &set);
    let served = serve(&rules, &redis);
    let mut conn = HttpConn::connect(served.port);
    let mut by_model = 0;
    for e in first {
        let got = check(&mut conn, e);
        assert_eq!(&got, &expected[e.call_id.as_str()], "call {}", e.call_id);
        by_model += usize::from(got["reason"] == "model");
    }
    assert!(by_model > 0, "no model reject among the first calls");
    let old_version = set.version().to_string();
    // Swap the model (written beside and renamed over, as a deploy does).
    let other = dir.path().join("other.onnx");
    train_other_model(dir.path(), &other);
    std::fs::rename(&other, &model).unwrap();
    let new_set = RuleSet::from_file(&rules).unwrap();
    assert_ne!(new_set.version(), old_version);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut next = rest.iter();
    let first_new = loop {
        let e = next.next().unwrap();
        let got = check(&mut conn, e);
        if got["rules_version"] != old_version.as_str() {
            break got;
        }
        assert!(Instant::now() < deadline, "the new model was not loaded");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(first_new["rules_version"], new_set.version());
    // Once: every later check is decided under the new version.
    for e in next.by_ref().take(200) {
        assert_eq!(check(&mut conn, e)["rules_version"], new_set.version());
    }
    // A corrupt model: the one in force stays, and /v1/stats says why.
    std::fs::write(&model, b"not a model").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let stats = common::http_get(served.port, "/v1/stats").unwrap_or_default();
        if stats.contains("not an ONNX model") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the corrupt model is not reported: {stats}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let e = next.next().unwrap();
    let got = check(&mut conn, e);
    assert_eq!(got["rules_version"], new_set.version());
    assert!(got["score"].is_f64(), "{got}");
}

/// Writes `data/rules.toml` with a `[model]` of these lines in `dir`.
fn rules_with_model(dir: &Path, model_lines: &str) -> PathBuf {
    common::rules_file(
        dir,
        &format!(
            "{}\n[model]\n{model_lines}\n",
            std::fs::read_to_string("data/rules.toml").unwrap()
        ),
    )
}

/// A bad `[model]`: each refused at start with a message that says what is
/// wrong, and the command writes nothing.
#[test]
fn bad_models_are_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = std::fs::canonicalize("data/model.onnx").unwrap();
    let m = format!("path = {:?}", model.display().to_string());
    let six = r#"inputs = ["count_burst", "count_minute", "count_hour", "since_prev_ms", "distinct_callees", "local_hour"]"#;
    std::fs::write(
        dir.path().join("junk.onnx"),
        b"\x00\x01 definitely not protobuf",
    )
    .unwrap();
    // A model with two outputs, neither named `probabilities`.
    let renamed = dir.path().join("two-outputs.onnx");
    let o = std::process::Command::new("python3")
        .args([
            "-c",
            "import onnx,sys\nm=onnx.load(sys.argv[1])\nfor o in m.graph.output:\n  o.name=o.name+'_x'\nfor n in m.graph.node:\n  n.output[:]=[x+'_x' if x in ('label','probabilities') else x for x in n.output]\nonnx.save(m,sys.argv[2])",
        ])
        .arg(&model)
        .arg(&renamed)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cases = [
        (
            format!("{m}\ninputs = [\"count_burst\", \"count_minute\", \"count_hour\", \"since_prev_ms\", \"distinct_callees\", \"duration_ms\"]\nthreshold = 0.9"),
            "`duration_ms` is known only after the attempt",
        ),
        (
            format!("{m}\ninputs = [\"count_burst\", \"count_minute\", \"count_hour\", \"since_prev_ms\", \"distinct_callees\", \"count_day\"]\nthreshold = 0.9"),
            "no feature column `count_day`",
        ),
        (
            format!("{m}\ninputs = [\"count_burst\", \"count_minute\", \"count_hour\", \"since_prev_ms\", \"distinct_callees\", \"caller\"]\nthreshold = 0.9"),
            "`caller` names the call",
        ),
        (
            format!("{m}\ninputs = [\"count_burst\", \"count_minute\"]\nthreshold = 0.9"),
            "the model takes 6 features a call, and `inputs` names 2",
        ),
        (
            format!("path = \"junk.onnx\"\n{six}\nthreshold = 0.9"),
            "not an ONNX model",
        ),
        (
            format!("path = \"missing.onnx\"\n{six}\nthreshold = 0.9"),
            "cannot read",
        ),
        (
            format!("path = {:?}\n{six}\nthreshold = 0.9", renamed.display().to_string()),
            "none named `probabilities`",
        ),
        (
            format!("{m}\n{six}\nthreshold = 0.9\nwarn = 0.95"),
            "warn: a number no higher than threshold",
        ),
    ];
    for (lines, want) in cases {
        let rules = rules_with_model(dir.path(), &lines);
        let out = dir.path().join("out.csv");
        let o = std::process::Command::new(common::bin())
            .args(["replay", "-i", "data/calls.csv", "--rules"])
            .arg(&rules)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "accepted: {lines}");
        assert!(err.contains(want), "{lines}\nwant {want:?}, got: {err}");
        assert!(!out.exists(), "a refused model wrote {}", out.display());
    }
    // An enforcing model with a rule that decides before it and would keep
    // the call's state is refused; in shadow it is taken.
    let clash = format!(
        "{}\n[[rule]]\nname = \"channels\"\nkind = \"concurrent\"\nlimit = 5\nmax_duration = \"4h\"\n\n[model]\n{m}\n{six}\nthreshold = 0.9\n",
        std::fs::read_to_string("data/rules.toml").unwrap()
    );
    let e = RuleSet::from_toml(&clash).unwrap_err().to_string();
    assert!(
        e.contains("an enforcing model cannot go with the caller's concurrent rule `channels`"),
        "{e}"
    );
    RuleSet::from_toml(&clash.replace("threshold = 0.9", "threshold = 0.9\nshadow = true"))
        .unwrap();
}

/// `tune --model`: each threshold's counts equal a replay with the model
/// enforcing at that threshold; the recommendation is the lowest threshold
/// whose model's own legit false-reject rate is within the bound; the CLI
/// writes the table and the plot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_threshold_sweep_equals_a_replay_per_threshold() {
    use callguard::offline::order::OrderedLog;
    use callguard::offline::tune::sweep_model;
    let dir = tempfile::tempdir().unwrap();
    let shadow = RuleSet::from_file(&common::model_rules(dir.path(), true, 0.9)).unwrap();
    let log = std::sync::Arc::new(
        OrderedLog::open(Path::new("data/calls.csv"), &ReadOptions::default()).unwrap(),
    );
    let thresholds = [0.3f32, 0.65, 0.9, 0.99];
    let (sweep, invalid) = sweep_model(log, &shadow, &thresholds, 0.002, false)
        .await
        .unwrap();
    assert!(invalid.is_empty());
    let calls = read_call_log(Path::new("data/calls.csv"), &ReadOptions::default()).unwrap();
    for row in &sweep.rows {
        let t = row.threshold.unwrap();
        let sub = dir.path().join(format!("t{t}"));
        std::fs::create_dir_all(&sub).unwrap();
        let enforcing = RuleSet::from_file(&common::model_rules(&sub, false, t)).unwrap();
        let verdicts = callguard::offline::replay::run(&calls, &enforcing, &mut MemoryStore::new())
            .await
            .unwrap();
        let (mut rejected, mut by_model, mut fraud, mut legit) = (0, 0, 0, 0);
        for ((_, e), v) in calls.events.iter().zip(&verdicts) {
            if v.record.decision == Decision::Reject {
                rejected += 1;
                by_model += u64::from(v.record.reason == "model");
                fraud += u64::from(e.label == Some(true));
                legit += u64::from(e.label == Some(false));
            }
        }
        assert_eq!(
            (
                row.rejected,
                row.by_model,
                row.fraud_rejected,
                row.legit_rejected
            ),
            (rejected, by_model, fraud, legit),
            "threshold {t}"
        );
    }
    let alone = &sweep.rules_alone;
    assert_eq!(alone.by_model, 0);
    // The lowest threshold within the bound, and none below it is.
    let i = sweep.recommended.expect("a threshold within 0.2%");
    assert!(sweep.rows[i].model_false_reject_rate <= 0.002);
    assert!(sweep.rows[..i]
        .iter()
        .all(|r| r.model_false_reject_rate > 0.002));
    assert!(sweep.rows[i].recall > alone.recall);
    // The command: table, plot, and the side by side.
    let table = dir.path().join("sweep.csv");
    let plot = dir.path().join("sweep.png");
    let o = std::process::Command::new(common::bin())
        .args([
            "tune",
            "-i",
            "data/calls.csv",
            "--rules",
            "data/rules-model.toml",
            "--model",
        ])
        .arg("-o")
        .arg(&table)
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("rules alone")
            && out.contains("+ model")
            && out.contains("recommendation: threshold = "),
        "{out}"
    );
    assert!(std::fs::metadata(&plot).unwrap().len() > 10_000);
    let text = std::fs::read_to_string(&table).unwrap();
    assert_eq!(text.lines().count(), 1 + 22 + 1, "{text}");
    assert_eq!(
        text.lines().filter(|l| l.ends_with(",true")).count(),
        1,
        "{text}"
    );
}

/// `consume` (the binary, on the mock cluster): a model swapped under it
/// takes effect once, with a new version, from one call to the next; a
/// corrupt model file keeps the one in force (counted as a failed reload)
/// and calls go on being scored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_reloads_a_swapped_model_once_and_keeps_it_over_a_corrupt_one() {
    use common::kafka::{mock_cluster, signal, spawn_consumer, TOPICS};
    let redis = RedisServer::start(&[]);
    let (_kafka, brokers) = mock_cluster(&TOPICS.map(|t| (t, 1)));
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model.onnx");
    std::fs::copy("data/model.onnx", &model).unwrap();
    let rules = common::model_rules_of(dir.path(), &model, false, 0.5);
    let v1 = RuleSet::from_file(&rules).unwrap().version().to_string();
    let port = common::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = spawn_consumer(
        &brokers,
        &redis.url(),
        "g-model-reload",
        &rules,
        &["--metrics-addr", &addr],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !common::http_get(port, "/readyz").is_some_and(|r| r.contains(" 200 ")) {
        assert!(Instant::now() < deadline, "consume not ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut sent = 0;
    let r = decide_next(&brokers, &mut sent).await;
    assert_eq!(r["rules_version"], v1.as_str());
    assert!(r["score"].is_f64(), "{r}");
    // Swap the model (written beside it and renamed over it).
    let other = dir.path().join("other.onnx");
    train_other_model(dir.path(), &other);
    std::fs::rename(&other, &model).unwrap();
    let v2 = RuleSet::from_file(&rules).unwrap().version().to_string();
    assert_ne!(v1, v2);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = decide_next(&brokers, &mut sent).await;
        if r["rules_version"] == v2.as_str() {
            break;
        }
        assert_eq!(r["rules_version"], v1.as_str(), "{r}");
        assert!(Instant::now() < deadline, "the new model was not loaded");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Once: the calls after it are all decided under the new version.
    for _ in 0..3 {
        let r = decide_next(&brokers, &mut sent).await;
        assert_eq!(r["rules_version"], v2.as_str());
    }
    // A corrupt model: a failed reload, the model in force kept.
    std::fs::write(&model, b"not a model").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let metrics = common::http_get(port, "/metrics").unwrap_or_default();
        let failed = metrics
            .lines()
            .find_map(|l| l.strip_prefix("callguard_rule_reloads_total{kind=\"error\"} "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        if failed >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the corrupt model was not noticed: {metrics}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let r = decide_next(&brokers, &mut sent).await;
    assert_eq!(r["rules_version"], v2.as_str());
    assert!(r["score"].is_f64(), "{r}");
    signal(&child, "TERM");
    assert!(child.wait().unwrap().success());
}

/// Sends the next call (`m<n>`, a caller of its own) to `calls` and waits
/// for its decision record.
async fn decide_next(brokers: &str, sent: &mut usize) -> serde_json::Value {
    use common::kafka::{produce_raw, read_decisions};
    *sent += 1;
    let i = *sent;
    let caller = format!("+3461100{i:04}");
    let msg = serde_json::json!({
        "call_id": format!("m{i}"),
        "caller": caller,
        "callee": "+34600000001",
        "ts": 1_764_547_200_000i64 + i as i64 * 1_000,
    });
    produce_raw(
        brokers,
        "calls",
        &[(Some(caller.as_bytes()), msg.to_string().as_bytes())],
    )
    .await;
    read_decisions(brokers, "call-decisions", i, Duration::from_secs(60))
        .await
        .into_iter()
        .find(|r| r["call_id"] == format!("m{i}"))
        .expect("the call's decision")
}

/// Block keys of model rejects: with `--block-keys` and `[model] block =
/// true`, each caller the model rejects gets its block key, `model`, for
/// the reject's Retry-After, in both Redis modes; without `block = true`,
/// a model reject writes none (a rule's reject still does).
#[test]
fn a_model_reject_sets_the_block_key_only_when_asked() {
    let log = read_call_log(Path::new("data/calls.csv"), &ReadOptions::default()).unwrap();
    let events: Vec<_> = log
        .events
        .iter()
        .map(|(_, e)| e.clone())
        .take(1_500)
        .collect();
    for (mode, block) in [("cached", true), ("script", true), ("cached", false)] {
        let redis = RedisServer::start(&[]);
        let dir = tempfile::tempdir().unwrap();
        let rules = common::model_rules(dir.path(), false, 0.5);
        if block {
            let text = std::fs::read_to_string(&rules).unwrap();
            std::fs::write(&rules, format!("{text}block = true\n")).unwrap();
        }
        let set = RuleSet::from_file(&rules).unwrap();
        assert_eq!(set.model().unwrap().block, block);
        let served = serve_with(&rules, &redis, &["--block-keys", "--redis-mode", mode]);
        let mut conn = HttpConn::connect(served.port);
        let mut con = redis.connection();
        let (mut by_model, mut by_rule) = (0, 0);
        for e in &events {
            let got = check(&mut conn, e);
            let key = format!("cg:block:{{{}}}", e.caller);
            let value: Option<String> = redis::cmd("GET").arg(&key).query(&mut con).unwrap();
            let what = format!("{mode}, block {block}, call {}: {got}", e.call_id);
            match got["reason"].as_str().unwrap() {
                "model" if got["decision"] == "reject" => {
                    by_model += 1;
                    if block {
                        assert_eq!(value.as_deref(), Some("model"), "{what}");
                        let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut con).unwrap();
                        let retry = got["retry_after_ms"].as_i64().unwrap();
                        assert!(ttl > 0 && ttl <= retry, "{what}: PTTL {ttl}");
                    } else {
                        // (A key a rule's earlier reject set may remain.)
                        assert_ne!(value.as_deref(), Some("model"), "{what}");
                    }
                }
                // A rule's reject sets the key to the rule, as always.
                reason if got["decision"] == "reject" && reason != "denylist" => {
                    by_rule += 1;
                    assert_eq!(value.as_deref(), Some(reason), "{what}");
                }
                _ => {}
            }
            if by_model >= 20 && by_rule >= 5 {
                break;
            }
        }
        assert!(
            by_model >= 20 && by_rule >= 5,
            "{mode}: {by_model} model and {by_rule} rule rejects"
        );
    }
}

//! `callguard features` and the call-log presets: point-in-time features
//! equal the replay, no leakage from the future, typed Parquet, Asterisk CDRs.

use crate::common;

use callguard::engine::record::{Row, Schema};
use callguard::engine::rules::RuleSet;
use callguard::offline::read::{read_call_log, read_frame, InputFormat, ReadOptions};
use callguard::offline::table::frame;
use callguard::store::memory::MemoryStore;
use polars::prelude::*;

fn rules() -> RuleSet {
    RuleSet::from_file(std::path::Path::new("data/rules.toml")).unwrap()
}

async fn frame_for(log: &callguard::offline::read::CallLog, rules: &RuleSet) -> DataFrame {
    let verdicts = callguard::offline::replay::run(log, rules, &mut MemoryStore::new())
        .await
        .unwrap();
    let rows: Vec<Row> = log
        .events
        .iter()
        .zip(&verdicts)
        .map(|((_, event), verdict)| Row { event, verdict })
        .collect();
    frame(&Schema::features(rules), &rows).unwrap()
}

#[tokio::test]
async fn features_file_holds_the_replay_counts_with_typed_columns() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("features.parquet");
    let dec = dir.path().join("decisions.csv");
    let run = |args: &[&str]| {
        let o = std::process::Command::new(common::bin())
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    run(&[
        "features",
        "-i",
        "data/calls.csv",
        "--rules",
        "data/rules.toml",
        "-o",
        out.to_str().unwrap(),
    ]);
    run(&[
        "replay",
        "-i",
        "data/calls.csv",
        "--rules",
        "data/rules.toml",
        "-o",
        dec.to_str().unwrap(),
    ]);
    let f = ParquetReader::new(std::fs::File::open(&out).unwrap())
        .finish()
        .unwrap();
    let d = read_frame(&dec, InputFormat::Csv).unwrap();
    assert_eq!(f.height(), 20_000);
    assert_eq!(
        f.column("event_time").unwrap().dtype(),
        &DataType::Datetime(TimeUnit::Milliseconds, Some(TimeZone::UTC))
    );
    assert_eq!(f.column("label").unwrap().dtype(), &DataType::Boolean);
    assert_eq!(f.column("count_minute").unwrap().dtype(), &DataType::UInt64);
    for col in [
        "call_id",
        "count_burst",
        "count_minute",
        "count_hour",
        "decision",
        "reason",
    ] {
        let a = f.column(col).unwrap().cast(&DataType::String).unwrap();
        let b = d.column(col).unwrap().cast(&DataType::String).unwrap();
        assert!(a.equals(&b), "column {col} differs from the replay");
    }
    // Every generated call names a callee: at least itself is counted, and
    // wangiri bursts (a new callee per call) reach far more.
    let distinct = f.column("distinct_callees").unwrap().u64().unwrap();
    assert_eq!(distinct.null_count(), 0);
    assert_eq!(distinct.min(), Some(1));
    assert!(distinct.max().unwrap() > 50, "{:?}", distinct.max());
    let since = f.column("since_prev_ms").unwrap().i64().unwrap();
    assert!(since.null_count() > 0 && since.null_count() < 20_000);
    assert!(
        since.iter().flatten().all(|s| s >= 0),
        "a time-sorted log has no negative gaps"
    );
}

/// What a data scientist's tools read: pyarrow and (Python) polars see
/// `event_time` as a UTC-aware millisecond timestamp equal to `ts_ms`, and
/// the CSV file's `event_time` is the RFC 3339 text the topics carry.
#[test]
fn event_time_is_utc_aware_for_pyarrow_and_polars() {
    let dir = tempfile::tempdir().unwrap();
    let (parquet, csv) = (dir.path().join("f.parquet"), dir.path().join("f.csv"));
    for out in [&parquet, &csv] {
        let o = std::process::Command::new(common::bin())
            .args([
                "features",
                "-i",
                "data/calls.csv",
                "--rules",
                "data/rules.toml",
            ])
            .args(["--columns", "call_id,event_time,ts_ms", "-o"])
            .arg(out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let script = r#"
import sys, datetime
import pyarrow as pa, pyarrow.parquet as pq, polars as pl
t = pq.read_table(sys.argv[1])
assert t.schema.field("event_time").type == pa.timestamp("ms", tz="UTC"), t.schema
meta = pq.ParquetFile(sys.argv[1]).schema.column(1).logical_type
assert "isAdjustedToUTC=true" in str(meta), meta
ms = t.column("ts_ms").to_pylist()
times = t.column("event_time").to_pylist()
assert all(x.tzinfo is not None and x.utcoffset() == datetime.timedelta(0) for x in times)
assert [int(x.timestamp() * 1000 + 0.5) for x in times] == ms
df = pl.read_parquet(sys.argv[1])
assert df.schema["event_time"] == pl.Datetime("ms", "UTC"), df.schema
assert df["event_time"].dt.epoch("ms").to_list() == ms
c = pl.read_csv(sys.argv[2], try_parse_dates=True)
assert c.schema["event_time"].time_zone == "UTC", c.schema
assert c["event_time"].dt.epoch("ms").to_list() == ms
print(len(ms))
"#;
    let o = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(&parquet)
        .arg(&csv)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "pyarrow/polars check failed (pip install -r notebooks/requirements.txt; scripts/test-all.sh does):\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "20000");
    // The CSV text of each call is the topic's: RFC 3339, milliseconds, Z.
    let text = std::fs::read_to_string(&csv).unwrap();
    let mut rows = text.lines().skip(1);
    let first: Vec<&str> = rows.next().unwrap().split(',').collect();
    let ms: i64 = first[2].parse().unwrap();
    let expect = chrono::DateTime::from_timestamp_millis(ms)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    assert_eq!(first[1], expect);
    assert!(rows.all(|r| r
        .split(',')
        .nth(1)
        .is_some_and(|t| t.ends_with('Z') && t.len() == 24)));
}

/// `--columns`: only the named columns, in that order, with the full
/// table's values (also when distinct callees are then not tracked, or
/// callees not even read, and when they are); an unknown name is refused
/// with the list of columns.
#[test]
fn selected_columns_hold_the_full_tables_values() {
    let dir = tempfile::tempdir().unwrap();
    let features = |name: &str, columns: Option<&str>| {
        let out = dir.path().join(name);
        let mut cmd = std::process::Command::new(common::bin());
        cmd.args([
            "features",
            "-i",
            "data/calls.csv",
            "--rules",
            "data/rules.toml",
        ])
        .args(["-o", out.to_str().unwrap()]);
        if let Some(c) = columns {
            cmd.args(["--columns", c]);
        }
        let o = cmd.output().unwrap();
        (o, out)
    };
    let read = |path: &std::path::Path| {
        ParquetReader::new(std::fs::File::open(path).unwrap())
            .finish()
            .unwrap()
    };
    let (o, full) = features("full.parquet", None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let full = read(&full);
    for (name, columns) in [
        (
            "lean.parquet",
            "call_id,count_minute,count_hour,retry_after_ms,reason",
        ),
        (
            "callees.parquet",
            "distinct_callees, call_id,since_prev_ms,call_id",
        ),
        // The callees are read for their column, not tracked.
        ("callee.parquet", "callee,call_id,count_minute"),
    ] {
        let (o, path) = features(name, Some(columns));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let got = read(&path);
        let mut wanted: Vec<&str> = Vec::new();
        for c in columns.split(',').map(str::trim) {
            if !wanted.contains(&c) {
                wanted.push(c);
            }
        }
        let names: Vec<&str> = got.get_column_names().iter().map(|n| n.as_str()).collect();
        assert_eq!(names, wanted);
        assert!(
            got.equals_missing(&full.select(wanted.iter().copied()).unwrap()),
            "{columns}: values differ from the full table"
        );
    }
    let (o, _) = features("bad.parquet", Some("call_id,count_minutes"));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("no column `count_minutes`") && err.contains("count_minute,"),
        "{err}"
    );
}

#[tokio::test]
async fn appending_future_calls_changes_no_earlier_feature() {
    let mut log = read_call_log(
        std::path::Path::new("data/calls.csv"),
        &ReadOptions::default(),
    )
    .unwrap();
    log.sort_by_time();
    let cut = 12_000;
    let mut early = callguard::offline::read::CallLog {
        events: log.events[..cut].to_vec(),
        ..Default::default()
    };
    let full = frame_for(&log, &rules()).await;
    let head = frame_for(&early, &rules()).await;
    assert!(
        full.slice(0, cut).equals_missing(&head),
        "features of the first {cut} calls depend on later calls"
    );
    // And a burst appended after the last call changes nothing before it.
    let last = early.events.last().unwrap().1.clone();
    for i in 0..50 {
        let mut e = last.clone();
        e.call_id = format!("future{i}").into();
        e.ts_ms += 1 + i;
        early.events.push((0, e));
    }
    let with_future = frame_for(&early, &rules()).await;
    assert!(with_future.slice(0, cut).equals_missing(&head));
}

#[test]
fn asterisk_master_csv_preset() {
    let opts = |tz: Option<chrono_tz::Tz>| ReadOptions {
        format: InputFormat::Asterisk,
        timezone: tz,
        decoder: callguard::engine::event::Decoder::new(Default::default(), Some("34".into()))
            .unwrap(),
        ..ReadOptions::default()
    };
    let path = std::path::Path::new("tests/golden/Master.csv");
    let mut log = read_call_log(path, &opts(Some(chrono_tz::Europe::Madrid))).unwrap();
    // The row with an empty src has no usable caller: decided as
    // `bad_caller`, and reported with its row number as kept.
    assert_eq!(log.invalid.len(), 1);
    assert_eq!(log.invalid[0].row, 4);
    assert!(log.invalid[0].kept);
    assert_eq!(log.events.len(), 5);
    log.events.retain(|(_, e)| e.caller != "bad_caller");
    log.sort_by_time();
    let first = &log.events[0].1;
    // Rows are written at hangup; sorting by start puts row 5 first.
    assert_eq!(first.call_id, "1764575990.5");
    assert_eq!(first.caller, "+34911234567");
    assert_eq!(first.callee.as_deref(), Some("+34600000005"));
    // 08:59:50 in Madrid (UTC+1 in December) is 07:59:50Z.
    assert_eq!(first.ts_ms, 1_764_575_990_000);
    assert!(log.events.iter().all(|(_, e)| e.caller == "+34911234567"));
    let utc = read_call_log(path, &opts(None)).unwrap();
    let utc_first = utc.events.iter().map(|(_, e)| e.ts_ms).min().unwrap();
    assert_eq!(utc_first - first.ts_ms, 3_600_000);
}

/// A features file is a call log too: replayed with `ts` read from its
/// UTC-aware `event_time`, it gives the decisions of the log it came from;
/// two fields may read one column.
#[test]
fn a_features_file_replays_to_the_same_decisions() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name);
    let run = |args: &[&str]| {
        let o = std::process::Command::new(common::bin())
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (features, again, direct, twice) = (
        s(&p("f.parquet")),
        s(&p("again.csv")),
        s(&p("direct.csv")),
        s(&p("twice.csv")),
    );
    let rules = ["--rules", "data/rules.toml"];
    run(&[
        &["features", "-i", "data/calls.csv", "-o", &features],
        &rules[..],
    ]
    .concat());
    run(&[
        &["replay", "-i", "data/calls.csv", "-o", &direct],
        &rules[..],
    ]
    .concat());
    run(&[
        &[
            "replay",
            "-i",
            &features,
            "--map",
            "ts=event_time",
            "-o",
            &again,
        ],
        &rules[..],
    ]
    .concat());
    assert_eq!(
        std::fs::read_to_string(&again).unwrap(),
        std::fs::read_to_string(&direct).unwrap()
    );
    // `callee` read from `caller` as well: one column for two fields.
    let o = std::process::Command::new(common::bin())
        .args([
            "replay",
            "-i",
            &features,
            "--map",
            "ts=event_time,callee=caller",
            "-o",
            &twice,
        ])
        .args(rules)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read_to_string(&twice).unwrap().lines().count(),
        20_001
    );
    // Without the mapping, the missing column is named against all of the
    // file's columns, so the fix can be read off the message.
    let o = std::process::Command::new(common::bin())
        .args(["replay", "-i", &features, "-o", &twice])
        .args(rules)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("`ts`") && err.contains("event_time") && err.contains("ts_ms"),
        "{err}"
    );
}

/// Columns no rule and no selected feature reads are not read, so a bad
/// value there is not listed among the dropped fields; the features'
/// values are those of the same log with them empty. Talk and accounts
/// are read only for the rules (`duration_ms` also for its column).
#[test]
fn columns_no_rule_or_feature_reads_are_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let log = |name: &str, duration: &str, talk: &str, account: &str| {
        let path = dir.path().join(name);
        let mut text = String::from("call_id,caller,ts,duration_ms,talk_ms,account,label\n");
        for i in 0..4 {
            text.push_str(&format!(
                "c{i},+34911000001,2025-12-01T00:00:{:02}Z,{duration},{talk},{account},legit\n",
                i * 5
            ));
        }
        std::fs::write(&path, text).unwrap();
        path
    };
    let runs = std::cell::Cell::new(0);
    let features = |input: &std::path::Path, rules: &[&str], columns: &str| {
        runs.set(runs.get() + 1);
        let out = dir.path().join(format!("run{}.parquet", runs.get()));
        let mut args: Vec<&str> = rules.iter().flat_map(|r| ["--rule", r]).collect();
        args.extend(["--columns", columns]);
        features_into(&args, input, &out);
        let listed = std::fs::read_to_string(out.with_extension("invalid.csv")).unwrap_or_default();
        let table = ParquetReader::new(std::fs::File::open(&out).unwrap())
            .finish()
            .unwrap();
        (listed, table)
    };
    let minute = ["minute:sliding:60s:2"];
    let bad = log("bad.csv", "1.5", "-3", "no spaces allowed");
    let clean = log("clean.csv", "", "", "");
    // Durations shown: a bad one is read, and listed; talk and accounts not.
    let (listed, got) = features(&bad, &minute, "call_id,count_minute,duration_ms");
    let (_, want) = features(&clean, &minute, "call_id,count_minute,duration_ms");
    assert!(got.equals_missing(&want));
    assert!(listed.contains("bad_number"), "{listed}");
    assert!(
        !listed.contains("talk") && !listed.contains("account"),
        "{listed}"
    );
    // Neither shown nor used: none is read.
    let (listed, got) = features(&bad, &minute, "call_id,count_minute");
    let (_, want) = features(&clean, &minute, "call_id,count_minute");
    assert!(got.equals_missing(&want));
    assert!(!listed.contains("bad_"), "{listed}");
    // A concurrent rule reads durations and talk for the calls' ends.
    let lines = ["minute:sliding:60s:2", "lines:concurrent:4h:9"];
    let (listed, _) = features(&bad, &lines, "call_id,count_minute");
    assert!(listed.contains("bad_number"), "{listed}");
}

/// A run without invalid rows removes an earlier run's list of them
/// beside the same output: left there, it would read as this run's.
#[test]
fn a_clean_run_removes_an_earlier_runs_invalid_rows() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, ts: &str| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "call_id,caller,ts\nc1,+34911000001,2025-12-01T00:00:00Z\nc2,+34911000001,{ts}\n"
            ),
        )
        .unwrap();
        path
    };
    let out = dir.path().join("features.parquet");
    let listed = dir.path().join("features.invalid.csv");
    let run =
        |input: &std::path::Path| features_into(&["--rule", "minute:sliding:60s:2"], input, &out);
    run(&write("bad.csv", "yesterday"));
    let text = std::fs::read_to_string(&listed).unwrap();
    assert!(text.contains("2,bad_timestamp"), "{text}");
    run(&write("clean.csv", "2025-12-01T00:00:05Z"));
    assert!(!listed.exists(), "the earlier run's list is still there");
}

/// Runs `callguard features ARGS -i INPUT -o OUT`; fails the test if the
/// run fails.
fn features_into(args: &[&str], input: &std::path::Path, out: &std::path::Path) {
    let o = std::process::Command::new(common::bin())
        .arg("features")
        .args(args)
        .arg("-i")
        .arg(input)
        .arg("-o")
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

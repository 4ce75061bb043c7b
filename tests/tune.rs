//! `callguard tune`: the one-pass sweep equals a replay per N; the
//! recommendation on small hand-made logs; the command end to end.

mod common;

use callguard::engine::event::CallEvent;
use callguard::engine::rules::{CountPolicy, Rule, RuleSet};
use callguard::offline::read::{read_call_log, CallLog, ReadOptions};
use callguard::offline::tune::{row_by_replay, sweep, Sweeper, Target};
use common::scenarios::T0;

/// A generated log: its directory, its file and the log, time-sorted.
fn generated_file(rows: usize, seed: u64) -> (tempfile::TempDir, std::path::PathBuf, CallLog) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calls.csv");
    callguard::offline::generate::write_csv(
        &path,
        &callguard::offline::generate::generate(rows, seed),
    )
    .unwrap();
    let mut log = read_call_log(&path, &ReadOptions::default()).unwrap();
    log.sort_by_time();
    (dir, path, log)
}

#[test]
fn sweep_equals_a_replay_for_every_n() {
    let (_dir, path, log) = generated_file(6_000, 3);
    let ordered = std::sync::Arc::new(
        callguard::offline::order::OrderedLog::open(&path, &ReadOptions::default()).unwrap(),
    );
    let rules = [
        Rule::parse_shorthand("burst:fixed:1s:2").unwrap(),
        Rule::parse_shorthand("minute:sliding:60s:10").unwrap(),
        Rule::parse_shorthand("hour:sliding-approx:1h:200").unwrap(),
    ];
    for policy in [CountPolicy::Attempts, CountPolicy::Admitted] {
        let set = RuleSet::new(
            rules.to_vec(),
            policy,
            5_000,
            vec!["+34900".into()],
            vec!["+882".into()],
            false,
        )
        .unwrap();
        for index in 0..3 {
            let limits: Vec<u64> = (1..=25).collect();
            let s = sweep(&log, &set, index, &limits, Target::MaxFalseReject(0.002)).unwrap();
            let expected_passes = if policy == CountPolicy::Attempts {
                1
            } else {
                limits.len() + 1
            };
            assert_eq!(s.passes, expected_passes);
            // Fed in chunks (as a large file is), and with its callers
            // split over any number of shards, the sweep is the same.
            for shards in [1, 2, 3] {
                let mut chunked = Sweeper::new(&set, index, &limits, Target::MaxFalseReject(0.002))
                    .unwrap()
                    .with_shards(shards);
                for part in log.events.chunks(997) {
                    chunked.feed(part);
                }
                let chunked = chunked.finish();
                assert_eq!(
                    chunked.rows, s.rows,
                    "{policy:?}, rule {index}, chunked, {shards} shards"
                );
                assert_eq!(chunked.recommended, s.recommended);
                // Chunks of the file with their callers numbered (as
                // `tune` reads it): the callers' tallies live in arrays.
                let mut numbered =
                    Sweeper::new(&set, index, &limits, Target::MaxFalseReject(0.002))
                        .unwrap()
                        .with_shards(shards);
                for chunk in ordered.chunks(1_009) {
                    assert_eq!(chunk.callers.len(), chunk.events.len());
                    numbered.feed_log(&chunk);
                }
                let numbered = numbered.finish();
                assert_eq!(
                    numbered.rows, s.rows,
                    "{policy:?}, rule {index}, numbered, {shards} shards"
                );
                assert_eq!(numbered.recommended, s.recommended);
            }
            // As `tune` runs it: the file's chunks queued to a thread per
            // shard of callers.
            let (queued, invalid) = callguard::offline::tune::sweep_ordered(
                std::sync::Arc::clone(&ordered),
                &set,
                index,
                &limits,
                Target::MaxFalseReject(0.002),
                false,
            )
            .unwrap();
            assert!(invalid.is_empty());
            assert_eq!(queued.rows, s.rows, "{policy:?}, rule {index}, queued");
            assert_eq!(queued.recommended, s.recommended);
            for (row, &n) in s.rows.iter().zip(&limits) {
                let want = row_by_replay(&log, &set, index, n).unwrap();
                assert_eq!(row, &want, "{policy:?}, rule {index}, N = {n}");
            }
            // The sweep is not flat: N matters for at least one rule.
            if index == 1 {
                assert!(s.rows[0].calls_rejected > s.rows[24].calls_rejected);
            }
        }
    }
}

fn ev(caller: &str, id: usize, ts: i64, fraud: bool) -> (u64, CallEvent) {
    (
        id as u64,
        CallEvent {
            call_id: format!("c{id}").into(),
            caller: caller.into(),
            ts_ms: ts,
            callee: None,
            duration_ms: None,
            label: Some(fraud),
            list_number: None,
        },
    )
}

/// A legit PBX with 3 calls in a minute, a robocaller with 10, and a
/// subscriber with one call.
fn hand_made() -> CallLog {
    let mut events = Vec::new();
    let mut id = 0;
    for i in 0..3 {
        id += 1;
        events.push(ev("+34910000100", id, T0 + i * 10_000, false));
    }
    for i in 0..10 {
        id += 1;
        events.push(ev("+21655550001", id, T0 + i * 5_000, true));
    }
    id += 1;
    events.push(ev("+34600000001", id, T0, false));
    let mut log = CallLog {
        events,
        ..Default::default()
    };
    log.sort_by_time();
    log
}

#[test]
fn recommendation_with_labels_is_the_smallest_safe_n() {
    let log = hand_made();
    let rules = RuleSet::from_args(None, &["m:sliding:60s:100".into()]).unwrap();
    let limits: Vec<u64> = (1..=20).collect();
    let s = sweep(&log, &rules, 0, &limits, Target::MaxFalseReject(0.0)).unwrap();
    assert!(s.labelled);
    // The PBX peaks at 3 calls in the window: N = 3 is the smallest limit that never hits it.
    assert_eq!(s.recommended, Some(3), "{}", s.explanation);
    let r3 = &s.rows[2];
    assert_eq!(r3.legit_callers_rejected, Some(0));
    assert_eq!(r3.fraud_calls_rejected, Some(7));
    assert_eq!(r3.recall, Some(0.7));
    assert_eq!(r3.precision, Some(1.0));
    assert_eq!(r3.fraud_callers_caught, Some(1));
    let r2 = &s.rows[1];
    assert_eq!(r2.legit_calls_rejected, Some(1));
    assert_eq!(r2.legit_callers_rejected, Some(1));
    // Allowing 1/14 legit calls wrongly rejected: N = 2 qualifies.
    let loose = sweep(&log, &rules, 0, &limits, Target::MaxFalseReject(0.25)).unwrap();
    assert_eq!(loose.recommended, Some(2));
    // Nothing qualifies: say so.
    let none = sweep(&log, &rules, 0, &[1, 2], Target::MaxFalseReject(0.0)).unwrap();
    assert_eq!(none.recommended, None);
    assert!(none.explanation.contains("no limit"));
}

#[test]
fn recommendation_without_labels_uses_peak_quantiles() {
    let mut log = hand_made();
    for (_, e) in &mut log.events {
        e.label = None;
    }
    let rules = RuleSet::from_args(None, &["m:sliding:60s:100".into()]).unwrap();
    let limits: Vec<u64> = (1..=20).collect();
    // Peaks per caller: 1, 3, 10.
    let q = |q: f64| {
        sweep(&log, &rules, 0, &limits, Target::Quantile(q))
            .unwrap()
            .recommended
    };
    assert_eq!(q(0.3), Some(1));
    assert_eq!(q(0.5), Some(3));
    assert_eq!(q(1.0), Some(10));
    let s = sweep(&log, &rules, 0, &limits, Target::MaxFalseReject(0.01)).unwrap();
    assert!(!s.labelled && s.rows[0].recall.is_none());
    assert!(s.explanation.contains("no labels"), "{}", s.explanation);
}

#[test]
fn tune_command_writes_table_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("sweep.csv");
    let svg = dir.path().join("sweep.svg");
    let o = std::process::Command::new(common::bin())
        .args([
            "tune",
            "-i",
            "data/calls.csv",
            "--rule",
            "minute:sliding:60s",
            "--limits",
            "1..40",
        ])
        .arg("-o")
        .arg(&csv)
        .arg("--plot")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("recommendation: N = "), "{out}");
    let table = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(table.lines().count(), 41);
    assert!(table
        .lines()
        .next()
        .unwrap()
        .starts_with("limit,calls_rejected,rejected_share"));
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.contains("<svg") && plot.contains("recommended N"));
}

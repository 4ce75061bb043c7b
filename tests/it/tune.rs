//! `callguard tune`: the one-pass sweep equals a replay per N; the
//! recommendation on small hand-made logs; the command end to end.

use crate::common;

use callguard::engine::event::CallEvent;
use callguard::engine::rules::{CountPolicy, Rule, RuleSet};
use callguard::offline::read::{CallLog, ReadOptions};
use callguard::offline::tune::{row_by_replay, sweep, Sweeper, Target};
use common::scenarios::T0;

/// A generated log: its directory, its file and the log, time-sorted.
fn generated_file(rows: usize, seed: u64) -> (tempfile::TempDir, std::path::PathBuf, CallLog) {
    common::generated_log(rows, seed)
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
            // As `tune` runs it: a thread per shard of callers, each
            // decoding its own callers' events from the log.
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

/// The newer rule kinds swept as replay decides, under both policies: a
/// distinct-callees rule, a token bucket whose span is the longest window
/// (its burst moves the retention, so every N is replayed), a shadow rule
/// keyed by caller and callee, and a night-time rule on premium ranges.
#[test]
fn sweeps_of_the_newer_rule_kinds_equal_a_replay_for_every_n() {
    let (_dir, _path, log) = generated_file(6_000, 5);
    for count in ["attempts", "admitted"] {
        let set = RuleSet::from_toml(&format!(
            r#"
            count = "{count}"
            timezone = "Europe/Madrid"
            [[rule]]
            name = "spray"
            kind = "distinct-callees"
            window = "10m"
            limit = 30
            warn = 20
            [[rule]]
            name = "pbx"
            kind = "token-bucket"
            rate = "1/m"
            burst = 20
            [[rule]]
            name = "same_callee"
            key = "caller+callee"
            kind = "fixed"
            window = "5m"
            limit = 3
            shadow = true
            [[rule]]
            name = "irsf"
            kind = "sliding"
            window = "10m"
            limit = 2
            callees = ["+881", "+882", "+883", "+53", "+252", "+232"]
            hours = "22:00-07:00"
            "#
        ))
        .unwrap();
        for index in 0..4 {
            let limits: Vec<u64> = (1..=12).collect();
            let s = sweep(&log, &set, index, &limits, Target::MaxFalseReject(0.002)).unwrap();
            let per_limit = count == "admitted" || set.rules[index].name == "pbx";
            assert_eq!(s.passes, if per_limit { limits.len() + 1 } else { 1 });
            for (row, &n) in s.rows.iter().zip(&limits) {
                let want = row_by_replay(&log, &set, index, n).unwrap();
                assert_eq!(row, &want, "{count}, rule {index}, N = {n}");
            }
            assert!(
                s.rows[0].calls_rejected > s.rows[11].calls_rejected,
                "{count}, rule {index}: N changes nothing"
            );
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
            label: Some(fraud),
            ..Default::default()
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

/// The false-reject curve as drawn: one point per N with a positive rate,
/// each at its own height inside the lower panel (a clipped curve runs
/// flat along an edge), in the order of the rates; the rates of zero are
/// marks on the bottom edge; the bound and the recommended N are drawn.
#[test]
fn tune_plot_shows_the_whole_false_reject_curve() {
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
        ])
        .args(["--limits", "1..40", "--max-false-reject", "0.002", "-o"])
        .arg(&csv)
        .arg("--plot")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = std::fs::read_to_string(&csv).unwrap();
    let header: Vec<&str> = table.lines().next().unwrap().split(',').collect();
    let at = header
        .iter()
        .position(|h| *h == "rule_false_reject_rate")
        .unwrap();
    let rates: Vec<f64> = table
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(at).unwrap().parse().unwrap())
        .collect();
    let positive: Vec<f64> = rates.iter().copied().filter(|r| *r > 0.0).collect();
    assert!(
        positive[0] > 0.3,
        "the sample's curve starts above 30%: {positive:?}"
    );
    assert!(positive.len() > 10 && positive.len() < rates.len());

    let plot = std::fs::read_to_string(&svg).unwrap();
    let lines: Vec<(&str, Vec<(i64, i64)>)> = plot
        .split("<polyline")
        .skip(1)
        .map(|p| {
            let stroke = p
                .split("stroke=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap();
            let pts = p
                .split("points=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap();
            let pts = pts
                .split_whitespace()
                .map(|xy| {
                    let (x, y) = xy.split_once(',').unwrap();
                    (x.parse().unwrap(), y.parse().unwrap())
                })
                .collect();
            (stroke, pts)
        })
        .collect();
    let (_, curve) = lines
        .iter()
        .filter(|(s, _)| *s == "#FF0000")
        .max_by_key(|(_, p)| p.len())
        .unwrap();
    assert_eq!(curve.len(), positive.len(), "one point per positive rate");
    // The lower panel is the bottom 45% of the 800-pixel picture.
    let (top, bottom) = (800 * 55 / 100, 800);
    assert!(
        curve.iter().all(|(_, y)| (top..bottom).contains(y)),
        "{curve:?}"
    );
    // Rates fall with N, so heights rise on the page (y grows), each its own.
    for (w, r) in curve.windows(2).zip(positive.windows(2)) {
        if r[1] < r[0] * 0.9 {
            assert!(w[1].1 > w[0].1, "{w:?} for rates {r:?}: clipped or flat");
        }
    }
    // The rates of zero: hollow marks on one line below the curve.
    let marks: Vec<i64> = plot
        .split("<circle")
        .skip(1)
        .map(|c| {
            c.split("cy=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    let zeros = rates.len() - positive.len();
    assert_eq!(
        marks.len(),
        zeros + 1,
        "one mark per zero rate, one in the legend"
    );
    let floor = marks.iter().copied().max().unwrap();
    assert_eq!(marks.iter().filter(|y| **y == floor).count(), zeros);
    assert!(floor > curve.last().unwrap().1 && floor < bottom);
    // The --max-false-reject line, between the curve's ends.
    let bound = lines
        .iter()
        .find(|(s, p)| *s == "#E68C00" && p.len() == 2 && p[0].0 < 100)
        .expect("the --max-false-reject line");
    assert!(bound.1[0].1 > curve[0].1 && bound.1[0].1 < curve.last().unwrap().1);
    // The recommendation the command printed is the one drawn.
    let out = String::from_utf8_lossy(&o.stdout);
    let n: u64 = out
        .split("recommendation: N = ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("no recommendation: {out}"));
    assert!(plot.contains("--max-false-reject 0.2%"));
    assert!(plot.contains(&format!("recommended N = {n}")), "N = {n}");
}

/// A rule that sees only some calls (night calls to premium ranges, from a
/// callees file) is swept over the calls it sees: `tune`'s rows equal what
/// `replay` rejects with each limit (the sweep reads the callees it needs).
#[test]
fn a_filtered_rule_is_swept_as_replay_decides() {
    let dir = tempfile::tempdir().unwrap();
    let ranges = std::fs::canonicalize("data/irsf-ranges.txt").unwrap();
    let rules_at = |limit: u64| {
        let path = dir.path().join(format!("irsf-{limit}.toml"));
        std::fs::write(
            &path,
            format!(
                "timezone = \"Europe/Madrid\"\n[[rule]]\nname = \"irsf_night\"\nkind = \"sliding\"\nwindow = \"1h\"\nlimit = {limit}\ncallees_file = \"{}\"\nhours = \"22:00-07:00\"\n",
                ranges.display()
            ),
        )
        .unwrap();
        path
    };
    let csv = dir.path().join("sweep.csv");
    let o = std::process::Command::new(common::bin())
        .args(["tune", "-i", "data/calls.csv", "--rules"])
        .arg(rules_at(3))
        .args(["--limits", "1..8", "-o"])
        .arg(&csv)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = std::fs::read_to_string(&csv).unwrap();
    let rejected: Vec<u64> = table
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
        .collect();
    for n in [1u64, 4, 8] {
        let out = dir.path().join(format!("d{n}.csv"));
        let o = std::process::Command::new(common::bin())
            .args(["replay", "-i", "data/calls.csv", "--rules"])
            .arg(rules_at(n))
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = std::fs::read_to_string(&out).unwrap();
        let rejects = text.lines().filter(|l| l.contains(",reject,")).count() as u64;
        assert!(rejects > 0, "the rule rejects nothing at N = {n}");
        assert_eq!(rejected[n as usize - 1], rejects, "N = {n}");
    }
}

/// A misspelled `--label-column` (or any optional field named with
/// `--map`) is an error naming the column and listing the file's, not a
/// sweep without labels that recommends the no-label quantile.
#[test]
fn a_named_column_that_does_not_exist_is_an_error() {
    let run = |cmd: &str, extra: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let mut c = std::process::Command::new(common::bin());
        c.args([
            cmd,
            "-i",
            "data/calls.csv",
            "--rule",
            "minute:sliding:60s:10",
        ]);
        if cmd != "tune" {
            c.arg("-o").arg(dir.path().join("out.csv"));
        }
        c.args(extra).output().unwrap()
    };
    for (cmd, extra, missing) in [
        ("tune", &["--label-column", "lable"][..], "lable"),
        ("replay", &["--map", "callee=calee"][..], "calee"),
        ("features", &["--map", "duration_ms=billsec"][..], "billsec"),
    ] {
        let o = run(cmd, extra);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{cmd} {extra:?}: {stderr}");
        assert!(
            stderr.contains(&format!("column `{missing}`")) && stderr.contains("label"),
            "{cmd} {extra:?}: {stderr}"
        );
    }
    // Spelled right, the labels are read: the recommendation is the
    // labelled one, not a quantile of peaks.
    let o = run("tune", &["--label-column", "label", "--limits", "1..40"]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!stdout.contains("quantile"), "{stdout}");
}

/// A log with no valid call is an error that says why and lists the rows;
/// a bad optional field (a label `unknown`, a duration `1.5`) drops that
/// field, not the call, so the other calls' counts do not change. Columns
/// no rule uses are not read: a rule set without concurrent or sum rules
/// never sees the bad duration.
#[test]
fn tune_fails_with_a_reason_and_keeps_calls_with_a_bad_optional_field() {
    let dir = tempfile::tempdir().unwrap();
    let all_bad = dir.path().join("bad.csv");
    let mut text = String::from("call_id,caller,ts\n");
    for i in 0..50 {
        text.push_str(&format!("c{i},+34911000001,yesterday at {i}\n"));
    }
    std::fs::write(&all_bad, text).unwrap();
    let o = std::process::Command::new(common::bin())
        .current_dir(dir.path())
        .args(["tune", "-i", "bad.csv", "--rule", "minute:sliding:60s"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("all 50 rows are invalid"), "{stderr}");
    assert!(
        stderr.contains("row 1:") && stderr.contains("bad.invalid.csv"),
        "{stderr}"
    );
    let listed = std::fs::read_to_string(dir.path().join("bad.invalid.csv")).unwrap();
    assert_eq!(listed.lines().count(), 51, "{listed}");

    // One caller's five calls in a minute, one of them with a bad label
    // and another with a bad duration: the calls all count, and the sweep
    // is the one of the same log with those fields empty.
    let sweep = |rows: &[(&str, &str)], name: &str, rules: &[&str]| {
        let path = dir.path().join(name);
        let mut text = String::from("call_id,caller,ts,duration_ms,label\n");
        for (i, (duration, label)) in rows.iter().enumerate() {
            text.push_str(&format!(
                "c{i},+34911000001,2025-12-01T00:00:{:02}Z,{duration},{label}\n",
                i * 5
            ));
        }
        std::fs::write(&path, text).unwrap();
        let out = dir.path().join(format!("{name}.sweep.csv"));
        let o = std::process::Command::new(common::bin())
            .arg("tune")
            .args(rules.iter().flat_map(|r| ["--rule", r]))
            .args(["--limits", "1..6", "-i"])
            .arg(&path)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (
            std::fs::read_to_string(&out).unwrap(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
        )
    };
    let bad_rows = [
        ("1000", "legit"),
        ("1.5", "legit"),
        ("1000", "unknown"),
        ("1000", "legit"),
        ("1000", "legit"),
    ];
    let clean_rows = [
        ("1000", "legit"),
        ("", "legit"),
        ("1000", ""),
        ("1000", "legit"),
        ("1000", "legit"),
    ];
    // With a concurrent rule, the durations are read (the calls' ends).
    let both = ["minute:sliding:60s", "lines:concurrent:4h:9"];
    let (bad, bad_stdout) = sweep(&bad_rows, "bad", &both);
    let (clean, _) = sweep(&clean_rows, "clean", &both);
    assert_eq!(bad, clean);
    assert!(
        bad_stdout.contains("5 events, 0 invalid rows"),
        "{bad_stdout}"
    );
    assert!(bad_stdout.contains("2 fields dropped"), "{bad_stdout}");
    let listed = std::fs::read_to_string(dir.path().join("bad.sweep.invalid.csv")).unwrap();
    assert!(
        listed.starts_with("row,error_kind,error,kept\n"),
        "{listed}"
    );
    assert!(
        listed.contains("2,bad_number,") && listed.contains("3,bad_label,"),
        "{listed}"
    );
    assert_eq!(listed.matches(",true\n").count(), 2, "{listed}");

    // The minute rule alone does not read the durations: only the label
    // is dropped, and the sweep is the same.
    let (alone, alone_stdout) = sweep(&bad_rows, "alone", &["minute:sliding:60s"]);
    let (clean_alone, _) = sweep(&clean_rows, "clean-alone", &["minute:sliding:60s"]);
    assert_eq!(alone, clean_alone);
    assert!(alone_stdout.contains("1 field dropped"), "{alone_stdout}");
    let listed = std::fs::read_to_string(dir.path().join("alone.sweep.invalid.csv")).unwrap();
    assert!(
        listed.contains("3,bad_label,") && !listed.contains("bad_number"),
        "{listed}"
    );
}

/// A rule swept inside a set is judged by its own effect: the calls it
/// alone rejects beside the whole set's, and the recommendation bounds its
/// own false rejects (the other rules' are the same for every N, so the
/// set's curve is flat). A recommended N outside `--limits` says so.
#[test]
fn a_rule_swept_in_a_set_is_judged_by_its_own_effect() {
    let (_dir, path, log) = generated_file(6_000, 7);
    // A strict rule beside the swept one: it rejects many legit calls.
    let rules = RuleSet::new(
        vec![
            Rule::parse_shorthand("strict:sliding:1h:3").unwrap(),
            Rule::parse_shorthand("minute:sliding:60s:10").unwrap(),
        ],
        CountPolicy::Attempts,
        5_000,
        vec![],
        vec![],
        false,
    )
    .unwrap();
    let limits: Vec<u64> = (1..=30).collect();
    let s = sweep(&log, &rules, 1, &limits, Target::MaxFalseReject(0.002)).unwrap();
    let set_rates: Vec<f64> = s
        .rows
        .iter()
        .map(|r| r.false_reject_rate.unwrap())
        .collect();
    let own: Vec<f64> = s
        .rows
        .iter()
        .map(|r| r.rule_false_reject_rate.unwrap())
        .collect();
    // The set's rate stays above the target at every N; the rule's own falls to it.
    assert!(set_rates.iter().all(|&r| r > 0.002), "{set_rates:?}");
    assert!(
        own.first() > own.last() && *own.last().unwrap() <= 0.002,
        "{own:?}"
    );
    let n = s
        .recommended
        .expect("a recommendation on the rule's own rate");
    let row = s.rows.iter().find(|r| r.limit == n).unwrap();
    assert!(row.rule_false_reject_rate.unwrap() <= 0.002);
    assert!(row.rule_calls_rejected <= row.calls_rejected);
    assert!(
        s.explanation.contains("own legit false-reject rate"),
        "{}",
        s.explanation
    );
    // The rule's own columns equal a replay's, N by N (the oracle).
    for n in [1, 5, 12, 30] {
        let want = row_by_replay(&log, &rules, 1, n).unwrap();
        let got = s.rows.iter().find(|r| r.limit == n).unwrap();
        assert_eq!(got, &want, "N = {n}");
    }
    // Under `admitted` (each N replayed) too.
    let admitted = rules
        .with_options(CountPolicy::Admitted, 5_000, false)
        .unwrap();
    let a = sweep(
        &log,
        &admitted,
        1,
        &[2, 8, 20],
        Target::MaxFalseReject(0.002),
    )
    .unwrap();
    for r in &a.rows {
        assert_eq!(r, &row_by_replay(&log, &admitted, 1, r.limit).unwrap());
    }
    // Without labels, the quantile's N outside the range is named so.
    let o = std::process::Command::new(common::bin())
        .args([
            "tune",
            "--rule",
            "minute:sliding:60s",
            "--limits",
            "1..3",
            "--quantile",
            "0.999",
            "-i",
        ])
        .arg(&path)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("outside --limits (1..3)"), "{out}");
}

/// A concurrent rule is swept like any other, from a log's calls and their
/// ends (`ts + duration_ms`): every N's row equals a replay with that N;
/// with a concurrent rule in the set, a window rule's sweep replays each N
/// too (the calls open depend on what N allows) and equals the replay;
/// `callguard tune --sweep` of it runs and recommends.
#[test]
fn a_concurrent_rule_is_swept_as_replay_decides() {
    use callguard::engine::event::EventKind;
    use callguard::offline::order::OrderedLog;
    let (dir, path) = common::generated_csv(20_000, 23);
    let text = "[[rule]]\nname = \"minute\"\nkind = \"sliding\"\nwindow = \"60s\"\nlimit = 10\n\n\
                [[rule]]\nname = \"channels\"\nkind = \"concurrent\"\nlimit = 30\nmax_duration = \"1h\"\n";
    let rules_path = common::rules_file(dir.path(), text);
    let rules = RuleSet::from_file(&rules_path).unwrap();
    let log = OrderedLog::open(&path, &Default::default())
        .unwrap()
        .with_ends()
        .read_all()
        .unwrap();
    assert!(log.events.iter().any(|(_, e)| e.kind == EventKind::End));
    let limits = [1, 2, 3, 5, 8];
    let s = sweep(&log, &rules, 1, &limits, Target::MaxFalseReject(0.01)).unwrap();
    for r in &s.rows {
        assert_eq!(
            r,
            &row_by_replay(&log, &rules, 1, r.limit).unwrap(),
            "channels N = {}",
            r.limit
        );
    }
    let rejected: Vec<u64> = s.rows.iter().map(|r| r.rule_calls_rejected).collect();
    assert!(rejected[0] > rejected[4] && rejected[4] > 0, "{rejected:?}");
    // The window rule beside it: each N replayed, as replay decides.
    let w = sweep(&log, &rules, 0, &[3, 10], Target::MaxFalseReject(0.01)).unwrap();
    for r in &w.rows {
        assert_eq!(
            r,
            &row_by_replay(&log, &rules, 0, r.limit).unwrap(),
            "minute N = {}",
            r.limit
        );
    }
    let o = std::process::Command::new(common::bin())
        .args([
            "tune",
            "--sweep",
            "channels",
            "--limits",
            "1..8",
            "--label-column",
            "label",
            "--rules",
        ])
        .arg(&rules_path)
        .arg("-i")
        .arg(&path)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("channels"), "{out}");
}

/// A sum rule's limit (talk seconds here) is swept as replay decides each
/// N; the command takes the limits in the rule's unit, or finds them from
/// the callers' observed sums, tail included.
#[test]
fn a_sum_rule_is_swept_as_replay_decides() {
    use callguard::offline::order::OrderedLog;
    let (dir, path) = common::generated_csv(20_000, 29);
    let text = "[[rule]]\nname = \"minute\"\nkind = \"sliding\"\nwindow = \"60s\"\nlimit = 10\n\n\
                [[rule]]\nname = \"talk\"\nkind = \"sliding\"\nwindow = \"1h\"\nsum = \"talk\"\nlimit = \"90m\"\n";
    let rules_path = common::rules_file(dir.path(), text);
    let rules = RuleSet::from_file(&rules_path).unwrap();
    let log = OrderedLog::open(&path, &Default::default())
        .unwrap()
        .with_ends()
        .read_all()
        .unwrap();
    let limits = [600, 1_800, 3_600, 5_400];
    let s = sweep(&log, &rules, 1, &limits, Target::MaxFalseReject(0.01)).unwrap();
    for r in &s.rows {
        assert_eq!(
            r,
            &row_by_replay(&log, &rules, 1, r.limit).unwrap(),
            "talk N = {}",
            r.limit
        );
    }
    let rejected: Vec<u64> = s.rows.iter().map(|r| r.rule_calls_rejected).collect();
    assert!(rejected[0] > rejected[3] && rejected[3] > 0, "{rejected:?}");
    let tune = |limits: Option<&str>| {
        let mut cmd = std::process::Command::new(common::bin());
        cmd.args([
            "tune",
            "--sweep",
            "talk",
            "--label-column",
            "label",
            "--rules",
        ])
        .arg(&rules_path)
        .arg("-i")
        .arg(&path);
        if let Some(l) = limits {
            cmd.args(["--limits", l]);
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    // In the rule's unit: 10m and 90m are 600 and 5400 seconds.
    let out = tune(Some("10m,1800,1h,90m"));
    for n in limits {
        assert!(out.contains(&format!(" {n} ")), "N = {n}: {out}");
    }
    // Without limits: from the observed sums, up to the largest.
    let out = tune(None);
    let line = out
        .lines()
        .find(|l| l.starts_with("limits of talk"))
        .unwrap_or_else(|| panic!("{out}"));
    let found: Vec<u64> = line
        .rsplit(": ")
        .next()
        .unwrap()
        .split(", ")
        .map(|v| v.parse().unwrap())
        .collect();
    assert!(
        found.len() >= 8 && found.windows(2).all(|w| w[0] < w[1]),
        "{line}"
    );
    // The largest is the biggest talk sum any caller reached.
    let open = rules.with_limit(1, u64::MAX / 4).unwrap();
    let mut store = callguard::store::memory::MemoryStore::new();
    let peak = log
        .events
        .iter()
        .map(|(_, e)| store.apply(&open, e))
        .filter(|v| !v.end)
        .map(|v| v.record.counts[1])
        .max()
        .unwrap();
    assert_eq!(found.last(), Some(&peak), "{line}");
    assert!(out.contains("recommendation: N = "), "{out}");
}

/// Pools (a trunk's channels and its talk, keyed by account) are swept as
/// replay decides each N, and so is a window rule beside them (each N
/// replayed: what the pools hold depends on it); without limits a sum
/// pool's are found from each account's peak sum, the largest the
/// biggest any account reached.
#[test]
fn pools_are_swept_as_replay_decides() {
    use callguard::offline::order::OrderedLog;
    let (dir, path) = common::generated_csv(20_000, 31);
    let text = "[[rule]]\nname = \"minute\"\nkind = \"sliding\"\nwindow = \"60s\"\nlimit = 10\n\n\
                [[rule]]\nname = \"channels\"\nkind = \"concurrent\"\nkey = \"account\"\nlimit = 10\nmax_duration = \"1h\"\n\n\
                [[rule]]\nname = \"talk\"\nkind = \"fixed\"\nwindow = \"1h\"\nkey = \"account\"\nsum = \"talk\"\nlimit = \"5h\"\n";
    let rules_path = common::rules_file(dir.path(), text);
    let rules = RuleSet::from_file(&rules_path).unwrap();
    let log = OrderedLog::open(&path, &Default::default())
        .unwrap()
        .with_ends()
        .read_all()
        .unwrap();
    for (index, limits) in [
        (1, vec![2, 4, 8, 16]),
        (2, vec![1_800, 7_200, 18_000]),
        (0, vec![3, 10]),
    ] {
        let s = sweep(&log, &rules, index, &limits, Target::MaxFalseReject(0.01)).unwrap();
        for r in &s.rows {
            assert_eq!(
                r,
                &row_by_replay(&log, &rules, index, r.limit).unwrap(),
                "rule {index}, N = {}",
                r.limit
            );
        }
        let rejected: Vec<u64> = s.rows.iter().map(|r| r.rule_calls_rejected).collect();
        assert!(
            rejected[0] > *rejected.last().unwrap(),
            "rule {index}: {rejected:?}"
        );
    }
    let o = std::process::Command::new(common::bin())
        .args([
            "tune",
            "--sweep",
            "talk",
            "--label-column",
            "label",
            "--rules",
        ])
        .arg(&rules_path)
        .arg("-i")
        .arg(&path)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let line = out
        .lines()
        .find(|l| l.starts_with("limits of talk"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("from each account's peak sum"), "{line}");
    let found: Vec<u64> = line
        .rsplit(": ")
        .next()
        .unwrap()
        .split(", ")
        .map(|v| v.parse().unwrap())
        .collect();
    let open = rules.with_limit(2, u64::MAX / 4).unwrap();
    let (mut store, mut pools) = (
        callguard::store::memory::MemoryStore::new(),
        callguard::engine::pool::Pools::new(),
    );
    let peak = log
        .events
        .iter()
        .map(|(_, e)| {
            let mut v = store.apply(&open, e);
            pools.apply_one(&open, e, &mut v);
            v
        })
        .filter(|v| !v.end)
        .map(|v| v.record.counts[2])
        .max()
        .unwrap();
    assert!(peak > 0);
    assert_eq!(found.last(), Some(&peak), "{line}");
}

//! A log longer than its sort budget (`--sort-rows`), put in order on disk
//! (`callguard::offline::spill`): the same events in the same order, with
//! the same caller numbers and invalid rows, as the log ordered in memory;
//! and the same records from `replay`, `features` and `tune`.

use std::path::Path;

use callguard::offline::order::OrderedLog;
use callguard::offline::read::ReadOptions;
use polars::prelude::SerReader;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::common;

/// A random call log as CSV: few callers and times (ties), repeated call
/// ids, durations (zero among them), end rows, talk times, accounts,
/// labels, and some invalid rows, in no order.
fn random_log(rng: &mut StdRng, rows: usize) -> String {
    let mut csv =
        String::from("call_id,caller,callee,ts,duration_ms,event,talk_ms,account,label\n");
    for i in 0..rows {
        let id = if rng.random_bool(0.1) {
            format!("c{}", rng.random_range(0..5))
        } else {
            format!("c-{i}")
        };
        let caller = match rng.random_range(0..20) {
            0 => "12".to_string(), // not a number: an invalid row
            n => format!("+3460000000{}", n % 7),
        };
        let ts = if rng.random_bool(0.02) {
            "soon".to_string() // an invalid row
        } else {
            (1_764_583_200_000i64 + rng.random_range(0..40) * 500).to_string()
        };
        let duration = match rng.random_range(0..4) {
            0 => String::new(),
            1 => "0".into(),
            _ => (rng.random_range(0..6) * 500).to_string(),
        };
        let event = if rng.random_bool(0.1) { "end" } else { "" };
        let talk = if rng.random_bool(0.3) { "1000" } else { "" };
        let account = if rng.random_bool(0.2) { "trunk-1" } else { "" };
        let label = ["", "fraud", "legit"][rng.random_range(0..3)];
        csv.push_str(&format!(
            "{id},{caller},+3491000000{},{ts},{duration},{event},{talk},{account},{label}\n",
            rng.random_range(0..4)
        ));
    }
    csv
}

fn open(path: &Path, sort_rows: usize, ends: bool) -> OrderedLog {
    let opts = ReadOptions {
        sort_rows,
        ..ReadOptions::default()
    };
    let log = OrderedLog::open(path, &opts).unwrap();
    if ends {
        log.with_ends()
    } else {
        log
    }
}

/// 200 random logs, each ordered in memory and on disk with budgets of 1,
/// 7 and 50 rows, with and without the calls' ends: the same events (rows,
/// fields, order), caller numbers, unique call ids and invalid rows.
#[test]
fn a_spilled_log_merges_in_the_order_and_numbers_of_memory() {
    let mut rng = StdRng::seed_from_u64(54);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calls.csv");
    let mut spilled_runs = 0;
    for case in 0..200 {
        let rows = rng.random_range(1..=300);
        std::fs::write(&path, random_log(&mut rng, rows)).unwrap();
        for ends in [false, true] {
            let memory = open(&path, usize::MAX, ends);
            assert!(!memory.spilled());
            let want = memory.read_all().unwrap();
            for budget in [1, 7, 50] {
                let disk = open(&path, budget, ends);
                assert_eq!(disk.rows(), memory.rows(), "case {case}");
                // Spilled when the valid rows outgrow the budget, or when
                // the file's size says so (then read twice); never when its
                // rows, valid or not, fit.
                let valid = memory.rows() - not_kept(&want);
                if valid > budget {
                    assert!(disk.spilled(), "case {case}, budget {budget}");
                }
                if memory.rows() <= budget {
                    assert!(!disk.spilled(), "case {case}, budget {budget}");
                }
                spilled_runs += usize::from(disk.spilled());
                let got = disk.read_all().unwrap();
                let at = format!("case {case}, budget {budget}, ends {ends}");
                assert_eq!(got.events, want.events, "{at}");
                assert_eq!(got.invalid, want.invalid, "{at}");
                assert_eq!(got.unique, want.unique, "{at}");
                if disk.spilled() {
                    assert_eq!(got.callers, want.callers, "{at}");
                }
            }
        }
    }
    assert!(spilled_runs > 800, "only {spilled_runs} spilled");
}

fn not_kept(log: &callguard::offline::read::CallLog) -> usize {
    callguard::offline::read::not_kept(&log.invalid)
}

fn run(args: &[&str], tmp: &Path) -> String {
    let o = std::process::Command::new(common::bin())
        .args(args)
        .env("TMPDIR", tmp)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "callguard {args:?}: {err}");
    err
}

/// A log's CSV lines ordered by time (stable; a row whose time is not a
/// number sorts first): a log file as a switch writes it.
fn in_time_order(csv: &str) -> String {
    let mut lines: Vec<&str> = csv.lines().collect();
    let header = lines.remove(0);
    let ts = |l: &str| l.split(',').nth(3).and_then(|t| t.parse::<i64>().ok());
    lines.sort_by_key(|l| ts(l).unwrap_or(i64::MIN));
    format!("{header}\n{}\n", lines.join("\n"))
}

/// Random logs in time order, whole or for a random beginning (the rest
/// in no order), ordered with budgets of 1, 7 and 50 rows: the same
/// events, caller numbers, unique call ids and invalid rows as in memory.
/// A log in order is read from its file again and writes no run; one
/// whose order breaks writes runs only for what follows the break.
#[test]
fn a_log_in_time_order_is_read_again_not_sorted_on_disk() {
    let mut rng = StdRng::seed_from_u64(5454);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calls.csv");
    let (mut streamed, mut mixed) = (0, 0);
    for case in 0..80 {
        let whole = rng.random_bool(0.5);
        // A file is read in batches of 4,096 rows: an order that breaks
        // after the first batch needs a longer log.
        let rows = if whole {
            rng.random_range(1..=300)
        } else {
            rng.random_range(4_200..=9_000)
        };
        let sorted = in_time_order(&random_log(&mut rng, rows));
        let text = if whole {
            sorted
        } else {
            // The ordered beginning (past the first batch), then the rest
            // shuffled.
            let mut lines: Vec<&str> = sorted.lines().collect();
            let cut = rng.random_range(4_098..lines.len());
            lines[cut..].shuffle(&mut rng);
            format!("{}\n", lines.join("\n"))
        };
        std::fs::write(&path, text).unwrap();
        for ends in [false, true] {
            let memory = open(&path, usize::MAX, ends);
            let want = memory.read_all().unwrap();
            let valid = memory.rows() - not_kept(&want);
            for budget in [1, 7, 50] {
                let disk = open(&path, budget, ends);
                let at = format!("case {case}, budget {budget}, ends {ends}");
                let shape = disk.spill_shape();
                assert_eq!(shape.is_some(), valid > budget, "{at}");
                if let Some((runs, reread)) = shape {
                    if whole {
                        assert_eq!((runs, reread), (0, valid), "{at}");
                    }
                    assert!(reread <= valid, "{at}");
                    streamed += usize::from(runs == 0);
                    mixed += usize::from(runs > 0 && reread > 0);
                }
                let got = disk.read_all().unwrap();
                assert_eq!(got.events, want.events, "{at}");
                assert_eq!(got.invalid, want.invalid, "{at}");
                assert_eq!(got.unique, want.unique, "{at}");
                if shape.is_some() {
                    assert_eq!(got.callers, want.callers, "{at}");
                }
                // Unnumbered (a replay): the same events, no caller numbers.
                let opts = ReadOptions {
                    sort_rows: budget,
                    ..ReadOptions::default()
                };
                let bare = OrderedLog::open_unnumbered(&path, &opts).unwrap();
                let bare = if ends { bare.with_ends() } else { bare };
                let bare = bare.read_all().unwrap();
                assert_eq!(bare.events, want.events, "{at}, unnumbered");
                assert_eq!(bare.unique, want.unique, "{at}, unnumbered");
                assert!(bare.callers.is_empty(), "{at}, unnumbered");
            }
        }
    }
    assert!(
        streamed > 100 && mixed > 100,
        "{streamed} read again, {mixed} mixed"
    );
}

/// A generated log of 500 rows in time order, opened with a budget of 100:
/// to be read again from its file, which a test may then change.
fn ordered_log_to_read_again(seed: u64) -> (tempfile::TempDir, std::path::PathBuf, OrderedLog) {
    let (dir, path) = common::generated_csv(500, seed);
    let log = open(&path, 100, false);
    assert_eq!(log.spill_shape(), Some((0, 500)));
    (dir, path, log)
}

/// A log file read again must be the file first read: changed in between,
/// the chunks stop with an error that says so, never other records.
#[test]
fn a_log_changed_between_its_two_reads_is_an_error() {
    let (_dir, path, log) = ordered_log_to_read_again(7);
    let text = std::fs::read_to_string(&path).unwrap();
    // The same length, other bytes (a caller's digit), a later time.
    let at = text.find("+34").unwrap() + 5;
    let mut bytes = text.into_bytes();
    bytes[at] = if bytes[at] == b'1' { b'2' } else { b'1' };
    let file = std::fs::File::options().write(true).open(&path).unwrap();
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
    std::io::Write::write_all(&mut &file, &bytes).unwrap();
    file.set_modified(later).unwrap();
    drop(file);
    let err = log.read_all().unwrap_err().to_string();
    assert!(err.contains("the file changed"), "{err}");
}

/// A log file written to while it is read the second time: the chunks
/// stop at the end with an error that says so.
#[test]
fn a_log_written_to_during_its_second_read_is_an_error() {
    let (_dir, path, log) = ordered_log_to_read_again(8);
    let mut chunks = log.chunks(50);
    assert_eq!(chunks.next().map(|c| c.events.len()), Some(50));
    let mut file = std::fs::File::options().append(true).open(&path).unwrap();
    std::io::Write::write_all(&mut file, b"late-1,+34600000001,,1764590000000,,,,,\n").unwrap();
    drop(file);
    let rest: usize = chunks.map(|c| c.events.len()).sum();
    assert!(rest < 450, "{rest} events after the change");
    let err = log.check().unwrap_err().to_string();
    assert!(err.contains("the file changed"), "{err}");
}

/// Runs `replay` (the rules, and the fraud rules with calls held open
/// until their ends), `features` and `tune` on `input`, in memory and with
/// `--sort-rows 997`: the same files, the log said to be ordered as `said`
/// (and not as `unsaid`), and no run left behind.
fn small_budget_gives_the_same_files(input: &str, dir: &Path, said: &str, unsaid: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let out = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let spilled = said;
    let jobs: [(&str, Vec<&str>, &str); 4] = [
        ("replay", vec!["--rules", "data/rules.toml"], "csv"),
        ("replay", vec!["--rules", "data/rules-fraud.toml"], "csv"),
        ("features", vec!["--rules", "data/rules.toml"], "parquet"),
        (
            "tune",
            vec![
                "--rules",
                "data/rules.toml",
                "--sweep",
                "minute",
                "--limits",
                "1..12",
                "--label-column",
                "label",
            ],
            "csv",
        ),
    ];
    for (k, (command, extra, ext)) in jobs.iter().enumerate() {
        let (a, b) = (
            out(&format!("{k}-memory.{ext}")),
            out(&format!("{k}-disk.{ext}")),
        );
        let mut args = vec![*command, "-i", input];
        args.extend(extra.iter().copied());
        let mut memory = args.clone();
        memory.extend(["-o", &a]);
        let err = run(&memory, tmp.path());
        assert!(
            !err.contains(spilled),
            "{command} {extra:?} in memory: {err}"
        );
        let mut disk = args.clone();
        disk.extend(["-o", &b, "--sort-rows", "997"]);
        let err = run(&disk, tmp.path());
        assert!(
            err.contains(spilled) && !err.contains(unsaid),
            "{command} {extra:?}: not said {said:?}: {err}"
        );
        let (a, b) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        assert!(!a.is_empty());
        if *ext == "parquet" {
            let frame = |bytes: Vec<u8>| {
                polars::prelude::ParquetReader::new(std::io::Cursor::new(bytes))
                    .finish()
                    .unwrap()
            };
            assert!(frame(a).equals_missing(&frame(b)), "{command} {extra:?}");
        } else {
            assert_eq!(
                String::from_utf8_lossy(&a),
                String::from_utf8_lossy(&b),
                "{command} {extra:?}"
            );
        }
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert!(
            left.is_empty(),
            "{command} left {left:?} in the temporary directory"
        );
    }
    // The same log as Parquet (text columns): read a slice of rows at a
    // time under the budget, it replays as the CSV did, in memory and on
    // disk.
    let parquet = dir.join("log.parquet");
    let mut frame = polars::prelude::CsvReadOptions::default()
        .with_infer_schema_length(Some(0))
        .try_into_reader_with_file_path(Some(input.into()))
        .unwrap()
        .finish()
        .unwrap();
    polars::prelude::ParquetWriter::new(std::fs::File::create(&parquet).unwrap())
        .finish(&mut frame)
        .unwrap();
    let from_csv = std::fs::read_to_string(out("0-memory.csv")).unwrap();
    for budget in ["1000000", "997"] {
        let to = out(&format!("parquet-{budget}.csv"));
        let parquet = parquet.to_str().unwrap();
        let args = [
            "replay",
            "-i",
            parquet,
            "--rules",
            "data/rules.toml",
            "-o",
            &to,
        ];
        let err = run(&[&args[..], &["--sort-rows", budget]].concat(), tmp.path());
        assert_eq!(err.contains(spilled), budget == "997", "{err}");
        assert!(!err.contains(unsaid), "{err}");
        assert_eq!(
            std::fs::read_to_string(&to).unwrap(),
            from_csv,
            "Parquet, --sort-rows {budget}"
        );
    }
}

/// A generated log with its rows shuffled, longer than `--sort-rows 997`:
/// sorted on disk, with the records of the log ordered in memory.
#[test]
fn an_unordered_log_longer_than_the_sort_budget_gives_the_same_records() {
    let (dir, sorted) = common::generated_csv(6000, 54);
    let text = std::fs::read_to_string(&sorted).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    let header = lines.remove(0);
    lines.shuffle(&mut StdRng::seed_from_u64(5));
    let input = dir.path().join("shuffled.csv");
    std::fs::write(&input, format!("{header}\n{}\n", lines.join("\n"))).unwrap();
    small_budget_gives_the_same_files(
        input.to_str().unwrap(),
        dir.path(),
        "put in time order on disk",
        "in time order: read from the file a second time",
    );
}

/// A generated log, in time order as switches write them, longer than
/// `--sort-rows 997`: read from the file a second time, no run written,
/// with the records of the log ordered in memory.
#[test]
fn an_ordered_log_longer_than_the_sort_budget_is_read_again() {
    let (dir, sorted) = common::generated_csv(6000, 54);
    small_budget_gives_the_same_files(
        sorted.to_str().unwrap(),
        dir.path(),
        "in time order: read from the file a second time",
        "put in time order on disk",
    );
}

/// An ordered log longer than `--sort-rows 997` given through a pipe
/// (`-i /dev/stdin`), which cannot be read twice: sorted in runs, with the
/// records of the same file read in memory.
#[test]
fn a_piped_log_is_sorted_in_runs() {
    use std::io::Write;
    let (dir, sorted) = common::generated_csv(3000, 55);
    let want = dir.path().join("memory.csv");
    let args = ["replay", "--rules", "data/rules.toml", "-o"];
    let input = sorted.to_str().unwrap();
    run(
        &[&args[..], &[want.to_str().unwrap(), "-i", input]].concat(),
        dir.path(),
    );
    let got = dir.path().join("piped.csv");
    let mut child = std::process::Command::new(common::bin())
        .args(args)
        .args([
            got.to_str().unwrap(),
            "-i",
            "/dev/stdin",
            "--sort-rows",
            "997",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let text = std::fs::read(&sorted).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&text));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("put in time order on disk"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&got).unwrap(),
        std::fs::read_to_string(&want).unwrap()
    );
}

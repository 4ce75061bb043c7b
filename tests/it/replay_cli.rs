//! `callguard replay` end to end: golden files, output formats, the Redis
//! store producing the same records as the in-memory one, and clear errors.

use crate::common;

use std::path::Path;
use std::process::Command;

use callguard::engine::rules::RuleSet;
use common::{bin, RedisServer};

fn replay(args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .arg("replay")
        .args(args)
        .output()
        .expect("run callguard")
}

fn golden(name: &str) -> String {
    std::fs::read_to_string(Path::new("tests/golden").join(name)).unwrap()
}

#[test]
fn golden_replay_matches() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("decisions.csv");
    let o = replay(&[
        "-i",
        "tests/golden/calls.csv",
        "--rules",
        "tests/golden/rules.toml",
        "--default-country-code",
        "34",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        golden("decisions.csv")
    );
    let invalid = dir.path().join("decisions.invalid.csv");
    assert_eq!(
        std::fs::read_to_string(invalid).unwrap(),
        golden("decisions.invalid.csv")
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    // An unusable caller (bad1) is decided as `bad_caller`, and a bad
    // duration (bad3) drops the duration, not the call: both are listed
    // in the invalid rows as kept.
    for line in [
        "events           15",
        "rejected         4",
        "rejected callers 1",
        "duplicates       1",
        "invalid rows     2",
        "(2; and 2 fields dropped from calls kept)",
    ] {
        assert!(stdout.contains(line), "summary lacks `{line}`:\n{stdout}");
    }
}

#[test]
fn parquet_output_holds_the_same_records() {
    let dir = tempfile::tempdir().unwrap();
    let pq = dir.path().join("d.parquet");
    let csv = dir.path().join("d.csv");
    for out in [&pq, &csv] {
        let o = replay(&[
            "-i",
            "data/calls.csv",
            "--rules",
            "data/rules.toml",
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let a =
        callguard::offline::read::read_frame(&pq, callguard::offline::read::InputFormat::Parquet)
            .unwrap();
    let b = callguard::offline::read::read_frame(&csv, callguard::offline::read::InputFormat::Csv)
        .unwrap();
    assert_eq!(a.height(), 20_000);
    // Read back as text, an empty CSV cell is "" where Parquet has a null
    // (retry_after_ms of allowed calls): compare that column apart.
    let text = |f: &polars::prelude::DataFrame| -> Vec<String> {
        f.column("retry_after_ms")
            .unwrap()
            .str()
            .unwrap()
            .iter()
            .map(|v| v.unwrap_or_default().to_string())
            .collect()
    };
    let retry = text(&a);
    assert_eq!(retry, text(&b));
    assert!(
        retry.iter().any(|r| !r.is_empty()),
        "some rejects carry a retry-after"
    );
    let (a, b) = (
        a.drop("retry_after_ms").unwrap(),
        b.drop("retry_after_ms").unwrap(),
    );
    assert!(a.equals(&b), "parquet and csv outputs differ");
}

#[test]
fn redis_replay_writes_the_same_records_as_memory() {
    let server = RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("mem.csv");
    let red = dir.path().join("redis.csv");
    let base = [
        "-i",
        "data/calls.csv",
        "--rules",
        "data/rules.toml",
        "--count",
        "admitted",
    ];
    let o = replay(&[&base[..], &["-o", mem.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let url = server.url();
    let o = replay(
        &[
            &base[..],
            &[
                "--store",
                "redis",
                "--redis-url",
                &url,
                "-o",
                red.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = std::fs::read_to_string(&mem).unwrap();
    assert!(m.contains(",reject,"), "the sample should reject something");
    assert_eq!(m, std::fs::read_to_string(&red).unwrap());
}

/// `replay --store redis` says what the cached store's memory did: every
/// caller of a batch is one lookup, a caller not held is new or read back
/// from Redis, and a cache of 500 callers over 3,000 drops callers and
/// reads them back, while the records stay those of the in-memory store.
#[test]
fn redis_replay_reports_its_cache() {
    let server = RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("rounds.csv");
    // 3,000 callers, each calling once in each of 12 rounds a minute
    // apart: several of replay's batches.
    let (callers, rounds) = (3_000usize, 12usize);
    let mut text = String::from("call_id,caller,ts\n");
    let mut order = Vec::new();
    for r in 0..rounds {
        for c in 0..callers {
            let ts = 1_764_547_200_000i64 + (r * 60_000 + c * 10) as i64;
            let ts = chrono::DateTime::from_timestamp_millis(ts).unwrap();
            text += &format!("r{r}c{c},+346100{c:05},{}\n", ts.to_rfc3339());
            order.push(c);
        }
    }
    std::fs::write(&log, text).unwrap();
    // Lookups: the distinct callers of each of replay's batches.
    let lookups: usize = order
        .chunks(callguard::offline::replay::REPLAY_BATCH)
        .map(|b| b.iter().collect::<std::collections::HashSet<_>>().len())
        .sum();
    let (mem, red) = (dir.path().join("m.csv"), dir.path().join("r.csv"));
    let base = ["-i", log.to_str().unwrap(), "--rule", "m:sliding:60s:10"];
    let o = replay(&[&base[..], &["-o", mem.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let url = server.url();
    let o = replay(
        &[
            &base[..],
            &[
                "--store",
                "redis",
                "--redis-url",
                &url,
                "--cached-callers",
                "500",
            ],
            &["-o", red.to_str().unwrap()],
        ]
        .concat(),
    );
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read_to_string(&mem).unwrap(),
        std::fs::read_to_string(&red).unwrap()
    );
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("cache"))
        .unwrap_or_else(|| panic!("no cache line in {out}"));
    let numbers: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    let [looked, hits, _pct, reread, dropped, held, _mib] = numbers[..] else {
        panic!("unexpected cache line: {line}");
    };
    assert_eq!(looked as usize, lookups, "{line}");
    // Every caller is new once; every other caller not held is read back.
    assert!(hits > 0.0, "{line}");
    assert_eq!(looked - hits - callers as f64, reread, "{line}");
    assert!(reread > 0.0, "{line}");
    assert!(dropped >= (callers - 500) as f64, "{line}");
    assert!(held <= 500.0, "{line}");
}

#[test]
fn clear_errors_for_bad_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o.csv");
    let o = replay(&[
        "-i",
        "tests/golden/calls.csv",
        "--rule",
        "m:sliding:1m:5",
        "--map",
        "caller=src",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("column `src` (for `caller`) not found"),
        "{err}"
    );
    let o = replay(&[
        "-i",
        "nope.csv",
        "--rule",
        "m:sliding:1m:5",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no such file"));
    let o = replay(&["-i", "data/calls.csv", "-o", out.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no rules"));
    let o = replay(&[
        "-i",
        "data/calls.csv",
        "--rule",
        "m:sliding:1m:0",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("rule `m`, limit: must be at least 1"));
}

/// The streamed CSV reader (the `csv` crate, parsed on one thread and
/// decoded on others) reads what polars' CSV reader reads: decoding
/// polars' text frame of the same file gives the same events and invalid
/// rows, row numbers included, on files with quotes, ragged rows, invalid
/// UTF-8, semicolons, Asterisk's layout and the generated log.
#[test]
fn streamed_csv_reader_agrees_with_polars() {
    use callguard::offline::read::{
        decode_frame, effective_map, read_events, read_frame_columns, wanted_columns, CallLog,
        InputFormat, InvalidRow, ReadOptions,
    };
    let dir = tempfile::tempdir().unwrap();
    let odd = dir.path().join("odd.csv");
    let mut bytes = b"note,call_id,caller,ts,callee,duration_ms,label\n\
        x,a,+34600000001,2025-12-01T10:00:05Z,+34910000001,100,fraud\n\
        \"q,\"\"x\",b,+34600000002,2025-12-01T10:00:01Z,,,legit\n\
        x,\"c\",0034 600 000 003,not-a-time,+34910000002,-5,\n\
        x,d,+34600000003,2025-12-01T10:00:01Z,+34910000003,7,maybe\n\
        x,e,+34600000004\n\
        x,f,+34600000001,1764583200000,bad callee,8,1,extra,more\n\
        x, g ,+34600000005,2025-12-01T10:00:06.123+01:00,,,\n\
        \"two\nlines\",j,+34600000007,2025-12-01T10:00:07Z,,,\n\
        x,k,,2025-12-01T10:00:08Z,,,\n"
        .to_vec();
    bytes.extend_from_slice(b"x,h,+34911\xff000001,2025-12-01T00:00:02Z,,,\n");
    bytes.extend_from_slice(b"x,i,+34600000006,2025-12-01T00:00:02Z,+34\xfe1,,\n");
    // A two-byte character split by a delimiter: the record's bytes are
    // valid UTF-8 whole, its fields are not.
    bytes.extend_from_slice(b"x,l,+34600000008\xc3,\xa92025-12-01T00:00:03Z,,,\n");
    std::fs::write(&odd, bytes).unwrap();
    let semi = dir.path().join("semi.csv");
    std::fs::write(
        &semi,
        "call_id;caller;ts\na;+34911000001;1764547200000\nb;911000001;1764547200001\n",
    )
    .unwrap();
    // A byte-order mark and Windows line ends, as spreadsheet exports have.
    let bom = dir.path().join("bom.csv");
    std::fs::write(
        &bom,
        "\u{feff}call_id,caller,ts,label\r\na,+34911000001,1764547200000,Fraud\r\nb,,1764547200001,\r\n",
    )
    .unwrap();
    let generated = dir.path().join("generated.csv");
    let o = Command::new(bin())
        .args(["generate", "--rows", "20000", "--seed", "3", "--output"])
        .arg(&generated)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let asterisk = ReadOptions {
        format: InputFormat::Asterisk,
        timezone: Some(chrono_tz::Europe::Madrid),
        ..ReadOptions::default()
    };
    let semicolons = ReadOptions {
        delimiter: b';',
        ..ReadOptions::default()
    };
    let freeswitch = ReadOptions {
        format: InputFormat::FreeSwitch,
        timezone: Some(chrono_tz::Europe::Madrid),
        ..ReadOptions::default()
    };
    let kamailio = ReadOptions {
        format: InputFormat::KamailioAcc,
        ..freeswitch.clone()
    };
    let cases = [
        (odd.as_path(), ReadOptions::default()),
        (semi.as_path(), semicolons),
        (bom.as_path(), ReadOptions::default()),
        (generated.as_path(), ReadOptions::default()),
        (Path::new("data/calls.csv"), ReadOptions::default()),
        (Path::new("tests/golden/Master.csv"), asterisk),
        (Path::new("tests/golden/freeswitch.csv"), freeswitch),
        (Path::new("tests/golden/kamailio-acc.csv"), kamailio),
    ];
    for (file, opts) in cases {
        let mut decoder = opts.decoder.clone();
        decoder.map = effective_map(opts.format, &opts.decoder.map);
        let wanted = wanted_columns(&decoder.map, &opts);
        let frame = read_frame_columns(file, opts.format, opts.delimiter, Some(&wanted)).unwrap();
        let mut theirs = CallLog::default();
        decode_frame(
            &frame,
            &decoder,
            opts.format,
            opts.timezone,
            None,
            false,
            |row, e| match e {
                Ok(mut e) => {
                    // Dropped fields are reported as rows; the columns
                    // keep the call without them.
                    theirs.invalid.extend(InvalidRow::dropped(row, &e));
                    e.dropped = None;
                    theirs.events.push((row, e))
                }
                Err(error) => theirs.invalid.push(InvalidRow::new(row, error)),
            },
        )
        .unwrap();
        let (events, invalid) = read_events(file, &opts).unwrap();
        let ours: Vec<_> = (0..events.len())
            .map(|i| (events.row(i), events.event(i)))
            .collect();
        assert!(!ours.is_empty(), "{}", file.display());
        assert_eq!(ours, theirs.events, "{}", file.display());
        assert_eq!(invalid, theirs.invalid, "{}", file.display());
    }
}

/// The chunked, time-ordered reader yields exactly the whole sorted log:
/// same events in the same order (ties in file order), same row numbers,
/// same invalid rows, whatever the chunk size.
#[test]
fn ordered_chunks_equal_the_sorted_log() {
    use callguard::offline::{
        order::OrderedLog,
        read::{read_call_log, ReadOptions},
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calls.csv");
    // Out of order, ties, an unparseable time, a blank one, a bad caller, an
    // unused column.
    std::fs::write(
        &path,
        "note,call_id,caller,ts,callee\n\
         x,a,+34600000001,2025-12-01T10:00:05Z,+34910000001\n\
         x,b,+34600000002,2025-12-01T10:00:01Z,\n\
         x,c,+34600000001,not-a-time,+34910000002\n\
         x,d,+34600000003,2025-12-01T10:00:01Z,+34910000003\n\
         x,e,12,2025-12-01T10:00:00Z,+34910000004\n\
         x,f,+34600000001,1764583200000,+34910000005\n\
         x, a ,+34600000001,2025-12-01T10:00:06Z,\n\
         x,g,+34600000004,  ,\n",
    )
    .unwrap();
    let asterisk = ReadOptions {
        format: callguard::offline::read::InputFormat::Asterisk,
        timezone: Some(chrono_tz::Europe::Madrid),
        ..ReadOptions::default()
    };
    for (file, opts) in [
        (path.as_path(), ReadOptions::default()),
        (
            std::path::Path::new("data/calls.csv"),
            ReadOptions::default(),
        ),
        (std::path::Path::new("tests/golden/Master.csv"), asterisk),
    ] {
        let mut whole = read_call_log(file, &opts).unwrap();
        whole.sort_by_time();
        let ordered = OrderedLog::open(file, &opts).unwrap();
        assert_eq!(
            ordered.rows(),
            whole.events.len() + callguard::offline::read::not_kept(&whole.invalid),
            "{}",
            file.display()
        );
        for size in [1, 2, 7, 4096] {
            let mut events = Vec::new();
            let mut invalid = Vec::new();
            let mut once = Vec::new();
            for chunk in ordered.chunks(size) {
                events.extend(chunk.events);
                invalid.extend(chunk.invalid);
                once.extend(chunk.unique);
            }
            invalid.sort_by_key(|r| r.row);
            assert_eq!(once.len(), events.len());
            assert_eq!(events, whole.events, "{} chunk {size}", file.display());
            assert_eq!(invalid, whole.invalid, "{} chunk {size}", file.display());
        }
    }
    let small = OrderedLog::open(&path, &ReadOptions::default())
        .unwrap()
        .read_all()
        .unwrap();
    let ids: Vec<&str> = small
        .events
        .iter()
        .map(|(_, e)| e.call_id.as_str())
        .collect();
    // `e`'s caller is no number: decided as the unusable caller.
    assert_eq!(ids, ["e", "f", "b", "d", "a", "a"]);
    assert_eq!(small.events[0].1.caller, "bad_caller");
    // `a` (once padded with spaces) is the one id that repeats.
    assert_eq!(small.unique, [true, true, true, true, false, false]);
    let bad: Vec<String> = small
        .invalid
        .iter()
        .map(|r| format!("{} {}", r.row, r.error))
        .collect();
    assert_eq!(
        bad,
        [
            "3 bad timestamp not-a-time: expected epoch milliseconds or RFC 3339 \
             (2025-12-01T10:00:00Z, 2025-12-01T11:00:00+01:00); a call log may also have \
             YYYY-MM-DD HH:MM:SS in --timezone, epoch seconds mapped as ts=COLUMN:s, or \
             any form named with --ts-format",
            "5 bad caller: 12 (national number: pass --default-country-code)",
            "8 missing field `ts`"
        ]
    );
}

/// Defect 12 of the reliability issue: row-level problems (invalid UTF-8,
/// too few or too many fields) become rows of `<output>.invalid.csv` with
/// their row numbers, and the run goes on.
#[test]
fn bad_rows_are_listed_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("calls.csv");
    let mut bytes = b"call_id,caller,ts\n\
        a,+34911000001,2025-12-01T00:00:00Z\n\
        b,+34911000001\n"
        .to_vec();
    bytes.extend_from_slice(b"c,+34911\xff000001,2025-12-01T00:00:02Z\n");
    bytes.extend_from_slice(b"d,+34911000001,2025-12-01T00:00:03Z,extra,fields\n");
    bytes.extend_from_slice(b"e,+34911000001,2025-12-01T00:00:04Z\n");
    std::fs::write(&input, bytes).unwrap();
    let out = dir.path().join("d.csv");
    let o = replay(&[
        "-i",
        input.to_str().unwrap(),
        "--rule",
        "m:sliding:60s:5",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let decided = std::fs::read_to_string(&out).unwrap();
    let ids: Vec<&str> = decided
        .lines()
        .skip(1)
        .map(|l| l.split(',').next().unwrap())
        .collect();
    // `c`'s caller is not UTF-8: no number, decided as the unusable caller.
    assert_eq!(ids, ["a", "c", "d", "e"]);
    let invalid = std::fs::read_to_string(dir.path().join("d.invalid.csv")).unwrap();
    let rows: Vec<&str> = invalid
        .lines()
        .skip(1)
        .map(|l| l.split(',').take(2).collect::<Vec<_>>().join(","))
        .map(|l| Box::leak(l.into_boxed_str()) as &str)
        .collect();
    assert_eq!(rows, ["2,missing_field", "3,bad_number"]);
}

/// Defect 12: a file that cannot be read at all gives one clear error with
/// its line (exit 2), a wrong delimiter is named, `--delimiter` reads it,
/// and a rules file error names the file.
#[test]
fn unreadable_files_give_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, text: &str, extra: &[&str]| {
        let input = dir.path().join(name);
        std::fs::write(&input, text).unwrap();
        let out = dir.path().join(format!("{name}.out.csv"));
        let mut args = vec!["-i", input.to_str().unwrap(), "-o", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        if !extra.contains(&"--rules") {
            args.extend_from_slice(&["--rule", "m:sliding:60s:5"]);
        }
        let o = replay(&args);
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
            out,
        )
    };
    let (code, err, out) = run(
        "quote.csv",
        "call_id,caller,ts\na,+34911000001,1764547200000\n\"b,+34911000001,1764547201000\nc,+34911000001,1764547202000\n",
        &[],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("line 3") && err.contains("never closed"),
        "{err}"
    );
    assert!(!out.exists());

    let semi = "call_id;caller;ts\na;+34911000001;1764547200000\n";
    let (code, err, _) = run("semi.csv", semi, &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--delimiter ';'"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let (code, err, out) = run("semi2.csv", semi, &["--delimiter", ";"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(std::fs::read_to_string(out).unwrap().lines().count(), 2);

    let (code, err, _) = run("empty.csv", "", &[]);
    assert_eq!(code, Some(2), "{err}");
    assert_eq!(err.matches("empty CSV").count(), 1, "said once: {err}");

    let rules = dir.path().join("bad-rules.toml");
    std::fs::write(&rules, "[[rule]]\nname='m'\nkind='sliding'\nwindow=1\n").unwrap();
    let (code, err, _) = run(
        "ok.csv",
        "call_id,caller,ts\na,+34911000001,1764547200000\n",
        &["--rules", rules.to_str().unwrap()],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("bad-rules.toml"), "the file is named: {err}");
}

/// Defect 12: a run that fails midway (here Redis runs out of memory) leaves
/// the previous output as it was and no partial or temporary file.
#[test]
fn a_failed_run_leaves_no_truncated_output() {
    let server = RedisServer::start(&["--maxmemory-policy", "noeviction"]);
    // Below what the sample log's callers take in either mode (the
    // default, cached, keeps them in about 1.6 KB each).
    server.cap_memory_above_use(300_000);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("decisions.csv");
    std::fs::write(&out, "the previous run's output\n").unwrap();
    let o = replay(&[
        "-i",
        "data/calls.csv",
        "--rules",
        "data/rules.toml",
        "--store",
        "redis",
        "--redis-url",
        &server.url(),
        "-o",
        out.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "the replay should run out of Redis memory"
    );
    assert!(err.contains("out of memory"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        "the previous run's output\n"
    );
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["decisions.csv"]);
}

/// Outputs take the umask (as every Unix tool's do), and log lines sent
/// to a pipe carry no colour codes.
#[test]
fn outputs_follow_the_umask_and_piped_logs_are_plain() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    for (umask, mode) in [("022", 0o644), ("027", 0o640)] {
        let out = dir.path().join(format!("d{umask}.csv"));
        let o = Command::new("sh")
            .args(["-c", &format!("umask {umask} && exec \"$0\" \"$@\"")])
            .arg(bin())
            .args(["replay", "-i", "tests/golden/calls.csv"])
            .args(["--rules", "tests/golden/rules.toml"])
            .args(["--default-country-code", "34", "-o"])
            .arg(&out)
            .env_remove("NO_COLOR")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        for written in [&out, &dir.path().join(format!("d{umask}.invalid.csv"))] {
            let got = std::fs::metadata(written).unwrap().permissions().mode() & 0o777;
            assert_eq!(got, mode, "{} under umask {umask}", written.display());
        }
        // The golden log has invalid rows, which are logged as warnings.
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(stderr.contains("invalid row"), "{stderr}");
        assert!(
            !stderr.contains('\u{1b}'),
            "colour codes in a pipe: {stderr:?}"
        );
    }
}

/// An output named with an extension of no known format is refused before
/// any work, naming the extensions that are understood; nothing is written.
#[test]
fn an_unknown_output_extension_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (cmd, flag, name, expected) in [
        ("replay", "-o", "d.json", ".csv or .parquet"),
        ("features", "-o", "f.txt", ".csv or .parquet"),
        ("tune", "-o", "s.json", ".csv or .parquet"),
        ("tune", "--plot", "p.jpg", ".png or .svg"),
        ("replay", "-o", "decisions", ".csv or .parquet"),
    ] {
        let out = dir.path().join(name);
        let o = Command::new(bin())
            .arg(cmd)
            .args([
                "-i",
                "tests/golden/calls.csv",
                "--rules",
                "tests/golden/rules.toml",
            ])
            .args(["--default-country-code", "34", flag])
            .arg(&out)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{cmd} {name}: {stderr}");
        assert!(
            stderr.contains("unknown output format") && stderr.contains(expected),
            "{cmd} {name}: {stderr}"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "{cmd} {name}"
        );
    }
}

/// `replay --store redis` on a key prefix that holds records of another
/// rule set refuses it, naming the version found; `--fresh` deletes only
/// that prefix's keys and replays afresh, `--resume` continues on them.
/// The same rule set continues: every record comes back as a duplicate
/// (unless asked `--fresh`).
#[test]
fn redis_replay_refuses_a_prefix_of_another_rule_set() {
    let server = RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let url = server.url();
    let run = |rule: &str, out: &str, extra: &[&str]| {
        let out = dir.path().join(out);
        let o = replay(
            &[
                &[
                    "-i",
                    "tests/golden/calls.csv",
                    "--default-country-code",
                    "34",
                ][..],
                &["--rule", rule, "--store", "redis", "--redis-url", &url],
                &["--key-prefix", "cg:replay:", "-o", out.to_str().unwrap()],
                extra,
            ]
            .concat(),
        );
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        (o, text)
    };
    let version = |rule: &str| {
        RuleSet::from_args(None, &[rule.to_string()])
            .unwrap()
            .version()
            .to_string()
    };
    let (a, b) = ("m:sliding:60s:2", "m:sliding:60s:3");
    // A key of another prefix, which --fresh must leave alone.
    let mut c = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("other:key")
        .arg("1")
        .query(&mut c)
        .unwrap();

    let (o, first) = run(a, "a1.csv", &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let events = stdout
        .lines()
        .find_map(|l| l.strip_prefix("events").map(|n| n.trim().to_string()))
        .unwrap();
    let (o, again) = run(a, "a2.csv", &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    // Every call comes back as the duplicate of the first run's.
    assert!(
        stdout.contains(&format!("duplicates       {events}\n")),
        "{stdout}"
    );
    assert_eq!(first.lines().count(), again.lines().count());

    let (o, _) = run(b, "b1.csv", &[]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "another rule set must be refused");
    assert!(
        stderr.contains(&format!("rule set version {}", version(a)))
            && stderr.contains("--fresh")
            && stderr.contains("--resume"),
        "{stderr}"
    );

    let (o, fresh) = run(b, "b2.csv", &["--fresh"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("keys deleted first (--fresh)"), "{stdout}");
    assert!(stdout.contains("duplicates       1\n"), "{stdout}");
    let (o, memory) = {
        let out = dir.path().join("b-mem.csv");
        let o = replay(&[
            "-i",
            "tests/golden/calls.csv",
            "--default-country-code",
            "34",
            "--rule",
            b,
            "-o",
            out.to_str().unwrap(),
        ]);
        (o, std::fs::read_to_string(&out).unwrap_or_default())
    };
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(fresh, memory, "a fresh Redis replay equals the memory one");
    let other: Option<String> = redis::cmd("GET").arg("other:key").query(&mut c).unwrap();
    assert_eq!(
        other.as_deref(),
        Some("1"),
        "--fresh deleted another prefix's key"
    );

    // --fresh on the prefix of the same rule set replays afresh too.
    let (o, again) = run(b, "b3.csv", &["--fresh"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("keys deleted first (--fresh)"), "{stdout}");
    assert!(stdout.contains("duplicates       1\n"), "{stdout}");
    assert_eq!(again, memory, "a second fresh replay of the same rules");

    let (o, _) = run(a, "a3.csv", &["--resume"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains(&format!("continuing on records of rule set {}", version(b))),
        "{stdout}"
    );
}

/// Units in the mapping: a switch's `billsec` in seconds and a start time
/// in epoch seconds (`--map duration_ms=billsec:s,ts=start:s`), and other
/// time forms named with `--ts-format`, give the features the same values
/// as milliseconds would; a time in none of the forms names them.
#[test]
fn mapped_units_and_time_forms_are_read_as_named() {
    let dir = tempfile::tempdir().unwrap();
    let features = |csv: &str, extra: &[&str]| {
        let input = dir.path().join("in.csv");
        std::fs::write(&input, csv).unwrap();
        let out = dir.path().join("f.csv");
        let o = Command::new(bin())
            .args([
                "features",
                "--rule",
                "m:sliding:60s:5",
                "--columns",
                "call_id,ts_ms,duration_ms",
            ])
            .arg("-i")
            .arg(&input)
            .arg("-o")
            .arg(&out)
            .args(extra)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::read_to_string(&out).unwrap()
    };
    // 2025-12-01T10:00:00Z and 10:00:30.5.
    let expected = "call_id,ts_ms,duration_ms\n\
        a,1764583200000,12000\n\
        b,1764583230500,1500\n";
    let seconds =
        "id,src,start,billsec\na,+34911000001,1764583200,12\nb,+34911000001,1764583230.5,1.5\n";
    let map = "call_id=id,caller=src,ts=start:s,duration_ms=billsec:s";
    assert_eq!(features(seconds, &["--map", map]), expected);

    let local = "id,src,start,billsec\na,+34911000001,01/12/2025 11:00:00.000,12\nb,+34911000001,01/12/2025 11:00:30.500,1.5\n";
    let map = "call_id=id,caller=src,ts=start,duration_ms=billsec:s";
    let form = [
        "--ts-format",
        "%d/%m/%Y %H:%M:%S%.f",
        "--timezone",
        "Europe/Madrid",
    ];
    assert_eq!(
        features(local, &[&["--map", map][..], &form].concat()),
        expected
    );
    let offsets = "id,src,start,billsec\na,+34911000001,2025-12-01T11:00:00+0100,12\nb,+34911000001,2025-12-01T10:00:30.5+0000,1.5\n";
    let form = ["--ts-format", "%Y-%m-%dT%H:%M:%S%.f%z"];
    assert_eq!(
        features(offsets, &[&["--map", map][..], &form].concat()),
        expected
    );

    // Not in any form read: the invalid row names the forms.
    let o = Command::new(bin())
        .args([
            "features",
            "--rule",
            "m:sliding:60s:5",
            "--map",
            map,
            "--ts-format",
            "%Q",
        ])
        .args(["-i", "x.csv", "-o", "y.csv"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--ts-format"),
        "{o:?}"
    );
    let e = callguard::engine::event::parse_ts(callguard::engine::event::RawValue::Str(
        "01/12/2025 11:00",
    ))
    .unwrap_err()
    .to_string();
    for form in [
        "epoch milliseconds",
        "RFC 3339",
        "YYYY-MM-DD HH:MM:SS",
        "ts=COLUMN:s",
        "--ts-format",
    ] {
        assert!(e.contains(form), "{e}");
    }
}

/// A concurrent rule over a call log with durations: each row is an
/// attempt and, at `ts + duration_ms`, an end; a call's end at the same
/// millisecond as an attempt closes it first; a row without a duration
/// is held until `max_duration`; an `event = end` row closes its call
/// and gets no decision row. Both Redis stores write the same records.
#[test]
fn a_concurrent_rule_holds_calls_open_until_their_ends() {
    let dir = tempfile::tempdir().unwrap();
    let rules = common::rules_file(
        dir.path(),
        "[[rule]]\nname = \"channels\"\nkind = \"concurrent\"\nlimit = 2\nmax_duration = \"10m\"\n",
    );
    let log = dir.path().join("calls.csv");
    std::fs::write(
        &log,
        "call_id,caller,callee,ts,duration_ms,event\n\
         a,+34911000001,+34910000001,2025-12-01T10:00:00Z,60000,\n\
         b,+34911000001,+34910000002,2025-12-01T10:00:10Z,60000,\n\
         c,+34911000001,+34910000003,2025-12-01T10:00:20Z,60000,\n\
         d,+34911000001,+34910000004,2025-12-01T10:01:00Z,30000,\n\
         e,+34911000001,+34910000005,2025-12-01T10:01:05Z,,\n\
         f,+34911000001,+34910000006,2025-12-01T10:01:20Z,10000,\n\
         n,+34911000001,+34910000007,2025-12-01T10:01:40Z,,\n\
         n,+34911000001,,2025-12-01T10:01:45Z,,end\n\
         g,+34911000001,+34910000008,2025-12-01T10:01:50Z,,\n\
         h,+34911000001,+34910000009,2025-12-01T10:01:55Z,,\n\
         i,+34911000001,+34910000010,2025-12-01T10:01:58Z,5000,\n",
    )
    .unwrap();
    let out = dir.path().join("out.csv");
    let o = replay(&[
        "-i",
        log.to_str().unwrap(),
        "--rules",
        rules.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("events           10"), "{stdout}");
    // a 10:00:00-10:01:00, b 10:00:10-10:01:10: c is the third; its
    // Retry-After runs to the first close known when it is decided (a's
    // max duration: its end comes later). d at 10:01:00 finds a closed. e
    // (no duration) is rejected, so holds nothing. d and f have closed by
    // n's call at 10:01:40; n's end row closes it at 10:01:45, before g.
    // g and h (no durations) hold their slots to their max durations, so
    // i is the third until g's runs out at 10:11:50.
    let text = std::fs::read_to_string(&out).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let wanted = ["call_id", "decision", "count_channels", "retry_after_ms"].map(col);
    let mut got = String::from("call_id,decision,count_channels,retry_after_ms\n");
    for line in lines {
        let fields: Vec<&str> = line.split(',').collect();
        got.push_str(&wanted.map(|i| fields[i]).join(","));
        got.push('\n');
    }
    assert_eq!(
        got,
        "call_id,decision,count_channels,retry_after_ms\n\
         a,allow,1,\n\
         b,allow,2,\n\
         c,reject,3,580000\n\
         d,allow,2,\n\
         e,reject,3,545000\n\
         f,allow,2,\n\
         n,allow,1,\n\
         g,allow,1,\n\
         h,allow,2,\n\
         i,reject,3,592000\n"
    );
    // Both Redis stores decide it exactly as memory.
    let redis = RedisServer::start(&[]);
    for mode in ["cached", "script"] {
        let written = dir.path().join(format!("{mode}.csv"));
        let o = replay(&[
            "-i",
            log.to_str().unwrap(),
            "--rules",
            rules.to_str().unwrap(),
            "-o",
            written.to_str().unwrap(),
            "--store",
            "redis",
            "--redis-mode",
            mode,
            "--key-prefix",
            &format!("{mode}:"),
            "--redis-url",
            &redis.url(),
        ]);
        assert!(
            o.status.success(),
            "{mode}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(std::fs::read_to_string(&written).unwrap(), text, "{mode}");
    }
}

/// The example spend rules (`data/rules-spend.toml`: a talk cap to premium
/// ranges and a spend cap priced by `data/rates.csv`) on a generated day
/// with talk times: the sums reject only the IRSF callers, a talk cap's
/// count is whole seconds of the caller's ended premium talk in its
/// hour, and the Redis stores decide the same.
#[test]
fn the_example_spend_rules_catch_irsf_by_its_minutes_and_money() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("calls.csv");
    callguard::offline::generate::write_csv(
        &log,
        &callguard::offline::generate::generate(100_000, 5),
    )
    .unwrap();
    let out = dir.path().join("out.csv");
    let o = replay(&[
        "-i",
        log.to_str().unwrap(),
        "--rules",
        "data/rules-spend.toml",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    use std::collections::HashMap;
    let population: HashMap<String, String> = csv_rows(&log)
        .into_iter()
        .map(|r| (r["call_id"].clone(), r["population"].clone()))
        .collect();
    let rows = csv_rows(&out);
    let mut by_sum = HashMap::<(String, String), usize>::new();
    for r in &rows {
        if ["premium_talk", "spend"].contains(&r["reason"].as_str()) {
            *by_sum
                .entry((r["reason"].clone(), population[&r["call_id"]].clone()))
                .or_default() += 1;
        }
    }
    assert!(
        by_sum.keys().all(|(_, p)| p == "irsf"),
        "sum rules rejected legit calls: {by_sum:?}"
    );
    for rule in ["premium_talk", "spend"] {
        let n = by_sum
            .get(&(rule.into(), "irsf".into()))
            .copied()
            .unwrap_or(0);
        assert!(n > 50, "{rule} rejected {n} IRSF calls");
    }
    // A talk count is whole seconds; a call to no premium range is not
    // seen by the talk cap (written empty).
    let talk: Vec<u64> = rows
        .iter()
        .filter_map(|r| r["count_premium_talk"].parse().ok())
        .collect();
    assert!(talk.iter().any(|&s| s > 5_400), "over 90 minutes somewhere");
    // The Redis stores (the default cached one, and the window script)
    // decide the same.
    let redis = RedisServer::start(&[]);
    for mode in ["cached", "script"] {
        let via = dir.path().join(format!("{mode}.csv"));
        let o = replay(&[
            "-i",
            log.to_str().unwrap(),
            "--rules",
            "data/rules-spend.toml",
            "--store",
            "redis",
            "--redis-url",
            &redis.url(),
            "--redis-mode",
            mode,
            "--key-prefix",
            &format!("{mode}:"),
            "-o",
            via.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(
            std::fs::read_to_string(&via).unwrap(),
            std::fs::read_to_string(&out).unwrap(),
            "{mode}"
        );
    }
}

/// A CSV file's rows, by column name (no quoted commas: the files here
/// have none).
fn csv_rows(path: &Path) -> Vec<std::collections::HashMap<String, String>> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    let header: Vec<String> = lines
        .next()
        .unwrap()
        .split(',')
        .map(str::to_string)
        .collect();
    lines
        .map(|l| {
            header
                .iter()
                .cloned()
                .zip(l.split(',').map(str::to_string))
                .collect()
        })
        .collect()
}

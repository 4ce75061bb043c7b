//! Switches' call records: the Asterisk, FreeSWITCH and Kamailio `acc`
//! presets, told from the first line, in the switch's local time across
//! DST switches, with durations and non-call rows.

use crate::common;

use std::path::Path;
use std::process::Command;

use callguard::engine::event::CallEvent;
use callguard::offline::generate::{generate, write_cdr};
use callguard::offline::read::{read_call_log, InputFormat, ReadOptions};
use common::bin;

const MADRID: chrono_tz::Tz = chrono_tz::Europe::Madrid;

fn madrid(format: InputFormat) -> ReadOptions {
    ReadOptions {
        format,
        timezone: Some(MADRID),
        ..ReadOptions::default()
    }
}

/// (call id, caller, callee, ts, duration) of each valid row, in file order.
type Row = (String, String, Option<String>, i64, Option<i64>);

fn rows(events: &[(u64, CallEvent)]) -> Vec<(u64, Row)> {
    events
        .iter()
        .map(|(n, e)| {
            (
                *n,
                (
                    e.call_id.to_string(),
                    e.caller.to_string(),
                    e.callee.as_ref().map(|c| c.to_string()),
                    e.ts_ms,
                    e.duration_ms,
                ),
            )
        })
        .collect()
}

/// A row whose caller is unusable: decided as `bad_caller`.
fn unusable(mut row: Row) -> Row {
    row.1 = "bad_caller".into();
    row
}

fn row(id: &str, callee: &str, ts: i64, duration: Option<i64>) -> Row {
    (
        id.into(),
        "+34911234567".into(),
        Some(callee.into()),
        ts,
        duration,
    )
}

/// Europe/Madrid's 2025 switches: 02:00 CET became 03:00 CEST on 30 March
/// (02:30 never happened: read as 02:30 CET, i.e. 03:30 CEST); 03:00 CEST
/// became 02:00 CET on 26 October (02:30 happened twice: read as the
/// first, CEST).
const SPRING_BEFORE: i64 = 1_743_296_370_000; // 01:59:30 CET
const SPRING_AFTER: i64 = 1_743_296_410_000; // 03:00:10 CEST
const SPRING_GAP: i64 = 1_743_298_200_000; // "02:30:00"
const FALL_EARLY: i64 = 1_761_434_100_000; // 01:15:00 CEST
const FALL_FOLD: i64 = 1_761_438_600_000; // "02:30:00", first time
const FALL_AFTER: i64 = 1_761_444_000_000; // 03:00:00 CET

#[test]
fn freeswitch_cdr_file_is_detected_and_read_in_local_time() {
    let path = Path::new("tests/golden/freeswitch.csv");
    for format in [InputFormat::Auto, InputFormat::FreeSwitch] {
        let log = read_call_log(path, &madrid(format)).unwrap();
        let id = |n: u32| format!("0b2f6c1e-1d4a-4b7e-9a31-{n:012}");
        // `duration` (attempt to hang-up) is the duration, `billsec` the
        // talk time.
        let expected = vec![
            (1, row(&id(1), "+34600000001", SPRING_BEFORE, Some(25_000))),
            (2, row(&id(2), "+34600000002", SPRING_AFTER, Some(30_000))),
            (3, row(&id(3), "+34600000003", SPRING_GAP, Some(1_000))),
            (
                4,
                unusable(row(&id(4), "+34600000004", FALL_EARLY, Some(0))),
            ),
            (5, row(&id(5), "+34600000005", FALL_FOLD, Some(124_000))),
            (6, row(&id(6), "+34600000006", FALL_AFTER, Some(9_000))),
        ];
        assert_eq!(rows(&log.events), expected, "{format:?}");
        let talk: Vec<Option<i64>> = log.events.iter().map(|(_, e)| e.talk_ms).collect();
        assert_eq!(
            talk,
            [
                Some(20_000),
                Some(0),
                Some(0),
                Some(0),
                Some(120_000),
                Some(7_000)
            ],
            "{format:?}"
        );
        // An anonymous caller is no number: decided as the unusable
        // caller, and listed with its row as a call kept.
        assert_eq!(log.invalid.len(), 1);
        assert_eq!(log.invalid[0].row, 4);
        assert_eq!(log.invalid[0].error.kind(), "bad_number");
        assert!(log.invalid[0].kept);
    }
}

#[test]
fn kamailio_acc_file_keeps_invite_rows_and_lists_the_others() {
    let path = Path::new("tests/golden/kamailio-acc.csv");
    for format in [InputFormat::Auto, InputFormat::KamailioAcc] {
        let log = read_call_log(path, &madrid(format)).unwrap();
        let expected = vec![
            // The challenged INVITE and its authenticated retry share the
            // call id: one call, the second a duplicate when decided.
            (
                1,
                row(
                    "a84b4c76e66710@pbx.example",
                    "+34600000001",
                    SPRING_BEFORE,
                    None,
                ),
            ),
            (
                2,
                row(
                    "a84b4c76e66710@pbx.example",
                    "+34600000001",
                    SPRING_BEFORE + 1_000,
                    None,
                ),
            ),
            (
                4,
                row("b22e90a1@pbx.example", "+34600000002", SPRING_AFTER, None),
            ),
            (6, row("c9d1@pbx.example", "+34600000003", SPRING_GAP, None)),
            (
                7,
                unusable(row("d07f@pbx.example", "+34600000004", FALL_EARLY, None)),
            ),
            (8, row("e1a2@pbx.example", "+34600000005", FALL_FOLD, None)),
            // Epoch seconds (acc's time_mode) are UTC whatever the zone.
            (9, row("f3b4@pbx.example", "+34600000006", FALL_AFTER, None)),
        ];
        assert_eq!(rows(&log.events), expected, "{format:?}");
        let invalid: Vec<(u64, &str)> = log
            .invalid
            .iter()
            .map(|r| (r.row, r.error.kind()))
            .collect();
        assert_eq!(
            invalid,
            vec![
                (3, "not_a_call_attempt"),
                (5, "not_a_call_attempt"),
                (7, "bad_number"),
                (10, "not_a_call_attempt"),
            ]
        );
        assert!(log.invalid[0].error.to_string().contains("BYE"));
    }
}

/// An `acc` table exported with its header (and the database's `id`
/// column first) is named by the header, not by position.
#[test]
fn kamailio_acc_export_with_a_header() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("acc.csv");
    std::fs::write(
        &path,
        "id,method,from_tag,to_tag,callid,sip_code,sip_reason,time,src_user,dst_user,src_ip\n\
         1,INVITE,a,b,x1@h,200,OK,2025-10-26 01:15:00,+34911234567,+34600000001,127.0.0.1\n\
         2,BYE,a,b,x1@h,200,OK,2025-10-26 01:16:00,+34911234567,+34600000001,127.0.0.1\n",
    )
    .unwrap();
    let log = read_call_log(&path, &madrid(InputFormat::Auto)).unwrap();
    assert_eq!(
        rows(&log.events),
        vec![(1, row("x1@h", "+34600000001", FALL_EARLY, None))]
    );
    assert_eq!(log.invalid.len(), 1);
    assert_eq!(log.invalid[0].row, 2);
}

/// Every preset reads back the calls `generate` wrote in it: same callers,
/// callees, start times (to the second, in local time) and talk times (to
/// the second; 0 unanswered); Kamailio's BYE rows are the answered calls.
#[test]
fn every_preset_reads_back_the_generated_calls() {
    let dir = tempfile::tempdir().unwrap();
    let calls = generate(5_000, 11);
    // The switches log the whole duration (the ring, then the talk time)
    // and the talk time, in whole seconds.
    // (The account too: the PBX trunks' accountcode.)
    type Row = (String, String, i64, i64, i64, String);
    let mut expected: Vec<Row> = calls
        .iter()
        .map(|c| {
            let talk = c.talk_ms / 1000 * 1000;
            let ring = c.ring_ms / 1000 * 1000;
            (
                c.caller.clone(),
                c.callee.clone(),
                c.ts_ms / 1000 * 1000,
                ring + talk,
                talk,
                c.account.clone().unwrap_or_default(),
            )
        })
        .collect();
    assert!(expected.iter().any(|r| !r.5.is_empty()), "no trunk calls");
    expected.sort();
    let answered = calls.iter().filter(|c| c.answered()).count();
    assert!(answered > 0 && answered < calls.len());
    for format in [
        InputFormat::Asterisk,
        InputFormat::FreeSwitch,
        InputFormat::KamailioAcc,
    ] {
        let path = dir.path().join(format!("{format:?}.csv"));
        write_cdr(&path, &calls, format, MADRID).unwrap();
        let log = read_call_log(&path, &madrid(InputFormat::Auto)).unwrap();
        let mut got: Vec<Row> = log
            .events
            .iter()
            .map(|(_, e)| {
                (
                    e.caller.to_string(),
                    e.callee.as_ref().map(|c| c.to_string()).unwrap_or_default(),
                    e.ts_ms,
                    e.duration_ms.unwrap_or(0),
                    e.talk_ms.unwrap_or(0),
                    e.account.as_deref().unwrap_or_default().to_string(),
                )
            })
            .collect();
        got.sort();
        if format == InputFormat::KamailioAcc {
            // acc has no duration, talk time nor account: compare the rest.
            let strip = |v: &[Row]| -> Vec<(String, String, i64)> {
                let mut v: Vec<_> = v
                    .iter()
                    .map(|(a, b, t, _, _, _)| (a.clone(), b.clone(), *t))
                    .collect();
                v.sort();
                v
            };
            assert_eq!(strip(&got), strip(&expected));
            assert_eq!(log.invalid.len(), answered, "one BYE per answered call");
            assert!(log
                .invalid
                .iter()
                .all(|r| r.error.kind() == "not_a_call_attempt"));
        } else {
            let differ = got.iter().zip(&expected).filter(|(g, x)| g != x).count();
            assert_eq!(got.len(), expected.len(), "{format:?}");
            assert_eq!(
                differ,
                0,
                "{format:?}: e.g. {:?}",
                got.iter().zip(&expected).find(|(g, x)| g != x)
            );
            assert!(
                log.invalid.is_empty(),
                "{format:?}: {:?}",
                log.invalid.first()
            );
        }
        let ids: std::collections::HashSet<_> = log
            .events
            .iter()
            .map(|(_, e)| e.call_id.to_string())
            .collect();
        assert_eq!(ids.len(), calls.len(), "{format:?}: one call id per call");
    }
}

fn run(args: &[&str]) -> std::process::Output {
    let o = Command::new(bin()).args(args).output().unwrap();
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// End to end: `generate --format X` then `replay` with the format told
/// from the file decides exactly as a replay of the same calls written as
/// callguard's CSV (epoch milliseconds, in the CDR's row order).
#[test]
fn replaying_a_cdr_file_decides_like_the_csv_of_its_calls() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    for (name, format) in [
        ("asterisk", InputFormat::Asterisk),
        ("freeswitch", InputFormat::FreeSwitch),
        ("kamailio-acc", InputFormat::KamailioAcc),
    ] {
        let cdr = p(&format!("{name}.cdr"));
        run(&[
            "generate",
            "--rows",
            "8000",
            "--seed",
            "5",
            "--format",
            name,
            "--timezone",
            "Europe/Madrid",
            "-o",
            &cdr,
        ]);
        let log = read_call_log(Path::new(&cdr), &madrid(format)).unwrap();
        let mut csv = String::from("call_id,caller,callee,ts,duration_ms\n");
        for (_, e) in &log.events {
            csv.push_str(&format!(
                "{},{},{},{},{}\n",
                e.call_id,
                e.caller,
                e.callee.as_deref().unwrap_or(""),
                e.ts_ms,
                e.duration_ms.map(|d| d.to_string()).unwrap_or_default()
            ));
        }
        let plain = p(&format!("{name}.csv"));
        std::fs::write(&plain, csv).unwrap();
        let (from_cdr, from_csv) = (
            p(&format!("{name}.cdr.out.csv")),
            p(&format!("{name}.out.csv")),
        );
        let rules = ["--rules", "data/rules.toml"];
        let o = run(&[
            &[
                "replay",
                "-i",
                &cdr,
                "--timezone",
                "Europe/Madrid",
                "-o",
                &from_cdr,
            ][..],
            &rules,
        ]
        .concat());
        run(&[&["replay", "-i", &plain, "-o", &from_csv][..], &rules].concat());
        let (a, b) = (
            std::fs::read(&from_cdr).unwrap(),
            std::fs::read(&from_csv).unwrap(),
        );
        assert_eq!(
            a.iter().filter(|c| **c == b'\n').count(),
            log.events.len() + 1
        );
        assert!(a == b, "{name}: decisions differ from the CSV replay");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains("rejected "), "{out}");
        if format == InputFormat::KamailioAcc {
            assert!(out.contains("not call attempts"), "{out}");
        }
    }
}

/// A preset forced on a file of another shape says what it expected.
#[test]
fn a_forced_preset_on_another_file_says_what_it_expected() {
    let o = Command::new(bin())
        .args([
            "replay",
            "-i",
            "data/calls.csv",
            "--format",
            "freeswitch",
            "--rules",
            "data/rules.toml",
            "-o",
        ])
        .arg(tempfile::tempdir().unwrap().path().join("d.csv"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("FreeSWITCH") && err.contains("at least 11"),
        "{err}"
    );
}

/// The switches' account codes (Asterisk and FreeSWITCH `accountcode`)
/// are read as the call's `account`, which rules keyed by account count.
#[test]
fn account_codes_are_read_as_the_calls_account() {
    let dir = tempfile::tempdir().unwrap();
    let master = std::fs::read_to_string("tests/golden/Master.csv").unwrap();
    let first = master.lines().next().unwrap();
    assert!(first.starts_with("\"\","), "{first}");
    let path = dir.path().join("Master.csv");
    std::fs::write(&path, format!("\"acme-trunk\",{}\n", &first[3..])).unwrap();
    let log = read_call_log(&path, &madrid(InputFormat::Asterisk)).unwrap();
    assert_eq!(log.events.len(), 1, "{:?}", log.invalid);
    assert_eq!(log.events[0].1.account.as_deref(), Some("acme-trunk"));
    let fs = std::fs::read_to_string("tests/golden/freeswitch.csv").unwrap();
    let mut fields: Vec<String> = fs
        .lines()
        .next()
        .unwrap()
        .split(',')
        .map(str::to_string)
        .collect();
    fields[12] = "\"tenant:42\"".into();
    let path = dir.path().join("freeswitch.csv");
    std::fs::write(&path, fields.join(",") + "\n").unwrap();
    let log = read_call_log(&path, &madrid(InputFormat::FreeSwitch)).unwrap();
    assert_eq!(log.events[0].1.account.as_deref(), Some("tenant:42"));
}

//! The commit call's bytes against `lua/commit.lua` on a real
//! redis-server: for every combination of flags the Rust encoder can send
//! (log operation, records operation, block key, TTL, a version check, a
//! caller believed new, a stale version, a version whose state string is
//! gone), two callers in one call, so a reader that takes one argument or
//! key too many or too few for the first caller garbles the second. Each
//! caller's keys are checked afterwards: a refused caller's as they were,
//! TTL and all.

use redis::Value;

use super::wire::*;
use super::*;
use crate::engine::window::PackedLog;
use crate::store::test_server::Server;

/// What the caller's version looks like to the write.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    /// Believed new (no state string): created only if absent.
    New,
    /// The version in Redis.
    Right,
    /// Another version: refused.
    Stale,
    /// A version, but no state string (expired, or deleted by hand):
    /// refused, and nothing left behind.
    Gone,
}

/// One combination of flags.
#[derive(Clone, Copy, Debug)]
struct Case {
    log: u8,
    records: u8,
    block: bool,
    ttl: bool,
    check: bool,
    expect: Expect,
}

const OLD_VERSION: u64 = 0x1111;
const OLD_TTL_MS: u64 = 100_000;
const NEW_TTL_MS: u64 = 500_000;
const BLOCK_TTL_MS: i64 = 40_000;

/// Every combination the encoder can produce: a version check carries
/// no other flag and an expected version; a caller believed new carries
/// its TTL (`Write::plain_ttl` sends the simplest of those outside the
/// script, but the script must take them all).
fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for expect in [Expect::New, Expect::Right, Expect::Stale, Expect::Gone] {
        out.push(Case {
            log: b'-',
            records: b'-',
            block: false,
            ttl: false,
            check: true,
            expect,
        });
        for log in *b"-KASD" {
            for records in *b"-HSD" {
                for block in [false, true] {
                    for ttl in [false, true] {
                        if expect == Expect::New && !ttl {
                            continue;
                        }
                        out.push(Case {
                            log,
                            records,
                            block,
                            ttl,
                            check: false,
                            expect,
                        });
                    }
                }
            }
        }
    }
    // A replaced log or records moved out always set the TTL again
    // (`SET` and a new hash have none).
    out.retain(|c| c.ttl || (c.log != b'S' && c.records != b'S'));
    out
}

/// The write of `case` for `caller`.
fn write_of(case: Case, caller: &str, pending: usize) -> Write {
    let log_op = match case.log {
        b'K' => LogOp::Keep,
        b'A' => LogOp::Append(b"appended".to_vec()),
        b'S' => LogOp::Set(b"replaced".to_vec()),
        b'D' => LogOp::Delete,
        _ => LogOp::Inline,
    };
    let records_op = match case.records {
        b'H' => RecordsOp::Hash,
        b'S' => RecordsOp::Replace,
        b'D' => RecordsOp::Delete,
        _ => RecordsOp::Inline,
    };
    let expected = match case.expect {
        Expect::New => None,
        Expect::Right => Some(OLD_VERSION),
        Expect::Stale | Expect::Gone => Some(OLD_VERSION + 2),
    };
    let with_records = matches!(records_op, RecordsOp::Hash | RecordsOp::Replace);
    Write {
        caller: caller.into(),
        pending,
        check: case.check,
        expected,
        version: 0x2222,
        ttl_ms: case.ttl.then_some(NEW_TTL_MS),
        log_op,
        log: PackedLog::Inline,
        value: if case.check {
            Vec::new()
        } else {
            format!("new state of {caller}").into_bytes()
        },
        records_op,
        sets: if with_records {
            vec![("n1".into(), "r1".into()), ("n2".into(), "r2".into())]
        } else {
            Vec::new()
        },
        dels: if records_op == RecordsOp::Hash {
            vec!["gone".into()]
        } else {
            Vec::new()
        },
        block: case.block.then(|| ("rule".into(), BLOCK_TTL_MS)),
        read_ids: None,
    }
}

/// The keys a caller holds before its write: its state string (unless
/// believed new), a log string and a records hash, all with a TTL.
fn seed(con: &mut redis::Connection, store: &CachedStore, case: Case, caller: &str) {
    let mut old = OLD_VERSION.to_le_bytes().to_vec();
    old.extend_from_slice(b"old state");
    let mut pipe = redis::pipe();
    if !matches!(case.expect, Expect::New | Expect::Gone) {
        pipe.cmd("SET")
            .arg(store.state_key(caller))
            .arg(old)
            .arg("PX")
            .arg(OLD_TTL_MS);
    }
    pipe.cmd("SET")
        .arg(store.log_key(caller))
        .arg("old log")
        .arg("PX")
        .arg(OLD_TTL_MS);
    pipe.cmd("HSET")
        .arg(store.records_key(caller))
        .arg("kept")
        .arg("rk")
        .arg("gone")
        .arg("rg");
    pipe.cmd("PEXPIRE")
        .arg(store.records_key(caller))
        .arg(OLD_TTL_MS);
    let _: () = pipe.query(con).unwrap();
}

fn pttl(con: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(con).unwrap()
}

/// Checks `caller`'s keys after its write of `case`; `written` says
/// whether the script reported it written.
fn check_after(
    con: &mut redis::Connection,
    store: &CachedStore,
    case: Case,
    caller: &str,
    written: bool,
) {
    let what = format!("{case:?} for {caller}");
    let refused = matches!(case.expect, Expect::Stale | Expect::Gone);
    assert_eq!(written, !refused, "{what}: refused");
    let applies = written && !case.check;
    let state: Option<Vec<u8>> = redis::cmd("GET")
        .arg(store.state_key(caller))
        .query(con)
        .unwrap();
    let log: Option<Vec<u8>> = redis::cmd("GET")
        .arg(store.log_key(caller))
        .query(con)
        .unwrap();
    let mut records: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(store.records_key(caller))
        .query(con)
        .unwrap();
    records.sort();
    let block: Option<String> = redis::cmd("GET")
        .arg(store.config().block_key(caller))
        .query(con)
        .unwrap();
    let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
    let old_records = vec![pair("gone", "rg"), pair("kept", "rk")];
    if !applies {
        let mut old = OLD_VERSION.to_le_bytes().to_vec();
        old.extend_from_slice(b"old state");
        let held = !matches!(case.expect, Expect::New | Expect::Gone);
        assert_eq!(state, held.then_some(old), "{what}: state");
        if held {
            // Left as it was, TTL and all.
            let ttl = pttl(con, &store.state_key(caller));
            assert!((1..=OLD_TTL_MS as i64).contains(&ttl), "{what}: TTL {ttl}");
        }
        assert_eq!(log.as_deref(), Some(&b"old log"[..]), "{what}: log");
        assert_eq!(records, old_records, "{what}: records");
        assert_eq!(block, None, "{what}: block key");
        return;
    }
    assert_eq!(
        state,
        Some(format!("new state of {caller}").into_bytes()),
        "{what}: state"
    );
    let state_ttl = pttl(con, &store.state_key(caller));
    if case.ttl {
        assert!(state_ttl > OLD_TTL_MS as i64, "{what}: TTL {state_ttl}");
    } else {
        assert!(
            (1..=OLD_TTL_MS as i64).contains(&state_ttl),
            "{what}: TTL kept {state_ttl}"
        );
    }
    let log_expected: Option<&[u8]> = match case.log {
        b'A' => Some(b"old logappended"),
        b'S' => Some(b"replaced"),
        b'D' => None,
        _ => Some(b"old log"),
    };
    assert_eq!(log.as_deref(), log_expected, "{what}: log");
    if matches!(case.log, b'K' | b'A' | b'S') && case.ttl {
        assert!(
            pttl(con, &store.log_key(caller)) > OLD_TTL_MS as i64,
            "{what}: log TTL"
        );
    }
    let records_expected = match case.records {
        b'H' => vec![pair("kept", "rk"), pair("n1", "r1"), pair("n2", "r2")],
        b'S' => vec![pair("n1", "r1"), pair("n2", "r2")],
        b'D' => Vec::new(),
        _ => old_records,
    };
    assert_eq!(records, records_expected, "{what}: records");
    if matches!(case.records, b'H' | b'S') {
        let ttl = pttl(con, &store.records_key(caller));
        if case.ttl {
            assert!(ttl > OLD_TTL_MS as i64, "{what}: records TTL {ttl}");
        } else if case.records == b'H' {
            assert!(ttl > 0, "{what}: records TTL {ttl}");
        }
    }
    if case.block {
        assert_eq!(block.as_deref(), Some("rule"), "{what}: block key");
        let ttl = pttl(con, &store.config().block_key(caller));
        assert!((1..=BLOCK_TTL_MS).contains(&ttl), "{what}: block TTL {ttl}");
    } else {
        assert_eq!(block, None, "{what}: block key");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_flag_combination_reads_back_as_written() {
    if !Server::available("the commit protocol tests") {
        return;
    }
    let server = Server::start();
    let config = RedisConfig {
        urls: vec![server.url()],
        ..RedisConfig::default()
    };
    let store = CachedStore::connect(config, 10).await.unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut con = client.get_connection().unwrap();
    let cases = cases();
    assert!(cases.len() > 100, "{} cases", cases.len());
    let mut con_async = client.get_multiplexed_async_connection().await.unwrap();
    let mut checked = 0;
    // Each case as the first caller, with the next case as the second.
    for (n, (&first, &second)) in cases.iter().zip(cases.iter().cycle().skip(1)).enumerate() {
        let callers = [format!("+3491{n:06}1"), format!("+3491{n:06}2")];
        seed(&mut con, &store, first, &callers[0]);
        seed(&mut con, &store, second, &callers[1]);
        let writes = [
            write_of(first, &callers[0], 0),
            write_of(second, &callers[1], 1),
        ];
        let cmd = invocation(
            store.config(),
            &store.sha,
            &[&writes[0], &writes[1]],
            n % 2 == 1,
        );
        let reply: Value = cmd
            .query_async(&mut con_async)
            .await
            .unwrap_or_else(|e| panic!("{first:?} then {second:?}: {e}"));
        let mut found = Vec::new();
        refusals(Some(reply), &[0, 1], &mut found).unwrap();
        for (i, case) in [first, second].into_iter().enumerate() {
            let refused = found.iter().find(|(w, _)| *w == i);
            check_after(&mut con, &store, case, &callers[i], refused.is_none());
            checked += 1;
            if let Some((_, value)) = refused {
                // A refusal carries the state string as it is.
                let now: Option<Vec<u8>> = redis::cmd("GET")
                    .arg(store.state_key(&callers[i]))
                    .query(&mut con)
                    .unwrap();
                assert_eq!(value, &now, "{case:?}: the refusal's state");
            }
        }
    }
    assert_eq!(checked, 2 * cases.len());
}

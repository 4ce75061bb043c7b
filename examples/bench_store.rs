//! Benchmark of the Redis window store against a local redis-server.
//!
//! Run: `cargo run --release --example bench_store [-- EVENTS]`
//!
//! It starts its own redis-server on a free loopback port and reports:
//! 1. Redis memory per active caller for each rule kind at 20 calls per
//!    window, with and without idempotency records (INFO used_memory delta),
//!    and what 20 distinct callees add (the distinct-callees feature);
//! 2. events/s through the pipelined batch API, beside `redis-benchmark`
//!    running the same script with the same pipelining depth (the Redis
//!    ceiling for that script) in the same run, as a ratio.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use callguard::engine::event::CallEvent;
use callguard::engine::rules::RuleSet;
use callguard::store::redis::{RedisConfig, RedisStore, WINDOW_LUA};

const T0: i64 = 1_764_547_200_000;
const PIPELINE: usize = 256;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

fn used_memory(con: &mut redis::Connection) -> i64 {
    let info: String = redis::cmd("INFO").arg("memory").query(con).expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory")
}

fn event(caller: usize, i: usize, ts: i64) -> CallEvent {
    CallEvent {
        call_id: format!("c{caller}-{i}"),
        caller: format!("+3460{caller:07}"),
        ts_ms: ts,
        callee: None,
        duration_ms: None,
        label: None,
        list_number: None,
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let total: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200_000);
    let port = free_port();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut server = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server must be installed (apt-get install redis-server)");
    let url = format!("redis://127.0.0.1:{port}");
    let client = redis::Client::open(url.as_str()).expect("url");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut con = loop {
        if let Ok(c) = client.get_connection() {
            break c;
        }
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    };

    println!("## Redis memory per active caller (20 calls per window, 2,000 callers)\n");
    println!("| rule | idempotency on | idempotency off |");
    println!("|---|---|---|");
    for (name, rule, callees) in [
        ("fixed 60s", "m:fixed:60s:100", false),
        ("sliding 60s", "m:sliding:60s:100", false),
        ("sliding-approx 60s", "m:sliding-approx:60s:100", false),
        (
            "sliding 60s, 20 distinct callees",
            "m:sliding:60s:100",
            true,
        ),
    ] {
        let rules = RuleSet::from_args(None, &[rule.to_string()]).expect("rules");
        let mut row = format!("| {name} |");
        for idem in [true, false] {
            let _: () = redis::cmd("FLUSHALL").query(&mut con).expect("flush");
            let before = used_memory(&mut con);
            let config = RedisConfig {
                urls: vec![url.clone()],
                idempotency: idem,
                key_prefix: "cg:".into(),
                ..RedisConfig::default()
            };
            let mut store = RedisStore::connect(config).await.expect("connect");
            let callers = 2_000;
            let mut batch = Vec::new();
            for i in 0..20 {
                for c in 0..callers {
                    // 20 calls spread over 50 s, all inside one 60 s window.
                    let mut e = event(c, i, T0 + (i as i64) * 2_500 + (c as i64 % 1_000));
                    if callees {
                        e.callee = Some(format!("+3491{i:07}"));
                    }
                    batch.push(e);
                    if batch.len() == PIPELINE {
                        store.apply_batch(&rules, &batch).await.expect("apply");
                        batch.clear();
                    }
                }
            }
            store.apply_batch(&rules, &batch).await.expect("apply");
            let after = used_memory(&mut con);
            row.push_str(&format!(" {} B |", (after - before) / callers as i64));
        }
        println!("{row}");
    }

    println!("\n## Throughput, {total} events, pipeline depth {PIPELINE}\n");
    let rules = RuleSet::from_toml(include_str!("../data/rules.toml")).expect("rules");
    let _: () = redis::cmd("FLUSHALL").query(&mut con).expect("flush");
    let mut store = RedisStore::connect(RedisConfig {
        urls: vec![url.clone()],
        ..RedisConfig::default()
    })
    .await
    .expect("connect");
    let events: Vec<CallEvent> = (0..total)
        .map(|i| event(i % 50_000, i, T0 + (i as i64) * 2))
        .collect();
    let start = Instant::now();
    for chunk in events.chunks(PIPELINE) {
        store.apply_batch(&rules, chunk).await.expect("apply");
    }
    let ours = total as f64 / start.elapsed().as_secs_f64();

    // The same script, keys and argument shapes through redis-benchmark.
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(WINDOW_LUA)
        .query(&mut con)
        .expect("load");
    let _: () = redis::cmd("FLUSHALL").query(&mut con).expect("flush");
    let _: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(WINDOW_LUA)
        .query(&mut con)
        .expect("load");
    // The store's own invocation for a template event whose caller and call
    // id redis-benchmark randomises (`__rand_int__`), so the peer runs exactly
    // the keys and arguments the store sends.
    let template = event(0, 0, T0);
    let template = CallEvent {
        call_id: "c__rand_int__".into(),
        caller: "+3460__rand_int__".into(),
        ..template
    };
    let args: Vec<String> = store
        .invocation(&rules, &template)
        .args_iter()
        .map(|a| match a {
            redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            other => panic!("unexpected argument {other:?} in the invocation"),
        })
        .collect();
    assert_eq!(args[1], sha, "the store loaded another script");
    let out = Command::new("redis-benchmark")
        .args([
            "-p",
            &port.to_string(),
            "-n",
            &total.to_string(),
            "-P",
            &PIPELINE.to_string(),
        ])
        .args(["-c", "1", "-r", "50000", "-q"])
        .args(&args)
        .output()
        .expect("redis-benchmark (package redis-tools) must be installed");
    let text = String::from_utf8_lossy(&out.stdout);
    let peer: f64 = text
        .split_whitespace()
        .zip(text.split_whitespace().skip(1))
        .find(|(_, b)| *b == "requests")
        .and_then(|(a, _)| a.parse().ok())
        .unwrap_or_else(|| panic!("cannot read redis-benchmark output: {text}"));
    println!(
        "redis-benchmark said: {}",
        text.rsplit('\r').next().unwrap_or("").trim()
    );
    println!("| client | events/s |");
    println!("|---|---|");
    println!("| callguard batch API (1 connection) | {ours:.0} |");
    println!("| redis-benchmark, same script (1 connection) | {peer:.0} |");
    println!("\nratio callguard / redis-benchmark: {:.2}", ours / peer);
    let _ = server.kill();
    let _ = server.wait();
}

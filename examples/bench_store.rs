//! Benchmark of the Redis window store against a local redis-server.
//!
//! Run: `cargo run --release --example bench_store [-- EVENTS [flood|ceiling]]`
//!
//! It starts its own redis-server on a free loopback port and reports:
//! 1. Redis memory per active caller for each rule kind at 20 calls per
//!    window, with and without idempotency records (INFO used_memory delta),
//!    and what 20 distinct callees add (the distinct-callees feature);
//! 2. events/s through the pipelined batch API (up to 32 events per script
//!    call), beside `redis-benchmark` running the same script with one
//!    event per call at the same pipelining depth, in the same run, as a
//!    ratio (above 1: what several events per call save);
//! 3. the store's events/s with one sliding rule and with `data/rules.toml`
//!    (three rules, idempotency and distinct callees on) beside the seeds'
//!    one-key sliding-window script (ZREMRANGEBYSCORE, ZCARD, ZADD,
//!    PEXPIRE) through `redis-benchmark` (pipeline 256, 8 clients, 100,000
//!    keys): the median of 3 alternating rounds, the ratios, Redis CPU
//!    microseconds per event (`INFO cpu` deltas) and the store's own (this
//!    thread's CPU time: it decides, encodes and runs the Redis
//!    connection's task, on a single-threaded runtime). The store's
//!    events go to 100,000 callers in turn, so with EVENTS = 100,000 each
//!    is a new caller and with 200,000 each caller calls twice. Issue #13's
//!    yardstick;
//! 4. one caller flooding at 1,000 calls/s of event time: events/s of each
//!    mode, per stretch of the flood, as the caller's state grows
//!    (`bench_store EVENTS flood` runs only this section).
//!
//! `bench_store EVENTS ceiling` runs only section 3; `BENCH_BATCH=N` sets
//! its store's batch size (default 256), `BENCH_PROFILE=1` (or 3, 5) runs
//! only that rule set once, for a profiler. `bench_store EVENTS aggregate`
//! measures rules keyed by callee or global against data/rules.toml
//! alone; `BENCH_AGG_SETS=0,2` runs only those of its rule sets.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use callguard::engine::event::CallEvent;
use callguard::engine::rules::RuleSet;
use callguard::store::cached::CacheLimit;
use callguard::store::redis::{RedisConfig, RedisStore, WINDOW_LUA};
use callguard::store::{AnyStore, WindowStore};

/// The allocator the callguard binary runs with (src/main.rs), with its
/// page setting (`prefer_small_pages` in main), so the store is measured as
/// it runs there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const T0: i64 = 1_764_547_200_000;
const PIPELINE: usize = 256;

/// Events per batch in section 3: `BENCH_BATCH` (default [`PIPELINE`],
/// the seeds' script's pipeline depth; `consume` decides batches of up to
/// 500 by default).
fn ceiling_batch() -> usize {
    std::env::var("BENCH_BATCH")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(PIPELINE)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A Redis store: the window script (`cached = false`) or the cached store.
async fn connect(config: RedisConfig, cached: bool) -> AnyStore {
    AnyStore::connect_redis(config, cached.then_some(CacheLimit::callers(1_000_000)))
        .await
        .expect("connect")
}

fn used_memory(con: &mut redis::Connection) -> i64 {
    let info: String = redis::cmd("INFO").arg("memory").query(con).expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory")
}

fn event(caller: usize, i: usize, ts: i64) -> CallEvent {
    CallEvent::new(format!("c{caller}-{i}"), format!("+3460{caller:07}"), ts)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    callguard::process::prefer_small_pages();
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

    match std::env::args().nth(2).as_deref() {
        Some("flood") => {
            flood(&mut con, &url).await;
            let _ = server.kill();
            let _ = server.wait();
            return;
        }
        Some("aggregate") => {
            aggregate_cost(&mut con, &url, total).await;
            let _ = server.kill();
            let _ = server.wait();
            return;
        }
        Some("ceiling") => {
            ceiling_comparison(&mut con, &url, port, total).await;
            let _ = server.kill();
            let _ = server.wait();
            return;
        }
        _ => {}
    }
    println!("## Redis memory per active caller (20 calls per window, 2,000 callers)\n");
    println!("| rule | script, idempotency on | script, off | cached, on | cached, off |");
    println!("|---|---|---|---|---|");
    let shorthand = |r: &str| RuleSet::from_args(None, &[r.to_string()]).expect("rules");
    // The newer kinds alone (the distinct-callees feature off), 20 callees.
    let toml = |rule: &str| {
        RuleSet::from_toml(&format!(
            "distinct_callees = false\n[[rule]]\nname = \"m\"\n{rule}"
        ))
        .expect("rules")
    };
    // (name, rules, callees, ends: each call ends 1 ms later with 30 s
    // of talk).
    let kinds = [
        ("fixed 60s", shorthand("m:fixed:60s:100"), false, false),
        ("sliding 60s", shorthand("m:sliding:60s:100"), false, false),
        (
            "sliding-approx 60s",
            shorthand("m:sliding-approx:60s:100"),
            false,
            false,
        ),
        (
            "sliding 60s, 20 distinct callees",
            shorthand("m:sliding:60s:100"),
            true,
            false,
        ),
        (
            "token-bucket 1/s, burst 100",
            toml("kind = \"token-bucket\"\nrate = \"1/s\"\nburst = 100\n"),
            false,
            false,
        ),
        (
            "distinct-callees 60s, 20 callees (feature off)",
            toml("kind = \"distinct-callees\"\nwindow = \"60s\"\nlimit = 100\n"),
            true,
            false,
        ),
        (
            "sliding 60s seeing callees +3491 (own log; feature off)",
            toml("kind = \"sliding\"\nwindow = \"60s\"\nlimit = 100\ncallees = [\"+3491\"]\n"),
            true,
            false,
        ),
        (
            "sliding 60s keyed caller+callee, 20 callees (feature off)",
            toml("kind = \"sliding\"\nwindow = \"60s\"\nlimit = 100\nkey = \"caller+callee\"\n"),
            true,
            false,
        ),
        (
            "concurrent 4h, 20 calls open (feature off)",
            toml("kind = \"concurrent\"\nmax_duration = \"4h\"\nlimit = 100\n"),
            false,
            false,
        ),
        (
            "sum talk sliding 60s, 20 calls waiting for their ends (feature off)",
            toml("kind = \"sliding\"\nwindow = \"60s\"\nsum = \"talk\"\nlimit = 100000\n"),
            false,
            false,
        ),
        (
            "sum talk sliding 60s, 20 ended calls (feature off)",
            toml("kind = \"sliding\"\nwindow = \"60s\"\nsum = \"talk\"\nlimit = 100000\n"),
            false,
            true,
        ),
    ];
    for (name, rules, callees, ends) in kinds {
        let mut row = format!("| {name} |");
        for (cached, idem) in [(false, true), (false, false), (true, true), (true, false)] {
            let _: () = redis::cmd("FLUSHALL").query(&mut con).expect("flush");
            let config = RedisConfig {
                urls: vec![url.clone()],
                idempotency: idem,
                key_prefix: "cg:".into(),
                ..RedisConfig::default()
            };
            let mut store = connect(config, cached).await;
            let before = used_memory(&mut con);
            let callers = 2_000;
            let mut batch = Vec::new();
            for i in 0..20 {
                for c in 0..callers {
                    // 20 calls spread over 50 s, all inside one 60 s window.
                    let mut e = event(c, i, T0 + (i as i64) * 2_500 + (c as i64 % 1_000));
                    if callees {
                        e.callee = Some(format!("+3491{i:07}").into());
                    }
                    let end = ends.then(|| CallEvent {
                        kind: callguard::engine::event::EventKind::End,
                        ts_ms: e.ts_ms + 1,
                        talk_ms: Some(30_000),
                        ..e.clone()
                    });
                    batch.push(e);
                    batch.extend(end);
                    if batch.len() >= PIPELINE {
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
        .invocation(&rules, &[&template])
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
    println!("| redis-benchmark, same script, one event per call (1 connection) | {peer:.0} |");
    println!("\nratio callguard / redis-benchmark: {:.2}", ours / peer);

    ceiling_comparison(&mut con, &url, port, total).await;
    flood(&mut con, &url).await;
    let _ = server.kill();
    let _ = server.wait();
}

/// The seeds' one-key sliding-window script: the simple ceiling.
const SEEDS_SCRIPT: &str =
    "redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, tonumber(ARGV[1]) - tonumber(ARGV[2])) \
local c = redis.call('ZCARD', KEYS[1]) \
if c < tonumber(ARGV[3]) then redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4]) \
redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end return 0";

/// Redis CPU seconds so far (user + system).
fn redis_cpu(con: &mut redis::Connection) -> f64 {
    let info: String = redis::cmd("INFO").arg("cpu").query(con).expect("INFO cpu");
    info.lines()
        .filter_map(|l| {
            l.strip_prefix("used_cpu_sys:")
                .or_else(|| l.strip_prefix("used_cpu_user:"))
        })
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum()
}

/// Events/s and Redis CPU µs per event of the seeds' script.
/// One timed round: events/s, Redis CPU µs per event and, for the store,
/// the benchmark thread's own CPU µs per event (deciding, encoding and the
/// Redis connection's task: all run on it).
type Round = (f64, f64, Option<f64>);

/// CPU time of the calling thread so far, in ns (Linux's schedstat), if
/// readable.
fn thread_cpu_ns() -> Option<f64> {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn seeds_round(con: &mut redis::Connection, port: u16, total: usize) -> Round {
    let _: () = redis::cmd("FLUSHALL").query(con).expect("flush");
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(SEEDS_SCRIPT)
        .query(con)
        .expect("load");
    let cpu = redis_cpu(con);
    let out = Command::new("redis-benchmark")
        .args(["-p", &port.to_string(), "-n", &total.to_string()])
        .args(["-P", "256", "-c", "8", "-r", "100000", "-q"])
        .args(["EVALSHA", &sha, "1", "seed:__rand_int__"])
        .arg(T0.to_string())
        .args(["60000", "20", "__rand_int__"])
        .output()
        .expect("redis-benchmark (package redis-tools) must be installed");
    let text = String::from_utf8_lossy(&out.stdout);
    let rate: f64 = text
        .split_whitespace()
        .zip(text.split_whitespace().skip(1))
        .find(|(_, b)| *b == "requests")
        .and_then(|(a, _)| a.parse().ok())
        .unwrap_or_else(|| panic!("cannot read redis-benchmark output: {text}"));
    (rate, (redis_cpu(con) - cpu) * 1e6 / total as f64, None)
}

/// Events/s, Redis CPU µs per event and the store's own CPU µs per event
/// on `rules`.
async fn store_round(
    con: &mut redis::Connection,
    url: &str,
    rules: &RuleSet,
    total: usize,
    cached: bool,
) -> Round {
    let _: () = redis::cmd("FLUSHALL").query(con).expect("flush");
    let config = RedisConfig {
        urls: vec![url.to_string()],
        ..RedisConfig::default()
    };
    let mut store = connect(config, cached).await;
    let events: Vec<CallEvent> = (0..total)
        .map(|i| {
            let mut e = event(i % 100_000, i, T0 + (i as i64) * 2);
            e.callee = Some(format!("+3491{:07}", i % 5_000).into());
            e
        })
        .collect();
    let cpu = redis_cpu(con);
    let own = thread_cpu_ns();
    let start = Instant::now();
    for chunk in events.chunks(ceiling_batch()) {
        store.apply_batch(rules, chunk).await.expect("apply");
    }
    let rate = total as f64 / start.elapsed().as_secs_f64();
    let own = own
        .zip(thread_cpu_ns())
        .map(|(a, b)| (b - a) / 1e3 / total as f64);
    (rate, (redis_cpu(con) - cpu) * 1e6 / total as f64, own)
}

fn median(mut v: Vec<Round>) -> Round {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v[v.len() / 2]
}

/// The 5-rule set: `data/rules.toml` plus these two of `data/rules-fraud.toml`.
const FIVE_EXTRA: &str = r#"
[[rule]]
name = "spray"
kind = "distinct-callees"
window = "10m"
limit = 60

[[rule]]
name = "pbx_burst"
kind = "token-bucket"
rate = "2/s"
burst = 20
"#;

/// Section 3: the store against the seeds' one-key script, same run.
async fn ceiling_comparison(con: &mut redis::Connection, url: &str, port: u16, total: usize) {
    let one = RuleSet::from_args(None, &["minute:sliding:60s:20".into()]).expect("rules");
    let three = RuleSet::from_toml(include_str!("../data/rules.toml")).expect("rules");
    // The example set plus a distinct-callees rule and a token bucket.
    let five = RuleSet::from_toml(&format!(
        "{}{FIVE_EXTRA}",
        include_str!("../data/rules.toml")
    ))
    .expect("rules");
    let (mut seeds, mut s1, mut s3, mut c1, mut c3) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut s5, mut c5) = (Vec::new(), Vec::new());
    // BENCH_CACHED_ONLY=1 leaves the script store out (a quicker A/B of the default).
    let script = std::env::var_os("BENCH_CACHED_ONLY").is_none();
    // BENCH_PROFILE=1 (or 3, 5): that set alone, in the default store,
    // once, with no peer: a profiler's run.
    if let Ok(set) = std::env::var("BENCH_PROFILE") {
        let rules = match set.as_str() {
            "3" => &three,
            "5" => &five,
            _ => &one,
        };
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query(con)
            .expect("reset stats");
        let (rate, redis, own) = store_round(con, url, rules, total, true).await;
        println!(
            "{set} rule(s): {rate:.0} events/s, Redis {redis:.1} µs/event, own {own:?} µs/event"
        );
        let info: String = redis::cmd("INFO")
            .arg("stats")
            .query(con)
            .expect("INFO stats");
        let bytes = |name: &str| -> f64 {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
                .unwrap_or(0.0)
        };
        println!(
            "bytes/event: in {:.0}, out {:.0}",
            bytes("total_net_input_bytes") / total as f64,
            bytes("total_net_output_bytes") / total as f64
        );
        // Redis's own time per command (inside scripts too), per event.
        let stats: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(con)
            .expect("INFO commandstats");
        for line in stats.lines().filter(|l| l.starts_with("cmdstat_")) {
            let field = |name: &str| -> f64 {
                line.split([':', ','])
                    .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
                    .unwrap_or(0.0)
            };
            let calls = field("calls");
            let usec = field("usec");
            println!(
                "{:<24} {:>8.3} calls/event {:>6.2} µs/call {:>6.2} µs/event",
                line.split(':').next().unwrap_or(""),
                calls / total as f64,
                usec / calls.max(1.0),
                usec / total as f64
            );
        }
        return;
    }
    for _ in 0..3 {
        seeds.push(seeds_round(con, port, total));
        if script {
            s1.push(store_round(con, url, &one, total, false).await);
            s3.push(store_round(con, url, &three, total, false).await);
            s5.push(store_round(con, url, &five, total, false).await);
        }
        c1.push(store_round(con, url, &one, total, true).await);
        c3.push(store_round(con, url, &three, total, true).await);
        c5.push(store_round(con, url, &five, total, true).await);
    }
    // Each round's ratio to the seeds' round just before it, then their
    // median: steadier than a ratio of medians while the machine's speed
    // moves between rounds.
    let paired = |store: &[Round]| {
        let mut r: Vec<f64> = store.iter().zip(&seeds).map(|(s, b)| s.0 / b.0).collect();
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    };
    let (p1, p3, p5) = (paired(&c1), paired(&c3), paired(&c5));
    let (q1, q3, q5) = if script {
        (Some(paired(&s1)), Some(paired(&s3)), Some(paired(&s5)))
    } else {
        (None, None, None)
    };
    let (seeds, c1, c3) = (median(seeds), median(c1), median(c3));
    println!(
        "\n## Against the seeds' one-key sliding script, {total} events, store batches of {}, median of 3 rounds\n",
        ceiling_batch()
    );
    println!(
        "| what | events/s | ratio to the seeds' script | median of the rounds' ratios | Redis CPU µs/event | callguard CPU µs/event |"
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| seeds' script (redis-benchmark, P 256, 8 clients) | {:.0} | 1.00 | 1.00 | {:.1} | |",
        seeds.0, seeds.1
    );
    let mut rows = Vec::new();
    if let (Some(q1), Some(q3), Some(q5)) = (q1, q3, q5) {
        rows.push(("script store, 1 sliding rule", median(s1), q1));
        rows.push(("script store, data/rules.toml (3 rules)", median(s3), q3));
        rows.push((
            "script store, + spray and pbx_burst (5 rules)",
            median(s5),
            q5,
        ));
    }
    rows.push(("cached store, 1 sliding rule", c1, p1));
    rows.push(("cached store, data/rules.toml (3 rules)", c3, p3));
    rows.push((
        "cached store, + spray and pbx_burst (5 rules)",
        median(c5),
        p5,
    ));
    for (what, r, paired) in rows {
        let own = r.2.map_or_else(|| "n/a".into(), |us| format!("{us:.1}"));
        println!(
            "| {what} | {:.0} | {:.2} | {paired:.2} | {:.1} | {own} |",
            r.0,
            r.0 / seeds.0,
            r.1
        );
    }
}

/// Section 4: one caller flooding (1,000 calls/s of event time, every call
/// recorded under `attempts`), `data/rules.toml`: events/s of each mode as
/// its window state grows over the flood, by stretch of the flood.
async fn flood(con: &mut redis::Connection, url: &str) {
    let rules = RuleSet::from_toml(include_str!("../data/rules.toml")).expect("rules");
    let stretches = 4;
    let per = 50_000;
    println!("\n## One caller flooding at 1,000 calls/s (event time), data/rules.toml, batches of {PIPELINE}\n");
    print!("| mode |");
    for k in 0..stretches {
        print!(" calls {}-{}k |", k * per / 1000, (k + 1) * per / 1000);
    }
    println!("\n|---|{}", "---|".repeat(stretches));
    for cached in [false, true] {
        let _: () = redis::cmd("FLUSHALL").query(con).expect("flush");
        let config = RedisConfig {
            urls: vec![url.to_string()],
            ..RedisConfig::default()
        };
        let mut store = connect(config, cached).await;
        print!("| {} |", if cached { "cached" } else { "script" });
        for k in 0..stretches {
            let events: Vec<CallEvent> = (k * per..(k + 1) * per)
                .map(|i| event(7, i, T0 + i as i64))
                .collect();
            let start = Instant::now();
            for chunk in events.chunks(PIPELINE) {
                store.apply_batch(&rules, chunk).await.expect("apply");
            }
            print!(" {:.0}/s |", per as f64 / start.elapsed().as_secs_f64());
        }
        println!();
    }
}

/// Commands Redis has run (scripts' inner calls included).
fn redis_commands(con: &mut redis::Connection) -> f64 {
    let info: String = redis::cmd("INFO").arg("stats").query(con).expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("total_commands_processed")
}

/// `aggregate`: what a rule keyed by callee (5,000 callees called in turn,
/// each once per batch or less: a lease per call, the worst case) or
/// global (one hot counter) costs the default store, data/rules.toml,
/// behind the gate as `consume` runs it (each batch's credits leased while
/// the batch before commits). The median of `BENCH_ROUNDS` rounds
/// (default 5), each taking the sets in turn from a different one (the
/// set run first after a flush runs at another speed).
async fn aggregate_cost(con: &mut redis::Connection, url: &str, total: usize) {
    use callguard::store::gated::{Gated, Ledger};
    use callguard::store::redis::aggregate::lease::RedisLedger;
    use callguard::store::Next;
    let base = include_str!("../data/rules.toml");
    let callee = "\n[[rule]]\nname = \"tdos\"\nkey = \"callee\"\nkind = \"fixed\"\nwindow = \"10s\"\nlimit = 50\n";
    let global = "\n[[rule]]\nname = \"all\"\nkey = \"global\"\nkind = \"fixed\"\nwindow = \"1s\"\nlimit = 1000000\n";
    let fourth = "\n[[rule]]\nname = \"ten\"\nkind = \"fixed\"\nwindow = \"10s\"\nlimit = 50\n";
    let sets = [
        (
            "data/rules.toml (3 rules)",
            RuleSet::from_toml(base).expect("rules"),
        ),
        (
            "+ a caller rule (fixed 10 s, 50), for scale",
            RuleSet::from_toml(&format!("{base}{fourth}")).expect("rules"),
        ),
        (
            "+ a callee rule (fixed 10 s, 50)",
            RuleSet::from_toml(&format!("{base}{callee}")).expect("rules"),
        ),
        (
            "+ a global rule (fixed 1 s)",
            RuleSet::from_toml(&format!("{base}{global}")).expect("rules"),
        ),
    ];
    // (`BENCH_AGG_SETS=0,2`: only those sets, e.g. under a profiler.)
    let only: Option<Vec<usize>> = std::env::var("BENCH_AGG_SETS")
        .ok()
        .map(|v| v.split(',').filter_map(|k| k.trim().parse().ok()).collect());
    let mut rounds: Vec<Vec<(f64, f64, f64, f64)>> = vec![Vec::new(); sets.len()];
    let count: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(5);
    for round in 0..count {
        for j in 0..sets.len() {
            let k = (round + j) % sets.len();
            let rules = &sets[k].1;
            if only.as_ref().is_some_and(|o| !o.contains(&k)) {
                continue;
            }
            let _: () = redis::cmd("FLUSHALL").query(con).expect("flush");
            let config = RedisConfig {
                urls: vec![url.to_string()],
                ..RedisConfig::default()
            };
            let ledger = Ledger::Redis(Box::new(RedisLedger::new(config.clone())));
            let mut store = Gated::new(connect(config, true).await, ledger);
            let events: Vec<CallEvent> = (0..total)
                .map(|i| {
                    let mut e = event(i % 100_000, i, T0 + (i as i64) * 2);
                    e.callee = Some(format!("+3491{:07}", i % 5_000).into());
                    e
                })
                .collect();
            let commands = redis_commands(con);
            let cpu = redis_cpu(con);
            let own = thread_cpu_ns().unwrap_or(0.0);
            let start = Instant::now();
            let chunks: Vec<&[CallEvent]> = events.chunks(PIPELINE).collect();
            for (k, chunk) in chunks.iter().enumerate() {
                // The next batch known, as `consume`'s decider knows it.
                let mut next = chunks.get(k + 1).map(|&events| Next { rules, events });
                store
                    .apply_batch_partial_ahead(rules, chunk, &mut next)
                    .await
                    .expect("apply");
            }
            let rate = total as f64 / start.elapsed().as_secs_f64();
            let own = (thread_cpu_ns().unwrap_or(0.0) - own) / 1e3 / total as f64;
            let per_event = (redis_commands(con) - commands) / total as f64;
            let cpu = (redis_cpu(con) - cpu) * 1e6 / total as f64;
            rounds[k].push((rate, per_event, cpu, own));
        }
    }
    println!("\n## Rules keyed by callee or global, {total} events, cached store behind the gate, median of {count} rounds\n");
    println!("| rule set | events/s | ratio | Redis commands per event | Redis CPU µs per event | store thread CPU µs per event |");
    println!("|---|---|---|---|---|---|");
    // (The ratio is the median of each round's ratio to the first set in
    // that round: rounds run at different speeds.)
    let base: Vec<f64> = rounds[0].iter().map(|r| r.0).collect();
    for ((what, _), r) in sets.iter().zip(&rounds) {
        if r.is_empty() {
            continue;
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let rate = median(r.iter().map(|x| x.0).collect());
        let per_event = median(r.iter().map(|x| x.1).collect());
        let cpu = median(r.iter().map(|x| x.2).collect());
        let own = median(r.iter().map(|x| x.3).collect());
        let ratio = match base.len() == r.len() {
            true => format!(
                "{:.2}",
                median(r.iter().zip(&base).map(|(x, b)| x.0 / b).collect())
            ),
            false => "-".to_string(),
        };
        println!("| {what} | {rate:.0} | {ratio} | {per_event:.2} | {cpu:.1} | {own:.1} |");
    }
}

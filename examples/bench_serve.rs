//! Open-loop load on `callguard serve`: checks at a fixed rate, latency
//! percentiles measured from each check's scheduled send time when it went
//! out late (so a stall counts against every check it delays, not only the
//! first), else from its send.
//!
//! Run: `cargo run --release --example bench_serve -- PORT RATE SECONDS [CONNECTIONS] [CALLERS] [check|healthz]`
//!
//! Sends RATE checks per second for SECONDS seconds (at most RATE x SECONDS
//! checks; it stops at the deadline plus 5 s for stragglers) as
//! `POST /v1/check` over CONNECTIONS keep-alive connections (default 64),
//! callers drawn from CALLERS numbers (default 20,000; a few hot ones).
//! `healthz` sends `GET /healthz` instead: the HTTP floor of the same
//! server and client, the peer the check latencies are compared with.
//! Prints one line: rate offered and achieved, p50/p90/p99/p99.9/max in ms,
//! rejects, errors. Loopback only. Call ids are `b<connection>-<n>`; set
//! `CALL_ID_PREFIX` to tell apart several of these clients at once.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

fn arg<T: std::str::FromStr>(args: &[String], i: usize, name: &str, default: Option<T>) -> T {
    match args.get(i).map(|a| a.parse::<T>()) {
        Some(Ok(v)) => v,
        _ => default.unwrap_or_else(|| {
            eprintln!(
                "usage: bench_serve PORT RATE SECONDS [CONNECTIONS] [CALLERS] [check|healthz] ({name} missing or bad)"
            );
            std::process::exit(2)
        }),
    }
}

/// What one connection saw.
#[derive(Default)]
struct Seen {
    latencies_us: Vec<u64>,
    rejects: u64,
    errors: u64,
}

async fn connection(
    port: u16,
    id: u64,
    rate: f64,
    start: Instant,
    end: Instant,
    callers: u64,
    healthz: bool,
) -> Seen {
    let mut seen = Seen::default();
    let Ok(stream) = TcpStream::connect(("127.0.0.1", port)).await else {
        seen.errors += 1;
        return seen;
    };
    let _ = stream.set_nodelay(true);
    let mut stream = BufReader::new(stream);
    let mut rng = StdRng::seed_from_u64(id);
    let prefix = std::env::var("CALL_ID_PREFIX").unwrap_or_else(|_| "b".into());
    let interval = Duration::from_secs_f64(1.0 / rate);
    let mut due = start + interval.mul_f64(rng.random::<f64>());
    let mut n = 0u64;
    let mut line = String::new();
    while due < end {
        // Latency counts from the scheduled time when the previous answer
        // made this check late (no coordinated omission), and from the send
        // when the check waited for its time (the timer's millisecond
        // granularity is the client's, not the server's).
        let start = if Instant::now() < due {
            tokio::time::sleep_until(due.into()).await;
            Instant::now()
        } else {
            due
        };
        // Hot callers (diallers) take a tenth of the checks.
        let caller = if rng.random_bool(0.1) {
            rng.random_range(0..20)
        } else {
            rng.random_range(0..callers)
        };
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let body = format!(
            r#"{{"call_id":"{prefix}{id}-{n}","caller":"+3491{caller:07}","callee":"+346{:08}","ts":{ts}}}"#,
            rng.random_range(0..1_000_000u64)
        );
        let req = if healthz {
            "GET /healthz HTTP/1.1\r\nHost: b\r\n\r\n".to_string()
        } else {
            format!(
                "POST /v1/check HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
        };
        n += 1;
        if stream.get_mut().write_all(req.as_bytes()).await.is_err() {
            seen.errors += 1;
            return seen;
        }
        let mut len = 0usize;
        let mut status = 0u16;
        loop {
            line.clear();
            match stream.read_line(&mut line).await {
                Ok(0) | Err(_) => {
                    seen.errors += 1;
                    return seen;
                }
                Ok(_) => {}
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some(code) = l.strip_prefix("HTTP/1.1 ") {
                status = code.get(..3).and_then(|c| c.parse().ok()).unwrap_or(0);
            } else if let Some(v) = l
                .split_once(':')
                .filter(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            {
                len = v.1.trim().parse().unwrap_or(0);
            }
        }
        let mut buf = vec![0; len];
        if stream.read_exact(&mut buf).await.is_err() {
            seen.errors += 1;
            return seen;
        }
        seen.latencies_us.push(start.elapsed().as_micros() as u64);
        match status {
            200 if buf.windows(8).any(|w| w == b"\"reject\"") => seen.rejects += 1,
            200 => {}
            _ => seen.errors += 1,
        }
        due += interval;
    }
    seen
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let port: u16 = arg(&args, 1, "PORT", None);
    let rate: f64 = arg(&args, 2, "RATE", None);
    let seconds: f64 = arg(&args, 3, "SECONDS", None);
    let conns: u64 = arg(&args, 4, "CONNECTIONS", Some(64));
    let callers: u64 = arg(&args, 5, "CALLERS", Some(20_000));
    let mode: String = arg(&args, 6, "MODE", Some("check".to_string()));
    let healthz = mode == "healthz";
    let start = Instant::now() + Duration::from_millis(200);
    let end = start + Duration::from_secs_f64(seconds);
    let per_conn = rate / conns as f64;
    let tasks: Vec<_> = (0..conns)
        .map(|id| tokio::spawn(connection(port, id, per_conn, start, end, callers, healthz)))
        .collect();
    let mut all = Seen::default();
    let hard_stop = end + Duration::from_secs(5);
    for t in tasks {
        match tokio::time::timeout_at(hard_stop.into(), t).await {
            Ok(Ok(s)) => {
                all.latencies_us.extend(s.latencies_us);
                all.rejects += s.rejects;
                all.errors += s.errors;
            }
            _ => all.errors += 1,
        }
    }
    let elapsed = start.elapsed().as_secs_f64().min(seconds + 5.0);
    let mut l = all.latencies_us;
    l.sort_unstable();
    let pct = |p: f64| -> f64 {
        if l.is_empty() {
            return f64::NAN;
        }
        let i = ((l.len() as f64 * p).ceil() as usize).clamp(1, l.len()) - 1;
        l[i] as f64 / 1000.0
    };
    println!(
        "offered {:.0}/s achieved {:.0}/s checks {} p50 {:.2} ms p90 {:.2} ms p99 {:.2} ms p99.9 {:.2} ms max {:.2} ms rejects {} errors {}",
        rate,
        l.len() as f64 / elapsed.max(seconds),
        l.len(),
        pct(0.50),
        pct(0.90),
        pct(0.99),
        pct(0.999),
        pct(1.0),
        all.rejects,
        all.errors
    );
}

//! A steady load of call events at wall-clock event times, for soak runs.
//!
//! Run: `cargo run --release --example loadgen -- BROKERS TOPIC RATE SECONDS [CALLERS] [LINGER_MS]`
//!
//! Sends RATE events per second for SECONDS seconds (both bounded: at most
//! RATE x SECONDS events, and it stops at the deadline) to TOPIC, keyed by
//! caller, as JSON call events stamped with the current time. Callers are
//! drawn from CALLERS numbers (default 50,000) with a skew: a few busy
//! trunks and diallers, a long tail of subscribers, so window state keeps
//! being created and expiring. LINGER_MS (default 5) is the producer's
//! `linger.ms`: part of the latency measured from an event's stamp.
//! Loopback brokers only in tests.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::config::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

fn arg<T: std::str::FromStr>(args: &[String], i: usize, name: &str, default: Option<T>) -> T {
    match args.get(i).map(|a| a.parse::<T>()) {
        Some(Ok(v)) => v,
        _ => default.unwrap_or_else(|| {
            eprintln!(
                "usage: loadgen BROKERS TOPIC RATE SECONDS [CALLERS] [LINGER_MS] ({name} missing or bad)"
            );
            std::process::exit(2)
        }),
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let brokers: String = arg(&args, 1, "BROKERS", None);
    let topic: String = arg(&args, 2, "TOPIC", None);
    let rate: u64 = arg(&args, 3, "RATE", None);
    let seconds: u64 = arg(&args, 4, "SECONDS", None);
    let callers: u64 = arg(&args, 5, "CALLERS", Some(50_000));
    let linger_ms: u64 = arg(&args, 6, "LINGER_MS", Some(5));
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("partitioner", "murmur2_random")
        .set("linger.ms", linger_ms.to_string())
        .set("compression.type", "lz4")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .expect("producer");
    let mut rng = StdRng::seed_from_u64(7);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let total = rate * seconds;
    let tick = Duration::from_millis(10);
    let mut sent = 0u64;
    let mut next = started;
    while sent < total && Instant::now() < deadline {
        // Events due by now at RATE per second.
        let due = (started.elapsed().as_secs_f64() * rate as f64) as u64;
        while sent < due.min(total) {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64);
            // 5% of the calls come from 20 busy numbers, the rest from the tail.
            let caller = if rng.random_bool(0.05) {
                rng.random_range(0..20)
            } else {
                rng.random_range(20..callers.max(21))
            };
            let payload = format!(
                r#"{{"call_id":"soak-{sent}","caller":"+3491{caller:07}","callee":"+3460{:07}","ts":{now}}}"#,
                rng.random_range(0..5_000_000u64)
            );
            let key = format!("+3491{caller:07}");
            loop {
                match producer.send_result(FutureRecord::to(&topic).key(&key).payload(&payload)) {
                    Ok(_) => break,
                    Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
            sent += 1;
        }
        next += tick;
        tokio::time::sleep_until(next.into()).await;
    }
    let _ = producer.flush(Duration::from_secs(30));
    println!(
        "sent {sent} events in {:.1} s ({:.0}/s)",
        started.elapsed().as_secs_f64(),
        sent as f64 / started.elapsed().as_secs_f64()
    );
}

//! Latency from a call event's time to its decision record, read back from
//! the decisions topic.
//!
//! Run: `cargo run --release --example decision_latency -- BROKERS TOPIC COUNT [SECONDS] [--arrival] [KEY=VALUE...]`
//!
//! Reads TOPIC from the beginning until COUNT records or SECONDS (default
//! 60) without a new one, and prints how many it read and the percentiles
//! of (the record's Kafka timestamp - its `ts_ms`) in milliseconds. With
//! `examples/loadgen.rs`, which stamps each event with the wall clock when
//! it is sent, that is the time from producing a call to producing its
//! decision. With `--arrival`, started before the load, it measures (the
//! wall clock when a record arrives here - its `ts_ms`, or `ts`) instead:
//! on the input topic, the broker's and the client's share of that time
//! (the floor under callguard's). KEY=VALUE are librdkafka consumer
//! settings (e.g. `fetch.wait.max.ms=10`, callguard's default). Loopback
//! brokers only in tests.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::Message;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: decision_latency BROKERS TOPIC COUNT [SECONDS]");
        std::process::exit(2);
    }
    let count: usize = args[3].parse().expect("COUNT");
    let idle = Duration::from_secs(args.get(4).map_or(60, |s| s.parse().expect("SECONDS")));
    let arrival = args.iter().skip(5).any(|a| a == "--arrival");
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &args[1])
        .set(
            "group.id",
            format!("callguard-decision-latency-{}", args[2]),
        )
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest");
    for kv in args.iter().skip(5).filter(|a| *a != "--arrival") {
        let (k, v) = kv.split_once('=').expect("KEY=VALUE");
        config.set(k, v);
    }
    let consumer: BaseConsumer = config.create().expect("consumer");
    consumer.subscribe(&[&args[2]]).expect("subscribe");
    let mut lat: Vec<i64> = Vec::with_capacity(count);
    let mut waited = Duration::ZERO;
    let step = Duration::from_millis(200);
    while lat.len() < count && waited < idle {
        match consumer.poll(step) {
            Some(Ok(m)) => {
                waited = Duration::ZERO;
                let at = if arrival {
                    Some(wall_ms())
                } else {
                    m.timestamp().to_millis()
                };
                let Some(at) = at else {
                    continue;
                };
                let ts = m
                    .payload()
                    .and_then(|p| serde_json::from_slice::<serde_json::Value>(p).ok())
                    .and_then(|v| v.get("ts_ms").or(v.get("ts")).and_then(|t| t.as_i64()));
                if let Some(ts) = ts {
                    lat.push(at - ts);
                }
            }
            Some(Err(e)) => eprintln!("{e}"),
            None => waited += step,
        }
    }
    lat.sort_unstable();
    let pct = |p: f64| -> i64 {
        if lat.is_empty() {
            return -1;
        }
        lat[((lat.len() - 1) as f64 * p).round() as usize]
    };
    println!(
        "records {} latency ms: p50 {} p90 {} p99 {} max {}",
        lat.len(),
        pct(0.5),
        pct(0.9),
        pct(0.99),
        pct(1.0)
    );
}

/// The wall clock, epoch milliseconds.
fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

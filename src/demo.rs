//! `callguard demo`: the whole pipeline in one process, no servers needed.
//!
//! It starts librdkafka's mock cluster, creates the topics, produces a call
//! log (plus a few malformed messages), runs the stream processor with the
//! in-memory store, follows the decisions topic with a live summary, and
//! finally checks that the decisions equal `callguard replay` on the same
//! file.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::Value;
use tokio::sync::watch;

use crate::calllog::{OrderedLog, ReadOptions};
use crate::consumer::{self, ConsumeConfig};
use crate::kafka::{client_config, client_err, EmbeddedKafka, KafkaError};
use crate::metrics::{Health, Metrics};
use crate::replay;
use crate::rules::RuleSet;
use crate::store::memory::MemoryStore;

/// What the demo runs on.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// Call log to play.
    pub input: PathBuf,
    /// Read options.
    pub read: ReadOptions,
    /// Rules.
    pub rules: RuleSet,
    /// Partitions of the calls topic.
    pub partitions: i32,
    /// Give up after this long.
    pub timeout: Duration,
}

/// The outcome of a demo run.
#[derive(Debug, Clone, Default)]
pub struct DemoReport {
    /// Valid events produced.
    pub produced: u64,
    /// Distinct call ids decided (read back from the decisions topic).
    pub decided: u64,
    /// Rejected calls.
    pub rejected: u64,
    /// Dead letters.
    pub dead_letters: u64,
    /// Records that differ from the replay (0: parity holds).
    pub mismatches: u64,
    /// Events per second through the consumer.
    pub events_per_sec: f64,
    /// The most rejected callers.
    pub top_rejected: Vec<(String, u64)>,
}

/// Malformed messages the demo sends to show the dead-letter path.
const BAD_MESSAGES: [(&str, &str); 3] = [
    ("+34911000000", "{\"call_id\": \"bad-json\", "),
    (
        "+34911000000",
        "{\"call_id\":\"bad-ts\",\"caller\":\"+34911000000\",\"ts\":\"yesterday\"}",
    ),
    (
        "",
        "{\"call_id\":\"no-key\",\"caller\":\"+34911000000\",\"ts\":1764547200000}",
    ),
];

/// Runs the demo, printing a live summary every second.
pub async fn run(
    config: DemoConfig,
) -> Result<DemoReport, Box<dyn std::error::Error + Send + Sync>> {
    let log = OrderedLog::open(&config.input, &config.read)?.read_all()?;
    let kafka = EmbeddedKafka::start()?;
    let brokers = kafka.bootstrap();
    for (topic, p) in [
        ("calls", config.partitions),
        ("call-decisions", 4),
        ("call-features", 4),
        ("calls-dlq", 1),
    ] {
        kafka.create_topic(topic, p)?;
    }
    println!("embedded Kafka at {brokers}; topics calls, call-decisions, call-features, calls-dlq");
    let produced = crate::produce::produce(&log, &brokers, &[], "calls", false).await?;
    let bad: FutureProducer = crate::kafka::producer_config(&brokers, &[])
        .create()
        .map_err(client_err("creating a producer"))?;
    for (key, payload) in BAD_MESSAGES {
        let mut r = FutureRecord::to("calls").payload(payload);
        if !key.is_empty() {
            r = r.key(key);
        }
        bad.send(r, Duration::from_secs(5))
            .await
            .map_err(|(e, _)| client_err("producing")(e))?;
    }
    println!(
        "produced {produced} call events (+{} malformed) from {}",
        BAD_MESSAGES.len(),
        config.input.display()
    );

    let (_tx, rules_rx) = watch::channel(config.rules.clone());
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let consume_cfg = ConsumeConfig::new(
        &brokers,
        "callguard-demo",
        "calls",
        "call-decisions",
        "call-features",
        "calls-dlq",
    );
    let started = Instant::now();
    let worker = tokio::spawn(consumer::run(
        consume_cfg,
        MemoryStore::keeping_all(),
        rules_rx,
        metrics.clone(),
        health.clone(),
        async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        },
    ));

    // Follow the decisions topic.
    let reader: StreamConsumer = client_config(&brokers, &[])
        .set("group.id", "callguard-demo-reader")
        .set("auto.offset.reset", "earliest")
        .create()
        .map_err(client_err("creating the decisions reader"))?;
    reader
        .subscribe(&["call-decisions"])
        .map_err(client_err("subscribing to call-decisions"))?;
    let mut seen: HashMap<String, Value> = HashMap::new();
    let mut rejected_by: HashMap<String, u64> = HashMap::new();
    let mut last_print = Instant::now();
    let deadline = Instant::now() + config.timeout;
    while (seen.len() as u64) < produced && Instant::now() < deadline {
        let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(200), reader.recv()).await
        else {
            continue;
        };
        let Some(v) = m
            .payload()
            .and_then(|p| serde_json::from_slice::<Value>(p).ok())
        else {
            continue;
        };
        let id = v["call_id"].as_str().unwrap_or_default().to_string();
        if !seen.contains_key(&id) && v["decision"] == "reject" {
            *rejected_by
                .entry(v["caller"].as_str().unwrap_or_default().to_string())
                .or_default() += 1;
        }
        seen.entry(id).or_insert(v);
        if last_print.elapsed() >= Duration::from_secs(1) {
            last_print = Instant::now();
            let rate = seen.len() as f64 / started.elapsed().as_secs_f64();
            let mut top: Vec<(&String, &u64)> = rejected_by.iter().collect();
            top.sort_by(|a, b| b.1.cmp(a.1));
            println!(
                "decided {:>7}/{produced}  {:>8.0} events/s  rejected {:>6}  top: {}",
                seen.len(),
                rate,
                rejected_by.values().sum::<u64>(),
                top.iter()
                    .take(3)
                    .map(|(c, n)| format!("{c} ({n})"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let _ = stop_tx.send(true);
    let stats = worker
        .await
        .map_err(|e| KafkaError::Delivery(format!("consumer task failed: {e}")))??;

    // Parity with the offline replay.
    let mut store = MemoryStore::new();
    let verdicts = replay::run(&log, &config.rules, &mut store).await?;
    let mismatches = verdicts
        .iter()
        .filter(|v| seen.get(&v.record.call_id) != Some(&v.record.to_json(&config.rules)))
        .count() as u64;
    let mut top: Vec<(String, u64)> = rejected_by.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    top.truncate(5);
    Ok(DemoReport {
        produced,
        decided: seen.len() as u64,
        rejected: seen.values().filter(|v| v["decision"] == "reject").count() as u64,
        dead_letters: stats.dead_letters,
        mismatches,
        events_per_sec: seen.len() as f64 / elapsed,
        top_rejected: top,
    })
}

//! `callguard demo`: the whole pipeline in one process, no servers needed.
//!
//! It starts librdkafka's mock cluster, creates the topics, produces a call
//! log (plus a few malformed messages), runs the stream processor with the
//! in-memory store, follows the decisions topic with a live summary, and
//! finally checks that the decisions equal `callguard replay` on the same
//! file. It joins the online path to the offline one, so it lives beside
//! both.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::Value;
use tokio::sync::watch;

use crate::engine::record::{Row, Schema};
use crate::engine::rules::RuleSet;
use crate::error::{DemoError, KafkaError};
use crate::offline::order::OrderedLog;
use crate::offline::read::{CallLog, ReadOptions};
use crate::offline::replay;
use crate::online::consumer::{
    self, ConsumeConfig, DEFAULT_DECISIONS_TOPIC, DEFAULT_DLQ_TOPIC, DEFAULT_FEATURES_TOPIC,
    DEFAULT_INPUT_TOPIC,
};
use crate::online::kafka::{client_config, client_err, producer_config, EmbeddedKafka};
use crate::online::metrics::{Health, Metrics};
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
    /// Events per second through the consumer, from the first decision
    /// read back to the last (the wait for the consumer group's partitions
    /// before it is not the consumer's speed).
    pub events_per_sec: f64,
    /// Seconds from the consumer's start to its first decision read back:
    /// joining the group and getting partitions.
    pub first_decision_s: f64,
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
pub async fn run(config: DemoConfig) -> Result<DemoReport, DemoError> {
    let log = OrderedLog::open(&config.input, &config.read)?.read_all()?;
    let kafka = EmbeddedKafka::start()?;
    let brokers = kafka.bootstrap();
    for (topic, p) in [
        (DEFAULT_INPUT_TOPIC, config.partitions),
        (DEFAULT_DECISIONS_TOPIC, 4),
        (DEFAULT_FEATURES_TOPIC, 4),
        (DEFAULT_DLQ_TOPIC, 1),
    ] {
        kafka.create_topic(topic, p)?;
    }
    println!("embedded Kafka at {brokers}; topics calls, call-decisions, call-features, calls-dlq");
    let produced = produce_log(&log, &brokers).await?;
    println!(
        "produced {produced} call events (+{} malformed) from {}",
        BAD_MESSAGES.len(),
        config.input.display()
    );

    let (stop_tx, mut stop_rx) = watch::channel(false);
    let (_rules_tx, rules_rx) = watch::channel(config.rules.clone());
    let started = Instant::now();
    let worker = tokio::spawn(consumer::run(
        ConsumeConfig::new(
            &brokers,
            "callguard-demo",
            DEFAULT_INPUT_TOPIC,
            DEFAULT_DECISIONS_TOPIC,
            DEFAULT_FEATURES_TOPIC,
            DEFAULT_DLQ_TOPIC,
        ),
        MemoryStore::keeping_all(),
        rules_rx,
        Arc::new(Metrics::new()),
        Arc::new(Health::default()),
        async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        },
    ));
    let followed = follow_decisions(&brokers, produced, config.timeout).await?;
    let _ = stop_tx.send(true);
    let stats = worker.await.map_err(|e| DemoError::Task(e.to_string()))??;
    let mismatches = mismatches(&log, &config.rules, &followed.seen).await?;

    let events_per_sec = followed.rate();
    let mut top: Vec<(String, u64)> = followed.rejected_by.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    top.truncate(5);
    let seen = &followed.seen;
    Ok(DemoReport {
        produced,
        decided: seen.len() as u64,
        rejected: seen.values().filter(|v| v["decision"] == "reject").count() as u64,
        dead_letters: stats.dead_letters,
        mismatches,
        events_per_sec,
        first_decision_s: followed
            .first
            .map_or(0.0, |t| t.duration_since(started).as_secs_f64()),
        top_rejected: top,
    })
}

/// Produces the log and the malformed samples to the calls topic.
async fn produce_log(log: &CallLog, brokers: &str) -> Result<u64, KafkaError> {
    let events = log.events.iter().map(|(_, e)| e);
    let produced =
        crate::online::produce::produce(events, brokers, &[], DEFAULT_INPUT_TOPIC).await?;
    let bad: FutureProducer = producer_config(brokers, &[], &[])
        .create()
        .map_err(client_err("creating a producer"))?;
    for (key, payload) in BAD_MESSAGES {
        let mut r = FutureRecord::to(DEFAULT_INPUT_TOPIC).payload(payload);
        if !key.is_empty() {
            r = r.key(key);
        }
        bad.send(r, Duration::from_secs(5))
            .await
            .map_err(|(e, _)| client_err("producing")(e))?;
    }
    Ok(produced)
}

/// What the decisions topic showed.
struct Followed {
    /// The first record of each call id.
    seen: HashMap<String, Value>,
    /// Rejected calls per caller.
    rejected_by: HashMap<String, u64>,
    /// When the first and the latest new call id were read.
    first: Option<Instant>,
    last: Option<Instant>,
}

impl Followed {
    /// Decisions per second from the first read to the latest (all of
    /// them, over the time after the first).
    fn rate(&self) -> f64 {
        match (self.first, self.last) {
            (Some(first), Some(last)) if last > first => {
                self.seen.len() as f64 / (last - first).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

/// Reads the decisions topic until every produced call is decided or the
/// timeout passes, printing a summary every second.
async fn follow_decisions(
    brokers: &str,
    produced: u64,
    timeout: Duration,
) -> Result<Followed, KafkaError> {
    let reader: StreamConsumer = client_config(brokers, &[])
        .set("group.id", "callguard-demo-reader")
        .set("auto.offset.reset", "earliest")
        .create()
        .map_err(client_err("creating the decisions reader"))?;
    reader
        .subscribe(&[DEFAULT_DECISIONS_TOPIC])
        .map_err(client_err("subscribing to call-decisions"))?;
    let mut f = Followed {
        seen: HashMap::new(),
        rejected_by: HashMap::new(),
        first: None,
        last: None,
    };
    let mut last_print = Instant::now();
    let deadline = Instant::now() + timeout;
    while (f.seen.len() as u64) < produced && Instant::now() < deadline {
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
        if !f.seen.contains_key(&id) && v["decision"] == "reject" {
            *f.rejected_by
                .entry(v["caller"].as_str().unwrap_or_default().to_string())
                .or_default() += 1;
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = f.seen.entry(id) {
            slot.insert(v);
            let now = Instant::now();
            f.first.get_or_insert(now);
            f.last = Some(now);
        }
        if last_print.elapsed() >= Duration::from_secs(1) {
            last_print = Instant::now();
            print_progress(&f, produced);
        }
    }
    Ok(f)
}

fn print_progress(f: &Followed, produced: u64) {
    let rate = f.rate();
    let mut top: Vec<(&String, &u64)> = f.rejected_by.iter().collect();
    top.sort_by(|a, b| b.1.cmp(a.1));
    println!(
        "decided {:>7}/{produced}  {:>8.0} events/s  rejected {:>6}  top: {}",
        f.seen.len(),
        rate,
        f.rejected_by.values().sum::<u64>(),
        top.iter()
            .take(3)
            .map(|(c, n)| format!("{c} ({n})"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

/// Decision records of the topic that differ from the offline replay.
async fn mismatches(
    log: &CallLog,
    rules: &RuleSet,
    seen: &HashMap<String, Value>,
) -> Result<u64, DemoError> {
    let verdicts = replay::run(log, rules, &mut MemoryStore::new()).await?;
    let schema = Schema::decisions(rules);
    Ok(log
        .events
        .iter()
        .zip(&verdicts)
        .filter(|((_, event), verdict)| {
            let offline = schema.to_json(Row { event, verdict });
            seen.get(verdict.record.call_id.as_str()) != Some(&offline)
        })
        .count() as u64)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    #[test]
    fn the_rate_counts_from_the_first_decision() {
        let t0 = Instant::now();
        let mut f = super::Followed {
            seen: (0..1_000)
                .map(|i| (i.to_string(), serde_json::Value::Null))
                .collect(),
            rejected_by: Default::default(),
            first: Some(t0 + Duration::from_secs(3)),
            last: Some(t0 + Duration::from_millis(3_500)),
        };
        assert_eq!(
            f.rate(),
            2_000.0,
            "1,000 decisions in the half second after the first"
        );
        f.last = f.first;
        assert_eq!(f.rate(), 0.0, "no span yet");
    }
}

//! `callguard produce`: loads a call log into Kafka, keyed by caller.
//!
//! Events are sent in the replay's processing order (stable by event time),
//! as canonical JSON, so that consuming the topic decides exactly what
//! `callguard replay` decides for the same file.

use std::time::Duration;

use futures::stream::{FuturesOrdered, StreamExt};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use serde_json::json;

use crate::calllog::{progress_bar, CallLog};
use crate::event::CallEvent;
use crate::kafka::{client_err, producer_config, KafkaError};

/// Deliveries awaited at once.
const WINDOW: usize = 10_000;

/// The canonical JSON payload of an event.
pub fn event_json(e: &CallEvent) -> String {
    let mut v = json!({ "call_id": e.call_id, "caller": e.caller, "ts": e.ts_ms });
    if let Some(c) = &e.callee {
        v["callee"] = json!(c);
    }
    if let Some(d) = e.duration_ms {
        v["duration_ms"] = json!(d);
    }
    if let Some(l) = e.label {
        v["label"] = json!(if l { "fraud" } else { "legit" });
    }
    v.to_string()
}

/// Produces every event of a (time-sorted) log; returns how many were acknowledged.
pub async fn produce(
    log: &CallLog,
    brokers: &str,
    settings: &[(String, String)],
    topic: &str,
    progress: bool,
) -> Result<u64, KafkaError> {
    let mut cfg = producer_config(brokers, settings);
    cfg.set("enable.idempotence", "true")
        .set("linger.ms", "20")
        .set("compression.type", "lz4");
    let producer: FutureProducer = cfg.create().map_err(client_err("creating the producer"))?;
    let bar = progress_bar(log.events.len() as u64, progress, "producing");
    let mut pending = FuturesOrdered::new();
    let mut acked = 0u64;
    for (_, e) in &log.events {
        let payload = event_json(e);
        let record = FutureRecord::to(topic)
            .key(e.caller.as_str())
            .payload(payload.as_str());
        let fut = producer.send_result(record).map_err(|(err, _)| {
            KafkaError::Delivery(format!("cannot enqueue call {}: {err}", e.call_id))
        })?;
        pending.push_back(fut);
        while pending.len() >= WINDOW {
            acked += settle_one(&mut pending).await?;
            bar.inc(1);
        }
    }
    while !pending.is_empty() {
        acked += settle_one(&mut pending).await?;
        bar.inc(1);
    }
    producer
        .flush(Duration::from_secs(30))
        .map_err(client_err("flushing the producer"))?;
    bar.finish_and_clear();
    Ok(acked)
}

async fn settle_one(
    pending: &mut FuturesOrdered<rdkafka::producer::DeliveryFuture>,
) -> Result<u64, KafkaError> {
    match pending.next().await {
        Some(Ok(Ok(_))) => Ok(1),
        Some(Ok(Err((e, _)))) => Err(KafkaError::Delivery(e.to_string())),
        Some(Err(_)) => Err(KafkaError::Delivery("producer dropped a delivery".into())),
        None => Ok(0),
    }
}

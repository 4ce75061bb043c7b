//! `callguard produce`: loads a call log into Kafka, keyed by caller.
//!
//! Events are sent in the replay's processing order (stable by event time),
//! as canonical JSON, so that consuming the topic decides exactly what
//! `callguard replay` decides for the same file.

use std::time::Duration;

use futures::stream::{FuturesOrdered, StreamExt};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use serde_json::json;

use crate::engine::event::{CallEvent, EventKind};
use crate::error::KafkaError;
use crate::online::kafka::{client_err, producer_config};
use crate::progress::progress_bar;

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
    if e.kind == EventKind::End {
        v["event"] = json!(e.kind.as_str());
    }
    if let Some(t) = e.talk_ms {
        v["talk_ms"] = json!(t);
    }
    if let Some(a) = &e.account {
        v["account"] = json!(a);
    }
    v.to_string()
}

/// Produces events in the order given (a caller's in processing order);
/// returns how many were acknowledged.
pub async fn produce<'a>(
    events: impl ExactSizeIterator<Item = &'a CallEvent>,
    brokers: &str,
    settings: &[(String, String)],
    topic: &str,
) -> Result<u64, KafkaError> {
    let mut loader = Loader::new(brokers, settings, topic, events.len() as u64, false)?;
    for e in events {
        loader.send(e).await?;
    }
    loader.finish().await
}

/// What a call event's Kafka key is: the partition it goes to, so the
/// calls whose order matters to each other stay in one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyBy {
    /// The caller: each number's calls in order (every rule keyed by
    /// caller).
    #[default]
    Caller,
    /// The account when the call has one, else the caller: each trunk's
    /// calls in order too (rules keyed by account: a concurrent one then
    /// decides online exactly as `replay` does).
    Account,
}

impl KeyBy {
    /// The key of `e`.
    pub fn key_of(self, e: &CallEvent) -> &str {
        match (self, e.account.as_deref()) {
            (KeyBy::Account, Some(a)) if !a.is_empty() => a,
            _ => e.caller.as_str(),
        }
    }
}

/// Sends events to a topic keyed by caller (or account), up to 10,000 deliveries in
/// flight, in the order given: for logs that arrive a chunk at a time.
pub struct Loader {
    producer: FutureProducer,
    topic: String,
    key_by: KeyBy,
    pending: FuturesOrdered<rdkafka::producer::DeliveryFuture>,
    acked: u64,
    bar: indicatif::ProgressBar,
}

impl Loader {
    /// An idempotent producer (lz4, 20 ms linger); `total` sizes the progress bar.
    pub fn new(
        brokers: &str,
        settings: &[(String, String)],
        topic: &str,
        total: u64,
        progress: bool,
    ) -> Result<Self, KafkaError> {
        let cfg = producer_config(
            brokers,
            &[
                ("enable.idempotence", "true"),
                ("linger.ms", "20"),
                ("compression.type", "lz4"),
            ],
            settings,
        );
        Ok(Loader {
            producer: cfg.create().map_err(client_err("creating the producer"))?,
            topic: topic.to_string(),
            key_by: KeyBy::Caller,
            pending: FuturesOrdered::new(),
            acked: 0,
            bar: progress_bar(total, progress, "producing"),
        })
    }

    /// The same loader keying each event by `key_by`.
    pub fn keyed_by(mut self, key_by: KeyBy) -> Self {
        self.key_by = key_by;
        self
    }

    /// Enqueues one event (waiting for deliveries when the window is full).
    pub async fn send(&mut self, e: &CallEvent) -> Result<(), KafkaError> {
        let payload = event_json(e);
        let record = FutureRecord::to(&self.topic)
            .key(self.key_by.key_of(e))
            .payload(payload.as_str());
        let fut = self.producer.send_result(record).map_err(|(err, _)| {
            KafkaError::Delivery(format!("cannot enqueue call {}: {err}", e.call_id))
        })?;
        self.pending.push_back(fut);
        while self.pending.len() >= WINDOW {
            self.acked += settle_one(&mut self.pending).await?;
            self.bar.inc(1);
        }
        Ok(())
    }

    /// Waits for every delivery; returns how many were acknowledged.
    pub async fn finish(mut self) -> Result<u64, KafkaError> {
        while !self.pending.is_empty() {
            self.acked += settle_one(&mut self.pending).await?;
            self.bar.inc(1);
        }
        self.producer
            .flush(Duration::from_secs(30))
            .map_err(client_err("flushing the producer"))?;
        self.bar.finish_and_clear();
        Ok(self.acked)
    }
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

//! `callguard consume`: the stream processor.
//!
//! A consumer-group member reads call events, decides them in batches
//! through a [`WindowStore`], and produces one decision record and one
//! feature record per event (undecodable events go to the dead-letter topic
//! with the original bytes). Delivery is at least once with exact effects:
//!
//! * offsets are stored for commit only after every record of the batch
//!   (decisions, features, dead letters) is acknowledged by the broker;
//! * a redelivered event gets its first decision back from the store's
//!   per-call idempotency, so a crash anywhere yields, per call id, exactly
//!   one distinct decision;
//! * on a revoke, the producer is flushed and completed batches are stored
//!   and committed synchronously before the partitions go; messages read but
//!   not yet decided are dropped and read again from the committed offsets;
//! * on shutdown the same happens within a deadline.
//!
//! Events of one partition are decided in partition order (store calls are
//! sequential); up to `max_in_flight` batches may await broker
//! acknowledgement at once (backpressure: no unbounded memory).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientContext;
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use crate::decision::{Decision, DecisionRecord, Verdict};
use crate::error::{EventError, StoreError};
use crate::event::{CallEvent, Decoder};
use crate::features::feature_json;
use crate::kafka::{client_config, client_err, producer_config, KafkaError};
use crate::metrics::{DecisionLabels, Health, Metrics, PartitionLabels};
use crate::rules::RuleSet;
use crate::store::WindowStore;

/// How often an idle consumer stores the offsets of acknowledged batches.
const IDLE_SETTLE: Duration = Duration::from_millis(100);

/// Reason of a decision made by the fallback policy while the store failed.
pub const REASON_STORE_ERROR: &str = "store_error";

/// What to do when the window store fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreErrorPolicy {
    /// Stop consuming and retry with backoff; commit nothing meanwhile, so nothing is lost.
    Block,
    /// Allow the calls, flagged `degraded = true`, and keep going.
    Allow,
    /// Reject the calls, flagged `degraded = true`, and keep going.
    Reject,
}

/// Configuration of the stream processor.
#[derive(Debug, Clone)]
pub struct ConsumeConfig {
    /// Bootstrap servers.
    pub brokers: String,
    /// Consumer group id.
    pub group: String,
    /// Topic of call events.
    pub input_topic: String,
    /// Topic of decision records.
    pub decisions_topic: String,
    /// Topic of feature records.
    pub features_topic: String,
    /// Dead-letter topic.
    pub dlq_topic: String,
    /// Extra librdkafka settings (applied to consumer and producer).
    pub kafka_settings: Vec<(String, String)>,
    /// Largest batch of events per store call.
    pub batch_size: usize,
    /// How long to wait for a batch to fill.
    pub batch_linger: Duration,
    /// Batches that may await broker acknowledgement at once.
    pub max_in_flight: usize,
    /// Store failure policy.
    pub on_store_error: StoreErrorPolicy,
    /// Largest accepted payload, bytes.
    pub max_payload_bytes: usize,
    /// Event decoder.
    pub decoder: Decoder,
    /// Deadline for draining on shutdown and revoke.
    pub drain_timeout: Duration,
}

impl ConsumeConfig {
    /// Defaults for the given brokers and topics.
    pub fn new(
        brokers: &str,
        group: &str,
        input: &str,
        decisions: &str,
        features: &str,
        dlq: &str,
    ) -> Self {
        ConsumeConfig {
            brokers: brokers.to_string(),
            group: group.to_string(),
            input_topic: input.to_string(),
            decisions_topic: decisions.to_string(),
            features_topic: features.to_string(),
            dlq_topic: dlq.to_string(),
            kafka_settings: Vec::new(),
            batch_size: 500,
            batch_linger: Duration::from_millis(5),
            max_in_flight: 4,
            on_store_error: StoreErrorPolicy::Block,
            max_payload_bytes: 64 * 1024,
            decoder: Decoder::default(),
            drain_timeout: Duration::from_secs(10),
        }
    }
}

/// Failures that stop the stream processor.
#[derive(Debug, thiserror::Error)]
pub enum ConsumeError {
    /// Kafka failed.
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// The store failed with a fatal error.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Counts of what a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumeStats {
    /// Events decided (duplicates included).
    pub decided: u64,
    /// Events rejected.
    pub rejected: u64,
    /// Events sent to the dead-letter topic.
    pub dead_letters: u64,
    /// Batches processed.
    pub batches: u64,
}

/// A batch produced and awaiting acknowledgement.
struct Pending {
    /// (topic, partition) → last offset of the batch.
    offsets: Vec<(String, i32, i64)>,
    remaining: AtomicUsize,
    failure: Mutex<Option<String>>,
}

/// State shared between the loop and the librdkafka callbacks.
struct Shared {
    in_flight: Mutex<VecDeque<Arc<Pending>>>,
    rebalanced: AtomicBool,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    drain_timeout: Duration,
}

impl Shared {
    /// Stores the offsets of the acknowledged batches at the head of the
    /// queue; returns how many batches are still in flight, or the first
    /// delivery failure.
    fn settle<C: ConsumerContext, K: Consumer<C>>(
        &self,
        consumer: &K,
    ) -> Result<usize, KafkaError> {
        let mut q = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(head) = q.front() {
            if head.remaining.load(Ordering::Acquire) > 0 {
                break;
            }
            if let Some(msg) = head
                .failure
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
            {
                return Err(KafkaError::Delivery(msg));
            }
            for (topic, partition, offset) in &head.offsets {
                if let Err(e) = consumer.store_offset(topic, *partition, *offset) {
                    // The partition was revoked meanwhile: its new owner re-reads it.
                    debug!(topic, partition, offset, error = %e, "offset not stored");
                }
            }
            q.pop_front();
        }
        self.metrics.in_flight.set(q.len() as i64);
        Ok(q.len())
    }
}

/// Consumer callbacks: rebalances and statistics.
struct ConsumerCtx {
    shared: Arc<Shared>,
    producer: Arc<ThreadedProducer<ProducerCtx>>,
}

impl ClientContext for ConsumerCtx {
    fn stats(&self, stats: Statistics) {
        for (topic, t) in &stats.topics {
            for (partition, p) in &t.partitions {
                if *partition >= 0 && p.consumer_lag >= 0 {
                    self.shared
                        .metrics
                        .lag
                        .get_or_create(&PartitionLabels {
                            topic: topic.clone(),
                            partition: partition.to_string(),
                        })
                        .set(p.consumer_lag);
                }
            }
        }
    }
}

impl ConsumerContext for ConsumerCtx {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        self.shared.rebalanced.store(true, Ordering::Release);
        match rebalance {
            Rebalance::Revoke(tpl) => {
                Metrics::inc(&self.shared.metrics.rebalances, "revoke");
                self.shared.health.assigned.store(false, Ordering::Relaxed);
                // Drain: wait for every produced record, store what completed, commit.
                if let Err(e) = self.producer.flush(self.shared.drain_timeout) {
                    warn!(error = %e, "flush before revoke did not finish");
                }
                if let Err(e) = self.shared.settle::<Self, _>(consumer) {
                    error!(error = %e, "a batch failed delivery before revoke; it will be re-read");
                }
                if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
                    debug!(error = %e, "commit on revoke");
                }
                info!(partitions = tpl.count(), "partitions revoked");
            }
            Rebalance::Assign(tpl) => {
                Metrics::inc(&self.shared.metrics.rebalances, "assign");
                info!(partitions = tpl.count(), "partitions assigned");
            }
            Rebalance::Error(e) => {
                Metrics::inc(&self.shared.metrics.rebalances, "error");
                warn!(error = %e, "rebalance error");
            }
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            self.shared
                .health
                .assigned
                .store(tpl.count() > 0, Ordering::Relaxed);
        }
    }
}

/// Producer callbacks: delivery reports count down their batch.
struct ProducerCtx;

impl ClientContext for ProducerCtx {}

impl ProducerContext for ProducerCtx {
    type DeliveryOpaque = Arc<Pending>;

    fn delivery(&self, result: &DeliveryResult<'_>, pending: Arc<Pending>) {
        if let Err((e, _)) = result {
            let mut f = pending.failure.lock().unwrap_or_else(|p| p.into_inner());
            if f.is_none() {
                *f = Some(e.to_string());
            }
        }
        pending.remaining.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One record to produce.
struct OutRecord {
    topic: String,
    key: Vec<u8>,
    payload: Vec<u8>,
    headers: Option<OwnedHeaders>,
}

/// Runs the stream processor until `shutdown` resolves, then drains.
///
/// `rules` carries the current rule set; a new value takes effect from the
/// next batch on.
pub async fn run<S: WindowStore>(
    config: ConsumeConfig,
    mut store: S,
    rules: watch::Receiver<RuleSet>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()>,
) -> Result<ConsumeStats, ConsumeError> {
    let shared = Arc::new(Shared {
        in_flight: Mutex::new(VecDeque::new()),
        rebalanced: AtomicBool::new(false),
        metrics: metrics.clone(),
        health: health.clone(),
        drain_timeout: config.drain_timeout,
    });
    let mut pcfg = producer_config(&config.brokers, &config.kafka_settings);
    pcfg.set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("compression.type", "lz4");
    let producer: Arc<ThreadedProducer<ProducerCtx>> = Arc::new(
        pcfg.create_with_context(ProducerCtx)
            .map_err(client_err("creating the producer"))?,
    );
    let mut ccfg = client_config(&config.brokers, &config.kafka_settings);
    ccfg.set("group.id", &config.group)
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", "1000")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("statistics.interval.ms", "5000");
    for (k, v) in &config.kafka_settings {
        ccfg.set(k, v);
    }
    let consumer: StreamConsumer<ConsumerCtx> = ccfg
        .create_with_context(ConsumerCtx {
            shared: shared.clone(),
            producer: producer.clone(),
        })
        .map_err(client_err("creating the consumer"))?;
    consumer
        .subscribe(&[config.input_topic.as_str()])
        .map_err(client_err(format!("subscribing to {}", config.input_topic)))?;
    health.store_ok.store(true, Ordering::Relaxed);
    info!(topic = %config.input_topic, group = %config.group, "consuming");

    let mut stats = ConsumeStats::default();
    tokio::pin!(shutdown);
    let mut stopping = false;
    while !stopping {
        // 1. Collect a batch: wait for the first message, then up to the linger time.
        let mut batch: Vec<OwnedMessage> = Vec::with_capacity(config.batch_size);
        let mut deadline: Option<tokio::time::Instant> = None;
        while batch.len() < config.batch_size {
            // While idle, wake up now and then to store offsets of acknowledged batches.
            let wait_until = deadline.unwrap_or_else(|| tokio::time::Instant::now() + IDLE_SETTLE);
            tokio::select! {
                biased;
                _ = &mut shutdown => { stopping = true; break; }
                m = tokio::time::timeout_at(wait_until, consumer.recv()) => match m {
                    Err(_) if deadline.is_some() => break,
                    Err(_) => {
                        shared.settle::<ConsumerCtx, _>(&consumer)?;
                    }
                    Ok(Ok(m)) => {
                        if shared.rebalanced.swap(false, Ordering::AcqRel) {
                            // What was read before the rebalance is read again from the
                            // committed offsets; this message already comes from the new assignment.
                            batch.clear();
                        }
                        batch.push(m.detach());
                        deadline.get_or_insert_with(|| tokio::time::Instant::now() + config.batch_linger);
                    }
                    Ok(Err(e)) => {
                        warn!(error = %e, "consumer error");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
        if stopping || batch.is_empty() {
            continue;
        }

        // 2. Decode; bad events become dead letters.
        let current_rules = rules.borrow().clone();
        let mut events: Vec<CallEvent> = Vec::with_capacity(batch.len());
        let mut out: Vec<OutRecord> = Vec::with_capacity(batch.len() * 2);
        for m in &batch {
            match decode_message(m, &config) {
                Ok(e) => events.push(e),
                Err(err) => {
                    Metrics::inc(&metrics.dlq, err.kind());
                    stats.dead_letters += 1;
                    out.push(dead_letter(m, &err, &config.dlq_topic));
                }
            }
        }

        // 3. Decide (one store call per batch), with the failure policy.

        let verdicts = match decide(
            &mut store,
            &current_rules,
            &events,
            &config,
            &metrics,
            &health,
            &mut shutdown,
        )
        .await
        {
            Some(v) => v?,
            None => break, // shutdown while blocked: nothing of this batch is committed
        };
        metrics.batch_size.observe(events.len() as f64);
        for (v, e) in verdicts.iter().zip(&events) {
            count(&metrics, &mut stats, v);
            let key = e.caller.as_bytes().to_vec();
            out.push(OutRecord {
                topic: config.decisions_topic.clone(),
                key: key.clone(),
                payload: v.record.to_json(&current_rules).to_string().into_bytes(),
                headers: None,
            });
            out.push(OutRecord {
                topic: config.features_topic.clone(),
                key,
                payload: feature_json(v, e, &current_rules).to_string().into_bytes(),
                headers: None,
            });
        }

        // 4. Produce; the batch's offsets are stored once every record is acknowledged.
        let mut last: HashMap<(String, i32), i64> = HashMap::new();
        for m in &batch {
            let e = last
                .entry((m.topic().to_string(), m.partition()))
                .or_insert(m.offset());
            *e = (*e).max(m.offset());
        }
        let pending = Arc::new(Pending {
            offsets: last.into_iter().map(|((t, p), o)| (t, p, o)).collect(),
            remaining: AtomicUsize::new(out.len()),
            failure: Mutex::new(None),
        });
        shared
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(pending.clone());
        for rec in &out {
            send(&producer, rec, pending.clone()).await;
        }
        stats.batches += 1;

        // 5. Store what completed; wait while too many batches are in flight.
        loop {
            let in_flight = shared.settle::<ConsumerCtx, _>(&consumer)?;
            if in_flight < config.max_in_flight {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    // Drain: wait for the last acknowledgements, store, commit synchronously.
    info!("draining");
    let deadline = Instant::now() + config.drain_timeout;
    while shared.settle::<ConsumerCtx, _>(&consumer)? > 0 && Instant::now() < deadline {
        producer.poll(Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let left = shared.settle::<ConsumerCtx, _>(&consumer)?;
    if left > 0 {
        warn!(
            batches = left,
            "shutdown deadline passed with batches unacknowledged; they will be re-read"
        );
    }
    match consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(()) => info!("offsets committed"),
        Err(e) => debug!(error = %e, "final commit"),
    }
    consumer.unsubscribe();
    Ok(stats)
}

fn count(metrics: &Metrics, stats: &mut ConsumeStats, v: &Verdict) {
    let r = &v.record;
    stats.decided += 1;
    stats.rejected += u64::from(r.decision == Decision::Reject);
    metrics
        .events
        .get_or_create(&DecisionLabels {
            decision: r.decision.as_str().to_string(),
            reason: r.reason.clone(),
        })
        .inc();
    if v.duplicate {
        metrics.duplicates.inc();
    }
    if r.late {
        metrics.late.inc();
    }
    if r.degraded {
        metrics.degraded.inc();
    }
}

/// Decides a batch under the failure policy; `None` if shutdown came while blocked.
async fn decide<S: WindowStore, F: Future<Output = ()>>(
    store: &mut S,
    rules: &RuleSet,
    events: &[CallEvent],
    config: &ConsumeConfig,
    metrics: &Metrics,
    health: &Health,
    shutdown: &mut std::pin::Pin<&mut F>,
) -> Option<Result<Vec<Verdict>, ConsumeError>> {
    let mut backoff = Duration::from_millis(50);
    loop {
        let start = Instant::now();
        let result = store.apply_batch(rules, events).await;
        metrics.store_latency.observe(start.elapsed().as_secs_f64());
        let err = match result {
            Ok(v) => {
                health.store_ok.store(true, Ordering::Relaxed);
                return Some(Ok(v));
            }
            Err(e) => e,
        };
        Metrics::inc(
            &metrics.store_errors,
            if err.is_transient() {
                "transient"
            } else {
                "fatal"
            },
        );
        health.store_ok.store(false, Ordering::Relaxed);
        if let Ok(mut d) = health.detail.lock() {
            *d = err.to_string();
        }
        match config.on_store_error {
            StoreErrorPolicy::Block => {
                if !err.is_transient() {
                    return Some(Err(err.into()));
                }
                warn!(error = %err, retry_in_ms = backoff.as_millis() as u64, "store failed; blocking");
                tokio::select! {
                    _ = shutdown.as_mut() => return None,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            StoreErrorPolicy::Allow | StoreErrorPolicy::Reject => {
                warn!(error = %err, policy = ?config.on_store_error, "store failed; deciding degraded");
                let decision = if config.on_store_error == StoreErrorPolicy::Allow {
                    Decision::Allow
                } else {
                    Decision::Reject
                };
                return Some(Ok(events
                    .iter()
                    .map(|e| degraded(e, rules, decision))
                    .collect()));
            }
        }
    }
}

fn degraded(e: &CallEvent, rules: &RuleSet, decision: Decision) -> Verdict {
    Verdict {
        record: DecisionRecord {
            call_id: e.call_id.clone(),
            caller: e.caller.clone(),
            ts_ms: e.ts_ms,
            decision,
            reason: REASON_STORE_ERROR.to_string(),
            counts: vec![0; rules.rules.len()],
            shadow: false,
            late: false,
            degraded: true,
            rules_version: rules.version().to_string(),
        },
        prev_ts_ms: None,
        distinct_callees: None,
        duplicate: false,
    }
}

/// Decodes a message; the key must be present (producers key by caller).
pub fn decode_message(m: &OwnedMessage, config: &ConsumeConfig) -> Result<CallEvent, EventError> {
    let payload = m.payload().unwrap_or_default();
    if payload.len() > config.max_payload_bytes {
        return Err(EventError::Oversized {
            size: payload.len(),
            limit: config.max_payload_bytes,
        });
    }
    if m.key().is_none_or(|k| k.is_empty()) {
        return Err(EventError::Missing(
            "message key (producers must key call events by caller)",
        ));
    }
    if payload.is_empty() {
        return Err(EventError::Json("empty payload".into()));
    }
    config.decoder.decode_json(payload)
}

fn dead_letter(m: &OwnedMessage, err: &EventError, topic: &str) -> OutRecord {
    let mut headers = OwnedHeaders::new()
        .insert(Header {
            key: "callguard.error",
            value: Some(err.to_string().as_str()),
        })
        .insert(Header {
            key: "callguard.error_kind",
            value: Some(err.kind()),
        })
        .insert(Header {
            key: "callguard.source_topic",
            value: Some(m.topic()),
        })
        .insert(Header {
            key: "callguard.partition",
            value: Some(m.partition().to_string().as_str()),
        })
        .insert(Header {
            key: "callguard.offset",
            value: Some(m.offset().to_string().as_str()),
        });
    if let Some(h) = m.headers() {
        for i in 0..h.count() {
            let hdr = h.get(i);
            headers = headers.insert(Header {
                key: hdr.key,
                value: hdr.value,
            });
        }
    }
    OutRecord {
        topic: topic.to_string(),
        key: m.key().unwrap_or_default().to_vec(),
        payload: m.payload().unwrap_or_default().to_vec(),
        headers: Some(headers),
    }
}

async fn send(producer: &ThreadedProducer<ProducerCtx>, rec: &OutRecord, pending: Arc<Pending>) {
    loop {
        let mut r = BaseRecord::with_opaque_to(&rec.topic, pending.clone())
            .key(&rec.key)
            .payload(&rec.payload);
        if let Some(h) = &rec.headers {
            r = r.headers(h.clone());
        }
        match producer.send(r) {
            Ok(()) => return,
            Err((
                rdkafka::error::KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull),
                _,
            )) => {
                // Let deliveries drain, then try again.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err((e, _)) => {
                // Not retryable (e.g. too large for the broker): the batch fails as a whole.
                let mut f = pending.failure.lock().unwrap_or_else(|p| p.into_inner());
                f.get_or_insert_with(|| format!("cannot produce to {}: {e}", rec.topic));
                drop(f);
                pending.remaining.fetch_sub(1, Ordering::AcqRel);
                return;
            }
        }
    }
}

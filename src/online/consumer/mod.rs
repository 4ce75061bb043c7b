//! `callguard consume`: the stream processor.
//!
//! A consumer-group member reads call events, decides them in batches
//! through a [`WindowStore`], and produces one decision record and one
//! feature record per event (undecodable events go to the dead-letter topic
//! with the original bytes). The path of one batch, top to bottom in
//! [`run`]: collect (`next_batch`) → decode ([`encode::decode_message`]) →
//! decide (`decide::decide`, under the store-failure policy) → encode
//! (`encode::Encoder`, the record schema) → produce (`delivery::send`) →
//! acknowledge and store offsets (`delivery::Shared::settle`) → commit
//! (librdkafka's auto-commit of stored offsets, and synchronously on revoke
//! and shutdown).
//!
//! Delivery is at least once with exact effects:
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

mod decide;
mod delivery;
pub mod encode;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::producer::ThreadedProducer;
use rdkafka::types::RDKafkaErrorCode;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::engine::event::{CallEvent, Decoder};
use crate::engine::rules::RuleSet;
use crate::error::{ConsumeError, EventError, KafkaError};
use crate::online::kafka::{client_config, client_err, producer_config};
use crate::online::metrics::{Health, Metrics};
use crate::store::WindowStore;
use delivery::{ConsumerCtx, OutRecord, Pending, ProducerCtx, Shared};
use encode::{dead_letter, decode_message, Encoder};

/// Most messages held undecided while a checkpoint waits for its commit.
const MAX_HELD: usize = 100_000;

/// How long to wait before trying a failed checkpoint commit again.
const CHECKPOINT_RETRY: Duration = Duration::from_millis(50);

/// How often an idle consumer stores the offsets of acknowledged batches.
const IDLE_SETTLE: Duration = Duration::from_millis(100);

/// Default topic of call events.
pub const DEFAULT_INPUT_TOPIC: &str = "calls";
/// Default topic of decision records.
pub const DEFAULT_DECISIONS_TOPIC: &str = "call-decisions";
/// Default topic of feature records.
pub const DEFAULT_FEATURES_TOPIC: &str = "call-features";
/// Default dead-letter topic.
pub const DEFAULT_DLQ_TOPIC: &str = "calls-dlq";
/// Default consumer group.
pub const DEFAULT_GROUP: &str = "callguard";
/// Default `fetch.wait.max.ms` of the consumer (librdkafka's is 500): the
/// longest a broker may hold a fetch when no new data has arrived.
pub const DEFAULT_FETCH_WAIT_MS: &str = "10";

/// Default largest batch of events per store call.
pub const DEFAULT_BATCH_SIZE: usize = 500;
/// Default number of batches that may await acknowledgement at once.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 4;
/// Default largest accepted payload, bytes.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 64 * 1024;
/// Default tolerance for event times ahead of the wall clock, seconds.
pub const DEFAULT_MAX_FUTURE_SKEW_S: u64 = 300;
/// Default deadline for draining on shutdown and revoke, seconds.
pub const DEFAULT_DRAIN_TIMEOUT_S: u64 = 10;

/// What to do when the window store fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StoreErrorPolicy {
    /// Stop consuming and retry with backoff; commit nothing meanwhile, so nothing is lost.
    #[default]
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
    /// Events more than this ahead of the wall clock are dead letters
    /// (`ts_out_of_range`): one far-future time would otherwise move a
    /// caller's latest time ahead and put every real call of it behind the
    /// retention. `None`: only the decoder's absolute range applies.
    pub max_future_skew: Option<Duration>,
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
            batch_size: DEFAULT_BATCH_SIZE,
            batch_linger: Duration::from_millis(5),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            on_store_error: StoreErrorPolicy::Block,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            decoder: Decoder::default(),
            max_future_skew: Some(Duration::from_secs(DEFAULT_MAX_FUTURE_SKEW_S)),
            drain_timeout: Duration::from_secs(DEFAULT_DRAIN_TIMEOUT_S),
        }
    }
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

/// How many messages of `batch` can be decided before some partition's
/// uncommitted events would span more than `limit` ms of event time (at
/// least one, so the consumer always moves on: a single event spans
/// nothing).
fn span_cut(
    batch: &[OwnedMessage],
    decoded: &[Result<CallEvent, EventError>],
    uncommitted: &Uncommitted,
    limit: i64,
) -> usize {
    let mut spans = Uncommitted {
        spans: uncommitted.spans.clone(),
    };
    for (i, (m, e)) in batch.iter().zip(decoded).enumerate() {
        let Ok(e) = e else {
            continue; // a dead letter decides nothing
        };
        spans.note(m.topic(), m.partition(), e.ts_ms);
        if i > 0 && spans.due(limit) {
            return i;
        }
    }
    batch.len()
}

/// Event time decided per partition since the last synchronous commit.
///
/// A redelivered call is recognised only while its caller has moved on by
/// less than the idempotency horizon `D` in event time. Catching up on a
/// backlog covers hours of event time per second, so a crash between two
/// timed commits could redeliver calls whose callers moved on by more than
/// `D`, and they would be decided again, differently. So whenever a
/// partition's uncommitted events span more than `D / 4` of event time, the
/// consumer waits for its batches' acknowledgements and commits
/// synchronously: exactness does not depend on how fast it runs.
#[derive(Debug, Default)]
struct Uncommitted {
    /// (topic, partition, earliest, latest event time) since the commit; a
    /// consumer owns a few partitions, so a vector searched in place (no
    /// allocation per event).
    spans: Vec<(String, i32, i64, i64)>,
}

impl Uncommitted {
    fn note(&mut self, topic: &str, partition: i32, ts: i64) {
        match self
            .spans
            .iter_mut()
            .find(|(t, p, _, _)| *p == partition && t == topic)
        {
            Some((_, _, lo, hi)) => {
                *lo = (*lo).min(ts);
                *hi = (*hi).max(ts);
            }
            None => self.spans.push((topic.to_string(), partition, ts, ts)),
        }
    }

    /// Whether some partition's uncommitted events span more than `limit` ms.
    fn due(&self, limit: i64) -> bool {
        self.spans
            .iter()
            .any(|(_, _, lo, hi)| hi.saturating_sub(*lo) > limit)
    }
}

/// The Kafka clients of a run.
struct Clients {
    consumer: StreamConsumer<ConsumerCtx>,
    producer: Arc<ThreadedProducer<ProducerCtx>>,
    shared: Arc<Shared>,
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
    let clients = connect(&config, &metrics, &health)?;
    health.store_ok.store(true, Ordering::Relaxed);
    info!(topic = %config.input_topic, group = %config.group, "consuming");

    let mut stats = ConsumeStats::default();
    let mut encoder = Encoder::new(&rules.borrow());
    let mut uncommitted = Uncommitted::default();
    // A checkpoint is due but not committed yet; messages read meanwhile.
    let mut checkpoint_due = false;
    let mut held: Vec<OwnedMessage> = Vec::new();
    tokio::pin!(shutdown);
    loop {
        let Some(batch) = next_batch(&clients, &config, &mut shutdown, held).await? else {
            break;
        };
        held = Vec::new();
        if batch.is_empty() {
            continue; // all of it came from partitions revoked meanwhile
        }
        if checkpoint_due {
            // A checkpoint could not be committed: decide nothing more until
            // it is (a rebalance usually; reading on serves it). What was
            // read meanwhile waits, undecided; what a revoke takes is
            // dropped from it and re-read by the new owner.
            if commit_now(&clients, config.drain_timeout).await? {
                checkpoint_due = false;
                uncommitted = Uncommitted::default();
            } else {
                held = batch;
                tokio::time::sleep(CHECKPOINT_RETRY).await;
                continue;
            }
        }
        let current_rules = rules.borrow().clone();
        encoder.follow(&current_rules);
        let span_limit = current_rules.dedup_ms() / 4;
        // Where sparse traffic makes one batch cover more event time than
        // the checkpoint allows, decide only up to there: the rest waits
        // for the checkpoint that follows.
        let mut batch = batch;
        let mut decoded: Vec<Result<CallEvent, EventError>> =
            batch.iter().map(|m| decode_message(m, &config)).collect();
        let cut = span_cut(&batch, &decoded, &uncommitted, span_limit);
        if cut < batch.len() {
            held = batch.split_off(cut);
            decoded.truncate(cut);
        }
        let mut out: Vec<OutRecord> = Vec::with_capacity(batch.len() * 2);
        let events = sort_decoded(
            &batch,
            decoded,
            &config,
            &metrics,
            &mut stats,
            &mut out,
            &mut uncommitted,
        );
        let policy = config.on_store_error;
        let decided = decide::decide(
            &mut store,
            &current_rules,
            &events,
            policy,
            &metrics,
            &health,
            &mut shutdown,
        );
        let verdicts = match decided.await {
            Some(v) => v?,
            None => break, // shutdown while blocked: nothing of this batch is committed
        };
        metrics.batch_size.observe(events.len() as f64);
        for v in &verdicts {
            decide::count(&metrics, &mut stats, v);
        }
        encoder.encode(&events, &verdicts, &config, &mut out);
        produce_batch(&clients, &batch, &out).await;
        stats.batches += 1;
        wait_for_room(&clients, config.max_in_flight).await?;
        if uncommitted.due(span_limit) || !held.is_empty() {
            if commit_now(&clients, config.drain_timeout).await? {
                uncommitted = Uncommitted::default();
            } else {
                checkpoint_due = true;
            }
        }
    }
    drain(&clients, config.drain_timeout).await?;
    Ok(stats)
}

/// The producer's settings: idempotent, lz4, a 5 ms linger; `-X` settings
/// win over these defaults.
fn producer_settings(config: &ConsumeConfig) -> ClientConfig {
    producer_config(
        &config.brokers,
        &[
            ("enable.idempotence", "true"),
            ("linger.ms", "5"),
            ("compression.type", "lz4"),
        ],
        &config.kafka_settings,
    )
}

/// The consumer's settings: offsets stored only after a batch's outputs are
/// acknowledged, committed every second, and fetches answered within
/// [`DEFAULT_FETCH_WAIT_MS`]; `-X` settings win over these defaults.
fn consumer_settings(config: &ConsumeConfig) -> ClientConfig {
    let mut c = client_config(&config.brokers, &config.kafka_settings);
    c.set("group.id", &config.group)
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", "1000")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("statistics.interval.ms", "5000")
        // A fetch is answered when data arrives (fetch.min.bytes = 1) or
        // after this wait, whichever is first: Apache Kafka answers at once
        // when data is there, so this only bounds how long a broker that
        // holds fetches (tansu) delays each call; librdkafka's 500 ms
        // default added half a second to decisions there.
        .set("fetch.wait.max.ms", DEFAULT_FETCH_WAIT_MS);
    for (k, v) in &config.kafka_settings {
        c.set(k, v);
    }
    c
}

/// Creates the producer and the consumer, and subscribes.
fn connect(
    config: &ConsumeConfig,
    metrics: &Arc<Metrics>,
    health: &Arc<Health>,
) -> Result<Clients, KafkaError> {
    let shared = Arc::new(Shared::new(
        metrics.clone(),
        health.clone(),
        config.drain_timeout,
    ));
    let pcfg = producer_settings(config);
    let producer: Arc<ThreadedProducer<ProducerCtx>> = Arc::new(
        pcfg.create_with_context(ProducerCtx {
            metrics: metrics.clone(),
        })
        .map_err(client_err("creating the producer"))?,
    );
    let ccfg = consumer_settings(config);
    let consumer: StreamConsumer<ConsumerCtx> = ccfg
        .create_with_context(ConsumerCtx {
            shared: shared.clone(),
            producer: producer.clone(),
        })
        .map_err(client_err("creating the consumer"))?;
    consumer
        .subscribe(&[config.input_topic.as_str()])
        .map_err(client_err(format!("subscribing to {}", config.input_topic)))?;
    Ok(Clients {
        consumer,
        producer,
        shared,
    })
}

/// Collects the next batch: waits for a first message, then up to the
/// linger time or the batch size. `None` when shutdown is requested. While
/// idle it stores the offsets of acknowledged batches now and then.
async fn next_batch<F: Future<Output = ()>>(
    clients: &Clients,
    config: &ConsumeConfig,
    shutdown: &mut Pin<&mut F>,
    held: Vec<OwnedMessage>,
) -> Result<Option<Vec<OwnedMessage>>, KafkaError> {
    // Held messages (see `checkpoint_due` in `run`) come first, topped up to
    // a batch; while a checkpoint waits, at least one more message is read
    // per retry, as reading serves rebalances.
    let limit = if held.len() >= MAX_HELD {
        held.len() // hold no more: wait for the commit without reading
    } else {
        config.batch_size.max(held.len() + 1)
    };
    let mut batch = held;
    clients.shared.drop_revoked(&mut batch);
    let mut lingering = !batch.is_empty();
    // One timer per batch, not one per message: the linger deadline once
    // a message is in, the idle settle interval before.
    let timer = tokio::time::sleep(if lingering {
        config.batch_linger
    } else {
        IDLE_SETTLE
    });
    tokio::pin!(timer);
    while batch.len() < limit {
        tokio::select! {
            biased;
            _ = shutdown.as_mut() => return Ok(None),
            m = clients.consumer.recv() => match m {
                Ok(m) => {
                    // What was read from partitions revoked meanwhile is read again
                    // by their new owner; this message comes from the current assignment.
                    clients.shared.drop_revoked(&mut batch);
                    batch.push(m.detach());
                    if !lingering {
                        lingering = true;
                        timer.as_mut().reset(tokio::time::Instant::now() + config.batch_linger);
                    }
                }
                Err(e) => {
                    warn!(error = %e, "consumer error");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = timer.as_mut() => {
                if lingering {
                    break;
                }
                clients.shared.settle::<ConsumerCtx, _>(&clients.consumer)?;
                timer.as_mut().reset(tokio::time::Instant::now() + IDLE_SETTLE);
            }
        }
    }
    clients.shared.drop_revoked(&mut batch);
    Ok(Some(batch))
}

/// Sorts a decoded batch: events to decide, and dead letters (in `out`)
/// for messages that did not decode. Event times are noted per partition
/// in `uncommitted`.
fn sort_decoded(
    batch: &[OwnedMessage],
    decoded: Vec<Result<CallEvent, EventError>>,
    config: &ConsumeConfig,
    metrics: &Metrics,
    stats: &mut ConsumeStats,
    out: &mut Vec<OutRecord>,
    uncommitted: &mut Uncommitted,
) -> Vec<CallEvent> {
    let mut events = Vec::with_capacity(batch.len());
    for (m, result) in batch.iter().zip(decoded) {
        match result {
            Ok(e) => {
                uncommitted.note(m.topic(), m.partition(), e.ts_ms);
                events.push(e);
            }
            Err(err) => {
                Metrics::inc(&metrics.dlq, err.kind());
                stats.dead_letters += 1;
                out.push(dead_letter(
                    m,
                    &err,
                    &config.dlq_topic,
                    config.max_payload_bytes,
                ));
            }
        }
    }
    events
}

/// Produces a batch's records; its offsets are stored once every record is
/// acknowledged.
async fn produce_batch(clients: &Clients, batch: &[OwnedMessage], out: &[OutRecord]) {
    let mut last: HashMap<(String, i32), i64> = HashMap::new();
    for m in batch {
        let e = last
            .entry((m.topic().to_string(), m.partition()))
            .or_insert(m.offset());
        *e = (*e).max(m.offset());
    }
    let pending = Pending::new(
        last.into_iter().map(|((t, p), o)| (t, p, o)).collect(),
        out.len(),
    );
    clients.shared.push(pending.clone());
    for rec in out {
        delivery::send(&clients.producer, rec, &pending).await;
    }
}

/// Stores what completed; waits while too many batches are in flight.
async fn wait_for_room(clients: &Clients, max_in_flight: usize) -> Result<(), KafkaError> {
    while clients.shared.settle::<ConsumerCtx, _>(&clients.consumer)? >= max_in_flight {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// Waits for every batch in flight to be acknowledged (their offsets are
/// then stored) and commits synchronously: a checkpoint (see
/// [`Uncommitted`]). Returns whether everything decided is committed now.
/// A delivery failure stops the consumer, as anywhere.
async fn commit_now(clients: &Clients, timeout: Duration) -> Result<bool, KafkaError> {
    let deadline = Instant::now() + timeout;
    while clients.shared.settle::<ConsumerCtx, _>(&clients.consumer)? > 0 {
        if Instant::now() >= deadline {
            warn!("checkpoint: batches still unacknowledged; trying again");
            return Ok(false);
        }
        clients.producer.poll(Duration::from_millis(1));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    match clients.consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(()) => Ok(true),
        // Everything stored was committed already (by the timed commit).
        Err(rdkafka::error::KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => Ok(true),
        Err(e) => {
            warn!(error = %e, "checkpoint not committed; deciding nothing more until it is");
            Ok(false)
        }
    }
}

/// Waits for the last acknowledgements within the deadline, stores their
/// offsets and commits synchronously.
async fn drain(clients: &Clients, timeout: Duration) -> Result<(), KafkaError> {
    info!("draining");
    let deadline = Instant::now() + timeout;
    while clients.shared.settle::<ConsumerCtx, _>(&clients.consumer)? > 0
        && Instant::now() < deadline
    {
        clients.producer.poll(Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let left = clients.shared.settle::<ConsumerCtx, _>(&clients.consumer)?;
    if left > 0 {
        warn!(
            batches = left,
            "shutdown deadline passed with batches unacknowledged; they will be re-read"
        );
    }
    match clients.consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(()) => info!("offsets committed"),
        Err(e) => debug!(error = %e, "final commit"),
    }
    clients.consumer.unsubscribe();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetches_are_answered_quickly_by_default_and_settings_win() {
        let mut config = ConsumeConfig::new("127.0.0.1:9092", "g", "calls", "d", "f", "dlq");
        let c = consumer_settings(&config);
        assert_eq!(c.get("fetch.wait.max.ms"), Some(DEFAULT_FETCH_WAIT_MS));
        assert_eq!(c.get("enable.auto.offset.store"), Some("false"));
        assert_eq!(producer_settings(&config).get("linger.ms"), Some("5"));
        config.kafka_settings = vec![
            ("fetch.wait.max.ms".into(), "100".into()),
            ("linger.ms".into(), "20".into()),
        ];
        assert_eq!(
            consumer_settings(&config).get("fetch.wait.max.ms"),
            Some("100")
        );
        assert_eq!(producer_settings(&config).get("linger.ms"), Some("20"));
    }
}

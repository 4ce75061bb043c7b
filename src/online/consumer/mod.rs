//! `callguard consume`: the stream processor.
//!
//! A consumer-group member reads call events, decides them in batches
//! through a [`WindowStore`], and produces one decision record and one
//! feature record per event (undecodable events go to the dead-letter topic
//! with the original bytes). The path of one batch, top to bottom in
//! [`run`]: collect (`next_batch`) → decode ([`encode::decode_message`]) →
//! decide (`decide::Decider`, under the store-failure policy) → encode
//! (`encode::Encoder`, the record schema) → produce (`delivery::send`) →
//! acknowledge and store offsets (`delivery::Shared::settle`) → commit
//! (librdkafka's auto-commit of stored offsets, checkpoints, and
//! synchronously on revoke and shutdown).
//!
//! The steps overlap: the decider (the store, on a task of its own) works on
//! one batch while the loop collects and decodes the next and encodes and
//! produces the one before. Batches are decided one at a time, in the
//! order read, so a partition's events are decided in partition order.
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
//!   not yet decided are dropped and read again from the committed offsets
//!   (a batch the decider holds at that moment is finished and produced, so
//!   its calls may get a second, identical record from the new owner);
//! * no partition's uncommitted events span the idempotency horizon in
//!   event time or more (`checkpoint`);
//! * on shutdown the batch being decided is finished and the rest drains
//!   within a deadline.
//!
//! Up to `max_in_flight` batches may await broker acknowledgement at once
//! (backpressure: no unbounded memory).

mod checkpoint;
mod decide;
pub use checkpoint::span_limit;
mod delivery;
pub mod encode;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{Producer, ThreadedProducer};
use tokio::sync::{oneshot, watch};
use tracing::{debug, info, warn};

use crate::engine::event::{CallEvent, Decoder};
use crate::engine::rules::RuleSet;
use crate::error::{ConsumeError, KafkaError};
use crate::online::kafka::{client_config, client_err, producer_config};
use crate::online::metrics::{Health, Metrics};
use crate::store::WindowStore;
use checkpoint::{Early, Spans, Uncommitted};
use decide::{Decided, Decider};
use delivery::{ConsumerCtx, Offsets, OutRecord, Pending, ProducerCtx, Shared};
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

/// Default longest wait for a batch to fill, microseconds.
pub const DEFAULT_BATCH_LINGER_US: u64 = 5_000;
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
            batch_linger: Duration::from_micros(DEFAULT_BATCH_LINGER_US),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            on_store_error: StoreErrorPolicy::Block,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            decoder: Decoder::default(),
            max_future_skew: Some(Duration::from_secs(DEFAULT_MAX_FUTURE_SKEW_S)),
            drain_timeout: Duration::from_secs(DEFAULT_DRAIN_TIMEOUT_S),
        }
    }

    /// Refuses topic settings that would mix streams: an output topic equal
    /// to the input (the consumer would read its own records back as calls)
    /// or the dead-letter topic equal to an output topic (dead letters are
    /// told apart from records by their topic).
    pub fn check(&self) -> Result<(), ConsumeError> {
        let outputs = [
            ("--decisions-topic", &self.decisions_topic),
            ("--features-topic", &self.features_topic),
            ("--dlq-topic", &self.dlq_topic),
        ];
        for (flag, topic) in outputs {
            if *topic == self.input_topic {
                return Err(ConsumeError::Config(format!(
                    "{flag} {topic} is also the input topic; the consumer would read its own records as calls"
                )));
            }
        }
        for (flag, topic) in &outputs[..2] {
            if **topic == self.dlq_topic {
                return Err(ConsumeError::Config(format!(
                    "{flag} {topic} is also the dead-letter topic; give dead letters a topic of their own"
                )));
            }
        }
        Ok(())
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

/// The Kafka clients of a run.
struct Clients {
    consumer: Arc<StreamConsumer<ConsumerCtx>>,
    producer: Arc<ThreadedProducer<ProducerCtx>>,
    shared: Arc<Shared>,
    /// The input topic's name, shared by the messages read from it.
    input_topic: Arc<str>,
    /// The dead-letter topic's name, shared by the dead letters.
    dlq_topic: Arc<str>,
}

/// A batch handed to the [`Decider`], with what the loop keeps of it
/// meanwhile.
struct Deciding {
    /// Sequence number (from 1).
    seq: u64,
    /// The last offset per partition of the messages it came from (stored
    /// once its records are produced).
    offsets: Offsets,
    /// Its dead letters, to which the records are added.
    out: Vec<OutRecord>,
    /// The verdicts, on their way.
    reply: oneshot::Receiver<Decided>,
    /// The verdicts, when they arrived while the next batch was collected
    /// (an error: the decider stopped).
    ready: Option<Result<Decided, oneshot::error::RecvError>>,
}

/// What the loop carries from one batch to the next.
struct Progress {
    /// Encodes the records of decided batches.
    encoder: Encoder,
    stats: ConsumeStats,
    uncommitted: Uncommitted,
    early: Early,
    /// Batches submitted so far.
    seq: u64,
    /// The checkpoint allowance of the current rules (see [`checkpoint`]).
    span_limit: i64,
}

/// Runs the stream processor until `shutdown` resolves, then drains.
///
/// `rules` carries the current rule set; a new value takes effect from the
/// next batch on.
pub async fn run<S: WindowStore + 'static>(
    config: ConsumeConfig,
    store: S,
    rules: watch::Receiver<RuleSet>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<ConsumeStats, ConsumeError> {
    config.check()?;
    let clients = connect(&config, &metrics, &health)?;
    warm_producer(&clients, &config).await;
    info!(topic = %config.input_topic, group = %config.group, "consuming");

    let mut shutdown = shutdown.boxed().shared();
    let decider = Decider::spawn(
        store,
        config.clone(),
        metrics.clone(),
        health.clone(),
        shutdown.clone(),
    );
    let mut p = Progress {
        encoder: Encoder::new(&rules.borrow(), &config),
        stats: ConsumeStats::default(),
        uncommitted: Uncommitted::default(),
        early: Early::default(),
        seq: 0,
        span_limit: checkpoint::span_limit(rules.borrow().dedup_ms()),
    };
    // A checkpoint is due but not committed yet; messages read meanwhile.
    let mut checkpoint_due = false;
    let mut held = Read::default();
    // The batch being decided while the next one is collected.
    let mut deciding: Option<Deciding> = None;
    loop {
        let next = next_batch(&clients, &config, &mut shutdown, held, deciding.as_mut()).await?;
        held = Read::default();
        // Store what was acknowledged meanwhile; a wanted background commit
        // may start.
        clients
            .shared
            .settle::<ConsumerCtx, _>(&*clients.consumer)?;
        p.early
            .step(&clients.consumer, &clients.shared, &mut p.uncommitted);
        let mut batch = match next {
            Some(b) if !b.is_empty() => b,
            // Nothing new (the batch being decided is back, or all of it
            // came from partitions revoked meanwhile): finish that one.
            Some(_) => {
                if !finish(&clients, &config, &metrics, &mut p, deciding.take(), false).await? {
                    break;
                }
                continue;
            }
            None => {
                finish(&clients, &config, &metrics, &mut p, deciding.take(), false).await?;
                break;
            }
        };
        let current_rules = rules.borrow().clone();
        let span_limit = checkpoint::span_limit(current_rules.dedup_ms());
        p.span_limit = span_limit;
        // Decide only what fits in the checkpoint allowance; when nothing
        // does, wait for the commit under way, or commit now.
        let mut cut = p.uncommitted.cut(&batch.items, span_limit);
        if cut == 0 || checkpoint_due {
            // Everything decided is produced first, so a commit covers it.
            if !finish(&clients, &config, &metrics, &mut p, deciding.take(), false).await? {
                break;
            }
            p.early.finish(&mut p.uncommitted).await;
            cut = p.uncommitted.cut(&batch.items, span_limit);
            if cut == 0 || checkpoint_due {
                if commit_now(&clients, config.drain_timeout).await? {
                    checkpoint_due = false;
                    p.uncommitted = Uncommitted::default();
                    cut = p.uncommitted.cut(&batch.items, span_limit);
                } else {
                    // Decide nothing more until it is committed (a
                    // rebalance usually; reading on serves it). What was
                    // read meanwhile waits, undecided; what a revoke takes
                    // is dropped from it and re-read by the new owner.
                    checkpoint_due = true;
                    held = batch;
                    tokio::time::sleep(CHECKPOINT_RETRY).await;
                    continue;
                }
            }
        }
        if cut < batch.len() {
            held = batch.split_off(cut);
        }
        let mut out: Vec<OutRecord> = Vec::with_capacity(batch.len() * 2);
        let Sorted {
            events,
            spans,
            offsets,
        } = sort_read(batch.items, &metrics, &mut p.stats, &mut out);
        p.seq += 1;
        p.uncommitted.push(p.seq, spans);
        // The previous batch is produced while this one is decided.
        let reply = decider.submit(current_rules.clone(), events).await?;
        let previous = deciding.replace(Deciding {
            seq: p.seq,
            offsets,
            out,
            reply,
            ready: None,
        });
        if !finish(
            &clients,
            &config,
            &metrics,
            &mut p,
            previous,
            !held.is_empty(),
        )
        .await?
        {
            break;
        }
    }
    p.early.finish(&mut p.uncommitted).await;
    drain(&clients, config.drain_timeout).await?;
    Ok(p.stats)
}

/// Waits for a batch's verdicts and records, then produces them and
/// starts a background commit once a quarter of the checkpoint allowance is
/// used (or `cut`: the next batch did not fit). `false`: shutdown came while the store was
/// failing, and nothing of the batch is produced or committed.
async fn finish(
    clients: &Clients,
    config: &ConsumeConfig,
    metrics: &Metrics,
    p: &mut Progress,
    deciding: Option<Deciding>,
    cut: bool,
) -> Result<bool, ConsumeError> {
    let Some(mut d) = deciding else {
        return Ok(true);
    };
    let decided = match d.ready.take() {
        Some(r) => r,
        None => (&mut d.reply).await,
    }
    .map_err(|_| ConsumeError::DeciderStopped)?;
    let Some(verdicts) = decided.verdicts else {
        return Ok(false);
    };
    let verdicts = verdicts?;
    metrics.batch_size.observe(verdicts.len() as f64);
    for v in &verdicts {
        decide::count(metrics, &mut p.stats, v);
    }
    // Encoded here, not by the decider: the store is the pipeline's slowest
    // step, so it does nothing else.
    p.encoder.follow(&decided.rules);
    d.out.reserve(2 * verdicts.len());
    p.encoder.encode(&decided.events, &verdicts, &mut d.out);
    p.stats.batches += 1;
    produce_batch(clients, d.seq, d.offsets, &d.out).await;
    wait_for_room(clients, config.max_in_flight).await?;
    if cut || p.uncommitted.due(p.span_limit / 4) {
        // A quarter of the allowance used, or the next batch cut: commit in
        // the background while deciding goes on.
        p.early.want(d.seq);
    }
    p.early
        .step(&clients.consumer, &clients.shared, &mut p.uncommitted);
    Ok(true)
}

/// The producer's settings: idempotent, lz4, a 1 ms linger (a batch's
/// records are sent together anyway; a checkpoint waits for them); `-X`
/// settings win over these defaults.
fn producer_settings(config: &ConsumeConfig) -> ClientConfig {
    producer_config(
        &config.brokers,
        &[
            ("enable.idempotence", "true"),
            ("linger.ms", "1"),
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
            dlq_topic: config.dlq_topic.clone(),
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
        consumer: Arc::new(consumer),
        producer,
        shared,
        input_topic: config.input_topic.as_str().into(),
        dlq_topic: config.dlq_topic.as_str().into(),
    })
}

/// Longest wait at start for an output topic's metadata.
const WARM_TIMEOUT: Duration = Duration::from_secs(5);

/// Looks up the decisions and features topics before the first batch, so
/// the first records are not held while the producer finds their
/// partitions: on tansu the first batch's acknowledgements took 0.8 s
/// without it, and the first checkpoint, which waits for them, stalled
/// deciding that long. A failure is only logged (producing looks the
/// topics up again).
async fn warm_producer(clients: &Clients, config: &ConsumeConfig) {
    let producer = clients.producer.clone();
    let topics = [
        config.decisions_topic.clone(),
        config.features_topic.clone(),
    ];
    let _ = tokio::task::spawn_blocking(move || {
        for topic in &topics {
            if let Err(e) = producer.client().fetch_metadata(Some(topic), WARM_TIMEOUT) {
                warn!(%topic, error = %e, "could not look up an output topic at start");
            }
        }
    })
    .await;
}

/// A message read: where it came from, and its event, or its dead letter
/// if it is not one (built as it is read, so the message's bytes are not
/// kept).
struct Item {
    topic: Arc<str>,
    partition: i32,
    offset: i64,
    /// The event, or the error's kind and the dead letter.
    event: Result<CallEvent, (&'static str, Box<OutRecord>)>,
}

/// Messages read and not yet decided: decoded as they arrive, while the
/// batch before is with the store.
#[derive(Default)]
struct Read {
    items: Vec<Item>,
}

impl Read {
    fn len(&self) -> usize {
        self.items.len()
    }

    fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    fn push(&mut self, m: &impl Message, clients: &Clients, config: &ConsumeConfig) {
        let topic = if m.topic() == &*clients.input_topic {
            clients.input_topic.clone()
        } else {
            m.topic().into()
        };
        let event = decode_message(m, config).map_err(|err| {
            let letter = dead_letter(m, &err, &clients.dlq_topic, config.max_payload_bytes);
            (err.kind(), Box::new(letter))
        });
        self.items.push(Item {
            topic,
            partition: m.partition(),
            offset: m.offset(),
            event,
        });
    }

    /// Drops the messages of partitions revoked since the last call.
    fn drop_revoked(&mut self, shared: &Shared) {
        let revoked = shared.take_revoked();
        if revoked.is_empty() {
            return;
        }
        self.items.retain(|m| {
            !revoked
                .iter()
                .any(|(t, p)| *p == m.partition && *t == *m.topic)
        });
    }

    /// Splits off the messages from `at` on.
    fn split_off(&mut self, at: usize) -> Read {
        Read {
            items: self.items.split_off(at),
        }
    }
}

/// Collects the next batch: waits for a first message, then up to the
/// linger time or the batch size. When the verdicts of the batch being
/// decided arrive it stops lingering: it returns at once if it has nothing,
/// else after taking the messages already received. `None` when shutdown is
/// requested. While idle it stores the offsets of acknowledged batches now
/// and then.
async fn next_batch<F: Future<Output = ()> + Unpin>(
    clients: &Clients,
    config: &ConsumeConfig,
    shutdown: &mut F,
    held: Read,
    mut deciding: Option<&mut Deciding>,
) -> Result<Option<Read>, KafkaError> {
    // Held messages (see `checkpoint_due` in `run`) come first, topped up to
    // a batch; while a checkpoint waits, at least one more message is read
    // per retry, as reading serves rebalances.
    let limit = if held.len() >= MAX_HELD {
        held.len() // hold no more: wait for the commit without reading
    } else {
        config.batch_size.max(held.len() + 1)
    };
    let mut batch = held;
    batch.drop_revoked(&clients.shared);
    let mut lingering = !batch.is_empty();
    // One timer per batch, not one per message: the linger deadline once
    // a message is in, the idle settle interval before.
    let timer = tokio::time::sleep(if lingering {
        config.batch_linger
    } else {
        IDLE_SETTLE
    });
    tokio::pin!(timer);
    // Watch the batch being decided only until its verdicts are in.
    if deciding.as_ref().is_some_and(|d| d.ready.is_some()) {
        deciding = None;
    }
    while batch.len() < limit {
        let watching = deciding.is_some();
        tokio::select! {
            biased;
            _ = &mut *shutdown => return Ok(None),
            r = reply_of(&mut deciding), if watching => {
                if let Some(d) = deciding.take() {
                    d.ready = Some(r);
                }
                if batch.is_empty() {
                    break;
                }
                // Take what is already there (a backlog), then go.
                timer.as_mut().reset(tokio::time::Instant::now());
                lingering = true;
            }
            m = clients.consumer.recv() => match m {
                Ok(m) => {
                    // What was read from partitions revoked meanwhile is read again
                    // by their new owner; this message comes from the current assignment.
                    batch.drop_revoked(&clients.shared);
                    batch.push(&m, clients, config);
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
                clients.shared.settle::<ConsumerCtx, _>(&*clients.consumer)?;
                timer.as_mut().reset(tokio::time::Instant::now() + IDLE_SETTLE);
            }
        }
    }
    batch.drop_revoked(&clients.shared);
    Ok(Some(batch))
}

/// The verdicts of the batch being decided, when they come (never, for
/// none).
fn reply_of<'a, 'b: 'a>(
    deciding: &'a mut Option<&'b mut Deciding>,
) -> impl Future<Output = Result<Decided, oneshot::error::RecvError>> + use<'a, 'b> {
    std::future::poll_fn(move |cx| match deciding {
        Some(d) => std::pin::Pin::new(&mut d.reply).poll(cx),
        None => std::task::Poll::Pending,
    })
}

/// A batch sorted for deciding.
struct Sorted {
    /// The events to decide, in the order read.
    events: Vec<CallEvent>,
    /// Their event times per partition.
    spans: Spans,
    /// The last offset per partition of every message of the batch.
    offsets: Offsets,
}

/// Sorts a batch read: events to decide, and dead letters (into `out`) for
/// messages that did not decode.
fn sort_read(
    items: Vec<Item>,
    metrics: &Metrics,
    stats: &mut ConsumeStats,
    out: &mut Vec<OutRecord>,
) -> Sorted {
    let mut events = Vec::with_capacity(items.len());
    let mut spans = Spans::default();
    let mut offsets = Offsets::default();
    for m in items {
        offsets.note(&m.topic, m.partition, m.offset, |last| {
            *last = (*last).max(m.offset)
        });
        match m.event {
            Ok(e) => {
                spans.note(&m.topic, m.partition, e.ts_ms);
                events.push(e);
            }
            Err((kind, letter)) => {
                metrics.dead_letter(kind);
                stats.dead_letters += 1;
                out.push(*letter);
            }
        }
    }
    Sorted {
        events,
        spans,
        offsets,
    }
}

/// Produces a batch's records; its offsets are stored once every record is
/// acknowledged.
async fn produce_batch(clients: &Clients, seq: u64, offsets: Offsets, out: &[OutRecord]) {
    let pending = Pending::new(seq, offsets.into_vec(), out.len());
    clients.shared.push(pending.clone());
    for rec in out {
        delivery::send(&clients.producer, rec, &pending).await;
    }
}

/// Stores what completed; waits while too many batches are in flight.
async fn wait_for_room(clients: &Clients, max_in_flight: usize) -> Result<(), KafkaError> {
    while clients
        .shared
        .settle::<ConsumerCtx, _>(&*clients.consumer)?
        >= max_in_flight
    {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// Waits for every batch in flight to be acknowledged (their offsets are
/// then stored) and commits synchronously: a checkpoint (see
/// [`checkpoint`]). Returns whether everything decided is committed now.
/// A delivery failure stops the consumer, as anywhere.
async fn commit_now(clients: &Clients, timeout: Duration) -> Result<bool, KafkaError> {
    let deadline = Instant::now() + timeout;
    while clients
        .shared
        .settle::<ConsumerCtx, _>(&*clients.consumer)?
        > 0
    {
        if Instant::now() >= deadline {
            warn!("checkpoint: batches still unacknowledged; trying again");
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let consumer = clients.consumer.clone();
    Ok(
        tokio::task::spawn_blocking(move || checkpoint::commit(&consumer))
            .await
            .unwrap_or(false),
    )
}

/// Waits for the last acknowledgements within the deadline, stores their
/// offsets and commits synchronously.
async fn drain(clients: &Clients, timeout: Duration) -> Result<(), KafkaError> {
    info!("draining");
    let deadline = Instant::now() + timeout;
    while clients
        .shared
        .settle::<ConsumerCtx, _>(&*clients.consumer)?
        > 0
        && Instant::now() < deadline
    {
        clients.producer.poll(Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let left = clients
        .shared
        .settle::<ConsumerCtx, _>(&*clients.consumer)?;
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
    fn topics_that_would_mix_streams_are_refused() {
        let ok = ConsumeConfig::new("b", "g", "calls", "d", "f", "dlq");
        assert!(ok.check().is_ok());
        let looped = ConsumeConfig::new("b", "g", "calls", "calls", "f", "dlq");
        let e = looped.check().unwrap_err().to_string();
        assert!(
            e.contains("--decisions-topic calls is also the input topic"),
            "{e}"
        );
        let mixed = ConsumeConfig::new("b", "g", "calls", "d", "dlq", "dlq");
        let e = mixed.check().unwrap_err().to_string();
        assert!(
            e.contains("--features-topic dlq is also the dead-letter topic"),
            "{e}"
        );
        // Decisions and features may share a topic.
        assert!(ConsumeConfig::new("b", "g", "calls", "out", "out", "dlq")
            .check()
            .is_ok());
    }

    #[test]
    fn fetches_are_answered_quickly_by_default_and_settings_win() {
        let mut config = ConsumeConfig::new("127.0.0.1:9092", "g", "calls", "d", "f", "dlq");
        let c = consumer_settings(&config);
        assert_eq!(c.get("fetch.wait.max.ms"), Some(DEFAULT_FETCH_WAIT_MS));
        assert_eq!(c.get("enable.auto.offset.store"), Some("false"));
        assert_eq!(producer_settings(&config).get("linger.ms"), Some("1"));
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

//! The Kafka clients of a run: connecting, producing a batch's records,
//! and waiting for their acknowledgements (woken by the delivery
//! callback) for room, a checkpoint or the drain.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::producer::{Producer, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use tracing::{debug, info, warn};

use crate::error::KafkaError;
use crate::online::kafka::{client_config, client_err, producer_config};
use crate::online::metrics::{Health, Metrics};

use super::delivery::{self, ConsumerCtx, Offsets, OutRecord, Pending, ProducerCtx, Shared};
use super::{ConsumeConfig, DEFAULT_FETCH_WAIT_MS};

/// The Kafka clients of a run.
pub(super) struct Clients {
    pub(super) consumer: Arc<StreamConsumer<ConsumerCtx>>,
    pub(super) producer: Arc<ThreadedProducer<ProducerCtx>>,
    pub(super) shared: Arc<Shared>,
    /// The input topic's name, shared by the messages read from it.
    pub(super) input_topic: Arc<str>,
    /// The dead-letter topic's name, shared by the dead letters.
    pub(super) dlq_topic: Arc<str>,
}

/// The producer's settings: idempotent, lz4, a 1 ms linger (a batch's
/// records are sent together anyway; a checkpoint waits for them); `-X`
/// settings win over these defaults.
pub(super) fn producer_settings(config: &ConsumeConfig) -> ClientConfig {
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
pub(super) fn consumer_settings(config: &ConsumeConfig) -> ClientConfig {
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
pub(super) fn connect(
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
            acked: shared.acked.clone(),
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
pub(super) async fn warm_producer(clients: &Clients, config: &ConsumeConfig) {
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

/// Produces a batch's records; its offsets are stored once every record is
/// acknowledged.
pub(super) async fn produce_batch(
    clients: &Clients,
    seq: u64,
    offsets: Offsets,
    out: &[OutRecord],
) {
    let pending = Pending::new(seq, offsets.into_vec(), out.len());
    clients.shared.push(pending.clone());
    for rec in out {
        delivery::send(&clients.producer, rec, &pending).await;
    }
}

/// Stores the offsets of acknowledged batches until at most `at_most` are
/// in flight, woken by the delivery callback ([`Shared::acked`]); `false`
/// if `deadline` passes first. A delivery failure is an error.
pub(super) async fn settle_to(
    clients: &Clients,
    at_most: usize,
    deadline: Option<Instant>,
) -> Result<bool, KafkaError> {
    loop {
        // Created before looking, so an acknowledgement in between is
        // not missed (and `notify_one` keeps a permit anyway).
        let acked = clients.shared.acked.notified();
        if clients
            .shared
            .settle::<ConsumerCtx, _>(&*clients.consumer)?
            <= at_most
        {
            return Ok(true);
        }
        match deadline {
            Some(d) => {
                if tokio::time::timeout_at(d.into(), acked).await.is_err() {
                    return Ok(false);
                }
            }
            None => acked.await,
        }
    }
}

/// Stores what completed; waits while too many batches are in flight.
pub(super) async fn wait_for_room(
    clients: &Clients,
    max_in_flight: usize,
) -> Result<(), KafkaError> {
    settle_to(clients, max_in_flight.saturating_sub(1), None).await?;
    Ok(())
}

/// Waits for every batch in flight to be acknowledged (their offsets are
/// then stored) and commits synchronously: a checkpoint (see
/// [`checkpoint`]). Returns whether everything decided is committed now.
/// A delivery failure stops the consumer, as anywhere.
pub(super) async fn commit_now(clients: &Clients, timeout: Duration) -> Result<bool, KafkaError> {
    if !settle_to(clients, 0, Some(Instant::now() + timeout)).await? {
        warn!("checkpoint: batches still unacknowledged; trying again");
        return Ok(false);
    }
    let consumer = clients.consumer.clone();
    Ok(tokio::task::spawn_blocking(move || commit(&consumer))
        .await
        .unwrap_or(false))
}

/// Waits for the last acknowledgements within the deadline, stores their
/// offsets and commits synchronously.
pub(super) async fn drain(clients: &Clients, timeout: Duration) -> Result<(), KafkaError> {
    info!("draining");
    settle_to(clients, 0, Some(Instant::now() + timeout)).await?;
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

/// Commits the stored offsets synchronously; whether everything stored is
/// committed now.
pub(super) fn commit(consumer: &StreamConsumer<ConsumerCtx>) -> bool {
    match consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(()) => true,
        // Everything stored was committed already (by the timed commit).
        Err(rdkafka::error::KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => true,
        Err(e) => {
            warn!(error = %e, "checkpoint not committed; a later one tries again");
            false
        }
    }
}

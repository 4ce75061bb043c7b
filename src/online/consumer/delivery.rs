//! Producing a batch's records and storing its offsets once every record
//! is acknowledged: the at-least-once half of the consumer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientContext;
use tracing::{debug, error, info, warn};

use crate::error::KafkaError;
use crate::online::metrics::{Health, Metrics, PartitionLabels};

/// One record to produce.
pub(super) struct OutRecord {
    /// Destination topic.
    pub topic: String,
    /// Key (the caller, or the original key of a dead letter).
    pub key: Vec<u8>,
    /// Payload.
    pub payload: Vec<u8>,
    /// Headers (dead letters only).
    pub headers: Option<OwnedHeaders>,
    /// A dead letter: if it cannot be produced it is logged and counted,
    /// and the batch goes on (a poison pill must not stop the consumer).
    pub dead_letter: bool,
}

/// What a delivery report refers to.
pub(super) struct Delivery {
    pending: Arc<Pending>,
    dead_letter: bool,
}

/// A batch produced and awaiting acknowledgement.
pub(super) struct Pending {
    /// (topic, partition) → last offset of the batch.
    offsets: Vec<(String, i32, i64)>,
    remaining: AtomicUsize,
    failure: Mutex<Option<String>>,
}

impl Pending {
    /// A batch of `records` records covering these last offsets.
    pub fn new(offsets: Vec<(String, i32, i64)>, records: usize) -> Arc<Self> {
        Arc::new(Pending {
            offsets,
            remaining: AtomicUsize::new(records),
            failure: Mutex::new(None),
        })
    }

    fn done(&self) {
        self.remaining.fetch_sub(1, Ordering::AcqRel);
    }

    fn fail(&self, why: String) {
        let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert(why);
        drop(f);
        self.remaining.fetch_sub(1, Ordering::AcqRel);
    }
}

/// State shared between the loop and the librdkafka callbacks.
pub(super) struct Shared {
    in_flight: Mutex<VecDeque<Arc<Pending>>>,
    /// Set by a rebalance; the loop drops what it read before it.
    pub rebalanced: AtomicBool,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    drain_timeout: Duration,
}

impl Shared {
    pub fn new(metrics: Arc<Metrics>, health: Arc<Health>, drain_timeout: Duration) -> Self {
        Shared {
            in_flight: Mutex::new(VecDeque::new()),
            rebalanced: AtomicBool::new(false),
            metrics,
            health,
            drain_timeout,
        }
    }

    /// Queues a batch whose records are being produced.
    pub fn push(&self, pending: Arc<Pending>) {
        self.in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(pending);
    }

    /// Stores the offsets of the acknowledged batches at the head of the
    /// queue; returns how many batches are still in flight, or the first
    /// delivery failure.
    pub fn settle<C: ConsumerContext, K: Consumer<C>>(
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
pub(super) struct ConsumerCtx {
    pub shared: Arc<Shared>,
    pub producer: Arc<ThreadedProducer<ProducerCtx>>,
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
        let metrics = &self.shared.metrics;
        match rebalance {
            Rebalance::Revoke(tpl) => {
                Metrics::inc(&metrics.rebalances, "revoke");
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
                Metrics::inc(&metrics.rebalances, "assign");
                info!(partitions = tpl.count(), "partitions assigned");
            }
            Rebalance::Error(e) => {
                Metrics::inc(&metrics.rebalances, "error");
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
pub(super) struct ProducerCtx {
    pub metrics: Arc<Metrics>,
}

impl ProducerCtx {
    /// A record failed for good: a dead letter is logged and counted (the
    /// batch goes on), any other record fails its batch.
    fn failed(&self, d: &Delivery, topic: &str, why: String) {
        if d.dead_letter {
            self.metrics.dlq_failures.inc();
            error!(topic, error = %why, "a dead letter could not be produced; it is dropped, the batch goes on");
            d.pending.done();
        } else {
            d.pending.fail(format!("cannot produce to {topic}: {why}"));
        }
    }
}

impl ClientContext for ProducerCtx {}

impl ProducerContext for ProducerCtx {
    type DeliveryOpaque = Box<Delivery>;

    fn delivery(&self, result: &DeliveryResult<'_>, d: Box<Delivery>) {
        match result {
            Err((e, m)) => {
                use rdkafka::message::Message;
                self.failed(&d, m.topic(), e.to_string());
            }
            Ok(_) => d.pending.done(),
        }
    }
}

/// Enqueues one record of a batch, waiting while the producer queue is full.
pub(super) async fn send(
    producer: &ThreadedProducer<ProducerCtx>,
    rec: &OutRecord,
    pending: &Arc<Pending>,
) {
    loop {
        let delivery = Box::new(Delivery {
            pending: pending.clone(),
            dead_letter: rec.dead_letter,
        });
        let mut r = BaseRecord::with_opaque_to(&rec.topic, delivery)
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
            Err((e, r)) => {
                // Not retryable (e.g. too large for the broker).
                producer
                    .context()
                    .failed(&r.delivery_opaque, &rec.topic, e.to_string());
                return;
            }
        }
    }
}

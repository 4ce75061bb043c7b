//! Producing a batch's records and storing its offsets once every record
//! is acknowledged: the at-least-once half of the consumer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use compact_str::CompactString;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientContext;
use tokio::sync::Notify;
use tracing::{debug, error, info, warn};

use crate::error::KafkaError;
use crate::online::metrics::{Health, Metrics, PartitionLabels};

/// One record to produce.
pub(super) struct OutRecord {
    /// Destination topic (shared by every record bound for it).
    pub topic: Arc<str>,
    /// Key: the caller, or the original key of a dead letter.
    pub key: OutKey,
    /// Payload.
    pub payload: Vec<u8>,
    /// Headers (dead letters only).
    pub headers: Option<OwnedHeaders>,
}

/// The key of an [`OutRecord`].
pub(super) enum OutKey {
    /// A caller (normalised numbers are kept inline: no allocation).
    Caller(CompactString),
    /// A dead letter's original key, as read.
    Bytes(Vec<u8>),
}

impl OutKey {
    fn as_bytes(&self) -> &[u8] {
        match self {
            OutKey::Caller(c) => c.as_bytes(),
            OutKey::Bytes(b) => b,
        }
    }
}

/// A value per (topic, partition). A consumer owns a few partitions, so a
/// vector searched in place beats a map (no allocation per message: topic
/// names are shared).
#[derive(Debug, Clone)]
pub(super) struct ByPartition<V>(Vec<(Arc<str>, i32, V)>);

impl<V> Default for ByPartition<V> {
    fn default() -> Self {
        ByPartition(Vec::new())
    }
}

impl<V> ByPartition<V> {
    /// Updates the value of `topic`/`partition` with `update`, or starts it
    /// at `first`.
    pub fn note(
        &mut self,
        topic: &Arc<str>,
        partition: i32,
        first: V,
        update: impl FnOnce(&mut V),
    ) {
        match self
            .0
            .iter_mut()
            .find(|(t, p, _)| *p == partition && *t == *topic)
        {
            Some((_, _, v)) => update(v),
            None => self.0.push((topic.clone(), partition, first)),
        }
    }

    /// (topic, partition, value) for each partition noted.
    pub fn iter(&self) -> impl Iterator<Item = &(Arc<str>, i32, V)> {
        self.0.iter()
    }

    /// (topic, partition, value) for each partition noted.
    pub fn into_vec(self) -> Vec<(Arc<str>, i32, V)> {
        self.0
    }
}

/// The last offset read per partition of a batch.
pub(super) type Offsets = ByPartition<i64>;

/// A batch produced and awaiting acknowledgement.
pub(super) struct Pending {
    /// The batch's sequence number (they grow from 1).
    seq: u64,
    /// (topic, partition) → last offset of the batch.
    offsets: Vec<(Arc<str>, i32, i64)>,
    remaining: AtomicUsize,
    failure: Mutex<Option<String>>,
}

impl Pending {
    /// Batch `seq` of `records` records covering these last offsets.
    pub fn new(seq: u64, offsets: Vec<(Arc<str>, i32, i64)>, records: usize) -> Arc<Self> {
        Arc::new(Pending {
            seq,
            offsets,
            remaining: AtomicUsize::new(records),
            failure: Mutex::new(None),
        })
    }

    /// One record acknowledged; whether it was the batch's last.
    fn done(&self) -> bool {
        self.remaining.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// One record failed for good; whether it was the batch's last.
    fn fail(&self, why: String) -> bool {
        let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert(why);
        drop(f);
        self.remaining.fetch_sub(1, Ordering::AcqRel) == 1
    }
}

/// State shared between the loop and the librdkafka callbacks.
pub(super) struct Shared {
    in_flight: Mutex<VecDeque<Arc<Pending>>>,
    /// Partitions revoked since the loop last looked: it drops what it read
    /// from them and has not decided yet (their new owner reads it again).
    /// Under cooperative rebalancing the partitions it keeps are not here,
    /// so their messages stay in the batch and their fetch positions hold.
    revoked: Mutex<Vec<(String, i32)>>,
    /// The last batch whose offsets are stored.
    stored_through: AtomicU64,
    /// Signalled by the delivery callback when a batch's last record is
    /// acknowledged (or failed): the loop waits on it for room, a
    /// checkpoint or the drain, instead of polling.
    pub acked: Arc<Notify>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    drain_timeout: Duration,
}

impl Shared {
    pub fn new(metrics: Arc<Metrics>, health: Arc<Health>, drain_timeout: Duration) -> Self {
        Shared {
            in_flight: Mutex::new(VecDeque::new()),
            revoked: Mutex::new(Vec::new()),
            stored_through: AtomicU64::new(0),
            acked: Arc::new(Notify::new()),
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

    /// The last batch whose offsets are stored (0: none yet).
    pub fn stored_through(&self) -> u64 {
        self.stored_through.load(Ordering::Acquire)
    }

    /// The partitions revoked since the last call: messages read from them
    /// are dropped undecided (their new owner reads them again).
    pub fn take_revoked(&self) -> Vec<(String, i32)> {
        std::mem::take(&mut *self.revoked.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Stores the offsets of the acknowledged batches at the head of the
    /// queue; returns how many batches are still in flight, or the first
    /// delivery failure. A failed batch stays at the head, failed: neither
    /// its offsets nor those of any later batch are ever stored, so nothing
    /// past it is committed (the process stops and its successor re-reads
    /// from the last commit).
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
                .as_ref()
            {
                return Err(KafkaError::Delivery(msg.clone()));
            }
            for (topic, partition, offset) in &head.offsets {
                if let Err(e) = consumer.store_offset(topic, *partition, *offset) {
                    // The partition was revoked meanwhile: its new owner re-reads it.
                    debug!(topic = &**topic, partition, offset, error = %e, "offset not stored");
                }
            }
            self.stored_through.store(head.seq, Ordering::Release);
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
                    self.shared
                        .metrics
                        .status
                        .lag(topic, *partition, p.consumer_lag);
                }
            }
        }
    }
}

impl ConsumerContext for ConsumerCtx {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let metrics = &self.shared.metrics;
        match rebalance {
            Rebalance::Revoke(tpl) => {
                Metrics::inc(&metrics.rebalances, "revoke");
                self.shared
                    .revoked
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend(
                        tpl.elements()
                            .iter()
                            .map(|e| (e.topic().to_string(), e.partition())),
                    );
                // Drain: wait for every produced record, store what completed, commit.
                if let Err(e) = self.producer.flush(self.shared.drain_timeout) {
                    warn!(error = %e, "flush before revoke did not finish");
                }
                if let Err(e) = self.shared.settle::<Self, _>(consumer) {
                    // Nothing from the failed batch on is stored: the commit
                    // below covers only batches before it.
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

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, _rebalance: &Rebalance<'_>) {
        // Ready while anything is assigned: under cooperative rebalancing a
        // revoke takes some partitions and leaves the others.
        let owned = consumer.assignment().map_or(0, |a| a.count());
        self.shared
            .health
            .assigned
            .store(owned > 0, Ordering::Relaxed);
        self.shared
            .metrics
            .assigned_partitions
            .set(i64::try_from(owned).unwrap_or(i64::MAX));
    }
}

/// Producer callbacks: delivery reports count down their batch. A record's
/// delivery opaque is its batch's [`Pending`] (no allocation per record);
/// a dead letter is told apart by its topic, which differs from the output
/// topics (see [`super::ConsumeConfig::check`]).
pub(super) struct ProducerCtx {
    pub metrics: Arc<Metrics>,
    /// The dead-letter topic.
    pub dlq_topic: String,
    /// [`Shared::acked`].
    pub acked: Arc<Notify>,
}

impl ProducerCtx {
    /// A record failed for good: a dead letter is logged and counted (the
    /// batch goes on), any other record fails its batch. Whether it was
    /// the batch's last.
    fn failed(&self, pending: &Pending, topic: &str, why: String) -> bool {
        if topic == self.dlq_topic {
            self.metrics.dlq_failures.inc();
            error!(topic, error = %why, "a dead letter could not be produced; it is dropped, the batch goes on");
            pending.done()
        } else {
            pending.fail(format!("cannot produce to {topic}: {why}"))
        }
    }
}

impl ClientContext for ProducerCtx {}

impl ProducerContext for ProducerCtx {
    type DeliveryOpaque = Arc<Pending>;

    fn delivery(&self, result: &DeliveryResult<'_>, pending: Arc<Pending>) {
        let last = match result {
            Err((e, m)) => {
                use rdkafka::message::Message;
                self.failed(&pending, m.topic(), e.to_string())
            }
            Ok(_) => pending.done(),
        };
        if last {
            // A permit is kept if the loop is not waiting yet.
            self.acked.notify_one();
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
        let mut r = BaseRecord::with_opaque_to(&rec.topic, pending.clone())
            .key(rec.key.as_bytes())
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
    use rdkafka::{Offset, TopicPartitionList};

    use super::*;
    use crate::online::kafka::{client_config, EmbeddedKafka};

    /// A failed delivery is told apart by its topic: a dead letter is
    /// dropped and its batch goes on; a decision or feature record fails
    /// its batch.
    #[test]
    fn a_failed_dead_letter_is_dropped_and_a_failed_record_fails_its_batch() {
        let metrics = Arc::new(Metrics::new());
        let ctx = ProducerCtx {
            metrics: metrics.clone(),
            dlq_topic: "calls-dlq".into(),
            acked: Arc::new(Notify::new()),
        };
        let batch = Pending::new(1, vec![("calls".into(), 0, 9)], 2);
        ctx.failed(&batch, "calls-dlq", "too large".into());
        assert_eq!(batch.remaining.load(Ordering::Acquire), 1);
        assert!(batch.failure.lock().unwrap().is_none());
        assert_eq!(metrics.dlq_failures.get(), 1);
        ctx.failed(&batch, "call-decisions", "broker said no".into());
        assert_eq!(batch.remaining.load(Ordering::Acquire), 0);
        let why = batch.failure.lock().unwrap().clone().unwrap();
        assert!(
            why.contains("cannot produce to call-decisions: broker said no"),
            "{why}"
        );
        assert_eq!(metrics.dlq_failures.get(), 1);
    }

    /// A batch whose delivery failed stays failed: later calls of `settle`
    /// (the revoke handler's, the loop's) never store its offsets, so a
    /// commit never moves past it.
    #[test]
    fn a_failed_batch_is_never_stored_or_committed() {
        let kafka = EmbeddedKafka::start().unwrap();
        kafka.create_topic("t", 1).unwrap();
        let consumer: BaseConsumer = client_config(&kafka.bootstrap(), &[])
            .set("group.id", "g")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset("t", 0, Offset::Beginning).unwrap();
        consumer.assign(&tpl).unwrap();
        let _ = consumer.poll(Duration::from_millis(500));
        let shared = Shared::new(
            Arc::new(Metrics::new()),
            Arc::new(Health::default()),
            Duration::from_secs(1),
        );
        let ok = Pending::new(1, vec![("t".into(), 0, 9)], 1);
        let failed = Pending::new(2, vec![("t".into(), 0, 19)], 2);
        let later = Pending::new(3, vec![("t".into(), 0, 29)], 1);
        for p in [&ok, &failed, &later] {
            shared.push(p.clone());
        }
        ok.done();
        failed.done();
        failed.fail("broker said no".into());
        later.done();
        for _ in 0..3 {
            let e = shared.settle::<_, _>(&consumer).unwrap_err();
            assert!(e.to_string().contains("broker said no"), "{e}");
        }
        assert_eq!(shared.stored_through(), 1);
        consumer.commit_consumer_state(CommitMode::Sync).unwrap();
        let committed = consumer
            .committed_offsets(tpl, Duration::from_secs(5))
            .unwrap();
        let offset = committed.find_partition("t", 0).unwrap().offset();
        // The batch before the failed one is committed (next offset 10), nothing after it.
        assert_eq!(offset, Offset::Offset(10));
    }
}

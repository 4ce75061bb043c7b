//! `callguard consume`: the stream processor.
//!
//! A consumer-group member reads call events, decides them in batches
//! through a [`WindowStore`], and produces one decision record and one
//! feature record per event (undecodable events go to the dead-letter topic
//! with the original bytes). [`run`] starts a `processor::Processor` and
//! calls its `step` until shutdown. The path of one batch, top to bottom:
//! collect (`batch::next_batch`) → decode ([`encode::decode_message`]) →
//! admit what fits the checkpoint allowance (`Processor::admit`) → decide
//! (`decide::Decider`, under the store-failure policy) → encode
//! (`encode::Encoder`, the record schema) → produce (`delivery::send`) →
//! acknowledge and store offsets (`delivery::Shared::settle`, woken by the
//! delivery callback) → commit (librdkafka's auto-commit of stored
//! offsets, checkpoints, and synchronously on revoke and shutdown).
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

mod batch;
mod checkpoint;
mod clients;
mod decide;
pub use checkpoint::span_limit;
mod delivery;
pub mod encode;
mod processor;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::engine::event::Decoder;
use crate::engine::rules::RuleSet;
use crate::error::ConsumeError;
use crate::online::metrics::{Health, Metrics};
use crate::store::WindowStore;
use processor::Processor;

/// How long to wait before trying a failed checkpoint commit again.
const CHECKPOINT_RETRY: Duration = Duration::from_millis(50);

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

/// Default longest wait for a batch to fill, microseconds: none, a batch
/// takes what has arrived (the broker delivers in bursts anyway).
pub const DEFAULT_BATCH_LINGER_US: u64 = 0;
/// Default largest batch of events per store call (batches start at a
/// fifth of it: `batch::BatchCap`).
pub const DEFAULT_BATCH_SIZE: usize = 500;
/// Default number of batches that may await acknowledgement at once.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 4;
/// Default largest accepted payload, bytes.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 64 * 1024;
/// Default tolerance for event times ahead of the wall clock, seconds.
pub const DEFAULT_MAX_FUTURE_SKEW_S: u64 = 300;
/// Default deadline for draining on shutdown and revoke, seconds.
pub const DEFAULT_DRAIN_TIMEOUT_S: u64 = 10;

pub use crate::online::policy::StoreErrorPolicy;

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
    /// Under `local`: the share of each limit shared between instances
    /// (rules keyed by callee or global) this instance admits alone.
    pub local_share: f64,
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
            local_share: 1.0,
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
    let mut processor = Processor::start(config, store, rules, metrics, health, shutdown).await?;
    while processor.step().await? {}
    processor.drain().await
}

#[cfg(test)]
mod tests {
    use super::clients::{consumer_settings, producer_settings};
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

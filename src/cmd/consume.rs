//! `callguard consume`.

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

use callguard::online::consumer::{self, ConsumeConfig, StoreErrorPolicy};
use callguard::online::kafka::EmbeddedKafka;
use callguard::online::metrics::{self, Health, Metrics};

use crate::cmd::args::{KafkaArgs, OnlineArgs, StoreKind};
use crate::cmd::shutdown_signal;

/// Run the stream processor: consume call events from Kafka, decide
/// them against per-caller windows, and produce decisions, features and
/// dead letters.
#[derive(Debug, Clone, Args)]
pub struct ConsumeArgs {
    /// Kafka options.
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Consumer group.
    #[arg(long, env = "CALLGUARD_GROUP", default_value = consumer::DEFAULT_GROUP)]
    pub group: String,
    /// Topic of call events (JSON, keyed by caller).
    #[arg(long, env = "CALLGUARD_INPUT_TOPIC", default_value = consumer::DEFAULT_INPUT_TOPIC)]
    pub input_topic: String,
    /// Topic of decision records.
    #[arg(long, env = "CALLGUARD_DECISIONS_TOPIC", default_value = consumer::DEFAULT_DECISIONS_TOPIC)]
    pub decisions_topic: String,
    /// Topic of feature records.
    #[arg(long, env = "CALLGUARD_FEATURES_TOPIC", default_value = consumer::DEFAULT_FEATURES_TOPIC)]
    pub features_topic: String,
    /// Dead-letter topic (original bytes, error in headers); it must differ
    /// from the input, decisions and features topics.
    #[arg(long, env = "CALLGUARD_DLQ_TOPIC", default_value = consumer::DEFAULT_DLQ_TOPIC)]
    pub dlq_topic: String,
    /// The rules, the store, the events' fields, pseudonyms.
    #[command(flatten)]
    pub online: OnlineArgs,
    /// What to do when the window store fails: `block` (stop and retry,
    /// commit nothing: nothing is lost), `allow` or `reject` (decide
    /// `degraded = true` and keep going), `local` (decide on this
    /// instance's own windows, `degraded = true`, limits shared between
    /// instances cut to --local-share; back to Redis when it answers).
    #[arg(long, value_enum, env = "CALLGUARD_ON_STORE_ERROR", default_value_t = PolicyArg::Block)]
    pub on_store_error: PolicyArg,
    /// Largest batch of events per store round trip. Batches start at a
    /// fifth of it, so a burst the broker delivers at once is decided in
    /// parts (its first events do not wait for its last), and double while
    /// they come back full (a backlog), up to this.
    #[arg(long, env = "CALLGUARD_BATCH_SIZE", default_value_t = consumer::DEFAULT_BATCH_SIZE)]
    pub batch_size: usize,
    /// Longest wait, in microseconds, for a batch to fill once its first
    /// event is in (the verdicts of the batch with the store end it
    /// sooner). 0: a batch takes what has arrived and goes; the broker
    /// delivers in bursts, and while the store works on one batch the
    /// next fills anyway. Higher: fuller batches at low rates, at the
    /// cost of that wait in every decision's latency (timers tick in
    /// milliseconds: a wait under 1000 lasts up to one).
    #[arg(long, env = "CALLGUARD_BATCH_LINGER_US", default_value_t = consumer::DEFAULT_BATCH_LINGER_US)]
    pub batch_linger_us: u64,
    /// Batches that may await broker acknowledgement at once.
    #[arg(long, env = "CALLGUARD_MAX_IN_FLIGHT", default_value_t = consumer::DEFAULT_MAX_IN_FLIGHT)]
    pub max_in_flight: usize,
    /// Largest accepted message, bytes; larger ones are dead letters.
    #[arg(long, env = "CALLGUARD_MAX_PAYLOAD_BYTES", default_value_t = consumer::DEFAULT_MAX_PAYLOAD_BYTES)]
    pub max_payload_bytes: usize,
    /// Event times more than this many seconds ahead of the wall clock are
    /// dead letters (`ts_out_of_range`); 0 turns the check off. Times before
    /// 2000 or from 2100 on are always invalid.
    #[arg(long, env = "CALLGUARD_MAX_FUTURE_SKEW_S", default_value_t = consumer::DEFAULT_MAX_FUTURE_SKEW_S)]
    pub max_future_skew_s: u64,
    /// Prometheus metrics, /healthz and /readyz on this address.
    #[arg(long, env = "CALLGUARD_METRICS_ADDR", default_value = metrics::DEFAULT_ADDR)]
    pub metrics_addr: std::net::SocketAddr,
    /// Deadline for draining in-flight work on shutdown, seconds.
    #[arg(long, env = "CALLGUARD_DRAIN_TIMEOUT_S", default_value_t = consumer::DEFAULT_DRAIN_TIMEOUT_S)]
    pub drain_timeout_s: u64,
}

/// `--on-store-error` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    /// Stop consuming and retry with backoff; commit nothing meanwhile, so nothing is lost.
    Block,
    /// Allow the calls, flagged `degraded = true`, and keep going.
    Allow,
    /// Reject the calls, flagged `degraded = true`, and keep going.
    Reject,
    /// Decide the calls on this instance's own window state (kept in memory
    /// from the start of the outage), flagged `degraded = true`, and keep
    /// going; back to the store as soon as it answers. The store never
    /// learns of these calls.
    Local,
}

impl From<PolicyArg> for StoreErrorPolicy {
    fn from(p: PolicyArg) -> Self {
        match p {
            PolicyArg::Block => StoreErrorPolicy::Block,
            PolicyArg::Allow => StoreErrorPolicy::Allow,
            PolicyArg::Reject => StoreErrorPolicy::Reject,
            PolicyArg::Local => StoreErrorPolicy::Local,
        }
    }
}

impl ConsumeArgs {
    /// The consumer configuration for these bootstrap servers.
    fn config(&self, brokers: &str) -> Result<ConsumeConfig> {
        let mut config = ConsumeConfig::new(
            brokers,
            &self.group,
            &self.input_topic,
            &self.decisions_topic,
            &self.features_topic,
            &self.dlq_topic,
        );
        config.kafka_settings = self.kafka.settings.parse()?;
        config.batch_size = self.batch_size.max(1);
        config.max_in_flight = self.max_in_flight.max(1);
        config.batch_linger = std::time::Duration::from_micros(self.batch_linger_us);
        config.on_store_error = self.on_store_error.into();
        config.local_share = self.online.fallback.share()?;
        config.max_payload_bytes = self.max_payload_bytes;
        config.decoder = self.online.event_decoder()?;
        config.max_future_skew = (self.max_future_skew_s > 0)
            .then(|| std::time::Duration::from_secs(self.max_future_skew_s));
        config.drain_timeout = std::time::Duration::from_secs(self.drain_timeout_s);
        Ok(config)
    }

    /// `--brokers mock`: an embedded mock cluster with the topics created.
    fn embedded(&self) -> Result<EmbeddedKafka> {
        let k = EmbeddedKafka::start()?;
        for t in [
            &self.input_topic,
            &self.decisions_topic,
            &self.features_topic,
        ] {
            k.create_topic(t, 4)?;
        }
        k.create_topic(&self.dlq_topic, 1)?;
        println!(
            "embedded Kafka (librdkafka mock cluster) at {}",
            k.bootstrap()
        );
        Ok(k)
    }
}

/// Runs `callguard consume` until SIGINT or SIGTERM.
pub async fn run(args: ConsumeArgs) -> Result<()> {
    args.online.store.kind(StoreKind::Redis)?;
    let embedded = match args.kafka.brokers.as_str() {
        "mock" => Some(args.embedded()?),
        _ => None,
    };
    let brokers = embedded
        .as_ref()
        .map_or_else(|| args.kafka.brokers.clone(), EmbeddedKafka::bootstrap);
    let config = args.config(&brokers)?;

    let metrics = Arc::new(Metrics::new());
    // The rules first: a bad file stops it before anything is served.
    let rules_rx = args.online.watch_rules(&metrics)?;
    let health = Arc::new(Health::default());
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let server_stop = async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    };
    let bound = metrics::serve(
        args.metrics_addr,
        metrics.clone(),
        health.clone(),
        server_stop,
    )
    .await
    .with_context(|| format!("serving metrics on {}", args.metrics_addr))?;
    tracing::info!(addr = %bound, "metrics on /metrics, health on /healthz and /readyz");
    let store = args
        .online
        .store
        .open_gated(StoreKind::Redis, args.online.fallback.expected_instances)
        .await?;
    let stats = consumer::run(config, store, rules_rx, metrics, health, shutdown_signal()).await;
    let _ = stop_tx.send(true);
    let stats = stats?;
    tracing::info!(
        decided = stats.decided,
        rejected = stats.rejected,
        dead_letters = stats.dead_letters,
        "stopped"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::cmd::{Cli, Command};

    fn consume(args: &[&str]) -> super::ConsumeArgs {
        let argv = ["callguard", "consume"].iter().chain(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Consume(c) => *c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn kafka_settings_keep_semicolons() {
        let c = consume(&["-X", "sasl.password=pa;ss", "-X", "client.id=cg"]);
        assert_eq!(
            c.kafka.settings.settings,
            ["sasl.password=pa;ss", "client.id=cg"]
        );
    }

    #[test]
    fn consume_defaults_to_redis_and_refuses_a_url_with_memory() {
        use crate::cmd::args::StoreKind;
        let c = consume(&[]);
        assert_eq!(
            c.online.store.kind(StoreKind::Redis).unwrap(),
            StoreKind::Redis
        );
        let c = consume(&["--store", "memory", "--redis-url", "redis://127.0.0.1:1"]);
        let e = c
            .online
            .store
            .kind(StoreKind::Redis)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--store memory"), "{e}");
        let c = consume(&["--store", "memory"]);
        assert_eq!(
            c.online.store.kind(StoreKind::Redis).unwrap(),
            StoreKind::Memory
        );
    }

    #[test]
    fn batch_linger_defaults_to_none_and_is_set_in_microseconds() {
        use std::time::Duration;
        let linger = |args: &[&str]| consume(args).config("127.0.0.1:1").unwrap().batch_linger;
        assert_eq!(linger(&[]), Duration::ZERO);
        assert_eq!(
            linger(&["--batch-linger-us", "250"]),
            Duration::from_micros(250)
        );
        assert_eq!(linger(&["--batch-linger-us", "0"]), Duration::ZERO);
    }

    #[test]
    fn deciding_ahead_is_off_unless_asked_for() {
        let ahead = |args: &[&str]| consume(args).online.store.redis_config().decide_ahead;
        assert!(!ahead(&[]));
        assert!(ahead(&["--decide-ahead"]));
    }
}

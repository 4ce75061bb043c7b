//! Command-line arguments shared by the subcommands.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::calllog::{InputFormat, ReadOptions};
use crate::error::{EventError, RulesError};
use crate::event::{Decoder, FieldMap};
use crate::rules::{parse_duration_ms, CountPolicy, RuleSet};
use crate::store::redis::RedisConfig;

/// callguard: per-number call-rate windows that reject fraud bursts
/// (robocalls, wangiri, SIP floods), online from Kafka with Redis and offline
/// from call logs, with identical decisions.
#[derive(Debug, Parser)]
#[command(name = "callguard", version, about, long_about = None)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "CALLGUARD_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Decide every call of a historical call log, offline, with the same
    /// window semantics as the online consumer.
    Replay(Box<ReplayArgs>),
    /// Run the stream processor: consume call events from Kafka, decide
    /// them against per-caller windows (Redis by default), and produce
    /// decisions, features and dead letters.
    Consume(Box<ConsumeArgs>),
    /// Load a call log into a Kafka topic, keyed by caller, in the replay's
    /// processing order (stable by event time).
    Produce(Box<ProduceArgs>),
    /// The whole pipeline in one process with no servers: embedded Kafka
    /// (librdkafka mock cluster), in-memory windows, the sample call log,
    /// a live summary, and a parity check against `replay`.
    Demo(Box<DemoArgs>),
    /// Sweep a rule's limit N over a range on a call log and recommend one:
    /// calls and callers rejected, and with labels precision, recall and
    /// legit callers wrongly rejected, for every N.
    Tune(Box<TuneArgs>),
    /// Export point-in-time features of every call of a call log (Parquet
    /// or CSV): window counts, time since the caller's previous call,
    /// distinct callees in the longest window, decision and label; the same
    /// values the consumer emits online. Large logs stream in chunks.
    Features(Box<FeaturesArgs>),
    /// Write a synthetic, labelled call log (subscribers, PBX trunks, call
    /// centres, robocallers, wangiri bursts) for trying and testing callguard.
    Generate(GenerateArgs),
}

/// Kafka connection options.
#[derive(Debug, Clone, Args)]
pub struct KafkaArgs {
    /// Bootstrap servers (HOST:PORT,...), or `mock` for an embedded
    /// in-process mock cluster (topics are created on it).
    #[arg(long, env = "CALLGUARD_BROKERS", default_value = "localhost:9092")]
    pub brokers: String,
    /// Any librdkafka setting, KEY=VALUE (SASL, SSL, client.id, ...); repeatable.
    #[arg(
        short = 'X',
        value_name = "KEY=VALUE",
        env = "CALLGUARD_KAFKA_SETTINGS",
        value_delimiter = ';'
    )]
    pub settings: Vec<String>,
}

/// `callguard consume`.
#[derive(Debug, Clone, Args)]
pub struct ConsumeArgs {
    /// Kafka options.
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Consumer group.
    #[arg(long, env = "CALLGUARD_GROUP", default_value = "callguard")]
    pub group: String,
    /// Topic of call events (JSON, keyed by caller).
    #[arg(long, env = "CALLGUARD_INPUT_TOPIC", default_value = "calls")]
    pub input_topic: String,
    /// Topic of decision records.
    #[arg(
        long,
        env = "CALLGUARD_DECISIONS_TOPIC",
        default_value = "call-decisions"
    )]
    pub decisions_topic: String,
    /// Topic of feature records.
    #[arg(
        long,
        env = "CALLGUARD_FEATURES_TOPIC",
        default_value = "call-features"
    )]
    pub features_topic: String,
    /// Dead-letter topic (original bytes, error in headers).
    #[arg(long, env = "CALLGUARD_DLQ_TOPIC", default_value = "calls-dlq")]
    pub dlq_topic: String,
    /// Rule options (the rules file is reloaded on SIGHUP and when it changes).
    #[command(flatten)]
    pub rules: RuleArgs,
    /// Store options.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Field mapping of the JSON payload, FIELD=NAME[,...].
    #[arg(
        long = "map",
        value_name = "FIELD=NAME",
        env = "CALLGUARD_MAP",
        value_delimiter = ';'
    )]
    pub map: Vec<String>,
    /// Country code for national numbers, e.g. 34.
    #[arg(long, env = "CALLGUARD_DEFAULT_COUNTRY_CODE")]
    pub default_country_code: Option<String>,
    /// What to do when the window store fails: `block` (stop and retry,
    /// commit nothing: nothing is lost), `allow` or `reject` (decide
    /// `degraded = true` and keep going).
    #[arg(long, value_enum, env = "CALLGUARD_ON_STORE_ERROR", default_value_t = crate::consumer::StoreErrorPolicy::Block)]
    pub on_store_error: crate::consumer::StoreErrorPolicy,
    /// Largest batch of events per store round trip.
    #[arg(long, env = "CALLGUARD_BATCH_SIZE", default_value_t = 500)]
    pub batch_size: usize,
    /// Batches that may await broker acknowledgement at once.
    #[arg(long, env = "CALLGUARD_MAX_IN_FLIGHT", default_value_t = 4)]
    pub max_in_flight: usize,
    /// Largest accepted message, bytes; larger ones are dead letters.
    #[arg(long, env = "CALLGUARD_MAX_PAYLOAD_BYTES", default_value_t = 65_536)]
    pub max_payload_bytes: usize,
    /// Prometheus metrics, /healthz and /readyz on this address.
    #[arg(long, env = "CALLGUARD_METRICS_ADDR", default_value = "127.0.0.1:9898")]
    pub metrics_addr: std::net::SocketAddr,
    /// Deadline for draining in-flight work on shutdown, seconds.
    #[arg(long, env = "CALLGUARD_DRAIN_TIMEOUT_S", default_value_t = 10)]
    pub drain_timeout_s: u64,
}

/// `callguard produce`.
#[derive(Debug, Clone, Args)]
pub struct ProduceArgs {
    /// Input options.
    #[command(flatten)]
    pub input: InputArgs,
    /// Kafka options.
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Topic to write.
    #[arg(long, env = "CALLGUARD_INPUT_TOPIC", default_value = "calls")]
    pub topic: String,
}

/// `callguard demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Call log to play.
    #[arg(long, short, default_value = "data/calls.csv")]
    pub input: PathBuf,
    /// Rule set file.
    #[arg(long, default_value = "data/rules.toml")]
    pub rules: PathBuf,
    /// Partitions of the calls topic.
    #[arg(long, default_value_t = 4)]
    pub partitions: i32,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
}

/// `callguard tune`.
#[derive(Debug, Clone, Args)]
pub struct TuneArgs {
    /// Input options.
    #[command(flatten)]
    pub input: InputArgs,
    /// Rule set file; the other rules keep their limits while one is swept.
    #[arg(long)]
    pub rules: Option<PathBuf>,
    /// A rule NAME:KIND:WINDOW[:LIMIT], e.g. `minute:sliding:60s` (repeatable).
    #[arg(long = "rule", value_name = "NAME:KIND:WINDOW[:LIMIT]")]
    pub rule: Vec<String>,
    /// Which rule to sweep (default: the first).
    #[arg(long)]
    pub sweep: Option<String>,
    /// Range of N, inclusive: `A..B`.
    #[arg(long, default_value = "1..200")]
    pub limits: String,
    /// Column holding the ground truth (1/0, true/false, fraud/legit).
    #[arg(long)]
    pub label_column: Option<String>,
    /// With labels: recommend the smallest N whose legit false-reject rate is at most this.
    #[arg(long, default_value_t = 0.002, conflicts_with = "quantile")]
    pub max_false_reject: f64,
    /// Without labels (or to override): recommend this quantile of per-caller peak counts.
    #[arg(long)]
    pub quantile: Option<f64>,
    /// Override the counting policy.
    #[arg(long, value_enum)]
    pub count: Option<CountArg>,
    /// Full sweep table: `.csv` or `.parquet`.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Plot: `.png` or `.svg`.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// Parses `A..B` (inclusive) into the limits A, A+1, ..., B.
pub fn parse_limits(s: &str) -> Result<Vec<u64>, RulesError> {
    let bad = || {
        RulesError::Invalid(format!(
            "limits `{s}`: expected A..B with 1 <= A <= B <= 1000000"
        ))
    };
    let (a, b) = s.split_once("..").ok_or_else(bad)?;
    let a: u64 = a.trim().parse().map_err(|_| bad())?;
    let b: u64 = b
        .trim()
        .trim_start_matches('=')
        .parse()
        .map_err(|_| bad())?;
    if a == 0 || a > b || b > 1_000_000 {
        return Err(bad());
    }
    Ok((a..=b).collect())
}

/// `callguard features`.
#[derive(Debug, Clone, Args)]
pub struct FeaturesArgs {
    /// Input options.
    #[command(flatten)]
    pub input: InputArgs,
    /// Rule options.
    #[command(flatten)]
    pub rules: RuleArgs,
    /// Feature table: `.parquet` (recommended: typed timestamps) or `.csv`.
    #[arg(long, short)]
    pub output: PathBuf,
}

/// `callguard generate`.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// Number of calls.
    #[arg(long, default_value_t = 20_000)]
    pub rows: usize,
    /// Random seed (the same seed gives the same log).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output CSV.
    #[arg(long, short)]
    pub output: PathBuf,
}

/// Where call events come from on disk and how to read them.
#[derive(Debug, Clone, Args)]
pub struct InputArgs {
    /// Call log: CSV (header row), Parquet, or an Asterisk Master.csv.
    #[arg(long, short)]
    pub input: PathBuf,
    /// Input layout; `auto` picks Parquet for `.parquet`, else CSV.
    #[arg(long, value_enum, default_value_t = InputFormat::Auto)]
    pub format: InputFormat,
    /// Field mapping, FIELD=COLUMN[,...], e.g. `caller=src,ts=start_time`.
    /// Fields: call_id, caller, ts, callee, duration_ms, label.
    #[arg(long = "map", value_name = "FIELD=COLUMN")]
    pub map: Vec<String>,
    /// Country code for national numbers (leading 0 or no prefix), e.g. 34.
    #[arg(long, env = "CALLGUARD_DEFAULT_COUNTRY_CODE")]
    pub default_country_code: Option<String>,
    /// Time zone of naive local times (Asterisk `start`), e.g. Europe/Madrid; default UTC.
    #[arg(long)]
    pub timezone: Option<chrono_tz::Tz>,
}

impl InputArgs {
    /// Read options from the arguments.
    pub fn read_options(&self, progress: bool) -> Result<ReadOptions, EventError> {
        Ok(ReadOptions {
            format: self.format,
            decoder: Decoder::new(
                FieldMap::parse(&self.map)?,
                self.default_country_code.clone(),
            )?,
            timezone: self.timezone,
            progress,
        })
    }
}

/// The rule set: a file, shorthands, and overrides.
#[derive(Debug, Clone, Args)]
pub struct RuleArgs {
    /// Rule set file (TOML); see data/rules.toml.
    #[arg(long, env = "CALLGUARD_RULES")]
    pub rules: Option<PathBuf>,
    /// A rule NAME:KIND:WINDOW:LIMIT (KIND: fixed, sliding, sliding-approx),
    /// e.g. `minute:sliding:60s:20`; repeatable, appended to --rules.
    #[arg(long = "rule", value_name = "NAME:KIND:WINDOW:LIMIT")]
    pub rule: Vec<String>,
    /// Override the counting policy: `attempts` (every call counts) or
    /// `admitted` (only allowed calls count).
    #[arg(long, value_enum)]
    pub count: Option<CountArg>,
    /// Override the allowed lateness (e.g. 5s).
    #[arg(long)]
    pub grace: Option<String>,
    /// Shadow mode: decide and report, but allow every call.
    #[arg(long)]
    pub shadow: bool,
}

/// `--count` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CountArg {
    /// Every call attempt counts.
    Attempts,
    /// Only allowed calls count.
    Admitted,
}

impl RuleArgs {
    /// Builds the rule set.
    pub fn rule_set(&self) -> Result<RuleSet, RulesError> {
        let base = RuleSet::from_args(self.rules.as_deref(), &self.rule)?;
        let count = match self.count {
            Some(CountArg::Attempts) => CountPolicy::Attempts,
            Some(CountArg::Admitted) => CountPolicy::Admitted,
            None => base.count,
        };
        let grace = match &self.grace {
            Some(g) => parse_duration_ms(g)?,
            None => base.grace_ms,
        };
        if count == base.count && grace == base.grace_ms && (!self.shadow || base.shadow) {
            return Ok(base);
        }
        base.with_options(count, grace, self.shadow || base.shadow)
    }
}

/// Which window store to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// In process (no server; state is lost on exit).
    Memory,
    /// Redis, shared by every instance.
    Redis,
}

/// Window store options.
#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    /// Window store.
    #[arg(long, value_enum, default_value_t = StoreKind::Memory, env = "CALLGUARD_STORE")]
    pub store: StoreKind,
    /// Redis URL (`redis://[user:pass@]host:port[/db]` or `rediss://` for TLS);
    /// repeat, or separate with commas, to give Cluster seed nodes.
    #[arg(
        long,
        env = "CALLGUARD_REDIS_URL",
        value_delimiter = ',',
        default_value = "redis://127.0.0.1:6379"
    )]
    pub redis_url: Vec<String>,
    /// Use the Redis Cluster client (implied by several URLs).
    #[arg(long, env = "CALLGUARD_REDIS_CLUSTER")]
    pub redis_cluster: bool,
    /// Prefix of every Redis key, to separate environments.
    #[arg(long, env = "CALLGUARD_KEY_PREFIX", default_value = "cg:")]
    pub key_prefix: String,
    /// Do not keep per-call records in Redis: faster, but a redelivered call
    /// counts again and may get another decision.
    #[arg(long, env = "CALLGUARD_NO_IDEMPOTENCY")]
    pub no_idempotency: bool,
    /// Seconds added to every Redis TTL, so state outlives processing pauses
    /// (Redis restarts, rebalances, lag); it never changes a decision.
    #[arg(long, env = "CALLGUARD_TTL_SLACK_S", default_value_t = 60)]
    pub ttl_slack_s: u64,
    /// CA certificate (PEM) for `rediss://` servers signed by a private CA.
    #[arg(long, env = "CALLGUARD_REDIS_CA")]
    pub redis_ca: Option<PathBuf>,
    /// Timeout of every Redis call, in milliseconds.
    #[arg(long, env = "CALLGUARD_REDIS_TIMEOUT_MS", default_value_t = 2000)]
    pub redis_timeout_ms: u64,
}

impl StoreArgs {
    /// The Redis configuration.
    pub fn redis_config(&self) -> RedisConfig {
        RedisConfig {
            urls: self.redis_url.clone(),
            cluster: self.redis_cluster,
            key_prefix: self.key_prefix.clone(),
            idempotency: !self.no_idempotency,
            timeout: Duration::from_millis(self.redis_timeout_ms),
            ttl_slack: Duration::from_secs(self.ttl_slack_s),
            tls_ca: self.redis_ca.clone(),
        }
    }
}

/// `callguard replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// Input options.
    #[command(flatten)]
    pub input: InputArgs,
    /// Rule options.
    #[command(flatten)]
    pub rules: RuleArgs,
    /// Store options.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Decision records: `.csv` or `.parquet`. Invalid rows go to
    /// `<name>.invalid.csv` beside it.
    #[arg(long, short)]
    pub output: PathBuf,
}

//! Argument groups shared by several subcommands, and their mapping onto
//! the library's configurations. Defaults come from the library's constants.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

use callguard::engine::aggregate::MemoryLedger;
use callguard::engine::event::{Decoder, FieldMap, NumberHasher};
use callguard::engine::rules::{parse_duration_ms, CountPolicy, RuleSet};
use callguard::error::{EventError, RulesError};
use callguard::offline::read::{InputFormat, ReadOptions};
use callguard::offline::replay::ReplayStore;
use callguard::online::metrics::Metrics;
use callguard::online::reload;
use callguard::store::cached;
use callguard::store::gated::{Gated, Ledger};
use callguard::store::memory::MemoryStore;
use callguard::store::redis::lease::RedisLedger;
use callguard::store::redis::slot::Slots;
use callguard::store::redis::{self, RedisConfig};
use callguard::store::sharded::ShardedStore;
use callguard::store::AnyStore;
use tokio::sync::watch;

/// Kafka connection options.
#[derive(Debug, Clone, Args)]
pub struct KafkaArgs {
    /// Bootstrap servers (HOST:PORT,...), or `mock` for an embedded
    /// in-process mock cluster (topics are created on it).
    #[arg(long, env = "CALLGUARD_BROKERS", default_value = "localhost:9092")]
    pub brokers: String,
    /// librdkafka settings.
    #[command(flatten)]
    pub settings: KafkaSettingsArgs,
}

/// Extra librdkafka settings (`-X`).
#[derive(Debug, Clone, Args)]
pub struct KafkaSettingsArgs {
    /// Any librdkafka setting, KEY=VALUE (SASL, SSL, client.id, ...);
    /// repeatable. Values are taken whole (a password may contain `;`). In
    /// CALLGUARD_KAFKA_SETTINGS, put one setting per line. Never echoed.
    #[arg(
        short = 'X',
        value_name = "KEY=VALUE",
        env = "CALLGUARD_KAFKA_SETTINGS",
        value_delimiter = '\n',
        hide_env_values = true
    )]
    pub settings: Vec<String>,
}

impl KafkaSettingsArgs {
    /// The settings as (key, value) pairs.
    pub fn parse(&self) -> Result<Vec<(String, String)>, callguard::error::KafkaError> {
        callguard::online::kafka::parse_settings(&self.settings)
    }
}

/// Input layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// `.parquet` is Parquet; a CSV is told by its first line: a header
    /// with the mapped columns is plain CSV, else a switch's CDR file
    /// (header or row) is its preset.
    Auto,
    /// CSV with a header row.
    Csv,
    /// Parquet.
    Parquet,
    /// Asterisk `Master.csv`: `uniqueid` is the call id, `src` the caller,
    /// `dst` the callee, `start` the time, `billsec` the duration.
    Asterisk,
    /// FreeSWITCH `mod_cdr_csv` (default template): `uuid`,
    /// `caller_id_number`, `destination_number`, `start_stamp`, `billsec`.
    Freeswitch,
    /// Kamailio `acc` (with the `src_user`, `dst_user`, `src_ip` extras):
    /// `callid`, `src_user`, `dst_user`, `time`; only INVITE rows are calls.
    KamailioAcc,
}

/// How fields are named in the input and how numbers are normalised.
#[derive(Debug, Clone, Args)]
pub struct DecoderArgs {
    /// Field mapping, FIELD=NAME[,...], e.g. `caller=src,ts=start_time`.
    /// Fields: call_id, caller, ts, callee, duration_ms, label.
    #[arg(
        long = "map",
        value_name = "FIELD=NAME",
        env = "CALLGUARD_MAP",
        value_delimiter = ';'
    )]
    pub map: Vec<String>,
    /// Country code for national numbers (leading 0 or no prefix), e.g. 34.
    #[arg(long, env = "CALLGUARD_DEFAULT_COUNTRY_CODE")]
    pub default_country_code: Option<String>,
}

impl DecoderArgs {
    /// The decoder.
    pub fn decoder(&self) -> Result<Decoder, EventError> {
        Decoder::new(
            FieldMap::parse(&self.map)?,
            self.default_country_code.clone(),
        )
    }
}

/// Pseudonymised numbers.
#[derive(Debug, Clone, Args)]
pub struct PrivacyArgs {
    /// Replace every caller and callee, in Redis keys, records, features and
    /// logs, by an HMAC-SHA256 pseudonym of the normalised number (`h` and
    /// 32 hex digits) under a secret key (CALLGUARD_HASH_KEY, or
    /// --hash-key-file). Allow and deny lists and rules' callee prefixes
    /// still match the real numbers.
    /// Use the same key online and offline for equal pseudonyms. Dead
    /// letters keep the original bytes.
    #[arg(long, env = "CALLGUARD_HASH_NUMBERS")]
    pub hash_numbers: bool,
    /// File holding the key (at least 16 bytes; a trailing newline is
    /// dropped); otherwise CALLGUARD_HASH_KEY.
    #[arg(long, env = "CALLGUARD_HASH_KEY_FILE")]
    pub hash_key_file: Option<PathBuf>,
}

impl PrivacyArgs {
    /// Sets the decoder's hasher when `--hash-numbers` is given.
    pub fn apply(&self, decoder: &mut Decoder) -> Result<()> {
        if !self.hash_numbers {
            return Ok(());
        }
        let key = match &self.hash_key_file {
            Some(path) => {
                let mut key = std::fs::read(path)
                    .with_context(|| format!("reading the hash key file {}", path.display()))?;
                while key.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                    key.pop();
                }
                key
            }
            None => std::env::var("CALLGUARD_HASH_KEY")
                .map(String::into_bytes)
                .map_err(|_| {
                    anyhow::anyhow!(
                        "--hash-numbers needs a key: set CALLGUARD_HASH_KEY or pass --hash-key-file"
                    )
                })?,
        };
        decoder.hasher = Some(NumberHasher::new(&key)?);
        Ok(())
    }
}

/// Where call events come from on disk and how to read them.
#[derive(Debug, Clone, Args)]
pub struct InputArgs {
    /// Call log: CSV (header row), Parquet, or a switch's CDR file
    /// (Asterisk Master.csv, FreeSWITCH mod_cdr_csv, Kamailio acc).
    #[arg(long, short)]
    pub input: PathBuf,
    /// Input layout; `auto` picks Parquet for `.parquet`, else CSV.
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    pub format: FormatArg,
    /// Field names and number normalisation.
    #[command(flatten)]
    pub decoder: DecoderArgs,
    /// Time zone of the switch's local times (`YYYY-MM-DD HH:MM:SS` in CDR
    /// files), e.g. Europe/Madrid; DST switches included (a time in the
    /// repeated hour is read as its first occurrence). Default UTC.
    #[arg(long)]
    pub timezone: Option<chrono_tz::Tz>,
    /// Field delimiter of CSV input, one character: `,` (default), `;`
    /// (common in European CDR exports), `\t` or `|`. A header that looks
    /// separated by another one is reported with the delimiter to pass.
    #[arg(long, default_value = ",", value_parser = parse_delimiter)]
    pub delimiter: u8,
}

/// Parses `--delimiter`: one ASCII character, or `\t` for a tab.
fn parse_delimiter(s: &str) -> Result<u8, String> {
    match s {
        "\\t" | "tab" => Ok(b'\t'),
        _ if s.len() == 1 && s.is_ascii() && s != "\"" && s != "\n" => Ok(s.as_bytes()[0]),
        _ => Err(format!(
            "`{s}`: one ASCII character (not a quote or newline), or \\t"
        )),
    }
}

impl InputArgs {
    /// Read options from the arguments.
    pub fn read_options(&self, progress: bool) -> Result<ReadOptions, EventError> {
        Ok(ReadOptions {
            format: match self.format {
                FormatArg::Auto => InputFormat::Auto,
                FormatArg::Csv => InputFormat::Csv,
                FormatArg::Parquet => InputFormat::Parquet,
                FormatArg::Asterisk => InputFormat::Asterisk,
                FormatArg::Freeswitch => InputFormat::FreeSwitch,
                FormatArg::KamailioAcc => InputFormat::KamailioAcc,
            },
            decoder: self.decoder.decoder()?,
            timezone: self.timezone,
            delimiter: self.delimiter,
            progress,
            callees: true,
        })
    }
}

/// The flags `consume` and `serve` share: the rule set, the window store,
/// how call events are decoded and whether numbers are pseudonymised.
#[derive(Debug, Clone, Args)]
pub struct OnlineArgs {
    /// Rule options (the rules file is reloaded on SIGHUP and when it changes).
    #[command(flatten)]
    pub rules: RuleArgs,
    /// Store options.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Field names of the JSON events and number normalisation.
    #[command(flatten)]
    pub decoder: DecoderArgs,
    /// Pseudonymised numbers.
    #[command(flatten)]
    pub privacy: PrivacyArgs,
    /// Limits shared between instances: reserve slots, and the local
    /// fallback's share.
    #[command(flatten)]
    pub fallback: FallbackArgs,
}

/// Limits shared between instances (rules keyed by callee or global): how
/// many instances share them, and how much one may admit alone under
/// `--on-store-error local`.
#[derive(Debug, Clone, Args)]
pub struct FallbackArgs {
    /// Instances deciding the same calls (consume members and serve
    /// processes together). As many reserve slots: each instance holding
    /// one spends floor(limit / (16 x this)) calls of each counter of a rule
    /// keyed by callee or global without asking Redis (the first call to a
    /// callee costs no Redis write); the first instance records the number
    /// in Redis and every instance follows the recorded one. While Redis
    /// fails, each admits at most limit / this of such a rule, at least one
    /// call per bucket (`--on-store-error local`).
    #[arg(long, env = "CALLGUARD_EXPECTED_INSTANCES", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub expected_instances: u32,
    /// The share of such a limit one instance admits alone while Redis
    /// fails, 0 to 1 (instead of 1 / --expected-instances).
    #[arg(long, env = "CALLGUARD_LOCAL_SHARE")]
    pub local_share: Option<f64>,
}

impl FallbackArgs {
    /// The share: `--local-share`, else 1 / `--expected-instances`.
    pub fn share(&self) -> Result<f64> {
        match self.local_share {
            Some(s) if s.is_finite() && s > 0.0 && s <= 1.0 => Ok(s),
            Some(s) => anyhow::bail!("--local-share {s}: must be above 0 and at most 1"),
            None => Ok(1.0 / f64::from(self.expected_instances)),
        }
    }
}

impl OnlineArgs {
    /// The rule set, reloaded on SIGHUP and when its file changes: the
    /// receiver always holds the set in force.
    pub fn watch_rules(&self, metrics: &Arc<Metrics>) -> Result<watch::Receiver<RuleSet>> {
        let (tx, rx) = watch::channel(self.rules.rule_set()?);
        let rule_args = self.rules.clone();
        reload::spawn(
            move || rule_args.rule_set(),
            self.rules.rules.clone(),
            tx,
            metrics.clone(),
        )?;
        Ok(rx)
    }

    /// The event decoder, pseudonymising numbers when asked.
    pub fn event_decoder(&self) -> Result<Decoder> {
        let mut decoder = self.decoder.decoder()?;
        self.privacy.apply(&mut decoder)?;
        Ok(decoder)
    }
}

/// The flags the offline commands share: the call log and how to read
/// it, the rule set, and whether numbers are pseudonymised.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Input options.
    #[command(flatten)]
    pub input: InputArgs,
    /// Rule options.
    #[command(flatten)]
    pub rules: RuleArgs,
    /// Pseudonymised numbers.
    #[command(flatten)]
    pub privacy: PrivacyArgs,
}

impl LogArgs {
    /// The rule set.
    pub fn rule_set(&self) -> Result<RuleSet, RulesError> {
        self.rules.rule_set()
    }

    /// How to read the log, numbers pseudonymised when asked.
    pub fn read_options(&self, progress: bool) -> Result<ReadOptions> {
        let mut read = self.input.read_options(progress)?;
        self.privacy.apply(&mut read.decoder)?;
        Ok(read)
    }
}

/// The rule set: a file, shorthands, and overrides.
#[derive(Debug, Clone, Args)]
pub struct RuleArgs {
    /// Rule set file (TOML); see data/rules.toml, and data/rules-fraud.toml
    /// for token buckets, distinct-callees rules, callee and time-of-day
    /// filters, warn levels, per-rule shadow and caller+callee keys. A
    /// `callees_file` it names is reloaded with it.
    #[arg(long, env = "CALLGUARD_RULES")]
    pub rules: Option<PathBuf>,
    /// A rule NAME:KIND:WINDOW:LIMIT (KIND: fixed, sliding, sliding-approx,
    /// distinct-callees; a token bucket and rule options need a file), e.g.
    /// `minute:sliding:60s:20`; repeatable, appended to --rules.
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

impl From<CountArg> for CountPolicy {
    fn from(c: CountArg) -> Self {
        match c {
            CountArg::Attempts => CountPolicy::Attempts,
            CountArg::Admitted => CountPolicy::Admitted,
        }
    }
}

impl RuleArgs {
    /// Builds the rule set.
    pub fn rule_set(&self) -> Result<RuleSet, RulesError> {
        let base = RuleSet::from_args(self.rules.as_deref(), &self.rule)?;
        let count = self.count.map_or(base.count, CountPolicy::from);
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

/// Where the window algorithm runs with a Redis store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RedisMode {
    /// In Redis: a Lua call decides a group of events on state kept as
    /// sorted sets and hashes.
    Script,
    /// In callguard, on per-caller state cached in memory and written back
    /// to one Redis string per caller (a busy caller's log and records in
    /// keys of their own), each write checked against the version it read:
    /// a fraction of the Redis work per call.
    Cached,
}

/// Window store options.
#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    /// Window store. `consume` uses Redis unless told otherwise (`memory`
    /// there is for tests and demos: nothing is shared between instances
    /// and everything is lost on a restart); `replay` uses memory (its
    /// callers split over all cores) unless given `--store redis` or a
    /// `--redis-url`.
    #[arg(long, value_enum, env = "CALLGUARD_STORE")]
    pub store: Option<StoreKind>,
    /// Redis URL (`redis://[user:pass@]host:port[/db]` or `rediss://` for
    /// TLS; default redis://127.0.0.1:6379); repeat, or separate with
    /// commas, to give Cluster seed nodes. An error with `--store memory`.
    #[arg(
        long,
        env = "CALLGUARD_REDIS_URL",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub redis_url: Vec<String>,
    /// Use the Redis Cluster client (implied by several URLs).
    #[arg(long, env = "CALLGUARD_REDIS_CLUSTER")]
    pub redis_cluster: bool,
    /// Redis Sentinel addresses (`host:port`, or `redis://[:pass@]host:port`
    /// for a sentinel with a password), comma-separated: the primary is the
    /// one they name for --redis-master, and callguard moves to the new one
    /// after a failover (a failed call asks them again). --redis-url, if
    /// given, then only lends the primary its user, password, database and
    /// TLS. Add --redis-wait-replicas so a failover loses no decision.
    #[arg(
        long,
        env = "CALLGUARD_REDIS_SENTINEL",
        value_delimiter = ',',
        requires = "redis_master",
        conflicts_with = "redis_cluster"
    )]
    pub redis_sentinel: Vec<String>,
    /// The name the sentinels monitor the primary under (their
    /// `sentinel monitor <name> ...`); with --redis-sentinel.
    #[arg(long, env = "CALLGUARD_REDIS_MASTER", requires = "redis_sentinel")]
    pub redis_master: Option<String>,
    /// Replicas that must acknowledge each batch's writes (Redis `WAIT`, at
    /// most half of --redis-timeout-ms) before its calls are answered,
    /// produced or their offsets stored. Redis replicates asynchronously: a
    /// primary that fails takes the writes its replicas had not received,
    /// and the calls they decided are decided again after the failover,
    /// maybe differently. With 1, an acknowledged decision survives the
    /// loss of the primary; fewer acknowledgements fail the batch like a
    /// Redis error (consume retries it, serve answers 503). Costs a
    /// replication round trip per batch. 0: do not wait.
    #[arg(long, env = "CALLGUARD_REDIS_WAIT_REPLICAS", default_value_t = 0)]
    pub redis_wait_replicas: u32,
    /// Where the window algorithm runs with Redis. `cached` (the default):
    /// in callguard, on each caller's state cached in memory and written
    /// back to Redis under a version check, so Redis does a write or two per
    /// caller and batch instead of the algorithm; the partitioning by caller
    /// gives each caller one writer, and another writer of a caller (a
    /// second instance during a rebalance, `serve` beside `consume`) makes
    /// callguard re-read and decide again. `script`: in a Lua script in
    /// Redis, every call decided there; no retries when several instances
    /// decide the same callers at once (several `serve` instances behind a
    /// load balancer that does not route by caller). Same records either
    /// way; the two keep different keys, so every instance on a
    /// --key-prefix must use the same mode (the prefix records it).
    #[arg(long, value_enum, env = "CALLGUARD_REDIS_MODE", default_value_t = RedisMode::Cached)]
    pub redis_mode: RedisMode,
    /// Most callers kept in memory with --redis-mode cached; beyond it the
    /// idle ones are dropped first, then the least recently used, and a
    /// dropped caller's next call re-reads Redis (it never changes a
    /// record). A cached caller holds its records for the idempotency
    /// horizon in memory too: at high call rates that is as much as Redis
    /// holds for them.
    #[arg(long, env = "CALLGUARD_CACHED_CALLERS", default_value_t = cached::DEFAULT_CACHED_CALLERS)]
    pub cached_callers: usize,
    /// About how much memory (MiB) the cached callers may take with
    /// --redis-mode cached, counted from their windows, records and logs
    /// (allocator slack comes on top); past it callers are dropped as past
    /// --cached-callers. A flooding caller's hour of records can weigh as
    /// much as many thousand quiet callers.
    #[arg(long, env = "CALLGUARD_CACHED_MIB", default_value_t = cached::DEFAULT_CACHED_BYTES >> 20)]
    pub cached_mib: usize,
    /// Prefix of every Redis key, to separate environments.
    #[arg(long, env = "CALLGUARD_KEY_PREFIX", default_value = redis::DEFAULT_KEY_PREFIX)]
    pub key_prefix: String,
    /// Do not keep per-call records in Redis: faster, but a redelivered call
    /// counts again and may get another decision.
    #[arg(long, env = "CALLGUARD_NO_IDEMPOTENCY")]
    pub no_idempotency: bool,
    /// Seconds added to every Redis TTL, so state outlives processing pauses
    /// (Redis restarts, rebalances, lag); it never changes a decision.
    #[arg(long, env = "CALLGUARD_TTL_SLACK_S", default_value_t = redis::DEFAULT_TTL_SLACK_S)]
    pub ttl_slack_s: u64,
    /// CA certificate (PEM) for `rediss://` servers signed by a private CA.
    #[arg(long, env = "CALLGUARD_REDIS_CA")]
    pub redis_ca: Option<PathBuf>,
    /// Timeout of every Redis call, in milliseconds.
    #[arg(long, env = "CALLGUARD_REDIS_TIMEOUT_MS", default_value_t = redis::DEFAULT_TIMEOUT_MS)]
    pub redis_timeout_ms: u64,
    /// On each reject by a rule, also set the Redis key
    /// `<prefix>block:{<caller>}` to the reason, expiring after the
    /// retry-after, in the same atomic script call: a switch (Kamailio
    /// ndb_redis, OpenSIPS cachedb_redis, FreeSWITCH mod_hiredis) can then
    /// refuse the caller's next calls with one EXISTS. The switch must keep
    /// publishing the calls it refuses: they count under `attempts`.
    #[arg(long, env = "CALLGUARD_BLOCK_KEYS")]
    pub block_keys: bool,
}

impl StoreArgs {
    /// The Redis configuration.
    pub fn redis_config(&self) -> RedisConfig {
        let urls = if self.redis_url.is_empty() && self.redis_sentinel.is_empty() {
            vec![redis::DEFAULT_URL.to_string()]
        } else {
            self.redis_url.clone()
        };
        RedisConfig {
            urls,
            cluster: self.redis_cluster,
            key_prefix: self.key_prefix.clone(),
            idempotency: !self.no_idempotency,
            timeout: Duration::from_millis(self.redis_timeout_ms),
            ttl_slack: Duration::from_secs(self.ttl_slack_s),
            tls_ca: self.redis_ca.clone(),
            block_keys: self.block_keys,
            sentinel: self
                .redis_master
                .as_ref()
                .map(|master| redis::SentinelConfig {
                    sentinels: self.redis_sentinel.clone(),
                    master: master.clone(),
                }),
            wait_replicas: self.redis_wait_replicas,
        }
    }

    /// Which store: `--store`, else Redis if a URL is given, else `default`.
    /// A Redis URL with `--store memory` is an error: the user meant one of
    /// them, and silently dropping the URL would keep windows in process.
    pub fn kind(&self, default: StoreKind) -> Result<StoreKind> {
        if self.block_keys && self.store == Some(StoreKind::Memory) {
            anyhow::bail!(
                "--block-keys sets keys in Redis, but --store memory keeps the windows in this process: drop one of them"
            );
        }
        let no_redis = self.redis_url.is_empty() && self.redis_sentinel.is_empty();
        match (self.store, no_redis) {
            (Some(StoreKind::Memory), false) => anyhow::bail!(
                "--redis-url or --redis-sentinel is set, but --store memory keeps the windows in this process: drop one of them"
            ),
            (Some(kind), _) => Ok(kind),
            (None, false) => Ok(StoreKind::Redis),
            (None, true) if self.block_keys => Ok(StoreKind::Redis),
            (None, true) => Ok(default),
        }
    }

    /// The cached store's bounds (`--redis-mode cached`), or `None` for
    /// the script store.
    pub fn cache_limit(&self) -> Option<cached::CacheLimit> {
        match self.redis_mode {
            RedisMode::Script => None,
            RedisMode::Cached => Some(cached::CacheLimit {
                callers: self.cached_callers,
                bytes: self.cached_mib.saturating_mul(1 << 20),
            }),
        }
    }

    /// Opens the store of an online command ([`StoreArgs::kind`]): the
    /// in-memory one keeps every caller (a stream's partitions may run far
    /// apart in event time).
    pub async fn open(&self, default: StoreKind) -> Result<AnyStore> {
        Ok(match self.kind(default)? {
            StoreKind::Memory => {
                tracing::warn!(
                    "in-memory window store: windows live in this process only, are not shared \
                     with other instances and are lost on restart or rebalance (for tests and demos; \
                     production uses --store redis)"
                );
                AnyStore::Memory(MemoryStore::keeping_all())
            }
            StoreKind::Redis => {
                let config = self.redis_config();
                let context = || match &config.sentinel {
                    Some(s) => format!(
                        "connecting to Redis primary {:?} through the sentinels at {}",
                        s.master,
                        s.sentinels
                            .iter()
                            .map(|u| redis::redact(u))
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                    None => format!(
                        "connecting to Redis at {}",
                        config
                            .urls
                            .iter()
                            .map(|u| redis::redact(u))
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                };
                AnyStore::connect_redis(config.clone(), self.cache_limit())
                    .await
                    .with_context(context)?
            }
        })
    }

    /// Opens the store of an online command behind the gate of the rules
    /// keyed by callee or global, whose credits come from the same place
    /// as the windows: Redis, or this process.
    pub async fn open_gated(&self, default: StoreKind, slots: u32) -> Result<Gated<AnyStore>> {
        let store = self.open(default).await?;
        Ok(Gated::new(store, self.ledger(default, slots)?))
    }

    /// Where the credits of the rules keyed by callee or global come from;
    /// with Redis, `slots` reserve slots unless Redis has a count recorded.
    pub fn ledger(&self, default: StoreKind, slots: u32) -> Result<Ledger> {
        Ok(match self.kind(default)? {
            StoreKind::Memory => Ledger::Memory(MemoryLedger::new()),
            StoreKind::Redis => Ledger::Redis(Box::new(RedisLedger::with_slots(
                self.redis_config(),
                Slots::new(slots),
            ))),
        })
    }

    /// Opens the store of an offline command, and so how its replay is
    /// driven: in memory, split by caller over the cores (the input is
    /// time-sorted); Redis in batches.
    pub async fn open_replay(&self) -> Result<ReplayStore<Gated<AnyStore>>> {
        Ok(match self.kind(StoreKind::Memory)? {
            StoreKind::Memory => ReplayStore::Sharded(ShardedStore::per_core()),
            StoreKind::Redis => ReplayStore::Batched(self.open_gated(StoreKind::Redis, 1).await?),
        })
    }
}

//! The window store's options (`--store`, `--redis-*`, `--key-prefix`,
//! the cached store's bounds) and the store they open.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

use callguard::engine::aggregate::MemoryLedger;
use callguard::offline::replay::ReplayStore;
use callguard::store::cached;
use callguard::store::gated::{Gated, Ledger};
use callguard::store::memory::MemoryStore;
use callguard::store::redis::aggregate::lease::RedisLedger;
use callguard::store::redis::aggregate::slot::Slots;
use callguard::store::redis::{self, RedisConfig};
use callguard::store::sharded::ShardedStore;
use callguard::store::AnyStore;

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
    /// `consume` with --redis-mode cached: while a batch's commits are in
    /// flight, decide the callers of the batch queued behind it who are not
    /// in this one, and send their commits behind it; their verdicts are
    /// handed out in their batch's turn (exactly once: needs the per-call
    /// records). Worth it where the wait for Redis dominates a batch (Redis
    /// on another host); on a machine whose cores Redis, the broker and
    /// callguard share it measured no faster. Off by default.
    #[arg(long, env = "CALLGUARD_DECIDE_AHEAD")]
    pub decide_ahead: bool,
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
            decide_ahead: self.decide_ahead,
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

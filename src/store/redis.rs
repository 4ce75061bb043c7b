//! The Redis store: the window algorithm as atomic Lua calls of up to
//! [`EVENTS_PER_CALL`] events each.
//!
//! Every key of a caller carries the caller in a hash tag
//! (`<prefix>{+34911234567}:m`), so all of a caller's state lives in one
//! Redis Cluster slot and one script call can touch all of it. Event time is
//! passed in; the script never reads the Redis clock. Batches go through one
//! pipelined round trip of `EVALSHA` calls, each deciding its events in
//! order with the rule set sent once; a `NOSCRIPT` reply (a restarted or
//! flushed server) loads the script and retries the batch, which per-call
//! idempotency makes safe.

use std::collections::HashMap;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;
use redis::{RedisError, Value};

use crate::engine::event::CallEvent;
use crate::engine::record::Verdict;
use crate::engine::rules::{CountPolicy, Listed, RuleSet};
use crate::error::StoreError;
use crate::store::WindowStore;

/// The window script (see its header for KEYS, ARGV and the reply).
pub const WINDOW_LUA: &str = include_str!("../../lua/window.lua");

/// This store's name for its way of keeping state (see [`Conn::claim_mode`]).
pub const MODE: &str = "script";

/// Most events decided by one script call. A call runs atomically, so it
/// holds Redis for its whole batch (about 1-2 ms at this size); larger
/// batches are split into pipelined calls.
pub const EVENTS_PER_CALL: usize = 32;

/// How often a store claims its key prefix's mode again while it runs
/// (see [`Conn::keep_mode`]): a Redis that lost its keys (a restart
/// without persistence, a flush) lost the claim too, and another mode
/// could take the prefix over.
pub const CLAIM_EVERY: Duration = Duration::from_secs(1);

/// Default Redis URL.
pub const DEFAULT_URL: &str = "redis://127.0.0.1:6379";
/// Default prefix of every key.
pub const DEFAULT_KEY_PREFIX: &str = "cg:";
/// Default timeout of connecting and of every call, milliseconds.
pub const DEFAULT_TIMEOUT_MS: u64 = 2_000;
/// Default slack added to every TTL, seconds.
pub const DEFAULT_TTL_SLACK_S: u64 = 60;

/// How to reach Redis and how to use it.
#[derive(Clone)]
pub struct RedisConfig {
    /// One `redis://` or `rediss://` URL (user and password in the URL for
    /// ACL), or several seed URLs of a Cluster.
    pub urls: Vec<String>,
    /// Use the Cluster client (implied by more than one URL).
    pub cluster: bool,
    /// Prefix of every key, to separate environments (`cg:`).
    pub key_prefix: String,
    /// Keep each call's record so a redelivered call id counts once and gets
    /// the same record back. Off: redeliveries count again.
    pub idempotency: bool,
    /// Timeout of connecting and of every call.
    pub timeout: Duration,
    /// Added to every key's TTL. The contract runs on event time and the
    /// script trims by event time, so TTLs only collect garbage; the slack
    /// keeps state alive through processing pauses (Redis restarts,
    /// rebalances, consumer lag) that would otherwise expire it early.
    pub ttl_slack: Duration,
    /// PEM file of the CA that signed the server certificate (`rediss://`
    /// with a private CA); the system trust store otherwise.
    pub tls_ca: Option<std::path::PathBuf>,
    /// On a reject by a rule, set the caller's block key
    /// (`<prefix>block:{<caller>}`, see [`RedisStore::block_key`]) to the
    /// reason with a TTL of the retry-after, in the same script call, so a
    /// switch can refuse the caller's next calls with one `EXISTS`.
    pub block_keys: bool,
}

/// A URL with its password replaced by `***`, for logs.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let creds = &url[scheme + 3..at];
            let user = creds.split(':').next().unwrap_or_default();
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field(
                "urls",
                &self.urls.iter().map(|u| redact(u)).collect::<Vec<_>>(),
            )
            .field("cluster", &self.cluster)
            .field("key_prefix", &self.key_prefix)
            .field("idempotency", &self.idempotency)
            .field("timeout", &self.timeout)
            .field("ttl_slack", &self.ttl_slack)
            .field("tls_ca", &self.tls_ca)
            .field("block_keys", &self.block_keys)
            .finish()
    }
}

impl RedisConfig {
    /// A key of a caller, `<prefix>{<caller>}<tail>`: hash-tagged by the
    /// caller, so all of its keys share a Cluster slot. Built without
    /// `format!`: a few per caller and batch.
    pub fn caller_key(&self, caller: &str, tail: &str) -> String {
        self.tagged("", caller, tail)
    }

    /// The block key of a caller, `<prefix>block:{<caller>}`. Set (with
    /// [`RedisConfig::block_keys`]) to the reason of a reject, expiring when
    /// the caller's retry-after ends; both stores write it.
    pub fn block_key(&self, caller: &str) -> String {
        self.tagged("block:", caller, "")
    }

    /// `<prefix><head>{<caller>}<tail>`.
    fn tagged(&self, head: &str, caller: &str, tail: &str) -> String {
        let mut key = String::new();
        self.write_tagged(&mut key, head, caller, tail);
        key
    }

    /// Writes `<prefix><head>{<caller>}<tail>` into `key`, replacing what
    /// it held (a buffer reused for many keys).
    pub(crate) fn write_tagged(&self, key: &mut String, head: &str, caller: &str, tail: &str) {
        let prefix = &self.key_prefix;
        key.clear();
        key.reserve(prefix.len() + head.len() + caller.len() + tail.len() + 2);
        key.push_str(prefix);
        key.push_str(head);
        key.push('{');
        key.push_str(caller);
        key.push('}');
        key.push_str(tail);
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            urls: vec![DEFAULT_URL.into()],
            cluster: false,
            key_prefix: DEFAULT_KEY_PREFIX.into(),
            idempotency: true,
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
            ttl_slack: Duration::from_secs(DEFAULT_TTL_SLACK_S),
            tls_ca: None,
            block_keys: false,
        }
    }
}

/// A connection to a standalone server or a Cluster (cheap to clone:
/// clones share the connection).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Conn {
    /// Connects to the server or Cluster `config` names.
    pub(crate) async fn open(config: &RedisConfig) -> Result<Self, StoreError> {
        if config.urls.is_empty() {
            return Err(StoreError::fatal("no Redis URL given"));
        }
        let certs = match &config.tls_ca {
            Some(path) => Some(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(std::fs::read(path).map_err(|e| {
                    StoreError::fatal(format!(
                        "cannot read the Redis CA file {}: {e}",
                        path.display()
                    ))
                })?),
            }),
            None => None,
        };
        let conn = if config.cluster || config.urls.len() > 1 {
            if certs.is_some() {
                return Err(StoreError::fatal(
                    "a CA file is not supported with Redis Cluster: add the CA to the system trust store",
                ));
            }
            let nodes = config
                .urls
                .iter()
                .map(|u| without_nagle(u))
                .collect::<Result<Vec<_>, _>>()?;
            let client = ClusterClientBuilder::new(nodes)
                .connection_timeout(config.timeout)
                .response_timeout(config.timeout)
                .build()
                .map_err(|e| StoreError::Fatal {
                    context: "bad Redis Cluster URLs".into(),
                    source: Some(e),
                })?;
            let conn = tokio::time::timeout(config.timeout * 2, client.get_async_connection())
                .await
                .map_err(|_| StoreError::transient("timed out connecting to Redis Cluster"))?
                .map_err(classify)?;
            Conn::Cluster(conn)
        } else {
            let info = without_nagle(&config.urls[0])?;
            let client = match certs {
                Some(certs) => redis::Client::build_with_tls(info, certs),
                None => redis::Client::open(info),
            }
            .map_err(|e| StoreError::Fatal {
                context: "bad Redis URL".into(),
                source: Some(e),
            })?;
            let mgr_config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(config.timeout))
                .set_response_timeout(Some(config.timeout))
                .set_number_of_retries(2);
            let conn = tokio::time::timeout(
                config.timeout * 2,
                ConnectionManager::new_with_config(client, mgr_config),
            )
            .await
            .map_err(|_| StoreError::transient("timed out connecting to Redis"))?
            .map_err(classify)?;
            Conn::Single(conn)
        };
        Ok(conn)
    }

    /// Indices `0..n` in the groups that may share a pipeline: all of
    /// them on a standalone server, one group per hash slot of `key(i)` on
    /// a Cluster (a caller's keys share a slot, so its order is kept).
    /// `key` is called only on a Cluster.
    pub(crate) fn groups<K: AsRef<[u8]>>(
        &self,
        n: usize,
        key: impl Fn(usize) -> K,
    ) -> Vec<Vec<usize>> {
        match self {
            Conn::Single(_) => vec![(0..n).collect()],
            Conn::Cluster(_) => {
                let mut by_slot: HashMap<Slot, Vec<usize>> = HashMap::new();
                for (i, key) in (0..n).map(|i| (i, key(i))) {
                    by_slot
                        .entry(Slot::for_key(key.as_ref()))
                        .or_default()
                        .push(i);
                }
                by_slot.into_values().collect()
            }
        }
    }

    /// Runs one pipeline (all commands in one slot, for a Cluster).
    pub(crate) async fn query(
        &mut self,
        pipe: &redis::Pipeline,
        timeout: Duration,
    ) -> Result<Vec<Value>, RedisError> {
        let fut = async {
            match self {
                Conn::Single(c) => pipe.query_async::<Vec<Value>>(c).await,
                Conn::Cluster(c) => pipe.query_async::<Vec<Value>>(c).await,
            }
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "Redis call timed out",
            ))),
        }
    }

    /// Claims the key prefix for a way of keeping window state (`mode`)
    /// at start: sets `<prefix>mode` if absent, and refuses a prefix
    /// another mode claimed, since the two keep different keys and would
    /// each count only their own share of a caller's calls. The one key
    /// per prefix without a TTL.
    ///
    /// A prefix without the key but with window state (found by a bounded
    /// `SCAN`) was written by a callguard that did not record its mode
    /// (the window script's layout): refused, rather than every caller
    /// starting afresh.
    pub(crate) async fn claim_mode(&mut self, prefix: &str, mode: &str) -> Result<(), StoreError> {
        let key = format!("{prefix}mode");
        let recorded: Option<String> = self.run(redis::cmd("GET").arg(&key)).await?;
        if recorded.is_none() {
            if let Some(found) = self.any_key(prefix, &key).await? {
                return Err(StoreError::fatal(format!(
                    "the key prefix {prefix:?} holds window state (e.g. {found}) but no {key}: \
                     it was written by a callguard that did not record its mode, in the window \
                     script's layout. To keep it, record the mode (`SET {key} script`) and run \
                     with --redis-mode script; to start afresh, drain the input and delete the \
                     prefix's keys, or use another --key-prefix"
                )));
            }
        }
        self.keep_mode(prefix, mode).await.map(|_| ())
    }

    /// [`Conn::keep_mode`] once [`CLAIM_EVERY`] has passed since `*claimed`; a
    /// claim found gone is logged, since every window and record of the
    /// prefix went with it.
    pub(crate) async fn keep_mode_every(
        &mut self,
        prefix: &str,
        mode: &str,
        claimed: &mut std::time::Instant,
    ) -> Result<(), StoreError> {
        if claimed.elapsed() < CLAIM_EVERY {
            return Ok(());
        }
        if self.keep_mode(prefix, mode).await? {
            tracing::warn!(
                prefix,
                "the key prefix's mode key was gone: Redis lost its keys (a restart without \
                 persistence, a flush, or a failover to a replica that had not received them); \
                 every window and record of the prefix went with it"
            );
        }
        *claimed = std::time::Instant::now();
        Ok(())
    }

    /// Claims the key prefix for `mode` again while running (see
    /// [`Conn::claim_mode`]): a Redis that lost its keys lost the claim
    /// too. Refuses a prefix another mode claimed meanwhile; `true` when
    /// the claim was gone (and is now made again).
    pub(crate) async fn keep_mode(&mut self, prefix: &str, mode: &str) -> Result<bool, StoreError> {
        let key = format!("{prefix}mode");
        let mut cmd = redis::cmd("SET");
        cmd.arg(&key).arg(mode).arg("NX").arg("GET");
        let before: Option<String> = self.run(&cmd).await?;
        // A mode may name its layout's version after a colon.
        let flag = |m: &str| m.split(':').next().unwrap_or(m).to_string();
        match before {
            Some(other) if other != mode && flag(&other) == flag(mode) => {
                Err(StoreError::fatal(format!(
                    "the key prefix {prefix:?} holds --redis-mode {} window state in another \
                     layout ({other}; this version keeps {mode}): drain the input and delete \
                     the prefix's keys, or use another --key-prefix (the key {key} records the \
                     layout)",
                    flag(mode)
                )))
            }
            Some(other) if other != mode => Err(StoreError::fatal(format!(
                "the key prefix {prefix:?} holds window state kept by --redis-mode {}, \
                 not {}: use --redis-mode {}, or another --key-prefix (the key {key} \
                 records the mode)",
                flag(&other),
                flag(mode),
                flag(&other)
            ))),
            Some(_) => Ok(false),
            None => Ok(true),
        }
    }

    /// A key of the prefix other than `except`, if a bounded `SCAN` finds
    /// one (up to 8 rounds of 1,000 on a server; one of 10,000 on each
    /// primary of a Cluster).
    async fn any_key(&mut self, prefix: &str, except: &str) -> Result<Option<String>, StoreError> {
        let pattern: String = prefix
            .chars()
            .flat_map(|c| {
                let escape = matches!(c, '*' | '?' | '[' | ']' | '\\');
                escape.then_some('\\').into_iter().chain(std::iter::once(c))
            })
            .chain(std::iter::once('*'))
            .collect();
        let found = |keys: Vec<String>| keys.into_iter().find(|k| k != except);
        match self {
            Conn::Single(c) => {
                let mut cursor = 0u64;
                for _ in 0..8 {
                    let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(1_000)
                        .query_async(c)
                        .await
                        .map_err(classify)?;
                    if let Some(k) = found(keys) {
                        return Ok(Some(k));
                    }
                    if next == 0 {
                        break;
                    }
                    cursor = next;
                }
                Ok(None)
            }
            Conn::Cluster(c) => {
                use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
                let mut cmd = redis::cmd("SCAN");
                cmd.arg(0)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(10_000);
                let route = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let v = c.route_command(cmd, route).await.map_err(classify)?;
                let replies: Vec<Value> = match v {
                    Value::Map(pairs) => pairs.into_iter().map(|(_, v)| v).collect(),
                    Value::Array(items) => items,
                    other => vec![other],
                };
                for reply in replies {
                    let (_, keys): (u64, Vec<String>) =
                        redis::from_redis_value(reply).map_err(|e| classify(e.into()))?;
                    if let Some(k) = found(keys) {
                        return Ok(Some(k));
                    }
                }
                Ok(None)
            }
        }
    }

    /// Runs one command.
    async fn run<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> Result<T, StoreError> {
        match self {
            Conn::Single(c) => cmd.query_async(c).await,
            Conn::Cluster(c) => cmd.query_async(c).await,
        }
        .map_err(classify)
    }

    /// Loads a script (on every primary of a Cluster) and returns its SHA.
    pub(crate) async fn load_script(&mut self, lua: &str) -> Result<String, StoreError> {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(lua);
        let sha: String = match self {
            Conn::Single(c) => cmd.query_async(c).await.map_err(classify)?,
            Conn::Cluster(c) => {
                // Load on every primary, so EVALSHA works whatever slot a caller is in.
                use redis::cluster_routing::{
                    MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo,
                };
                let route = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                ));
                let v = c.route_command(cmd, route).await.map_err(classify)?;
                match v {
                    Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                    Value::SimpleString(s) => s,
                    Value::Array(items) => match items.into_iter().next() {
                        Some(Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
                        other => {
                            return Err(StoreError::fatal(format!(
                                "SCRIPT LOAD answered {other:?}"
                            )))
                        }
                    },
                    other => {
                        return Err(StoreError::fatal(format!("SCRIPT LOAD answered {other:?}")))
                    }
                }
            }
        };
        Ok(sha)
    }
}

/// Window state in Redis (standalone or Cluster).
pub struct RedisStore {
    conn: Conn,
    sha: String,
    config: RedisConfig,
    /// When the prefix's mode was last claimed (see [`CLAIM_EVERY`]).
    claimed: std::time::Instant,
}

/// Server error codes that retrying may get past.
const TRANSIENT_CODES: [&str; 8] = [
    "LOADING",
    "BUSY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "READONLY",
    "MOVED",
    "ASK",
];

/// The connection settings of a Redis URL, with Nagle's algorithm off
/// (`TCP_NODELAY`, as hiredis sets it): the stores pipeline several small
/// calls on one connection, and none should wait for the acknowledgement
/// of the one before (on loopback no change was measured).
fn without_nagle(url: &str) -> Result<redis::ConnectionInfo, StoreError> {
    use redis::IntoConnectionInfo;
    let info = url.into_connection_info().map_err(|e| StoreError::Fatal {
        context: "bad Redis URL".into(),
        source: Some(e),
    })?;
    let tcp = info.tcp_settings().clone().set_nodelay(true);
    Ok(info.set_tcp_settings(tcp))
}

/// Classifies a Redis error as transient (retry), out of memory (retry
/// later) or fatal. A pipeline's error carries one server error per failed
/// call: it is out of memory or transient only if every one of them is, and
/// it is summarised by its first failure, not printed whole.
pub fn classify(e: RedisError) -> StoreError {
    let failures = e
        .clone()
        .into_server_errors()
        .unwrap_or_else(|| Vec::new().into());
    if failures.len() > 1 {
        let codes: Vec<&str> = failures.iter().map(|(_, f)| f.code()).collect();
        let first = RedisError::from(failures[0].1.clone());
        let context = format!("{} calls of a pipeline failed; the first", failures.len());
        return if codes
            .iter()
            .all(|c| *c == "OOM" || TRANSIENT_CODES.contains(c))
        {
            if codes.contains(&"OOM") {
                StoreError::OutOfMemory { source: first }
            } else {
                StoreError::Transient {
                    context,
                    source: Some(first),
                }
            }
        } else {
            StoreError::Fatal {
                context,
                source: Some(first),
            }
        };
    }
    let code = failures
        .first()
        .map(|(_, f)| f.code().to_string())
        .or_else(|| e.code().map(str::to_string));
    if code.as_deref() == Some("OOM") {
        return StoreError::OutOfMemory { source: e };
    }
    if e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || code.is_some_and(|c| TRANSIENT_CODES.contains(&c.as_str()))
    {
        StoreError::Transient {
            context: "Redis call failed".into(),
            source: Some(e),
        }
    } else {
        StoreError::Fatal {
            context: "Redis call failed".into(),
            source: Some(e),
        }
    }
}

pub(crate) fn is_noscript(e: &RedisError) -> bool {
    e.code() == Some("NOSCRIPT")
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("config", &self.config)
            .field("sha", &self.sha)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects and loads the script.
    pub async fn connect(config: RedisConfig) -> Result<Self, StoreError> {
        let mut conn = Conn::open(&config).await?;
        conn.claim_mode(&config.key_prefix, MODE).await?;
        let sha = conn.load_script(WINDOW_LUA).await?;
        Ok(RedisStore {
            conn,
            sha,
            config,
            claimed: std::time::Instant::now(),
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// Runs the groups (indices into `events`) as pipelines, concurrently,
    /// and returns each group's outcome.
    async fn run_groups(
        &self,
        rules: &RuleSet,
        events: &[CallEvent],
        groups: &[Vec<usize>],
    ) -> Vec<Result<Vec<Value>, RedisError>> {
        let timeout = self.config.timeout * 2;
        let calls = groups.iter().map(|g| {
            let mut pipe = redis::pipe();
            for chunk in g.chunks(EVENTS_PER_CALL) {
                let evs: Vec<&CallEvent> = chunk.iter().map(|&i| &events[i]).collect();
                pipe.add_command(self.invocation(rules, &evs));
            }
            let mut conn = self.conn.clone();
            async move {
                let replies = conn.query(&pipe, timeout).await?;
                Ok(per_event(replies))
            }
        });
        futures::future::join_all(calls).await
    }

    async fn load_script(&mut self) -> Result<(), StoreError> {
        self.sha = self.conn.load_script(WINDOW_LUA).await?;
        Ok(())
    }

    /// The stem of a caller's keys, `<prefix>{<caller>}`: the script names
    /// each of the caller's keys by a suffix to it.
    pub fn stem(&self, caller: &str) -> String {
        self.config.caller_key(caller, "")
    }

    /// The block key of a caller (see [`RedisConfig::block_key`]).
    pub fn block_key(&self, caller: &str) -> String {
        self.config.block_key(caller)
    }

    /// The `EVALSHA` of the window script for `events`, decided in order in
    /// one atomic call (keys and arguments as documented in
    /// `lua/window.lua`); benchmarks replay it elsewhere. On a Cluster all
    /// events must be in one hash slot.
    pub fn invocation(&self, rules: &RuleSet, events: &[&CallEvent]) -> redis::Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.sha).arg(events.len());
        for ev in events {
            cmd.arg(self.stem(&ev.caller));
        }
        cmd.arg(u8::from(rules.count == CountPolicy::Admitted))
            .arg(rules.grace_ms)
            .arg(rules.retention_ms())
            .arg(u8::from(rules.shadow))
            .arg(u8::from(self.config.idempotency))
            .arg(rules.version())
            .arg(u8::from(rules.has_sliding()))
            .arg(rules.dedup_ms())
            .arg(self.config.ttl_slack.as_millis() as u64)
            .arg(u8::from(rules.tracks_callees()))
            .arg(rules.max_window_ms())
            .arg(rules.max_distinct_callees())
            .arg(u8::from(self.config.block_keys))
            .arg(&self.config.key_prefix)
            .arg(rules.rules.len());
        for rule in &rules.rules {
            cmd.arg(rule.kind.code())
                .arg(rule.window_ms)
                .arg(rule.limit)
                .arg(&rule.name);
        }
        for ev in events {
            let listed = match rules.listed(ev.number_for_lists()) {
                Listed::No => 0,
                Listed::Allow => 1,
                Listed::Deny => 2,
            };
            cmd.arg(ev.ts_ms)
                .arg(ev.call_id.as_str())
                .arg(listed)
                .arg(ev.callee.as_deref().unwrap_or(""));
        }
        cmd
    }

    /// Applies events through pipelined round trips: one pipeline for a
    /// standalone server; one per hash slot, sent concurrently, for a Cluster
    /// (a caller's events share a slot, so their order is kept).
    pub async fn apply_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let prefix = &self.config.key_prefix;
        self.conn
            .keep_mode_every(prefix, MODE, &mut self.claimed)
            .await?;
        let groups = self
            .conn
            .groups(events.len(), |i| self.stem(&events[i].caller));
        let mut replies: Vec<Option<Value>> = vec![None; events.len()];
        let mut pending = groups;
        for attempt in 0..2 {
            let outcomes = self.run_groups(rules, events, &pending).await;
            let mut retry = Vec::new();
            let mut noscript = false;
            for (group, outcome) in pending.into_iter().zip(outcomes) {
                match outcome {
                    Ok(values) if values.len() == group.len() => {
                        for (i, v) in group.into_iter().zip(values) {
                            replies[i] = Some(v);
                        }
                    }
                    Ok(values) => {
                        return Err(StoreError::fatal(format!(
                            "{} replies for {} calls",
                            values.len(),
                            group.len()
                        )))
                    }
                    // Only groups that failed as a whole with NOSCRIPT ran nothing: retry just those.
                    Err(e) if is_noscript(&e) && attempt == 0 => {
                        noscript = true;
                        retry.push(group);
                    }
                    Err(e) => return Err(classify(e)),
                }
            }
            if !noscript {
                break;
            }
            self.load_script().await?;
            pending = retry;
        }
        replies
            .into_iter()
            .zip(events)
            .map(|(v, ev)| match v {
                Some(v) => parse_reply(v, ev),
                None => Err(StoreError::transient(format!(
                    "no reply for call {}",
                    ev.call_id
                ))),
            })
            .collect()
    }
}

impl WindowStore for RedisStore {
    async fn apply_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, StoreError> {
        RedisStore::apply_batch(self, rules, events).await
    }
}

/// Splits the replies of script calls (each a flat array of duplicate flag
/// and record per event) into one `[duplicate, record]` array per event. A
/// reply of another shape is passed on as it is, for `parse_reply` to refuse.
fn per_event(replies: Vec<Value>) -> Vec<Value> {
    let mut out = Vec::with_capacity(replies.len() * 2);
    for reply in replies {
        match reply {
            Value::Array(items) if items.len() % 2 == 0 => {
                let mut it = items.into_iter();
                while let (Some(dup), Some(rec)) = (it.next(), it.next()) {
                    out.push(Value::Array(vec![dup, rec]));
                }
            }
            other => out.push(other),
        }
    }
    out
}

fn parse_reply(v: Value, ev: &CallEvent) -> Result<Verdict, StoreError> {
    let bad = |what: &str| {
        StoreError::fatal(format!(
            "unexpected script reply for call {}: {what}",
            ev.call_id
        ))
    };
    let Value::Array(items) = v else {
        return Err(bad(&format!("{v:?}")));
    };
    let (dup, encoded) = match items.as_slice() {
        [Value::Int(d), Value::BulkString(s)] => (*d == 1, String::from_utf8_lossy(s).into_owned()),
        other => return Err(bad(&format!("{other:?}"))),
    };
    Verdict::from_reply(&encoded, ev, dup).ok_or_else(|| bad(&encoded))
}

#[cfg(test)]
mod tests {
    #[test]
    fn redacts_passwords() {
        assert_eq!(
            super::redact("redis://cg:s3cret@host:6379/0"),
            "redis://cg:***@host:6379/0"
        );
        assert_eq!(super::redact("redis://host:6379"), "redis://host:6379");
        let cfg = super::RedisConfig {
            urls: vec!["rediss://u:p@h:1".into()],
            ..Default::default()
        };
        assert!(!format!("{cfg:?}").contains(":p@"));
    }
}

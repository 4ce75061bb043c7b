//! The connection both Redis stores use: standalone or Cluster, TLS and
//! ACL from the URL, the claim of a key prefix's mode, and how Redis errors
//! are classified (transient, out of memory, fatal).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_routing::Slot;
use redis::{RedisError, Value};

use crate::error::StoreError;
use crate::store::redis::cluster::Nodes;
use crate::store::redis::config::{classify, without_nagle};
use crate::store::redis::sentinel::Primary;
use crate::store::redis::RedisConfig;

/// How often a store claims its key prefix's mode again while it runs
/// (see `Conn::keep_mode_every`): a Redis that lost its keys (a restart
/// without persistence, a flush) lost the claim too, and another mode
/// could take the prefix over.
pub const CLAIM_EVERY: Duration = Duration::from_secs(1);

/// A store's claim of its key prefix's mode: when it was last made, and
/// how often it was found gone (Redis had lost every key of the prefix).
#[derive(Debug, Clone, Copy)]
pub struct ModeClaim {
    /// When the claim was last made.
    pub at: std::time::Instant,
    /// Claims found gone since the store connected.
    pub lost: u64,
}

impl ModeClaim {
    /// A claim made now.
    pub fn now() -> Self {
        ModeClaim {
            at: std::time::Instant::now(),
            lost: 0,
        }
    }
}

/// A connection to a standalone server or a Cluster (cheap to clone:
/// clones share the connection).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(Arc<Nodes>),
    /// A standalone primary found through Sentinel, followed across
    /// failovers.
    Sentinel(Arc<Primary>),
}

impl Conn {
    /// Connects to the server or Cluster `config` names.
    pub(crate) async fn open(config: &RedisConfig) -> Result<Self, StoreError> {
        if config.urls.is_empty() && config.sentinel.is_none() {
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
        let mgr_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.timeout))
            .set_response_timeout(Some(config.timeout))
            .set_number_of_retries(2);
        let conn = if let Some(sentinel) = &config.sentinel {
            if config.cluster || config.urls.len() > 1 || certs.is_some() {
                return Err(StoreError::fatal(
                    "--redis-sentinel takes one --redis-url at most (for the primary's user, \
                     password and database), no --redis-cluster and no CA file",
                ));
            }
            let node = config.urls.first().map(String::as_str);
            Conn::Sentinel(Primary::connect(sentinel, node, mgr_config, config.timeout).await?)
        } else if config.cluster || config.urls.len() > 1 {
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
            Conn::Cluster(Arc::new(Nodes::new(client, conn, config.timeout)))
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
            Conn::Single(_) | Conn::Sentinel(_) => vec![(0..n).collect()],
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
                Conn::Cluster(n) => pipe.query_async::<Vec<Value>>(&mut n.conn()).await,
                Conn::Sentinel(p) => pipe.query_async::<Vec<Value>>(&mut p.conn()).await,
            }
        };
        let result = match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "Redis call timed out",
            ))),
        };
        self.follow(result).await
    }

    /// After an error a failover explains: with Sentinel, asks the
    /// sentinels again ([`Primary::follow`]); on a Cluster, rebuilds a
    /// connection that may be stuck ([`Nodes::follow`]). The result is
    /// passed on as it is.
    async fn follow<T>(&self, result: Result<T, RedisError>) -> Result<T, RedisError> {
        match (self, &result) {
            (Conn::Sentinel(p), Err(e)) => p.follow(e).await,
            (Conn::Cluster(n), Err(e)) => n.follow(e).await,
            _ => {}
        }
        result
    }

    /// The server's id of this connection (`CLIENT ID`), taken before a
    /// batch's writes when replicas must acknowledge them (see
    /// [`Conn::wait_replicas`]); `None` when none must, and on a Cluster
    /// (a connection per node).
    pub(crate) async fn batch_start(
        &mut self,
        wait_replicas: u32,
    ) -> Result<Option<i64>, StoreError> {
        if wait_replicas == 0 || matches!(self, Conn::Cluster(_)) {
            return Ok(None);
        }
        self.run(redis::cmd("CLIENT").arg("ID")).await.map(Some)
    }

    /// Makes `n` replicas acknowledge every write made so far on this
    /// connection (`WAIT`, on every primary of a Cluster), waiting at most
    /// half the call timeout for them. Fewer acknowledgements are a
    /// transient error: the writes stand on the primary, but a failover
    /// now could lose them, so the batch is not answered as decided.
    ///
    /// `WAIT` covers the writes of the connection it is sent on: if the
    /// connection was replaced since `since` ([`Conn::batch_start`]; a
    /// reconnect between the batch's writes and `WAIT`), it would pass
    /// without covering them. It goes in one pipeline with `CLIENT ID`, and
    /// a changed id is a transient error too (the batch is retried).
    pub(crate) async fn wait_replicas(
        &mut self,
        n: u32,
        timeout: Duration,
        since: Option<i64>,
    ) -> Result<(), StoreError> {
        if n == 0 {
            return Ok(());
        }
        let wait_ms = (timeout.as_millis() / 2).max(1) as u64;
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(n).arg(wait_ms);
        let acked: i64 = match self {
            Conn::Cluster(c) => {
                use redis::cluster_routing::{
                    MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo,
                };
                let route = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::Aggregate(
                        redis::cluster_routing::AggregateOp::Min,
                    )),
                ));
                let v = tokio::time::timeout(timeout, c.conn().route_command(cmd, route))
                    .await
                    .map_err(|_| StoreError::transient("WAIT for replicas timed out"))?
                    .map_err(|e| StoreError::Transient {
                        context: "WAIT on the Cluster's primaries failed".into(),
                        source: Some(e),
                    })?;
                redis::from_redis_value(v).map_err(|e| classify(e.into()))?
            }
            _ => {
                let mut pipe = redis::pipe();
                pipe.cmd("CLIENT").arg("ID").add_command(cmd);
                let replies = self.query(&pipe, timeout).await.map_err(classify)?;
                let (id, acked): (i64, i64) = redis::from_redis_value(Value::Array(replies))
                    .map_err(|e| classify(e.into()))?;
                if since.is_some_and(|s| s != id) {
                    return Err(StoreError::transient(
                        "the Redis connection was replaced during the batch: WAIT would not \
                         cover its writes (--redis-wait-replicas); the batch is not answered \
                         as decided",
                    ));
                }
                acked
            }
        };
        if acked < i64::from(n) {
            return Err(StoreError::transient(format!(
                "only {acked} of {n} Redis replicas acknowledged the batch's writes within \
                 {wait_ms} ms (--redis-wait-replicas): not answered as decided, since a \
                 failover now could lose them"
            )));
        }
        Ok(())
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
    /// starting afresh. Keys found while the mode key appeared meanwhile
    /// are another instance's, started at the same time: not refused.
    pub(crate) async fn claim_mode(&mut self, prefix: &str, mode: &str) -> Result<(), StoreError> {
        let key = format!("{prefix}mode");
        let recorded: Option<String> = self.run(redis::cmd("GET").arg(&key)).await?;
        if recorded.is_none() {
            let found = self.any_key(prefix).await?;
            // A callguard records the mode before it writes anything, so
            // keys found with the mode recorded by now were written by an
            // instance that claimed the prefix after our first look (two
            // starting at once), not by one that never records it.
            let recorded: Option<String> = match found {
                Some(_) => self.run(redis::cmd("GET").arg(&key)).await?,
                None => None,
            };
            if let (Some(found), None) = (found, recorded) {
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

    /// [`Conn::keep_mode`] once [`CLAIM_EVERY`] has passed since the last claim; a
    /// claim found gone is logged, since every window and record of the
    /// prefix went with it.
    pub(crate) async fn keep_mode_every(
        &mut self,
        prefix: &str,
        mode: &str,
        claim: &mut ModeClaim,
    ) -> Result<(), StoreError> {
        if claim.at.elapsed() < CLAIM_EVERY {
            return Ok(());
        }
        self.reclaim_mode(prefix, mode, claim).await
    }

    /// [`Conn::keep_mode`] now, logging a claim found gone; notes the time
    /// in `claim` (and a claim found gone in its count of losses).
    pub(crate) async fn reclaim_mode(
        &mut self,
        prefix: &str,
        mode: &str,
        claim: &mut ModeClaim,
    ) -> Result<(), StoreError> {
        if self.keep_mode(prefix, mode).await? {
            claim.lost += 1;
            tracing::warn!(
                prefix,
                "the key prefix's mode key was gone: Redis lost its keys (a restart without \
                 persistence, a flush, or a failover to a replica that had not received them); \
                 every window and record of the prefix went with it"
            );
        }
        claim.at = std::time::Instant::now();
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

    /// Takes the key prefix for a replay under the rule set `version`
    /// (see [`claim_replay`](super::claim_replay)): `<prefix>replay` records
    /// the version whose records the prefix holds.
    pub(crate) async fn claim_replay(
        &mut self,
        prefix: &str,
        version: &str,
        reuse: PrefixReuse,
    ) -> Result<ReplayClaim, StoreError> {
        let key = format!("{prefix}replay");
        let recorded: Option<String> = self.run(redis::cmd("GET").arg(&key)).await?;
        let found = match &recorded {
            // (Asked for afresh, the same rule set's records go too.)
            Some(v) if v == version && !matches!(reuse, PrefixReuse::Fresh) => {
                return Ok(ReplayClaim::Same)
            }
            Some(v) => Some(v.clone()),
            // Keys without a record of their rule set: an online command's,
            // or a replay's from before the record was kept.
            None => self.any_key(prefix).await?.map(|_| String::new()),
        };
        let claim = match (found, reuse) {
            (None, _) => ReplayClaim::New,
            (Some(found), PrefixReuse::Refuse) => {
                let held = if found.is_empty() {
                    "records of an unknown rule set (written by consume or serve, or by an \
                     older replay)"
                        .to_string()
                } else {
                    format!("records of rule set version {found}")
                };
                return Err(StoreError::fatal(format!(
                    "the key prefix {prefix:?} holds {held}, not of this rule set (version \
                     {version}): a replay would answer their calls with the old records. Pass \
                     --fresh to delete the prefix's keys first, --resume to continue on them, or \
                     use another --key-prefix"
                )));
            }
            (Some(found), PrefixReuse::Resume) => ReplayClaim::Resumed(found),
            (Some(_), PrefixReuse::Fresh) => {
                ReplayClaim::Emptied(self.delete_prefix(prefix).await?)
            }
        };
        self.run::<()>(redis::cmd("SET").arg(&key).arg(version))
            .await?;
        Ok(claim)
    }

    /// Deletes every key of the prefix (`SCAN` and `UNLINK`, a thousand at
    /// a time); returns how many. A Cluster's keys are spread over its
    /// primaries, each with its own cursor: not done there.
    async fn delete_prefix(&mut self, prefix: &str) -> Result<u64, StoreError> {
        if matches!(self, Conn::Cluster(_)) {
            return Err(StoreError::fatal(format!(
                "--fresh is not supported on Redis Cluster: delete the keys of {prefix:?} with \
                 redis-cli --cluster call, or use another --key-prefix"
            )));
        }
        let pattern = scan_pattern(prefix);
        let (mut cursor, mut deleted) = (0u64, 0u64);
        loop {
            let (next, keys) = self.scan_page(&pattern, cursor).await?;
            if !keys.is_empty() {
                let n: u64 = self.run(redis::cmd("UNLINK").arg(&keys)).await?;
                deleted += n;
            }
            if next == 0 {
                return Ok(deleted);
            }
            cursor = next;
        }
    }

    /// One `SCAN` page of keys matching `pattern` from `cursor` (1,000 a
    /// page): the next cursor (0 at the end) and the keys.
    async fn scan_page(
        &mut self,
        pattern: &str,
        cursor: u64,
    ) -> Result<(u64, Vec<String>), StoreError> {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1_000);
        self.run(&scan).await
    }

    /// A key of the prefix that holds state (not its mode or replay
    /// record), if a bounded `SCAN` finds one (up to 8 rounds of 1,000 on a server; one of 10,000 on each
    /// primary of a Cluster).
    async fn any_key(&mut self, prefix: &str) -> Result<Option<String>, StoreError> {
        let pattern = scan_pattern(prefix);
        let records = [format!("{prefix}mode"), format!("{prefix}replay")];
        let found = |keys: Vec<String>| keys.into_iter().find(|k| !records.contains(k));
        match self {
            Conn::Single(_) | Conn::Sentinel(_) => {
                let mut cursor = 0u64;
                for _ in 0..8 {
                    let (next, keys) = self.scan_page(&pattern, cursor).await?;
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
                let v = c.conn().route_command(cmd, route).await.map_err(classify)?;
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
        let result = match self {
            Conn::Single(c) => cmd.query_async(c).await,
            Conn::Cluster(n) => cmd.query_async(&mut n.conn()).await,
            Conn::Sentinel(p) => cmd.query_async(&mut p.conn()).await,
        };
        self.follow(result).await.map_err(classify)
    }

    /// Loads a script (on every primary of a Cluster) and returns its SHA.
    pub(crate) async fn load_script(&mut self, lua: &str) -> Result<String, StoreError> {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(lua);
        let sha: String = match self {
            Conn::Single(_) | Conn::Sentinel(_) => self.run(&cmd).await?,
            Conn::Cluster(c) => {
                // Load on every primary, so EVALSHA works whatever slot a caller is in.
                use redis::cluster_routing::{
                    MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo,
                };
                let route = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                ));
                let v = c.conn().route_command(cmd, route).await.map_err(classify)?;
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

/// The `SCAN MATCH` pattern of every key of a prefix (its glob characters
/// escaped).
fn scan_pattern(prefix: &str) -> String {
    prefix
        .chars()
        .flat_map(|c| {
            let escape = matches!(c, '*' | '?' | '[' | ']' | '\\');
            escape.then_some('\\').into_iter().chain(std::iter::once(c))
        })
        .chain(std::iter::once('*'))
        .collect()
}

/// What a replay may do with a key prefix that holds records of another
/// rule set (or of an unknown one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixReuse {
    /// Refuse it (the default): its calls would get the old records back.
    Refuse,
    /// Continue on it (`--resume`): the records it holds stand.
    Resume,
    /// Delete the prefix's keys first (`--fresh`).
    Fresh,
}

/// How a replay took its key prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayClaim {
    /// The prefix held nothing.
    New,
    /// The prefix holds records of the same rule set: they come back.
    Same,
    /// Continued on records of another rule set (its version; empty when
    /// unknown).
    Resumed(String),
    /// The prefix's keys were deleted first (how many).
    Emptied(u64),
}

pub(crate) fn is_noscript(e: &RedisError) -> bool {
    e.code() == Some("NOSCRIPT")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::test_server::Server;

    /// `WAIT` covers only the writes of the connection it goes on: a
    /// connection replaced between a batch's writes and `WAIT` would pass
    /// it (a replica acknowledges a new connection's nothing at once), so
    /// the replaced connection is an error, and an unchanged one passes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wait_fails_when_the_connection_changed_since_the_writes() {
        if !Server::available("wait_fails_when_the_connection_changed_since_the_writes") {
            return;
        }
        let primary = Server::start();
        let _replica = Server::start_with(Some(primary.port));
        let config = RedisConfig {
            urls: vec![primary.url()],
            ..RedisConfig::default()
        };
        let timeout = Duration::from_secs(2);
        let mut conn = Conn::open(&config).await.unwrap();
        let other = redis::Client::open(primary.url()).unwrap();
        let mut other = other.get_connection().unwrap();
        // The replica connected and synced: WAIT answers 1.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let since = conn.batch_start(1).await.unwrap();
            let _: () = conn.run(redis::cmd("SET").arg("k").arg("v")).await.unwrap();
            if conn.wait_replicas(1, timeout, since).await.is_ok() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the replica never acknowledged"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Writes, then the connection is killed and replaced before WAIT.
        let since = conn.batch_start(1).await.unwrap();
        let _: () = conn.run(redis::cmd("SET").arg("k").arg("w")).await.unwrap();
        let id = since.unwrap();
        let killed: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .query(&mut other)
            .unwrap();
        assert_eq!(killed, 1);
        let mut replaced = None;
        for _ in 0..20 {
            match conn.wait_replicas(1, timeout, since).await {
                Err(e) if e.to_string().contains("connection was replaced") => {
                    replaced = Some(e);
                    break;
                }
                Ok(()) => panic!("WAIT passed on a new connection that made none of the writes"),
                // The first try may meet the closed connection itself.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        let e = replaced.expect("the replaced connection was not noticed");
        assert!(e.is_transient(), "{e}");
    }
}

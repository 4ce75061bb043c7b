//! Credits of the rules keyed by callee or global, leased from Redis
//! (`lua/lease.lua`; [`crate::engine::aggregate::MemoryLedger`] is its
//! reference).
//!
//! A counter is the field `<key>` (the callee; empty for a global rule)
//! of the hash `<prefix>g:{<shard>}:<rule>:<W>:<bucket>`: the shard (one
//! of [`SHARDS`], from the key) is the hash tag, so a batch's counters go
//! in at most [`SHARDS`] script calls on a Cluster and in one on a
//! standalone server, whatever the number of callees; a field costs Redis
//! far less than a key of its own (no expiry entry; one TTL per hash).

use std::collections::HashMap;

use redis::Value;

use crate::engine::aggregate::{Lease, LeaseRequest};
use crate::error::StoreError;
use crate::store::redis::conn::{classify, is_noscript, Conn};
use crate::store::redis::RedisConfig;

/// The lease script.
pub const LEASE_LUA: &str = include_str!("../../../lua/lease.lua");

/// Hash tags the counters are spread over.
pub const SHARDS: u64 = 16;

/// Leases credits from Redis; connects on first use (and after a failed
/// connect, on the next).
pub struct RedisLedger {
    config: RedisConfig,
    conn: Option<(Conn, String)>,
}

impl std::fmt::Debug for RedisLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLedger")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// FNV-1a: a stable hash (the same in every instance and version).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl RedisLedger {
    /// A ledger on the Redis `config` names (not connected yet).
    pub fn new(config: RedisConfig) -> Self {
        RedisLedger { config, conn: None }
    }

    /// The hash holding the counters of a rule's bucket in one shard
    /// (the shard from the counter's key: callee, or '' for a global rule).
    pub fn hash_key(&self, rule: &str, window_ms: i64, key: &str, bucket: i64) -> String {
        let shard = (fnv1a(key) % SHARDS).to_string();
        let tail = format!(":{rule}:{window_ms}:{bucket}");
        self.config.tagged_key("g:", &shard, &tail)
    }

    async fn conn(&mut self) -> Result<&mut (Conn, String), StoreError> {
        if self.conn.is_none() {
            let mut conn = Conn::open(&self.config).await?;
            let sha = conn.load_script(LEASE_LUA).await?;
            self.conn = Some((conn, sha));
        }
        self.conn
            .as_mut()
            .ok_or_else(|| StoreError::transient("not connected to Redis"))
    }

    /// Answers `requests`: one script call per hash slot, concurrently.
    pub async fn lease(&mut self, requests: &[LeaseRequest]) -> Result<Vec<Lease>, StoreError> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        // Per request, its hash and the previous bucket's.
        let keys: Vec<(String, String)> = requests
            .iter()
            .map(|r| {
                let c = &r.counter;
                (
                    self.hash_key(&c.rule, c.window_ms, &c.key, c.bucket),
                    self.hash_key(&c.rule, c.window_ms, &c.key, c.bucket.saturating_sub(1)),
                )
            })
            .collect();
        let slack = self.config.ttl_slack.as_millis() as i64;
        let timeout = self.config.timeout * 2;
        let mut leases = vec![Lease::default(); requests.len()];
        let mut pending = {
            let (conn, _) = self.conn().await?;
            conn.groups(requests.len(), |i| keys[i].0.as_bytes().to_vec())
        };
        for attempt in 0..2 {
            let (conn, sha) = self.conn().await?;
            let calls = pending.iter().map(|group| {
                let cmd = invocation(sha, group, requests, &keys, slack);
                let mut pipe = redis::pipe();
                pipe.add_command(cmd);
                let mut conn = conn.clone();
                async move { conn.query(&pipe, timeout).await }
            });
            let outcomes = futures::future::join_all(calls).await;
            let mut retry = Vec::new();
            for (group, outcome) in pending.into_iter().zip(outcomes) {
                match outcome {
                    Ok(values) => read_reply(values, &group, &mut leases)?,
                    // One call per group: NOSCRIPT means it ran nothing.
                    Err(e) if is_noscript(&e) && attempt == 0 => retry.push(group),
                    Err(e) => {
                        self.conn = None;
                        return Err(classify(e));
                    }
                }
            }
            if retry.is_empty() {
                // Credits count like windows: under --redis-wait-replicas
                // they are on the replicas before a call is admitted.
                let (n, wait) = (self.config.wait_replicas, self.config.timeout);
                if let Some((conn, _)) = self.conn.as_mut() {
                    conn.wait_replicas(n, wait).await?;
                }
                return Ok(leases);
            }
            // A restarted or flushed server: load the script and ask again
            // for the groups that ran nothing.
            self.conn = None;
            pending = retry;
        }
        Err(StoreError::transient(
            "the lease script was not found twice",
        ))
    }
}

/// The lease script's call for one group of requests (one hash tag on a
/// Cluster): each hash named once in KEYS.
fn invocation(
    sha: &str,
    group: &[usize],
    requests: &[LeaseRequest],
    keys: &[(String, String)],
    slack_ms: i64,
) -> redis::Cmd {
    let mut names: Vec<&str> = Vec::new();
    let mut slots: HashMap<&str, usize> = HashMap::new();
    let mut counters = Vec::with_capacity(group.len());
    for &i in group {
        let r = &requests[i];
        let (cur, prev) = (keys[i].0.as_str(), keys[i].1.as_str());
        let cur = *slots.entry(cur).or_insert_with(|| {
            names.push(cur);
            names.len()
        });
        let prev = if r.approx || r.give_back > 0 {
            *slots.entry(prev).or_insert_with(|| {
                names.push(prev);
                names.len()
            })
        } else {
            0
        };
        counters.push((cur, prev, r));
    }
    let ttl = group
        .iter()
        .map(|&i| requests[i].ttl_ms)
        .max()
        .unwrap_or(0)
        .saturating_add(slack_ms);
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha).arg(names.len());
    for name in &names {
        cmd.arg(*name);
    }
    cmd.arg(ttl);
    for (cur, prev, r) in counters {
        cmd.arg(cur)
            .arg(prev)
            .arg(r.counter.key.as_str())
            .arg(r.want)
            .arg(r.give_back)
            .arg(r.limit);
    }
    cmd
}

/// One group's reply: three integers per counter.
fn read_reply(values: Vec<Value>, group: &[usize], leases: &mut [Lease]) -> Result<(), StoreError> {
    let bad = || StoreError::fatal("unexpected reply from the lease script");
    let Some(Value::Array(items)) = values.into_iter().next() else {
        return Err(bad());
    };
    if items.len() != group.len() * 3 {
        return Err(bad());
    }
    let int = |v: &Value| match v {
        Value::Int(n) => u64::try_from(*n).map_err(|_| bad()),
        _ => Err(bad()),
    };
    for (k, &i) in group.iter().enumerate() {
        leases[i] = Lease {
            granted: int(&items[3 * k])?,
            total: int(&items[3 * k + 1])?,
            prev: int(&items[3 * k + 2])?,
        };
    }
    Ok(())
}

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
//!
//! Two ways to the same counters, chosen per request:
//!
//! * a counter the instance holds nothing of (most often a callee called
//!   once: most callees) is answered by plain increments in one `MULTI`
//!   per hash slot ([`increment`]): `HINCRBY` by the credits wanted, and
//!   what passed the limit taken back at once, at a fraction of the
//!   script's Redis time per counter (`BENCHMARKS.md`);
//! * the others (credits held, or given back) by `lua/lease.lua`, which
//!   never lets a counter pass the limit.
//!
//! Both hand out at most the limit per counter: an increment past it is
//! answered with what was left under it. While it is taken back, other
//! leases see less room (fewer credits, never more), and counts read are
//! capped at the limit.

use std::collections::HashMap;

use redis::Value;

use crate::engine::aggregate::{Lease, LeaseRequest, Reserves};
use crate::error::StoreError;
use crate::store::redis::aggregate::slot::{Slots, SLOT_LUA};
use crate::store::redis::classify;
use crate::store::redis::conn::{is_noscript, Conn};
use crate::store::redis::RedisConfig;

/// The lease script.
pub const LEASE_LUA: &str = include_str!("../../../../lua/lease.lua");

/// Hash tags the counters are spread over.
pub const SHARDS: u64 = 16;

/// Leases credits from Redis; connects on first use (and after a failed
/// connect, on the next).
pub struct RedisLedger {
    config: RedisConfig,
    /// The connection, the lease script's SHA and the slot script's.
    conn: Option<(Conn, String, String)>,
    slots: Slots,
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
    /// A ledger on the Redis `config` names (not connected yet), with one
    /// reserve slot unless Redis has a count recorded.
    pub fn new(config: RedisConfig) -> Self {
        Self::with_slots(config, Slots::new(1))
    }

    /// A ledger taking its reserves through `slots`.
    pub fn with_slots(config: RedisConfig, slots: Slots) -> Self {
        RedisLedger {
            config,
            conn: None,
            slots,
        }
    }

    /// The Redis it leases from.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The reserves for a batch whose newest call is at `newest`; the
    /// slot's keys outlive the last call by `keep_ms` plus the TTL slack.
    pub async fn reserves(&mut self, newest: i64, keep_ms: i64) -> Result<Reserves, StoreError> {
        self.conn().await?;
        let Some((conn, _, sha)) = self.conn.as_mut() else {
            return Err(StoreError::transient("not connected to Redis"));
        };
        let keep_ms = keep_ms.saturating_add(self.config.ttl_slack.as_millis() as i64);
        let got = self
            .slots
            .reserves(conn, sha, &self.config, newest, keep_ms)
            .await;
        if got.is_err() {
            self.conn = None;
        }
        got
    }

    /// The hash holding the counters of a rule's bucket in one shard
    /// (the shard from the counter's key: callee, or '' for a global rule).
    pub fn hash_key(&self, rule: &str, window_ms: i64, key: &str, bucket: i64) -> String {
        let shard = (fnv1a(key) % SHARDS).to_string();
        let tail = format!(":{rule}:{window_ms}:{bucket}");
        self.config.tagged_key("g:", &shard, &tail)
    }

    async fn conn(&mut self) -> Result<&mut (Conn, String, String), StoreError> {
        if self.conn.is_none() {
            let mut conn = Conn::open(&self.config).await?;
            let sha = conn.load_script(LEASE_LUA).await?;
            let slot_sha = conn.load_script(SLOT_LUA).await?;
            self.conn = Some((conn, sha, slot_sha));
        }
        self.conn
            .as_mut()
            .ok_or_else(|| StoreError::transient("not connected to Redis"))
    }

    /// Answers `requests`: the counters this instance holds nothing of
    /// (cold, no give-back) by plain increments ([`increment`]), the others
    /// by the script, one call per hash slot, all at once.
    pub async fn lease(&mut self, requests: &[LeaseRequest]) -> Result<Vec<Lease>, StoreError> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        // Per request, its hash and the previous bucket's (empty when not
        // read: no sliding-approx estimate, nothing given back).
        let keys: Vec<(String, String)> = requests
            .iter()
            .map(|r| {
                let c = &r.counter;
                let prev = if r.approx || r.give_back > 0 {
                    self.hash_key(&c.rule, c.window_ms, &c.key, c.bucket.saturating_sub(1))
                } else {
                    String::new()
                };
                (self.hash_key(&c.rule, c.window_ms, &c.key, c.bucket), prev)
            })
            .collect();
        let (plain, scripted): (Vec<usize>, Vec<usize>) =
            (0..requests.len()).partition(|&i| is_plain(&requests[i]));
        let ttl = self.ttl_ms(requests);
        let timeout = self.config.timeout * 2;
        let mut leases = vec![Lease::default(); requests.len()];
        let mut conn = self.conn().await?.0.clone();
        let since = conn.batch_start(self.config.wait_replicas).await?;
        let increments = async {
            let calls = by_slot(&conn, &plain, &keys).into_iter().map(|group| {
                let conn = conn.clone();
                let keys = &keys;
                async move {
                    let got = increment(conn, &group, requests, keys, ttl, timeout).await;
                    got.map(|leases| (group, leases))
                }
            });
            futures::future::join_all(calls).await
        };
        let (scripts, increments) =
            futures::join!(self.run_script(&scripted, requests, &keys, ttl), increments);
        for outcome in increments {
            match outcome {
                Ok((group, got)) => {
                    for (i, lease) in group.into_iter().zip(got) {
                        leases[i] = lease;
                    }
                }
                Err(e) => {
                    self.conn = None;
                    return Err(e);
                }
            }
        }
        for (i, lease) in scripts? {
            leases[i] = lease;
        }
        // Credits count like windows: under --redis-wait-replicas they are
        // on the replicas before a call is admitted. (`WAIT` covers the
        // writes of its own connection: the increments' too, should the
        // script's retry have connected again; a connection replaced since
        // the start fails it, see Conn::wait_replicas.)
        let (n, wait) = (self.config.wait_replicas, self.config.timeout);
        if let Some((script_conn, _, _)) = self.conn.as_mut() {
            script_conn.wait_replicas(n, wait, since).await?;
        }
        if !plain.is_empty() {
            conn.wait_replicas(n, wait, since).await?;
        }
        Ok(leases)
    }

    /// The TTL of the hashes a call writes: the longest a request asks
    /// for, plus the slack.
    fn ttl_ms(&self, requests: &[LeaseRequest]) -> i64 {
        let slack = self.config.ttl_slack.as_millis() as i64;
        requests
            .iter()
            .map(|r| r.ttl_ms)
            .max()
            .unwrap_or(0)
            .saturating_add(slack)
    }

    /// Answers the requests `which` through the lease script: one call per
    /// hash slot, concurrently; once more for calls a restarted or flushed
    /// server answered `NOSCRIPT` (they ran nothing).
    async fn run_script(
        &mut self,
        which: &[usize],
        requests: &[LeaseRequest],
        keys: &[(String, String)],
        ttl: i64,
    ) -> Result<Vec<(usize, Lease)>, StoreError> {
        let mut out = Vec::with_capacity(which.len());
        if which.is_empty() {
            return Ok(out);
        }
        let timeout = self.config.timeout * 2;
        let mut pending = by_slot(&self.conn().await?.0, which, keys);
        for attempt in 0..2 {
            let (conn, sha, _) = self.conn().await?;
            let calls = pending.iter().map(|group| {
                let cmd = invocation(sha, group, requests, keys, ttl);
                let mut pipe = redis::pipe();
                pipe.add_command(cmd);
                let mut conn = conn.clone();
                async move { conn.query(&pipe, timeout).await }
            });
            let outcomes = futures::future::join_all(calls).await;
            let mut retry = Vec::new();
            for (group, outcome) in pending.into_iter().zip(outcomes) {
                match outcome {
                    Ok(values) => read_reply(values, &group, requests, &mut out)?,
                    // One call per group: NOSCRIPT means it ran nothing.
                    Err(e) if is_noscript(&e) && attempt == 0 => retry.push(group),
                    Err(e) => {
                        self.conn = None;
                        return Err(classify(e));
                    }
                }
            }
            if retry.is_empty() {
                return Ok(out);
            }
            self.conn = None;
            pending = retry;
        }
        Err(StoreError::transient(
            "the lease script was not found twice",
        ))
    }
}

/// The requests `which`, grouped by the hash slot of their counter's hash
/// (one group on a standalone server).
fn by_slot(conn: &Conn, which: &[usize], keys: &[(String, String)]) -> Vec<Vec<usize>> {
    conn.groups(which.len(), |k| keys[which[k]].0.as_bytes().to_vec())
        .into_iter()
        .map(|g| g.into_iter().map(|k| which[k]).collect())
        .collect()
}

/// A request Redis answers by a plain increment: the instance holds
/// nothing of the counter (so it is most likely far from its limit) and
/// gives nothing back.
pub fn is_plain(r: &LeaseRequest) -> bool {
    r.cold && r.give_back == 0
}

/// A field no counter has (no callee is this long, or has these
/// characters). Set in a hash the plain increments write [`MARK_FROM`]
/// counters of at once (a bucket with many callees: it will grow), it
/// makes Redis keep the hash as a hash table from then on (a field longer
/// than `hash-max-listpack-value`, 64 bytes by default): an increment of a
/// field then costs about a sixth of one in a packed hash of up to 128
/// fields, which Redis searches field by field. Sparse buckets (a few
/// callees per hash: a quiet hour, or a replay of a thin log) stay packed,
/// and are spared the command.
pub const TABLE_MARKER: &str =
    "~callguard: a field longer than hash-max-listpack-value keeps this hash a hash table";

/// Counters of one hash in one call from which it is given [`TABLE_MARKER`].
pub const MARK_FROM: usize = 16;

/// Answers `group` (one hash slot) by plain increments, in one `MULTI`:
/// `HINCRBY` of each counter by the credits wanted (and `HGET` of the
/// previous bucket's for sliding-approx), the marker and the TTL on each
/// hash. An increment that passes the limit is answered with what was
/// left under it, and the rest taken back at once with a second call.
/// Meanwhile another instance's lease sees the counter over its limit
/// and is granted less (never more): no call is admitted past the limit.
async fn increment(
    mut conn: Conn,
    group: &[usize],
    requests: &[LeaseRequest],
    keys: &[(String, String)],
    ttl_ms: i64,
    timeout: std::time::Duration,
) -> Result<Vec<Lease>, StoreError> {
    // The hashes in order of first use, with their counters in this call.
    let mut hashes: Vec<(&str, usize)> = Vec::new();
    let mut at: HashMap<&str, usize> = HashMap::new();
    for &i in group {
        let h = keys[i].0.as_str();
        match at.get(h) {
            Some(&k) => hashes[k].1 += 1,
            None => {
                at.insert(h, hashes.len());
                hashes.push((h, 1));
            }
        }
    }
    let mut pipe = redis::pipe();
    pipe.atomic();
    for &(h, counters) in &hashes {
        if counters >= MARK_FROM {
            pipe.cmd("HSETNX").arg(h).arg(TABLE_MARKER).arg(1).ignore();
        }
    }
    for &i in group {
        let r = &requests[i];
        let field = r.counter.key.as_str();
        pipe.cmd("HINCRBY").arg(&keys[i].0).arg(field).arg(r.want);
        if r.approx {
            pipe.cmd("HGET").arg(&keys[i].1).arg(field);
        }
    }
    for &(h, _) in &hashes {
        pipe.cmd("PEXPIRE").arg(h).arg(ttl_ms).ignore();
    }
    let values = conn.query(&pipe, timeout).await.map_err(classify)?;
    let (leases, over) = read_increments(&values, group, requests)?;
    if !over.is_empty() {
        let mut back = redis::pipe();
        for (i, excess) in over {
            let field = requests[i].counter.key.as_str();
            back.cmd("HINCRBY")
                .arg(&keys[i].0)
                .arg(field)
                .arg(-excess)
                .ignore();
        }
        conn.query(&back, timeout).await.map_err(classify)?;
    }
    Ok(leases)
}

/// Credits to take back from a counter an increment passed over its
/// limit: the request's index, and how many.
type TakeBack = (usize, i64);

/// The leases from the increments' replies, and per counter passed over
/// its limit, the credits to take back.
fn read_increments(
    values: &[Value],
    group: &[usize],
    requests: &[LeaseRequest],
) -> Result<(Vec<Lease>, Vec<TakeBack>), StoreError> {
    let bad = || StoreError::fatal("unexpected reply to the lease increments");
    let mut it = values.iter();
    let mut leases = Vec::with_capacity(group.len());
    let mut over = Vec::new();
    for &i in group {
        let r = &requests[i];
        let after = match it.next() {
            Some(Value::Int(n)) => *n,
            _ => return Err(bad()),
        };
        let prev = if r.approx {
            match it.next() {
                Some(Value::Nil) => 0,
                Some(v) => redis::from_redis_value::<i64>(v.clone())
                    .map_err(|_| bad())?
                    .max(0) as u64,
                None => return Err(bad()),
            }
        } else {
            0
        };
        let want = i64::try_from(r.want).unwrap_or(i64::MAX);
        let before = after.saturating_sub(want);
        let room = i64::try_from(r.limit)
            .unwrap_or(i64::MAX)
            .saturating_sub(before)
            .max(0);
        let granted = want.min(room);
        if granted < want {
            over.push((i, want - granted));
        }
        // (Other instances' increments past the limit are not credits:
        // the count is never more than the limit.)
        let limit = i64::try_from(r.limit).unwrap_or(i64::MAX);
        leases.push(Lease {
            granted: granted as u64,
            total: before.min(limit).saturating_add(granted).max(0) as u64,
            prev: prev.min(r.limit),
        });
    }
    Ok((leases, over))
}

/// The lease script's call for one group of requests (one hash tag on a
/// Cluster): each hash named once in KEYS.
fn invocation(
    sha: &str,
    group: &[usize],
    requests: &[LeaseRequest],
    keys: &[(String, String)],
    ttl: i64,
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
fn read_reply(
    values: Vec<Value>,
    group: &[usize],
    requests: &[LeaseRequest],
    leases: &mut Vec<(usize, Lease)>,
) -> Result<(), StoreError> {
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
        // (A plain increment of another instance can pass the limit for
        // a moment: not credits.)
        let limit = requests[i].limit;
        let lease = Lease {
            granted: int(&items[3 * k])?,
            total: int(&items[3 * k + 1])?.min(limit),
            prev: int(&items[3 * k + 2])?.min(limit),
        };
        leases.push((i, lease));
    }
    Ok(())
}

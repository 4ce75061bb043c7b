//! Pools in Redis (`lua/pool.lua`; [`crate::engine::pool::Pools`] is its
//! reference): one script call per batch, after the caller's rules, so
//! that every instance on the same key prefix shares each account's (or
//! callee's, or everyone's) open calls, exactly, in processing order.
//!
//! Every pool is under one hash tag (`<prefix>P{pools}`): a batch's pools
//! and the calls they hold change in one atomic call whatever they are.
//! On a Cluster that is one slot's node doing the pools' work for every
//! instance (a few Redis calls per attempt a pool sees, and per end).

use redis::Value;

use crate::engine::event::{CallEvent, EventKind};
use crate::engine::model::REASON_MODEL;
use crate::engine::pool::{call_key, pools_of, settle, Found, Opening, MAX_PENDING_ENDS};
use crate::engine::record::{Decision, Verdict};
use crate::engine::rules::{RuleSet, SumOf, WindowKind};
use crate::error::StoreError;
use crate::store::redis::classify;
use crate::store::redis::conn::{is_noscript, Conn};
use crate::store::redis::RedisConfig;

/// The pool script.
pub const POOL_LUA: &str = concat!(
    include_str!("../../../../lua/sums.lua"),
    include_str!("../../../../lua/pool.lua")
);

/// The pools in Redis; connects on first use (and after a failure, on the
/// next).
pub struct RedisPools {
    config: RedisConfig,
    conn: Option<(Conn, String)>,
}

impl std::fmt::Debug for RedisPools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisPools")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// One attempt of the batch sent to the script: its index.
struct Sent {
    at: usize,
}

impl RedisPools {
    /// The pools on the Redis `config` names (not connected yet).
    pub fn new(config: RedisConfig) -> Self {
        RedisPools { config, conn: None }
    }

    async fn conn(&mut self) -> Result<&mut (Conn, String), StoreError> {
        if self.conn.is_none() {
            let mut conn = Conn::open(&self.config).await?;
            let sha = conn.load_script(POOL_LUA).await?;
            self.conn = Some((conn, sha));
        }
        self.conn
            .as_mut()
            .ok_or_else(|| StoreError::transient("not connected to Redis"))
    }

    /// Sets the block key of each caller the model rejected in this batch
    /// (`verdicts` index for index with `events`), to `model` for the
    /// reject's Retry-After, when the set's `[model]` asks for it (`block =
    /// true`) and this store writes block keys (`--block-keys`): as a
    /// rule's reject sets it. Nothing to write is no Redis call.
    pub async fn block_model_rejects(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        verdicts: &[Option<Verdict>],
    ) -> Result<(), StoreError> {
        if !self.config.block_keys || !rules.model().is_some_and(|m| m.block) {
            return Ok(());
        }
        let blocks: Vec<(String, i64)> = events
            .iter()
            .zip(verdicts)
            .filter_map(|(e, v)| {
                let r = &v.as_ref()?.record;
                let by_model = r.decision == Decision::Reject && r.reason == REASON_MODEL;
                let ttl = r.retry_after_ms.filter(|&ms| ms > 0)?;
                by_model.then(|| (self.config.block_key(&e.caller), ttl))
            })
            .collect();
        if blocks.is_empty() {
            return Ok(());
        }
        let timeout = self.config.timeout;
        let conn = &mut self.conn().await?.0;
        for group in conn.groups(blocks.len(), |i| blocks[i].0.clone()) {
            let mut pipe = redis::pipe();
            for i in group {
                let (key, ttl) = &blocks[i];
                pipe.cmd("SET")
                    .arg(key)
                    .arg(REASON_MODEL)
                    .arg("PX")
                    .arg(*ttl)
                    .ignore();
            }
            if let Err(e) = conn.query(&pipe, timeout).await {
                self.conn = None;
                return Err(classify(e));
            }
        }
        Ok(())
    }

    /// The keys' common head, `<prefix>P{pools}`.
    fn base(&self) -> String {
        self.config.tagged_key("P", "pools", "")
    }

    /// Settles `verdicts` (index for index with `events`; `None` left
    /// undecided) by the pools, as [`crate::engine::pool::Pools::apply`]
    /// does in process; how many events the pools took.
    pub async fn apply(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        verdicts: &mut [Option<Verdict>],
    ) -> Result<u64, StoreError> {
        if !rules.has_pools() {
            return Ok(0);
        }
        let base = self.base();
        let ttl = ttl_ms(rules, &self.config);
        let mut sent = Vec::new();
        let mut ops = 0;
        let mut args: Vec<String> = vec![
            base.clone(),
            rules.grace_ms.to_string(),
            rules.dedup_ms().to_string(),
            MAX_PENDING_ENDS.to_string(),
            ttl.to_string(),
        ];
        for (at, (ev, v)) in events.iter().zip(verdicts.iter()).enumerate() {
            let Some(v) = v.as_ref().filter(|v| !v.record.degraded) else {
                continue;
            };
            let key = call_key(ev).to_string();
            if ev.kind == EventKind::End {
                let talk = ev.talk_ms.unwrap_or(0).to_string();
                args.extend(["E".into(), key, ev.ts_ms.to_string(), talk]);
                ops += 1;
                continue;
            }
            let pools = pools_of(rules, ev);
            if pools.is_empty() {
                continue;
            }
            let opening = match Opening::of(rules, ev, v) {
                Opening::Never => 0,
                Opening::Always => 1,
                Opening::Unless => 2,
            };
            args.extend([
                "A".into(),
                key,
                ev.ts_ms.to_string(),
                opening.to_string(),
                pools.len().to_string(),
            ]);
            for (i, pool) in &pools {
                args.extend(pool_args(rules, *i, pool, ev));
            }
            sent.push(Sent { at });
            ops += 1;
        }
        if ops == 0 {
            return Ok(0);
        }
        let meta = format!("{base}:m");
        let timeout = self.config.timeout * 2;
        let (n, wait) = (self.config.wait_replicas, self.config.timeout);
        let since = self.conn().await?.0.batch_start(n).await?;
        let mut reply = None;
        for attempt in 0..2 {
            let (conn, sha) = self.conn().await?;
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(sha.as_str()).arg(1).arg(&meta).arg(&args);
            let mut pipe = redis::pipe();
            pipe.add_command(cmd);
            match conn.query(&pipe, timeout).await {
                Ok(values) => {
                    reply = Some(values);
                    break;
                }
                // NOSCRIPT: it ran nothing; load it again.
                Err(e) if is_noscript(&e) && attempt == 0 => self.conn = None,
                Err(e) => {
                    self.conn = None;
                    return Err(classify(e));
                }
            }
        }
        let Some(values) = reply else {
            return Err(StoreError::transient("the pool script was not found twice"));
        };
        // (Under --redis-wait-replicas the pools' writes are on the
        // replicas before any call is answered, as the windows' are.)
        if let Some((conn, _)) = self.conn.as_mut() {
            conn.wait_replicas(n, wait, since).await?;
        }
        let answers = answers(values)?;
        if answers.len() != sent.len() {
            return Err(StoreError::fatal(format!(
                "the pool script answered {} attempts of {}",
                answers.len(),
                sent.len()
            )));
        }
        for (s, answer) in sent.iter().zip(answers) {
            let ev = &events[s.at];
            let found = parse_found(rules, ev.ts_ms, &answer)?;
            if let Some(v) = verdicts[s.at].as_mut() {
                settle(rules, ev, v, &found);
            }
        }
        Ok(ops)
    }
}

/// What the script is told of pool `pool` (rule `i`) for attempt `ev`:
/// rule, pool, limit, shadow, max_duration, sum (0 none, 1 talk, 2 cost),
/// window kind (F, S, A), window, and the callee's price (per minute,
/// increment; empty when unpriced).
fn pool_args(rules: &RuleSet, i: usize, pool: &str, ev: &CallEvent) -> [String; 10] {
    let r = &rules.rules[i];
    let (max, sum, price) = match &r.sum {
        None => (r.window_ms, "0", None),
        Some(s) => {
            let cost = matches!(s.of, SumOf::Cost(_));
            let price = s.price(ev.callee_for_filters());
            (s.max_duration_ms, if cost { "2" } else { "1" }, price)
        }
    };
    let kind = match r.kind {
        WindowKind::Fixed => "F",
        WindowKind::SlidingApprox => "A",
        _ => "S",
    };
    [
        i.to_string(),
        pool.to_string(),
        r.limit.to_string(),
        u8::from(r.shadow).to_string(),
        max.to_string(),
        sum.to_string(),
        kind.to_string(),
        r.window_ms.to_string(),
        price.map_or(String::new(), |p| p.per_minute.to_string()),
        price.map_or(String::new(), |p| p.increment_s.to_string()),
    ]
}

/// How long the pools' keys outlive their last write: the longest
/// `max_duration` of a pool, the idempotency horizon and the grace, plus
/// the TTL slack (event time runs with the clock online; offline it runs
/// faster, so keys outlive what they hold).
fn ttl_ms(rules: &RuleSet, config: &RedisConfig) -> i64 {
    let longest = rules
        .rules
        .iter()
        .filter(|r| r.is_pooled())
        .map(|r| {
            // (A sum pool keeps what ended calls added two windows on.)
            let sum = r.sum.as_ref().map_or(0, |s| s.max_duration_ms);
            r.window_ms.saturating_mul(2).max(sum)
        })
        .max()
        .unwrap_or(0);
    longest
        .max(rules.dedup_ms())
        .saturating_add(rules.grace_ms)
        .saturating_add(config.ttl_slack.as_millis() as i64)
}

/// The script's answers, one string per attempt sent.
fn answers(values: Vec<Value>) -> Result<Vec<String>, StoreError> {
    let bad = |what: String| StoreError::fatal(format!("the pool script answered {what}"));
    let Some(Value::Array(items)) = values.into_iter().next() else {
        return Err(bad("no list".into()));
    };
    items
        .into_iter()
        .map(|v| match v {
            Value::BulkString(b) => String::from_utf8(b).map_err(|e| bad(e.to_string())),
            Value::SimpleString(s) => Ok(s),
            other => Err(bad(format!("{other:?}"))),
        })
        .collect()
}

/// `rule:count:until;…` read back, each `until` through its rule's time
/// profile (as the in-process pools do).
fn parse_found(rules: &RuleSet, t: i64, answer: &str) -> Result<Vec<Found>, StoreError> {
    let bad = || StoreError::fatal(format!("the pool script answered `{answer}`"));
    answer
        .split(';')
        .map(|part| {
            let mut it = part.split(':');
            let (Some(rule), Some(count), Some(until)) = (it.next(), it.next(), it.next()) else {
                return Err(bad());
            };
            let rule: usize = rule.parse().map_err(|_| bad())?;
            let r = rules.rules.get(rule).ok_or_else(bad)?;
            let count = count.parse().map_err(|_| bad())?;
            let until = match until {
                "" => None,
                u => Some(u.parse::<i64>().map_err(|_| bad())?),
            };
            Ok(Found {
                rule,
                count,
                until: until.and_then(|u| r.filter.last_seen_within(t, u)),
            })
        })
        .collect()
}

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

use redis::{RedisError, Value};

use crate::engine::event::{CallEvent, EventKind};
use crate::engine::record::Verdict;
use crate::engine::rules::{CountPolicy, Listed, RuleKey, RuleSet};
use crate::error::StoreError;
use crate::store::redis::classify;
use crate::store::redis::conn::{is_noscript, Conn, ModeClaim};
use crate::store::redis::RedisConfig;
use crate::store::{StoreStats, WindowStore};

/// The window script (see its header for KEYS, ARGV and the reply).
pub const WINDOW_LUA: &str = concat!(
    // (The shebang must be the first line: the sum rules' arithmetic,
    // shared with lua/pool.lua, follows it.)
    "#!lua\n",
    include_str!("../../../lua/sums.lua"),
    include_str!("../../../lua/window.lua")
);

/// This store's name for its way of keeping state (see `Conn::claim_mode`).
pub const MODE: &str = "script";

/// Most events decided by one script call. A call runs atomically, so it
/// holds Redis for its whole batch (about 1-2 ms at this size); larger
/// batches are split into pipelined calls.
pub const EVENTS_PER_CALL: usize = 32;

/// Window state in Redis (standalone or Cluster).
pub struct RedisStore {
    conn: Conn,
    sha: String,
    config: RedisConfig,
    /// The prefix's mode claim (see [`crate::store::redis::CLAIM_EVERY`]).
    claim: ModeClaim,
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
            claim: ModeClaim::now(),
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
            // Rules keyed by callee or global were decided before: kind 5.
            cmd.arg(if rule.key.is_aggregate() {
                5
            } else {
                rule.kind.code()
            })
            .arg(rule.window_ms)
            .arg(rule.limit)
            .arg(&rule.name)
            .arg({
                // Keyed by caller and callee: a pair's state (4), or for a
                // concurrent rule its calls held per callee (8).
                let by_callee = rule.key == RuleKey::CallerCallee;
                let concurrent = rule.kind == crate::engine::rules::WindowKind::Concurrent;
                // A sum rule (16), a cost sum (32): the caller's (a
                // pool's sum is lua/pool.lua's).
                let caller_sum = rule.sum.is_some() && !rule.is_pooled();
                let cost = matches!(
                    rule.sum,
                    Some(crate::engine::rules::Sum {
                        of: crate::engine::rules::SumOf::Cost(_),
                        ..
                    })
                );
                u8::from(rule.shadow)
                    + 2 * u8::from(rule.own_log())
                    + 4 * u8::from(by_callee && !concurrent)
                    + 8 * u8::from(by_callee && concurrent)
                    + 16 * u8::from(caller_sum)
                    + 32 * u8::from(cost && caller_sum)
            })
            .arg(rule.warn.map_or_else(String::new, |w| w.to_string()))
            .arg(
                match (rule.sum.as_ref().filter(|_| !rule.is_pooled()), rule.rate) {
                    (Some(sum), _) => sum.max_duration_ms.to_string(),
                    (None, Some(r)) => format!("{}/{}", r.calls, r.per_ms),
                    (None, None) => String::new(),
                },
            );
        }
        let profiled = rules.rules.iter().any(|r| r.filter.has_time());
        let priced = rules.rules.iter().any(|r| {
            !r.is_pooled()
                && matches!(
                    r.sum,
                    Some(crate::engine::rules::Sum {
                        of: crate::engine::rules::SumOf::Cost(_),
                        ..
                    })
                )
        });
        for ev in events {
            // A call's end: `E` in the list code's place (see the script).
            let listed = match rules.listed(ev.number_for_lists()) {
                _ if ev.kind == EventKind::End => "E",
                Listed::No => "0",
                Listed::Allow => "1",
                Listed::Deny => "2",
                Listed::BadCallerAllow => "3",
                Listed::BadCallerReject => "4",
            };
            cmd.arg(ev.ts_ms)
                .arg(ev.call_id.as_str())
                .arg(listed)
                .arg(ev.callee.as_deref().unwrap_or(""))
                .arg(mask_with_profiles(rules, ev, profiled))
                .arg(match ev.kind {
                    // An end's talk time in the last value.
                    EventKind::End => ev.talk_ms.unwrap_or(0).max(0).to_string(),
                    EventKind::Attempt if priced => {
                        format!("{}#{}", outside(rules, ev), prices(rules, ev))
                    }
                    EventKind::Attempt => outside(rules, ev),
                });
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
        // Without a concurrent or sum rule an end changes nothing:
        // answered here, never sent to Redis.
        match crate::store::attempts_of(events).filter(|_| !rules.caller_uses_ends()) {
            Some(attempts) => {
                let decided = self.apply_attempts(rules, &attempts).await?;
                Ok(crate::store::with_ends(rules, events, decided, |v| v))
            }
            None => self.apply_attempts(rules, events).await,
        }
    }

    /// [`RedisStore::apply_batch`] of `events` (ends only with a
    /// concurrent rule).
    async fn apply_attempts(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let prefix = &self.config.key_prefix;
        self.conn
            .keep_mode_every(prefix, MODE, &mut self.claim)
            .await?;
        let since = self.conn.batch_start(self.config.wait_replicas).await?;
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
        let verdicts = replies
            .into_iter()
            .zip(events)
            .map(|(v, ev)| match v {
                Some(v) => parse_reply(v, ev, rules),
                None => Err(StoreError::transient(format!(
                    "no reply for call {}",
                    ev.call_id
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (n, timeout) = (self.config.wait_replicas, self.config.timeout);
        self.conn.wait_replicas(n, timeout, since).await?;
        Ok(verdicts)
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

    fn stats(&self) -> StoreStats {
        StoreStats {
            data_losses: self.claim.lost,
            ..StoreStats::default()
        }
    }

    async fn probe(&mut self) -> Result<(), StoreError> {
        let prefix = &self.config.key_prefix;
        self.conn.reclaim_mode(prefix, MODE, &mut self.claim).await
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

fn parse_reply(v: Value, ev: &CallEvent, rules: &RuleSet) -> Result<Verdict, StoreError> {
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
    if ev.kind == EventKind::End {
        return (encoded == "E")
            .then(|| Verdict::of_end(ev, rules))
            .ok_or_else(|| bad(&encoded));
    }
    Verdict::from_reply(&encoded, ev, dup).ok_or_else(|| bad(&encoded))
}

/// The window script's `outside` argument: per rule keyed by callee or
/// global, in order, `<count>:<until>` (see `lua/window.lua`).
/// The event's mask ([`RuleSet::mask`]), and when a rule has a time
/// profile, `|` and per rule (`;` between them) the ranges `a-b,...` of
/// `[t, t + grace + retention]` its profile holds at
/// ([`Filter::on_ranges`](crate::engine::filter::Filter::on_ranges); empty
/// for a rule without one): the window script ends a rule's part of the
/// retry-after at the last of them, as the engine does. (A call that is
/// not late has its caller's latest time within the grace of its own, so
/// no rule's part reaches past that span.)
fn mask_with_profiles(rules: &RuleSet, ev: &CallEvent, profiled: bool) -> String {
    use std::fmt::Write;
    let mut out = rules.mask(ev).unwrap_or_default();
    if !profiled {
        return out;
    }
    let end = ev
        .ts_ms
        .saturating_add(rules.grace_ms)
        .saturating_add(rules.retention_ms());
    out.push('|');
    for (i, rule) in rules.rules.iter().enumerate() {
        if i > 0 {
            out.push(';');
        }
        if rule.filter.has_time() {
            for (k, (a, b)) in rule.filter.on_ranges(ev.ts_ms, end).into_iter().enumerate() {
                let sep = if k > 0 { "," } else { "" };
                let _ = write!(out, "{sep}{a}-{b}");
            }
        }
    }
    out
}

/// The price of a call to `ev`'s callee per rule, for the script: per
/// minute (micro-units) and increment of each cost sum rule, `per/inc`, ''
/// for others or an unpriced callee, `;` between rules.
fn prices(rules: &RuleSet, ev: &CallEvent) -> String {
    rules
        .rules
        .iter()
        .map(|r| {
            // (A pool's sum is the pools' own: lua/pool.lua.)
            r.sum
                .as_ref()
                .filter(|_| !r.is_pooled())
                .and_then(|s| s.price(ev.callee_for_filters()))
                .map_or_else(String::new, |p| {
                    format!("{}/{}", p.per_minute, p.increment_s)
                })
        })
        .collect::<Vec<_>>()
        .join(";")
}

fn outside(rules: &RuleSet, ev: &CallEvent) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    if ev.aggregate.is_none() {
        return out;
    }
    for (i, rule) in rules.rules.iter().enumerate() {
        if !rule.key.is_aggregate() {
            continue;
        }
        let a = ev.aggregated(i);
        if !out.is_empty() {
            out.push(',');
        }
        let _ = write!(out, "{}:", a.count);
        if let Some(u) = a.until {
            let _ = write!(out, "{u}");
        }
    }
    out
}

//! The cached Redis store: window state decided in process, kept in Redis
//! with a version check.
//!
//! The window script ([`super::redis::RedisStore`]) runs the algorithm in
//! Redis: every event costs Redis several commands plus the script's own
//! work. Here callguard keeps each caller's [`CallerState`](crate::engine::window::CallerState) in memory (a
//! consumer owns its partitions' callers, so after the first call the cache
//! is nearly always current), decides a batch with the reference engine,
//! and writes each touched caller back in one atomic `EVALSHA` of
//! `lua/commit.lua` per group of callers: the caller's state string (its
//! version, packed state and, while few, its records), a busy caller's new
//! and trimmed records, the block key. A new caller whose first write
//! needs nothing else is one plain `SET ... NX PX ... GET`, no script.
//!
//! Every write is conditional on the caller's version being the one the
//! cache read (optimistic concurrency). Another writer (a second
//! instance after a rebalance, `serve` beside `consume`, a cache entry
//! evicted and later recreated) changes the version: that caller is not
//! written, the script returns its current state, and callguard decides
//! that caller's calls again on it and commits again. Callers never share
//! state, so the others' writes stand. A caller not in the cache is first
//! assumed new (no key): right for most first sights, and when wrong it
//! costs one more round trip, not a read before every write.
//!
//! Records are the same strings the window script keeps and are read back
//! into the cache when a caller is loaded, so a redelivered call id gets the
//! same record back after a restart, a rebalance or an eviction.
//!
//! This file holds the store and its rounds; `commit.rs` its commits and
//! read-backs (the I/O); `cache.rs` the cached callers and their TTL plan; `plan.rs` what one
//! caller's commit writes (no I/O); `wire.rs` the formats `lua/commit.lua`
//! mirrors (the state string, the call's keys and arguments, the replies);
//! `protocol_tests.rs` runs the encoder through the script on a real
//! server for every flag combination.

use futures::StreamExt;

use std::sync::Arc;

use ahead::{DecidedAhead, InFlight};
use cache::{Cache, Records, TtlPlan};
use commit::Committer;
use plan::{Pending, Plan};
use wire::load;
use wire::{Committed, Found, Write};

use crate::engine::event::CallEvent;
use crate::engine::record::Verdict;
use crate::engine::rules::RuleSet;
use crate::error::StoreError;
use crate::store::redis::conn::ModeClaim;
use crate::store::redis::{classify, Conn, RedisConfig};
use crate::store::{CacheStats, StoreStats, Upcoming, WindowStore, CONTENDED};

mod ahead;
mod cache;
mod commit;
mod plan;
mod wire;

#[cfg(test)]
mod protocol_tests;

/// The commit script (see its header for KEYS, ARGV and the reply).
pub const COMMIT_LUA: &str = include_str!("../../../lua/commit.lua");

/// This store's name for its way of keeping state (`--redis-mode cached`)
/// and the version of its key layout, as recorded in `<prefix>mode`.
pub const MODE: &str = "cached:2";

/// Most callers written by one script call (it holds Redis while it runs).
const CALLERS_PER_CALL: usize = 64;

/// The callers per group a round decides and sends at a time, for a round
/// of `callers`. Redis commits a group while the next is decided, so the
/// round ends one group's commit after its last decision: a small batch
/// (moderate load, where the wait is the latency) goes in groups of 16,
/// so that last commit is short; a large one (a backlog, where calls per
/// caller are the cost) in groups of [`CALLERS_PER_CALL`].
fn group_size(callers: usize) -> usize {
    if callers <= 2 * CALLERS_PER_CALL {
        CALLERS_PER_CALL / 4
    } else {
        CALLERS_PER_CALL
    }
}

/// Rounds of decide-and-commit before a batch gives up on a caller that
/// keeps changing under it (another writer deciding the same caller).
/// From its second round a refused caller is read back in part, in one
/// round trip (see [`read_some`]), and loses the next commit to the other
/// writer less than half the time (two instances checking one flooding
/// caller back to back): 32 rounds leave a batch undecided about once in
/// 10^12, where 8 left one in a thousand. Each round costs about two
/// round trips to Redis.
pub const DEFAULT_MAX_ROUNDS: usize = 32;

/// A caller's sliding log moves out of its packed state into a string of
/// fixed-width times (`<prefix>{<caller>}:l`) once it holds more times than
/// this, so a flooding caller's writes append its new times instead of
/// rewriting all of them; it moves back in below a quarter of it.
pub const DEFAULT_LOG_APART_ABOVE: usize = 128;

/// A caller's records move out of its state string into a hash
/// (`<prefix>{<caller>}:r`) once it holds more than this many, so a busy
/// caller's writes add its new records instead of rewriting all of them;
/// they move back in at a quarter of it.
pub const DEFAULT_RECORDS_APART_ABOVE: usize = 32;

/// Records read per call when loading a busy caller's records hash
/// (`HSCAN ... COUNT`): a flooding caller's records are read a bounded
/// amount at a time (about a millisecond of Redis's time each), while a
/// busy caller's usually fit in the first read.
pub const SCAN_COUNT: usize = 5_000;

/// Most records deleted from a caller's records hash per write; the rest
/// wait for its next writes.
pub const TRIM_COUNT: usize = 1_000;

/// Default number of callers kept in memory.
pub const DEFAULT_CACHED_CALLERS: usize = 1_000_000;

/// Default bound of the cached callers' memory (about; see
/// [`CachedStore::with_max_bytes`]): 2 GiB.
pub const DEFAULT_CACHED_BYTES: usize = 2 << 30;

/// How many callers, and about how many bytes of them, a cached store
/// keeps in process.
#[derive(Debug, Clone, Copy)]
pub struct CacheLimit {
    /// Callers.
    pub callers: usize,
    /// Bytes (see [`CachedStore::with_max_bytes`]).
    pub bytes: usize,
}

impl CacheLimit {
    /// At most `callers` callers, and the default bound of memory.
    pub fn callers(callers: usize) -> Self {
        CacheLimit {
            callers,
            bytes: DEFAULT_CACHED_BYTES,
        }
    }
}

/// Window state decided in process and kept in Redis under a version check.
pub struct CachedStore {
    conn: Conn,
    sha: Arc<str>,
    config: Arc<RedisConfig>,
    cache: Cache,
    /// The callers of the last batch Redis failed, as decided in it (see
    /// [`WindowStore::cached_state`]).
    seeds: foldhash::HashMap<compact_str::CompactString, crate::engine::window::CallerState>,
    /// Callers decided ahead in a round Redis failed, as decided: for a
    /// local fallback, before `seeds` (they are not cached).
    ahead_seeds: foldhash::HashMap<compact_str::CompactString, crate::engine::window::CallerState>,
    /// The batch decided ahead whose commits were sent, until it lands
    /// (at the next batch: see `ahead.rs`).
    in_flight: Option<InFlight>,
    /// The batch decided ahead and landed, until it is asked for.
    ahead: Option<DecidedAhead>,
    /// Calls whose verdicts were decided ahead and then asked for.
    calls_ahead: u64,
    /// Newest event time seen: callers idle past the idempotency horizon
    /// leave the cache first.
    watermark: i64,
    /// Commits refused because another writer had changed the caller,
    /// and writes refused because a caller believed new existed (a first
    /// sight after a restart, a rebalance or an eviction): misses, not
    /// conflicts.
    counts: Counts,
    /// The prefix's mode claim (see [`crate::store::redis::CLAIM_EVERY`]).
    claim: ModeClaim,
    /// See [`DEFAULT_MAX_ROUNDS`].
    max_rounds: usize,
    /// See [`CachedStore::with_partial_reads_after`].
    partial_reads_after: u32,
    /// How commits are planned (record keeping, block keys, where
    /// records and logs go).
    plan: Plan,
}

impl std::fmt::Debug for CachedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedStore")
            .field("config", &self.config)
            .field("cached_callers", &self.cache.len())
            .field("counts", &self.counts)
            .finish_non_exhaustive()
    }
}

impl CachedStore {
    /// Connects and loads the commit script; keeps at most `max_callers`
    /// callers in memory (more only cost re-reads, never a result).
    pub async fn connect(config: RedisConfig, max_callers: usize) -> Result<Self, StoreError> {
        let mut conn = Conn::open(&config).await?;
        conn.claim_mode(&config.key_prefix, MODE).await?;
        let sha = conn.load_script(COMMIT_LUA).await?;
        let plan = Plan {
            idempotency: config.idempotency,
            block_keys: config.block_keys,
            log_apart_above: DEFAULT_LOG_APART_ABOVE,
            records_apart_above: DEFAULT_RECORDS_APART_ABOVE,
        };
        Ok(CachedStore {
            conn,
            sha: sha.into(),
            config: Arc::new(config),
            cache: Cache::new(max_callers, DEFAULT_CACHED_BYTES),
            seeds: foldhash::HashMap::default(),
            ahead_seeds: foldhash::HashMap::default(),
            in_flight: None,
            ahead: None,
            calls_ahead: 0,
            watermark: i64::MIN,
            counts: Counts::default(),
            claim: ModeClaim::now(),
            max_rounds: DEFAULT_MAX_ROUNDS,
            partial_reads_after: 1,
            plan,
        })
    }

    /// Bounds the cached callers' memory at about `n` bytes (default
    /// [`DEFAULT_CACHED_BYTES`]), besides their number: a flooding caller
    /// holds its records in process too, and one caller can hold more than
    /// a million quiet ones. Counted from the callers' tables and records'
    /// text; allocator slack comes on top.
    pub fn with_max_bytes(mut self, n: usize) -> Self {
        self.cache.set_max_bytes(n);
        self
    }

    /// Gives up on a caller refused in `n` rounds in a row (default
    /// [`DEFAULT_MAX_ROUNDS`]; tests use 1 to leave a caller undecided at
    /// its first conflict).
    pub fn with_max_rounds(mut self, n: usize) -> Self {
        self.max_rounds = n.max(1);
        self
    }

    /// Reads back only the batch's records of a caller refused `n` times
    /// in a batch (default 1: from its second refusal; see [`read_some`]);
    /// tests use 0 to take that path at the first refusal.
    pub fn with_partial_reads_after(mut self, n: u32) -> Self {
        self.partial_reads_after = n;
        self
    }

    /// Keeps a caller's sliding log apart once it holds more than `n`
    /// times (default [`DEFAULT_LOG_APART_ABOVE`]; tests use small values
    /// to move logs in and out often).
    pub fn with_log_apart_above(mut self, n: usize) -> Self {
        self.plan.log_apart_above = n.max(1);
        self
    }

    /// Keeps a caller's records apart once it holds more than `n` (default
    /// [`DEFAULT_RECORDS_APART_ABOVE`]; tests use small values to move
    /// records in and out often).
    pub fn with_records_apart_above(mut self, n: usize) -> Self {
        self.plan.records_apart_above = n.max(1);
        self
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// Commits refused so far because another writer had changed the
    /// caller (each was decided again on the current state).
    pub fn conflicts(&self) -> u64 {
        self.counts.conflicts
    }

    /// Writes refused so far because a caller believed new existed (its
    /// state was then read, and its calls decided on it).
    pub fn misses(&self) -> u64 {
        self.counts.misses
    }

    /// Calls whose verdicts were decided ahead, while the batch before
    /// them was committed, and then asked for.
    pub fn calls_decided_ahead(&self) -> u64 {
        self.calls_ahead
    }

    /// Callers held in memory.
    pub fn cached_callers(&self) -> usize {
        self.cache.len()
    }

    /// About how many bytes the cached callers take.
    pub fn cached_bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// Forgets every cached caller (the next call of each re-reads Redis).
    pub fn clear_cache(&mut self) {
        self.cache.clear();
        self.in_flight = None;
        self.ahead = None;
    }

    /// The key of a caller's records kept apart, `<prefix>{<caller>}:r`.
    pub fn records_key(&self, caller: &str) -> String {
        self.config.caller_key(caller, ":r")
    }

    /// The key of a caller's state string, `<prefix>{<caller>}:s`.
    pub fn state_key(&self, caller: &str) -> String {
        self.config.caller_key(caller, ":s")
    }

    /// The key of a caller's sliding log kept apart, `<prefix>{<caller>}:l`.
    pub fn log_key(&self, caller: &str) -> String {
        self.config.caller_key(caller, ":l")
    }

    /// One attempt at a batch: up to [`DEFAULT_MAX_ROUNDS`] rounds of deciding and
    /// committing the callers not yet written. The callers it touches are
    /// out of the cache while it runs and go back only once written: after
    /// a failure their next call re-reads Redis, whatever part of the
    /// writes landed. A caller still refused after the last round is left
    /// undecided (`None` for its calls; nothing of them was written).
    ///
    /// With a batch after it in `next` (now, or arriving while this one's
    /// first round is in flight), that batch's other callers are decided
    /// and their commits sent meanwhile ([`ahead::decide`]); they land
    /// with the next batch asked for.
    async fn try_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        next: &mut dyn Upcoming,
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        self.cache.tick();
        let (index, mut pending) = gather(&mut self.cache, events, None);
        let ttl = TtlPlan::new(&self.config, rules);
        let mut verdicts: Vec<Option<Verdict>> = vec![None; events.len()];
        let mut todo: Vec<usize> = (0..pending.len()).collect();
        self.seeds.clear();
        let committer = Committer {
            conn: self.conn.clone(),
            config: self.config.clone(),
            sha: self.sha.clone(),
        };
        let mut looking = self.looks_ahead().then_some(next);
        for _ in 0..self.max_rounds {
            let rounds = Rounds {
                committer: &committer,
                plan: &self.plan,
                partial_reads_after: self.partial_reads_after,
            };
            // Only a round that looks ahead tells when its groups are sent.
            let looks = looking.take();
            let (on_sent, sent) = match looks {
                Some(_) => {
                    let (on_sent, sent) = tokio::sync::oneshot::channel();
                    (Some(on_sent), Some(sent))
                }
                None => (None, None),
            };
            let current = round(
                rounds,
                rules,
                events,
                &mut pending,
                &todo,
                &mut verdicts,
                ttl,
                on_sent,
            );
            let outcomes = match looks.zip(sent) {
                None => current.await,
                Some((next, sent)) => {
                    let (on_done, done) = tokio::sync::oneshot::channel();
                    let current = async {
                        let outcomes = current.await;
                        let _ = on_done.send(());
                        outcomes
                    };
                    let ahead = ahead::decide(rounds, &mut self.cache, &index, next, sent, done);
                    let (outcomes, ahead) = futures::join!(current, ahead);
                    self.in_flight = ahead;
                    outcomes
                }
            };
            let outcomes = match outcomes {
                Ok(outcomes) => outcomes,
                Err(e) => {
                    // Redis failed: the callers taken out are kept apart
                    // (not cached: their next call reads Redis again) for
                    // a local fallback to start from.
                    for p in pending {
                        self.seeds.insert(p.caller, p.cached.state);
                    }
                    return Err(classify(e));
                }
            };
            todo = settle(outcomes, &mut pending, ttl, &mut self.counts)?;
            if todo.is_empty() {
                break;
            }
        }
        for &p in &todo {
            // Refused in every round: its calls stay undecided (nothing of
            // them was written).
            for &i in &pending[p].events {
                verdicts[i] = None;
            }
        }
        put_back(&mut self.cache, pending, todo);
        self.cache
            .evict(self.watermark.saturating_sub(rules.dedup_ms()));
        Ok(verdicts)
    }

    /// Whether batches are decided ahead: when asked for
    /// ([`RedisConfig::decide_ahead`]), and only with records kept, which
    /// make a call decided ahead and then read again (a batch let go on a
    /// revoke, a crash) get its first decision back.
    fn looks_ahead(&self) -> bool {
        self.config.decide_ahead && self.plan.idempotency
    }

    /// Waits for the commits of the batch decided ahead, if any, and takes
    /// them in: its callers back into the cache, its verdicts kept for its
    /// turn. If Redis failed them, its callers stay out of the cache (Redis
    /// may or may not have them), their states kept for a local fallback.
    async fn land_ahead(&mut self) {
        let Some(flight) = self.in_flight.take() else {
            return;
        };
        match flight.land(&mut self.cache, &mut self.counts).await {
            Ok(decided) => self.ahead = Some(decided),
            Err(states) => self.ahead_seeds.extend(states),
        }
    }
}

/// The callers of `events` in order of first appearance, each taken out
/// of `cache` with the indices of its events, and where each is; with
/// `skip`, callers in it are left out (and in the cache).
fn gather<'a>(
    cache: &mut Cache,
    events: &'a [CallEvent],
    skip: Option<&foldhash::HashMap<&str, usize>>,
) -> (foldhash::HashMap<&'a str, usize>, Vec<Pending>) {
    let mut index: foldhash::HashMap<&str, usize> = foldhash::HashMap::default();
    let mut pending: Vec<Pending> = Vec::new();
    for (i, ev) in events.iter().enumerate() {
        let caller = ev.caller.as_str();
        if skip.is_some_and(|s| s.contains_key(caller)) {
            continue;
        }
        let at = *index.entry(caller).or_insert_with(|| {
            pending.push(Pending {
                caller: ev.caller.clone(),
                events: Vec::new(),
                cached: cache.take(caller),
                refused: 0,
                read_back: false,
            });
            pending.len() - 1
        });
        pending[at].events.push(i);
    }
    (index, pending)
}

/// Commits refused and writes refused as misses (a caller believed new
/// that existed).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Counts {
    conflicts: u64,
    misses: u64,
}

/// Takes in a round's commits: a written caller's new version, log and
/// TTL; a refused one's state read back (counted as a conflict, or a miss
/// if it was believed new). Returns the refused callers, in order, to
/// decide again.
fn settle(
    outcomes: Vec<Committed>,
    pending: &mut [Pending],
    ttl: TtlPlan,
    counts: &mut Counts,
) -> Result<Vec<usize>, StoreError> {
    let mut next = Vec::new();
    for Committed { writes, refused } in outcomes {
        let mut refused_set = vec![false; writes.len()];
        for r in refused {
            refused_set[r.write] = true;
            let w = &writes[r.write];
            // A caller it had never seen is a miss, not a conflict.
            match w.expected {
                Some(_) => counts.conflicts += 1,
                None => counts.misses += 1,
            }
            let p = &mut pending[w.pending];
            p.refused += 1;
            p.read_back = r.read.is_some();
            if let Some(Found {
                value,
                hash,
                log,
                partial,
            }) = r.read
            {
                *p.cached = load(&p.caller, value, hash, log)?;
                if partial && matches!(p.cached.records, Records::Apart) {
                    p.cached.records = Records::Partial;
                }
            }
            next.push(w.pending);
        }
        for (write, _) in writes.iter().zip(refused_set).filter(|(_, r)| !r) {
            let cached = &mut pending[write.pending].cached;
            cached.version = Some(write.version);
            cached.log = write.log;
            if write.ttl_ms.is_some() {
                cached.ttl_until = Some(ttl.until());
            }
        }
    }
    next.sort_unstable();
    Ok(next)
}

/// Puts a batch's callers back into `cache`, but for those `contended`
/// (refused in its last round, in order) whose state is not Redis's, and
/// those known in part that have [`settled`].
fn put_back(cache: &mut Cache, pending: Vec<Pending>, contended: Vec<usize>) {
    let mut contended = contended.into_iter().peekable();
    for (at, mut p) in pending.into_iter().enumerate() {
        // A contended caller's state is kept when it is the one Redis
        // returned with the last refusal, under its version: its calls,
        // tried again in a later batch, are decided on it and can land
        // at the first round. When Redis returned nothing (it was written
        // again while read), the state holds decisions never written: it
        // is dropped, and its next call reads Redis again.
        let is_contended = contended.next_if_eq(&at).is_some();
        if (is_contended && !p.read_back) || settled(&mut p) {
            continue;
        }
        cache.put(p.caller, p.cached);
    }
}

/// What a round needs of the store, borrowed apart from its cache.
#[derive(Clone, Copy)]
pub(super) struct Rounds<'s> {
    committer: &'s Committer,
    plan: &'s Plan,
    partial_reads_after: u32,
}

/// One round: decides the callers `todo` of `pending` and commits
/// what changed, a group of callers ([`group_size`]) per script call.
/// Each group is sent as soon as it is decided, so Redis runs one
/// group's commit while the next is decided. Once every group is sent,
/// `on_sent` is told (the batch after may then be decided ahead).
#[allow(clippy::too_many_arguments)]
async fn round(
    rounds: Rounds<'_>,
    rules: &RuleSet,
    events: &[CallEvent],
    pending: &mut [Pending],
    todo: &[usize],
    verdicts: &mut [Option<Verdict>],
    ttl: TtlPlan,
    on_sent: Option<tokio::sync::oneshot::Sender<()>>,
) -> Result<Vec<Committed>, redis::RedisError> {
    let mut inflight = futures::stream::FuturesOrdered::new();
    let mut outcomes = Vec::new();
    let sending = async {
        for group in todo.chunks(group_size(todo.len())) {
            let writes = decide_group(rounds, rules, events, pending, group, verdicts, ttl);
            inflight.push_back(rounds.committer.clone().commit(writes));
            // Start sending it (and let the connection's task write it).
            if let std::task::Poll::Ready(Some(out)) = futures::poll!(inflight.next()) {
                outcomes.push(out?);
            }
            tokio::task::yield_now().await;
        }
        Ok::<(), redis::RedisError>(())
    };
    let sent = sending.await;
    // (Told also when a commit failed before all were sent: deciding is
    // over either way.)
    if let Some(tell) = on_sent {
        let _ = tell.send(());
    }
    sent?;
    while let Some(out) = inflight.next().await {
        outcomes.push(out?);
    }
    Ok(outcomes)
}

/// Decides the callers `group` of `pending` and plans their writes.
#[allow(clippy::too_many_arguments)]
fn decide_group(
    rounds: Rounds<'_>,
    rules: &RuleSet,
    events: &[CallEvent],
    pending: &mut [Pending],
    group: &[usize],
    verdicts: &mut [Option<Verdict>],
    ttl: TtlPlan,
) -> Vec<Write> {
    group
        .iter()
        .map(|&at| {
            let mut w = plan::decide_caller(
                rounds.plan,
                rules,
                events,
                (at, &mut pending[at]),
                verdicts,
                ttl,
            );
            w.read_ids = read_some(&pending[at], events, rounds.partial_reads_after);
            w
        })
        .collect()
}

impl WindowStore for CachedStore {
    fn cached_state(&self, caller: &str) -> Option<crate::engine::window::CallerState> {
        self.cache
            .peek(caller)
            .or_else(|| self.in_flight.as_ref().and_then(|f| f.state_of(caller)))
            .or_else(|| self.ahead_seeds.get(caller))
            .or_else(|| self.seeds.get(caller))
            .cloned()
    }

    fn stats(&self) -> StoreStats {
        let (lookups, hits, evictions) = self.cache.counts();
        StoreStats {
            conflicts: self.counts.conflicts,
            data_losses: self.claim.lost,
            cache: CacheStats {
                lookups,
                hits,
                rereads: self.counts.misses,
                decided_ahead: self.calls_ahead,
                evictions,
                callers: self.cache.len() as u64,
                bytes: self.cache.bytes() as u64,
            },
            ..StoreStats::default()
        }
    }

    async fn probe(&mut self) -> Result<(), StoreError> {
        let prefix = &self.config.key_prefix;
        self.conn.reclaim_mode(prefix, MODE, &mut self.claim).await
    }

    async fn apply_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, StoreError> {
        self.apply_batch_partial(rules, events)
            .await?
            .into_iter()
            .collect::<Option<Vec<Verdict>>>()
            .ok_or_else(|| StoreError::transient(CONTENDED))
    }

    async fn apply_batch_partial(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        self.apply_batch_partial_ahead(rules, events, &mut ()).await
    }

    async fn apply_batch_partial_ahead(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        next: &mut dyn Upcoming,
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        // Without a concurrent or sum rule an end changes nothing:
        // answered here, never sent to Redis. With one, it is applied to
        // its caller's state like an attempt.
        match ahead::to_store(rules, events) {
            std::borrow::Cow::Owned(attempts) => {
                let decided = self.apply_events(rules, &attempts, next).await?;
                Ok(crate::store::with_ends(rules, events, decided, Some))
            }
            std::borrow::Cow::Borrowed(_) => self.apply_events(rules, events, next).await,
        }
    }
}

impl CachedStore {
    /// [`WindowStore::apply_batch_partial`] of `events` (ends only with a
    /// concurrent rule).
    async fn apply_events(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        next: &mut dyn Upcoming,
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let prefix = &self.config.key_prefix;
        self.conn
            .keep_mode_every(prefix, MODE, &mut self.claim)
            .await?;
        let (n, timeout) = (self.config.wait_replicas, self.config.timeout);
        let since = self.conn.batch_start(n).await?;
        for ev in events {
            self.watermark = self.watermark.max(ev.ts_ms);
        }
        self.land_ahead().await;
        let verdicts = match self.ahead.take() {
            Some(done) if done.fits(rules, events) => {
                self.finish_ahead(rules, events, done, next).await?
            }
            kept => {
                // Not the batch decided ahead (a retry of part of the one
                // before, under the failure policy): that one is kept for
                // when it comes, unless past the idempotency horizon.
                self.ahead =
                    kept.filter(|d| d.newest() > self.watermark.saturating_sub(rules.dedup_ms()));
                self.try_batch(rules, events, next).await?
            }
        };
        self.conn.wait_replicas(n, timeout, since).await?;
        // (States decided ahead in a round Redis failed are kept for a
        // fallback until a batch commits.)
        self.ahead_seeds.clear();
        Ok(verdicts)
    }

    /// The batch decided ahead, asked for: its calls decided then stand
    /// (they are written); the others (callers of the batch before, and
    /// callers refused then) are decided now, as a batch of their own.
    /// On a failure it is kept for the retry.
    async fn finish_ahead(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        done: DecidedAhead,
        next: &mut dyn Upcoming,
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        let rest: Vec<usize> = (0..events.len())
            .filter(|&i| done.verdicts[i].is_none())
            .collect();
        let early = (events.len() - rest.len()) as u64;
        if rest.is_empty() {
            self.calls_ahead += early;
            return Ok(done.verdicts);
        }
        let sub: Vec<CallEvent> = rest.iter().map(|&i| events[i].clone()).collect();
        match self.try_batch(rules, &sub, next).await {
            Ok(got) => {
                let mut verdicts = done.verdicts;
                for (&i, v) in rest.iter().zip(got) {
                    verdicts[i] = v;
                }
                self.calls_ahead += early;
                Ok(verdicts)
            }
            Err(e) => {
                self.ahead = Some(done);
                Err(e)
            }
        }
    }
}

/// Batches in a row a caller known in part is written at the first try
/// before it is forgotten, so that its next call reads it whole and its
/// old records are trimmed again: long enough that two writers taking
/// turns on a flooding caller do not read its thousands of records
/// between turns, short enough that the records of a flood that is over
/// are trimmed within a few seconds of its calls.
pub const SETTLED_AFTER: u32 = 64;

/// Whether `p`, known in part, has now been written at the first try
/// [`SETTLED_AFTER`] batches in a row (no other writer seen): then it is
/// not kept. Counts that streak.
fn settled(p: &mut Pending) -> bool {
    if !matches!(p.cached.records, Records::Partial) {
        return false;
    }
    if p.refused > 0 {
        p.cached.unopposed = 0;
        return false;
    }
    p.cached.unopposed += 1;
    p.cached.unopposed >= SETTLED_AFTER
}

/// Which records to read back with `p`'s state if its write is refused:
/// all (`None`) the first `after` times (once, by default); after that,
/// or for a caller already known in part, only those of its calls in the
/// batch, the only ones its decisions need (a duplicate is found by its
/// call id).
///
/// A caller written by two instances at once (a flooding caller behind a
/// load balancer) loses about every other commit. Reading all its records
/// back (thousands, for a flood within the idempotency horizon) took
/// longer than the other writer took to write it again, so its calls were
/// left undecided after every round; read in part, in one round trip,
/// the next commit nearly always lands.
fn read_some(
    p: &Pending,
    events: &[CallEvent],
    after: u32,
) -> Option<Vec<compact_str::CompactString>> {
    (p.refused >= after || matches!(p.cached.records, Records::Partial)).then(|| {
        p.events
            .iter()
            .map(|&i| events[i].call_id.clone())
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::{group_size, CALLERS_PER_CALL};

    #[test]
    fn small_rounds_go_in_small_groups_and_backlogs_in_full_ones() {
        assert_eq!(group_size(1), 16);
        assert_eq!(group_size(2 * CALLERS_PER_CALL), 16);
        assert_eq!(group_size(2 * CALLERS_PER_CALL + 1), CALLERS_PER_CALL);
        assert_eq!(group_size(500), CALLERS_PER_CALL);
    }
}

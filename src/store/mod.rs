//! Window stores: where per-caller window state lives.
//!
//! One algorithm, two stores: [`memory::MemoryStore`] runs the reference
//! algorithm of [`crate::engine::window`] in process (and
//! [`sharded::ShardedStore`] runs it split by caller over the cores, for
//! offline work, where `offline::replay::ReplayStore` drives it chunk by
//! chunk); [`redis::RedisStore`] runs the
//! same algorithm in atomic Lua calls of several events each;
//! [`cached::CachedStore`] runs the reference algorithm in process on
//! cached per-caller state and keeps that state in Redis, written back
//! under a version check. [`gated::Gated`] puts a store behind the gate of
//! the rules keyed by callee or global (credits leased from Redis or in
//! process). The conformance suite in `tests/` runs the same
//! scenarios against every store and demands identical records.

pub mod cached;

/// Why a store left a caller's calls undecided
/// ([`WindowStore::apply_batch_partial`]): another writer kept changing the
/// caller. Names no caller: it reaches answers, logs and readiness that
/// other callers' calls share.
pub const CONTENDED: &str =
    "a caller changed under each of its commit rounds: another writer is deciding it";

/// A batch's attempts, when it holds call ends, for a store that keeps no
/// open calls (no concurrent rule: an end changes nothing); `None` when
/// it holds only attempts.
pub(crate) fn attempts_of(events: &[CallEvent]) -> Option<Vec<CallEvent>> {
    use crate::engine::event::EventKind;
    events.iter().any(|e| e.kind == EventKind::End).then(|| {
        events
            .iter()
            .filter(|e| e.kind != EventKind::End)
            .cloned()
            .collect()
    })
}

/// The results of a batch from those of its attempts ([`attempts_of`]):
/// each end gets [`Verdict::of_end`], wrapped by `wrap`.
pub(crate) fn with_ends<T>(
    rules: &RuleSet,
    events: &[CallEvent],
    decided: Vec<T>,
    wrap: impl Fn(Verdict) -> T,
) -> Vec<T> {
    use crate::engine::event::EventKind;
    let mut decided = decided.into_iter();
    events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::End => Some(wrap(Verdict::of_end(e, rules))),
            EventKind::Attempt => decided.next(),
        })
        .collect()
}
pub mod connecting;
pub mod gated;
pub mod memory;
pub mod redis;
pub mod reply;
pub mod sharded;
#[cfg(test)]
pub(crate) mod test_server;

use std::future::Future;

use crate::engine::event::CallEvent;
use crate::engine::record::Verdict;
use crate::engine::rules::RuleSet;
use crate::engine::window::CallerState;
use crate::error::StoreError;

/// Scores `verdicts` by the rule set's model, if it has one, and decides
/// them by their scores ([`crate::engine::model`]). A model that fails to
/// score a batch (one that loaded and scored a probe row should not) leaves
/// the batch as the rules decided it, unscored, and says so in the log.
pub fn settle_by_model<'a>(rules: &RuleSet, verdicts: impl IntoIterator<Item = &'a mut Verdict>) {
    if let Err(e) = crate::engine::model::decide(rules, verdicts) {
        tracing::warn!(error = %e, rules_version = rules.version(), "the model did not score a batch: decided by the rules alone");
    }
}

/// What a store counts of its own work, since it connected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Writes refused because another writer had changed a caller (the
    /// cached store), each decided again.
    pub conflicts: u64,
    /// Times Redis was found to have lost every key of the prefix (its
    /// mode claim gone: a restart without persistence, a flush, a failover
    /// to a replica that had not received them).
    pub data_losses: u64,
    /// Credits of the rules keyed by callee or global (a store behind the
    /// gate; zeros otherwise).
    pub lease: LeaseStats,
    /// The pools' work (a store before the pools; zeros otherwise).
    pub pools: PoolStats,
    /// The cached store's callers in memory (zeros for other stores).
    pub cache: CacheStats,
}

/// What the cached store's callers in memory did, since it connected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Callers looked up, once per batch that has calls of theirs.
    pub lookups: u64,
    /// Of those, found in memory.
    pub hits: u64,
    /// Of those not found, callers Redis had (dropped from memory earlier,
    /// or written by another instance): read back before their calls were
    /// decided. The rest were new.
    pub rereads: u64,
    /// Callers dropped from memory to keep within its bounds.
    pub evictions: u64,
    /// Calls decided and written while the batch before them was
    /// committed (the consumer had their batch already).
    pub decided_ahead: u64,
    /// Callers held now.
    pub callers: u64,
    /// About how many bytes they take now (their windows, records and
    /// logs; allocator slack comes on top).
    pub bytes: u64,
}

/// What the pools (concurrent and sum rules keyed by account, callee or
/// global) did, since the store opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Batches settled by the pools (in Redis: pool script calls).
    pub calls: u64,
    /// Events they took: attempts a pool sees, and every end.
    pub events: u64,
    /// Time in the pools' step, microseconds.
    pub micros: u64,
}

/// What the gate leased for the rules keyed by callee or global, since
/// the store opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseStats {
    /// Lease calls: batches that needed credits not held.
    pub calls: u64,
    /// Counters asked of Redis by plain increments (held nothing of).
    pub increments: u64,
    /// Counters asked of Redis through the lease script.
    pub scripted: u64,
    /// Counters asked of an in-process ledger.
    pub in_process: u64,
    /// Counters given credits from this instance's reserve slot (no call).
    pub reserved: u64,
    /// Credits granted.
    pub granted: u64,
    /// Credits wanted and not granted: the counter was at its limit.
    pub short: u64,
    /// Time in lease calls, microseconds.
    pub micros: u64,
}

/// The batch a store will be asked to decide next, with its rules.
#[derive(Debug, Clone, Copy)]
pub struct Next<'a> {
    pub rules: &'a RuleSet,
    pub events: &'a [CallEvent],
}

/// Where a store deciding a batch learns the batch after it, if that has
/// come yet ([`WindowStore::apply_batch_partial_ahead`]).
pub trait Upcoming: Send {
    /// The next batch, if already known, with the rules it will be decided
    /// under: the store may decide it (the gate's part) while the current
    /// batch is committed. Asked once the current batch is decided, just
    /// before it is committed. (A batch retried in between is decided
    /// again, and the next one with it.)
    fn peek(&mut self) -> Option<Next<'_>>;

    /// Resolves once [`Upcoming::peek`] has a batch to give (at once if it
    /// has one), so a store may wait for the next batch while it commits
    /// this one. By default, never: no batch comes.
    fn arrival(&mut self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(std::future::pending())
    }
}

/// No batch after this one (or none worth waiting for).
impl Upcoming for () {
    fn peek(&mut self) -> Option<Next<'_>> {
        None
    }
}

/// A batch known from the start.
impl Upcoming for Option<Next<'_>> {
    fn peek(&mut self) -> Option<Next<'_>> {
        *self
    }
}

/// A place that keeps window state and decides calls atomically.
pub trait WindowStore: Send {
    /// Applies `events` in order (per caller, the order given) and returns one
    /// verdict per event, in the same order.
    ///
    /// On error no verdict is returned; events of the batch may or may not have
    /// been applied, so callers retry the whole batch, which per-call
    /// idempotency makes safe.
    fn apply_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> impl Future<Output = Result<Vec<Verdict>, StoreError>> + Send;

    /// [`WindowStore::apply_batch`], except that a caller another writer
    /// kept changing while this store decided it (the cached store gives
    /// up after a few rounds) leaves only that caller's calls undecided
    /// (`None`): nothing of theirs was written, so they can be tried again,
    /// and every other call's verdict stands. The online paths use this;
    /// by default it is `apply_batch`.
    fn apply_batch_partial(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> impl Future<Output = Result<Vec<Option<Verdict>>, StoreError>> + Send {
        async move {
            let verdicts = self.apply_batch(rules, events).await?;
            Ok(verdicts.into_iter().map(Some).collect())
        }
    }

    /// [`WindowStore::apply_batch_partial`] of this batch, with a way to
    /// learn the batch after it (`next`): a store may prepare for that one
    /// while it commits this one. The gate ([`gated::Gated`]) leases the
    /// next batch's credits then, so that round trip to Redis overlaps the
    /// commit's instead of following it. The results are
    /// `apply_batch_partial`'s: only the time differs.
    fn apply_batch_partial_ahead(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        next: &mut dyn Upcoming,
    ) -> impl Future<Output = Result<Vec<Option<Verdict>>, StoreError>> + Send {
        let _ = next;
        self.apply_batch_partial(rules, events)
    }

    /// The window state of `caller` this store holds in process, if any
    /// (the cached store's cache): where a local fallback starts from while
    /// the store fails. `None` by default.
    fn cached_state(&self, _caller: &str) -> Option<CallerState> {
        None
    }

    /// What the store has counted of its own work since it connected
    /// (zeros for in-process stores).
    fn stats(&self) -> StoreStats {
        StoreStats::default()
    }

    /// Checks that the store answers, as an idle server's readiness probe
    /// does (a Redis store claims its key prefix's mode again, which also
    /// reconnects a connection broken while idle, before a call needs it).
    /// In-process stores always answer.
    fn probe(&mut self) -> impl Future<Output = Result<(), StoreError>> + Send {
        async { Ok(()) }
    }
}

/// The store chosen at run time.
pub enum AnyStore {
    /// In process.
    Memory(memory::MemoryStore),
    /// Redis (standalone or Cluster), the algorithm in the window script.
    Redis(Box<redis::RedisStore>),
    /// Redis (standalone or Cluster), the algorithm in process on cached
    /// state, written back under a version check.
    Cached(Box<cached::CachedStore>),
}

impl AnyStore {
    /// A Redis store: the window script, or with `cache` the cached store
    /// keeping callers in memory within those bounds.
    pub async fn connect_redis(
        config: redis::RedisConfig,
        cache: Option<cached::CacheLimit>,
    ) -> Result<Self, StoreError> {
        Ok(match cache {
            None => AnyStore::Redis(Box::new(redis::RedisStore::connect(config).await?)),
            Some(limit) => AnyStore::Cached(Box::new(
                cached::CachedStore::connect(config, limit.callers)
                    .await?
                    .with_max_bytes(limit.bytes),
            )),
        })
    }
}

impl WindowStore for AnyStore {
    async fn apply_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.apply_batch(rules, events).await,
            AnyStore::Redis(s) => s.apply_batch(rules, events).await,
            AnyStore::Cached(s) => s.apply_batch(rules, events).await,
        }
    }

    async fn apply_batch_partial(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        match self {
            AnyStore::Cached(s) => s.apply_batch_partial(rules, events).await,
            AnyStore::Memory(s) => s.apply_batch_partial(rules, events).await,
            AnyStore::Redis(s) => s.apply_batch_partial(rules, events).await,
        }
    }

    async fn apply_batch_partial_ahead(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        next: &mut dyn Upcoming,
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        match self {
            AnyStore::Cached(s) => s.apply_batch_partial_ahead(rules, events, next).await,
            AnyStore::Memory(s) => s.apply_batch_partial(rules, events).await,
            AnyStore::Redis(s) => s.apply_batch_partial(rules, events).await,
        }
    }

    fn cached_state(&self, caller: &str) -> Option<CallerState> {
        match self {
            AnyStore::Cached(s) => s.cached_state(caller),
            AnyStore::Redis(_) | AnyStore::Memory(_) => None,
        }
    }

    fn stats(&self) -> StoreStats {
        match self {
            AnyStore::Cached(s) => s.stats(),
            AnyStore::Redis(s) => s.stats(),
            AnyStore::Memory(_) => StoreStats::default(),
        }
    }

    async fn probe(&mut self) -> Result<(), StoreError> {
        match self {
            AnyStore::Cached(s) => s.probe().await,
            AnyStore::Redis(s) => s.probe().await,
            AnyStore::Memory(_) => Ok(()),
        }
    }
}

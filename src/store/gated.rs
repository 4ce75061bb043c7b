//! A window store behind the gate of the rules keyed by callee or global:
//! each batch's calls get those rules' counts from credits (leased from
//! Redis online, or from an in-process ledger) before the store decides
//! them with the caller's rules (see [`crate::engine::aggregate`]).

use crate::engine::aggregate::{Gate, Lease, LeaseRequest, MemoryLedger};
use crate::engine::event::CallEvent;
use crate::engine::pool::Pools;
use crate::engine::record::Verdict;
use crate::engine::rules::RuleSet;
use crate::engine::window::CallerState;
use crate::error::StoreError;
use crate::store::redis::aggregate::lease::{is_plain, RedisLedger};
use crate::store::redis::aggregate::pool::RedisPools;
use crate::store::{LeaseStats, PoolStats, StoreStats, Upcoming, WindowStore};
use std::sync::Arc;
use tokio::sync::Mutex;
use tracing::{debug, warn};

/// Where credits come from.
#[derive(Debug)]
pub enum Ledger {
    /// In process: offline work, one instance alone, the local fallback.
    Memory(MemoryLedger),
    /// Redis, shared by every instance on the same key prefix.
    Redis(Box<RedisLedger>),
}

impl Ledger {
    async fn lease(&mut self, requests: &[LeaseRequest]) -> Result<Vec<Lease>, StoreError> {
        match self {
            Ledger::Memory(m) => Ok(m.lease(requests)),
            Ledger::Redis(r) => r.lease(requests).await,
        }
    }

    /// Counts a lease call's counters by the way they went.
    fn count(&self, requests: &[LeaseRequest], stats: &mut LeaseStats) {
        let n = requests.len() as u64;
        match self {
            Ledger::Memory(_) => stats.in_process += n,
            Ledger::Redis(_) => {
                let plain = requests.iter().filter(|r| is_plain(r)).count() as u64;
                stats.increments += plain;
                stats.scripted += n - plain;
            }
        }
    }
}

/// Where the pools are (concurrent rules keyed by account, callee or
/// global, decided after the store: [`crate::engine::pool`]): beside the
/// credits.
#[derive(Debug)]
enum PoolStore {
    Memory(Box<Pools>),
    Redis(Box<RedisPools>),
}

impl PoolStore {
    fn for_ledger(ledger: &Ledger) -> Self {
        match ledger {
            Ledger::Memory(_) => PoolStore::Memory(Box::default()),
            Ledger::Redis(r) => PoolStore::Redis(Box::new(RedisPools::new(r.config().clone()))),
        }
    }

    /// Settles the store's verdicts by the pools, counting its work in
    /// `stats`.
    async fn apply(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        verdicts: &mut [Option<Verdict>],
        stats: &mut PoolStats,
    ) -> Result<(), StoreError> {
        if !rules.has_pools() {
            crate::store::settle_by_model(rules, verdicts.iter_mut().flatten());
            return self.block_model_rejects(rules, events, verdicts).await;
        }
        let start = std::time::Instant::now();
        let taken = match self {
            PoolStore::Memory(p) => p.apply(rules, events, verdicts),
            PoolStore::Redis(p) => p.apply(rules, events, verdicts).await?,
        };
        crate::store::settle_by_model(rules, verdicts.iter_mut().flatten());
        self.block_model_rejects(rules, events, verdicts).await?;
        if taken == 0 {
            return Ok(());
        }
        stats.calls += 1;
        stats.events += taken;
        stats.micros += start.elapsed().as_micros() as u64;
        Ok(())
    }
}

impl PoolStore {
    /// The block keys of the model's rejects, where asked (see
    /// [`RedisPools::block_model_rejects`]); none in process.
    async fn block_model_rejects(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        verdicts: &[Option<Verdict>],
    ) -> Result<(), StoreError> {
        match self {
            PoolStore::Memory(_) => Ok(()),
            PoolStore::Redis(p) => p.block_model_rejects(rules, events, verdicts).await,
        }
    }
}

/// `S` behind the gate, and before the pools.
#[derive(Debug)]
pub struct Gated<S> {
    inner: S,
    pools: PoolStore,
    pooled: PoolStats,
    /// The gate: the store's task takes it for the batch it decides, a
    /// blocking-pool thread for the batch queued behind.
    gate: Arc<Mutex<Gate>>,
    ledger: Ledger,
    leased: LeaseStats,
    /// Counters given a reserve, as of the last batch gated.
    reserved: u64,
    /// The batch queued behind, decided by the gate while the one before
    /// it was committed.
    ahead: Option<DecidedAhead>,
    /// Batches taken from `ahead`.
    taken_ahead: u64,
    /// The rules the batches queued behind came with, shared with the
    /// gate's thread (copied again only when they change).
    ahead_rules: Option<Arc<RuleSet>>,
}

/// A batch the gate decided while the batch before it was committed: used
/// when that batch comes under the same rules with nothing decided since;
/// otherwise it is decided again, and its calls, remembered, get the same
/// results.
#[derive(Debug)]
struct DecidedAhead {
    events: Vec<CallEvent>,
    version: String,
    /// [`Gate::decided`] once it was decided.
    decided: u64,
}

impl DecidedAhead {
    /// It is `events` under `rules`, and the gate decided nothing since.
    fn fits(&self, rules: &RuleSet, events: &[CallEvent], decided: u64) -> bool {
        self.decided == decided
            && self.version == rules.version()
            && self.events.len() == events.len()
            && self
                .events
                .iter()
                .zip(events)
                .all(|(a, b)| a.call_id == b.call_id && a.ts_ms == b.ts_ms && a.callee == b.callee)
    }
}

impl<S: WindowStore> Gated<S> {
    /// `inner` behind a new gate taking credits from `ledger`.
    pub fn new(inner: S, ledger: Ledger) -> Self {
        Gated {
            inner,
            pools: PoolStore::for_ledger(&ledger),
            pooled: PoolStats::default(),
            gate: Arc::new(Mutex::new(Gate::new())),
            ledger,
            leased: LeaseStats::default(),
            reserved: 0,
            ahead: None,
            taken_ahead: 0,
            ahead_rules: None,
        }
    }

    /// Batches whose gate decision was made while the batch before them
    /// was committed.
    pub fn taken_ahead(&self) -> u64 {
        self.taken_ahead
    }

    /// The store behind the gate.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// `events` with the rules keyed by callee or global filled in; `None`
    /// when the set has none (the events go to the store as they are).
    /// The reserve slot's span is raised to cover `events` and, if it has
    /// come, the batch after them (`newest_next`: its newest call), whose
    /// credits are planned while this one commits.
    async fn gate(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        newest_next: Option<i64>,
    ) -> Result<Option<Vec<CallEvent>>, StoreError> {
        if !rules.has_aggregates() {
            return Ok(None);
        }
        // (Waits for the gate's thread, if the batch it was deciding ahead
        // was let go unfinished.)
        let mut gate = self.gate.clone().lock_owned().await;
        if let Ledger::Redis(ledger) = &mut self.ledger {
            let newest = newest_of(events).max(newest_next.unwrap_or(i64::MIN));
            let reserves = ledger.reserves(newest, keep_ms(rules)).await?;
            gate.set_reserves(reserves);
        }
        self.reserved = gate.reserved_counters();
        if let Some(ahead) = self.ahead.take() {
            if ahead.fits(rules, events, gate.decided()) {
                self.taken_ahead += 1;
                return Ok(Some(ahead.events));
            }
        }
        let mut events = events.to_vec();
        let requests = gate.plan(rules, &events);
        if !requests.is_empty() {
            let (leases, micros) = timed(self.ledger.lease(&requests)).await;
            self.leased.micros += micros;
            let leases = leases.inspect_err(|_| gate.forget_plan())?;
            count(&self.ledger, &mut self.leased, &requests, &leases);
            gate.settle(&requests, &leases);
        }
        gate.decide(rules, &mut events);
        self.reserved = gate.reserved_counters();
        Ok(Some(events))
    }

    /// Decides `events` (gated) in the store while the gate plans, leases
    /// for and decides the next batch, if it has come, on a thread of the
    /// blocking pool: the gate's work is off the store's thread. (The
    /// gate decides a batch before the store commits it, as
    /// [`Gated::gate`] does; the next batch is the decider's next job,
    /// decided next.) A failed lease ahead is let go: `next` asks again
    /// when it comes, and meets the error then.
    async fn apply_ahead(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        next: &mut dyn Upcoming,
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        let newest_next = next
            .peek()
            .filter(|n| n.rules.has_aggregates())
            .map(|n| newest_of(n.events));
        let gated = self.gate(rules, events, newest_next).await?;
        let batch = gated.as_deref().unwrap_or(events);
        let Some(n) = next.peek().filter(|n| n.rules.has_aggregates()) else {
            // Without a gate's part ahead, the store may decide the next
            // batch ahead itself (it leaves one under such rules alone).
            let mut verdicts = match gated {
                None => {
                    let inner = self.inner.apply_batch_partial_ahead(rules, batch, next);
                    inner.await?
                }
                Some(_) => self.inner.apply_batch_partial(rules, batch).await?,
            };
            let stats = &mut self.pooled;
            self.pools.apply(rules, batch, &mut verdicts, stats).await?;
            return Ok(verdicts);
        };
        let next_rules = match self.ahead_rules.take() {
            Some(r) if r.version() == n.rules.version() => r,
            _ => Arc::new(n.rules.clone()),
        };
        self.ahead_rules = Some(next_rules.clone());
        let ahead = Ahead {
            gate: self.gate.clone(),
            rules: next_rules,
            events: n.events.to_vec(),
        };
        let (inner, ledger, leased) = (&mut self.inner, &mut self.ledger, &mut self.leased);
        let (verdicts, ahead) = futures::join!(
            inner.apply_batch_partial(rules, batch),
            ahead.decide_ahead(ledger, leased)
        );
        self.ahead = ahead;
        let mut verdicts = verdicts?;
        let stats = &mut self.pooled;
        self.pools.apply(rules, batch, &mut verdicts, stats).await?;
        Ok(verdicts)
    }
}

/// The batch queued behind, for the gate's thread.
struct Ahead {
    gate: Arc<Mutex<Gate>>,
    rules: Arc<RuleSet>,
    events: Vec<CallEvent>,
}

/// What the gate's thread did with a batch queued behind.
enum OnThread {
    /// Decided: it needed no credits beyond those held.
    Decided(Vec<CallEvent>, u64),
    /// Planned: the credits to ask for first.
    Asks(Vec<LeaseRequest>, Vec<CallEvent>),
}

impl Ahead {
    /// The gate's decision on the batch: planned, leased for and decided
    /// (as [`Gated::gate`] would when it comes); `None` if its lease
    /// failed. Let go unfinished, the thread still finishes its part, and
    /// the batch is decided again when it comes.
    async fn decide_ahead(
        self,
        ledger: &mut Ledger,
        leased: &mut LeaseStats,
    ) -> Option<DecidedAhead> {
        let (gate, rules) = (self.gate.clone(), self.rules.clone());
        let mut events = self.events;
        let version = rules.version().to_string();
        let planned = tokio::task::spawn_blocking(move || {
            let mut g = gate.blocking_lock();
            let requests = g.plan(&rules, &events);
            if !requests.is_empty() {
                return OnThread::Asks(requests, events);
            }
            g.decide(&rules, &mut events);
            OnThread::Decided(events, g.decided())
        })
        .await;
        let (requests, mut events) = match planned {
            Ok(OnThread::Decided(events, decided)) => {
                return Some(DecidedAhead {
                    events,
                    version,
                    decided,
                })
            }
            Ok(OnThread::Asks(requests, events)) => (requests, events),
            Err(e) => {
                warn!(error = %e, "the gate's thread failed; the next batch is decided when it comes");
                return None;
            }
        };
        let (leases, micros) = timed(ledger.lease(&requests)).await;
        leased.micros += micros;
        let mut gate = self.gate.lock().await;
        match leases {
            Ok(leases) => {
                count(ledger, leased, &requests, &leases);
                gate.settle(&requests, &leases);
            }
            Err(e) => {
                gate.forget_plan();
                debug!(error = %e, "leasing ahead failed; the next batch asks again");
                return None;
            }
        }
        gate.decide(&self.rules, &mut events);
        Some(DecidedAhead {
            events,
            version,
            decided: gate.decided(),
        })
    }
}

/// Counts a lease call that was answered.
fn count(ledger: &Ledger, s: &mut LeaseStats, requests: &[LeaseRequest], leases: &[Lease]) {
    s.calls += 1;
    ledger.count(requests, s);
    for (r, l) in requests.iter().zip(leases) {
        s.granted += l.granted;
        s.short += r.want.saturating_sub(l.granted);
    }
}

/// The newest call's time (`i64::MIN` for none).
fn newest_of(events: &[CallEvent]) -> i64 {
    events.iter().map(|e| e.ts_ms).max().unwrap_or(i64::MIN)
}

/// How long a reserve slot's keys outlive the last call: the longest
/// life of a counter (`3 W + grace`) and an hour, as the in-process ledger
/// keeps counters (a slot's horizon forgotten while buckets below it still
/// count could let a new holder spend a reserve there twice).
fn keep_ms(rules: &RuleSet) -> i64 {
    rules
        .rules
        .iter()
        .filter(|r| r.is_gated())
        .map(|r| r.window_ms.saturating_mul(3).saturating_add(rules.grace_ms))
        .max()
        .unwrap_or(0)
        .saturating_add(crate::engine::aggregate::MEMORY_MARGIN_MS)
}

/// `work`'s output and how long it took, µs.
async fn timed<T>(work: impl std::future::Future<Output = T>) -> (T, u64) {
    let start = std::time::Instant::now();
    let out = work.await;
    (out, start.elapsed().as_micros() as u64)
}

impl<S: WindowStore> WindowStore for Gated<S> {
    async fn apply_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, StoreError> {
        let gated = self.gate(rules, events, None).await?;
        let batch = gated.as_deref().unwrap_or(events);
        let verdicts = self.inner.apply_batch(rules, batch).await?;
        if !rules.has_after_pass() {
            return Ok(verdicts);
        }
        let mut verdicts: Vec<Option<Verdict>> = verdicts.into_iter().map(Some).collect();
        let stats = &mut self.pooled;
        self.pools.apply(rules, batch, &mut verdicts, stats).await?;
        Ok(verdicts.into_iter().flatten().collect())
    }

    async fn apply_batch_partial(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        self.apply_ahead(rules, events, &mut ()).await
    }

    async fn apply_batch_partial_ahead(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        next: &mut dyn Upcoming,
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        self.apply_ahead(rules, events, next).await
    }

    fn stats(&self) -> StoreStats {
        StoreStats {
            lease: LeaseStats {
                // (Between batches the gate is free; while its thread
                // holds it, the count as of the last batch gated.)
                reserved: self
                    .gate
                    .try_lock()
                    .map_or(self.reserved, |g| g.reserved_counters()),
                ..self.leased
            },
            pools: self.pooled,
            ..self.inner.stats()
        }
    }

    fn cached_state(&self, caller: &str) -> Option<CallerState> {
        self.inner.cached_state(caller)
    }

    async fn probe(&mut self) -> Result<(), StoreError> {
        self.inner.probe().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::rules::{Rule, RuleKey, RuleSpec, WindowKind};
    use crate::store::memory::MemoryStore;
    use crate::store::Next;

    /// Batches of calls to a few callees (some over the limit) from
    /// many callers, with retransmissions.
    fn batches() -> Vec<Vec<CallEvent>> {
        let call = |i: usize| CallEvent {
            call_id: format!("c{}", if i.is_multiple_of(11) { i / 2 } else { i }).into(),
            caller: format!("+346000{:05}", i % 97).into(),
            ts_ms: 1_000_000 + i as i64 * 37,
            callee: Some(format!("+3491000{:04}", (i * 7) % 13).into()),
            ..Default::default()
        };
        (0..12)
            .map(|b| (b * 50..(b + 1) * 50).map(call).collect())
            .collect()
    }

    fn rules(kind: WindowKind) -> RuleSet {
        let mut callee = Rule::new("tdos", kind, 2_000, 4);
        callee.key = RuleKey::Callee;
        let caller = Rule::new("caller", WindowKind::Fixed, 1_000, 3);
        RuleSet::build(RuleSpec::new(vec![caller, callee])).expect("rules")
    }

    fn gated() -> Gated<MemoryStore> {
        Gated::new(MemoryStore::new(), Ledger::Memory(MemoryLedger::new()))
    }

    /// Leasing the next batch's credits while this one is committed
    /// changes no record, and the next batch then needs no lease call.
    #[tokio::test]
    async fn leasing_ahead_changes_nothing_but_the_time() {
        for kind in [WindowKind::Fixed, WindowKind::SlidingApprox] {
            let rules = rules(kind);
            let batches = batches();
            let (mut plain, mut ahead) = (gated(), gated());
            let last = batches.len() - 1;
            for (k, batch) in batches.iter().enumerate() {
                let want = plain
                    .apply_batch_partial(&rules, batch)
                    .await
                    .expect("plain");
                let before = ahead.stats().lease.calls;
                let mut next = batches.get(k + 1).map(|events| Next {
                    rules: &rules,
                    events,
                });
                let got = ahead
                    .apply_batch_partial_ahead(&rules, batch, &mut next)
                    .await
                    .expect("ahead");
                assert_eq!(got, want, "{kind:?}, batch {k}");
                // Batch k was leased for while k - 1 was committed: the
                // only call now is the one ahead, for k + 1.
                let calls = ahead.stats().lease.calls - before;
                let expected = if k == last { 0 } else { 1 };
                if k > 0 {
                    assert!(calls <= expected, "{kind:?}, batch {k}: {calls} calls");
                }
            }
            let (p, a) = (plain.stats().lease, ahead.stats().lease);
            assert!(p.short > 0, "{kind:?}: the limit was reached");
            assert!(p.calls >= last as u64, "{kind:?}: every batch leased");
            assert_eq!((a.granted, a.short), (p.granted, p.short), "{kind:?}");
            // Every batch after the first was decided while the one before
            // it was committed.
            assert_eq!(ahead.taken_ahead(), last as u64, "{kind:?}");
        }
    }

    /// A batch decided ahead is used only for the batch it was, under the
    /// rules it was decided with, with nothing decided since: a batch
    /// retried first (the store failed it) is decided again, with the
    /// records of a gate that never looked ahead, and so is the batch
    /// after it; a batch peeked under other rules than it comes with is
    /// not used either.
    #[tokio::test]
    async fn a_batch_decided_ahead_is_used_only_for_itself() {
        let first = rules(WindowKind::Fixed);
        let mut reloaded = Rule::new("tdos", WindowKind::Fixed, 2_000, 2);
        reloaded.key = RuleKey::Callee;
        let caller = Rule::new("caller", WindowKind::Fixed, 1_000, 3);
        let reloaded = RuleSet::build(RuleSpec::new(vec![caller, reloaded])).expect("rules");
        let b = batches();
        // (batch, its rules, the batch peeked behind it and its rules)
        type Step<'a> = (usize, &'a RuleSet, Option<(usize, &'a RuleSet)>);
        let steps: [Step; 5] = [
            (0, &first, Some((1, &first))),
            // Batch 0 again (retried), then 1: neither taken ahead.
            (0, &first, None),
            // A reload: the next batch comes with the new rules.
            (1, &first, Some((2, &reloaded))),
            (2, &reloaded, Some((3, &reloaded))),
            (3, &reloaded, None),
        ];
        let (mut plain, mut ahead) = (gated(), gated());
        for (k, &(j, rules, peek)) in steps.iter().enumerate() {
            let want = plain
                .apply_batch_partial(rules, &b[j])
                .await
                .expect("plain");
            let mut next = peek.map(|(n, rules)| Next {
                rules,
                events: &b[n],
            });
            let got = ahead
                .apply_batch_partial_ahead(rules, &b[j], &mut next)
                .await
                .expect("ahead");
            assert_eq!(got, want, "step {k}");
        }
        assert!(
            plain.stats().lease.short > 0,
            "the reloaded limit was reached"
        );
        // Batches 2 and 3 were taken as decided ahead.
        assert_eq!(ahead.taken_ahead(), 2);
        // Peeked under the first rules, it comes under the reloaded ones.
        let mut other = gated();
        let mut next = Some(Next {
            rules: &first,
            events: &b[1],
        });
        other
            .apply_batch_partial_ahead(&first, &b[0], &mut next)
            .await
            .expect("batch 0");
        other
            .apply_batch_partial(&reloaded, &b[1])
            .await
            .expect("batch 1");
        assert_eq!(other.taken_ahead(), 0);
    }

    /// A batch let go while the gate's thread decides the one queued
    /// behind (a deadline, a shutdown) and then tried again: the thread
    /// finishes first, and every record is a plain gate's.
    #[tokio::test]
    async fn a_batch_let_go_mid_way_changes_no_record() {
        use futures::FutureExt;
        let rules = rules(WindowKind::Fixed);
        let b = batches();
        let (mut plain, mut ahead) = (gated(), gated());
        let _ = plain.apply_batch_partial(&rules, &b[0]).await;
        // Queued behind: a batch long enough that the gate's thread is
        // still at it when the first poll returns, to callees and with ids
        // of its own (no record below depends on it).
        let long: Vec<CallEvent> = (0..20_000)
            .map(|k| CallEvent {
                call_id: format!("long{k}").into(),
                caller: format!("+346100{:05}", k % 97).into(),
                ts_ms: 1_000_000 + k as i64,
                callee: Some(format!("+3492{k:07}").into()),
                ..b[0][0].clone()
            })
            .collect();
        let mut next = Some(Next {
            rules: &rules,
            events: &long,
        });
        // (Polled once: the store is done, the gate's thread is not.)
        let let_go = ahead
            .apply_batch_partial_ahead(&rules, &b[0], &mut next)
            .now_or_never();
        assert!(let_go.is_none(), "the gate's thread was still deciding");
        for j in 0..3 {
            let want = plain
                .apply_batch_partial(&rules, &b[j])
                .await
                .expect("plain");
            let mut next = b.get(j + 1).map(|events| Next {
                rules: &rules,
                events,
            });
            let got = ahead
                .apply_batch_partial_ahead(&rules, &b[j], &mut next)
                .await
                .expect("ahead");
            assert_eq!(got, want, "batch {j}");
        }
        assert_eq!(ahead.taken_ahead(), 2);
    }
}

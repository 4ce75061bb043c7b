//! A window store behind the gate of the rules keyed by callee or global:
//! each batch's calls get those rules' counts from credits (leased from
//! Redis online, or from an in-process ledger) before the store decides
//! them with the caller's rules (see [`crate::engine::aggregate`]).

use crate::engine::aggregate::{Gate, Lease, LeaseRequest, MemoryLedger};
use crate::engine::event::CallEvent;
use crate::engine::record::Verdict;
use crate::engine::rules::RuleSet;
use crate::engine::window::CallerState;
use crate::error::StoreError;
use crate::store::redis::lease::{is_plain, RedisLedger};
use crate::store::{LeaseStats, StoreStats, Upcoming, WindowStore};
use tracing::debug;

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

/// `S` behind the gate.
#[derive(Debug)]
pub struct Gated<S> {
    inner: S,
    gate: Gate,
    ledger: Ledger,
    leased: LeaseStats,
}

impl<S: WindowStore> Gated<S> {
    /// `inner` behind a new gate taking credits from `ledger`.
    pub fn new(inner: S, ledger: Ledger) -> Self {
        Gated {
            inner,
            gate: Gate::new(),
            ledger,
            leased: LeaseStats::default(),
        }
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
        // (The batch queued behind, planned and leased for while the one
        // before was committed: see [`Gate::planned`].)
        let planned = self.gate.planned(events);
        if let Ledger::Redis(ledger) = &mut self.ledger {
            let newest = newest_of(events).max(newest_next.unwrap_or(i64::MIN));
            let reserves = ledger.reserves(newest, keep_ms(rules)).await?;
            self.gate.set_reserves(reserves);
        }
        let mut events = events.to_vec();
        let requests = if planned {
            debug_assert!(self.gate.holds(rules, &events), "planned ahead");
            Vec::new()
        } else {
            self.gate.plan(rules, &events)
        };
        if !requests.is_empty() {
            let (leases, micros) = timed(self.ledger.lease(&requests)).await;
            self.leased.micros += micros;
            let leases = leases.inspect_err(|_| self.gate.forget_plan())?;
            self.settle(&requests, &leases);
        }
        self.gate.decide(rules, &mut events);
        Ok(Some(events))
    }

    /// Decides `events` (gated) in the store while leasing the credits
    /// the next batch, if it has come, will need beyond those held, as
    /// [`Gate::plan`] would ask for them once `events` are decided (which
    /// they are: the gate decides before the store commits). A failed
    /// lease ahead is let go: `next` asks again when it comes, and meets
    /// the error then.
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
        let requests = match next.peek() {
            Some(n) if n.rules.has_aggregates() => self.gate.plan(n.rules, n.events),
            _ => Vec::new(),
        };
        if requests.is_empty() {
            return self.inner.apply_batch_partial(rules, batch).await;
        }
        let (inner, ledger) = (&mut self.inner, &mut self.ledger);
        let (verdicts, (leases, micros)) = futures::join!(
            inner.apply_batch_partial(rules, batch),
            timed(ledger.lease(&requests))
        );
        self.leased.micros += micros;
        match leases {
            Ok(leases) => self.settle(&requests, &leases),
            Err(e) => {
                self.gate.forget_plan();
                debug!(error = %e, "leasing ahead failed; the next batch asks again");
            }
        }
        verdicts
    }

    /// Takes a lease call's answers into the gate and the counts.
    fn settle(&mut self, requests: &[LeaseRequest], leases: &[Lease]) {
        self.count(requests, leases);
        self.gate.settle(requests, leases);
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
        .filter(|r| r.key.is_aggregate())
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

impl<S> Gated<S> {
    /// Counts a lease call that was answered.
    fn count(&mut self, requests: &[LeaseRequest], leases: &[Lease]) {
        let s = &mut self.leased;
        s.calls += 1;
        self.ledger.count(requests, s);
        for (r, l) in requests.iter().zip(leases) {
            s.granted += l.granted;
            s.short += r.want.saturating_sub(l.granted);
        }
    }
}

impl<S: WindowStore> WindowStore for Gated<S> {
    async fn apply_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, StoreError> {
        match self.gate(rules, events, None).await? {
            Some(gated) => self.inner.apply_batch(rules, &gated).await,
            None => self.inner.apply_batch(rules, events).await,
        }
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
                reserved: self.gate.reserved_counters(),
                ..self.leased
            },
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
            duration_ms: None,
            label: None,
            list_number: None,
            filter_callee: None,
            aggregate: None,
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
        }
    }
}

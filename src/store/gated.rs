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
use crate::store::{LeaseStats, StoreStats, WindowStore};

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
    async fn gate(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Option<Vec<CallEvent>>, StoreError> {
        if !rules.has_aggregates() {
            return Ok(None);
        }
        let mut events = events.to_vec();
        let requests = self.gate.plan(rules, &events);
        if !requests.is_empty() {
            let start = std::time::Instant::now();
            let leases = self.ledger.lease(&requests).await;
            self.leased.micros += start.elapsed().as_micros() as u64;
            let leases = leases?;
            self.count(&requests, &leases);
            self.gate.settle(&requests, &leases);
        }
        self.gate.decide(rules, &mut events);
        Ok(Some(events))
    }
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
        match self.gate(rules, events).await? {
            Some(gated) => self.inner.apply_batch(rules, &gated).await,
            None => self.inner.apply_batch(rules, events).await,
        }
    }

    async fn apply_batch_partial(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        match self.gate(rules, events).await? {
            Some(gated) => self.inner.apply_batch_partial(rules, &gated).await,
            None => self.inner.apply_batch_partial(rules, events).await,
        }
    }

    fn stats(&self) -> StoreStats {
        StoreStats {
            lease: self.leased,
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

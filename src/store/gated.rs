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
use crate::store::redis::lease::RedisLedger;
use crate::store::{StoreStats, WindowStore};

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
}

/// `S` behind the gate.
#[derive(Debug)]
pub struct Gated<S> {
    inner: S,
    gate: Gate,
    ledger: Ledger,
}

impl<S: WindowStore> Gated<S> {
    /// `inner` behind a new gate taking credits from `ledger`.
    pub fn new(inner: S, ledger: Ledger) -> Self {
        Gated {
            inner,
            gate: Gate::new(),
            ledger,
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
            let leases = self.ledger.lease(&requests).await?;
            self.gate.settle(&requests, &leases);
        }
        self.gate.decide(rules, &mut events);
        Ok(Some(events))
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
        self.inner.stats()
    }

    fn cached_state(&self, caller: &str) -> Option<CallerState> {
        self.inner.cached_state(caller)
    }

    async fn probe(&mut self) -> Result<(), StoreError> {
        self.inner.probe().await
    }
}

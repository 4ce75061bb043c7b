//! Credits of counters: what an instance asks a ledger for
//! ([`LeaseRequest`]), what it gets ([`Lease`]), and the ledger kept in
//! process ([`MemoryLedger`]; Redis's is `src/store/redis/aggregate/lease.rs`).

use super::counter::Buckets;
use super::{CounterId, MEMORY_MARGIN_MS};

/// A request for credits of one counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRequest {
    /// The counter.
    pub counter: CounterId,
    /// Sliding-approx: the previous bucket's credits are wanted too.
    pub approx: bool,
    /// The rule's limit.
    pub limit: u64,
    /// Credits wanted.
    pub want: u64,
    /// Credits of the previous bucket given back first.
    pub give_back: u64,
    /// How long the counter must live from its bucket's start, ms:
    /// `3 W + grace` (in Redis, its TTL from the lease, plus slack).
    pub ttl_ms: i64,
    /// The newest event time the gate saw before the batch (an in-memory
    /// ledger drops counters by it).
    pub now_ms: i64,
    /// The instance holds nothing of the counter yet: most often a key
    /// called once, far from its limit (Redis answers these by a plain
    /// increment rather than the script).
    pub cold: bool,
}

/// What a ledger answered to a [`LeaseRequest`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lease {
    /// Credits granted (maybe fewer than wanted, maybe none).
    pub granted: u64,
    /// Credits handed out for the counter so far, these included.
    pub total: u64,
    /// Credits handed out for the previous bucket (sliding-approx; 0 else).
    pub prev: u64,
}

/// Credits in process: the reference of Redis's lease (for one instance,
/// the same answers), the ledger of offline work (one instance, so counts
/// are exact) and of the local fallback (limits scaled by a share).
#[derive(Debug, Default)]
pub struct MemoryLedger {
    counters: Buckets<u64>,
    /// Limits are scaled by this (the local fallback's share).
    share: Option<f64>,
}

impl MemoryLedger {
    /// A ledger of whole limits.
    pub fn new() -> Self {
        MemoryLedger::default()
    }

    /// A ledger granting `share` of each limit (at least one call), for an
    /// instance deciding alone while Redis fails.
    pub fn with_share(share: f64) -> Self {
        MemoryLedger {
            share: Some(share.clamp(0.0, 1.0)),
            ..MemoryLedger::default()
        }
    }

    /// The limit a request is held to here.
    fn limit(&self, limit: u64) -> u64 {
        match self.share {
            // (A hair over, so a third of 9 is 3, not 2.999.)
            Some(share) => ((limit as f64 * share + 1e-9).floor() as u64).max(1),
            None => limit,
        }
    }

    /// Answers requests in order, as the lease script does.
    pub fn lease(&mut self, requests: &[LeaseRequest]) -> Vec<Lease> {
        requests.iter().map(|r| self.lease_one(r)).collect()
    }

    fn lease_one(&mut self, req: &LeaseRequest) -> Lease {
        self.expire(req.now_ms);
        let mut prev = 0;
        if req.give_back > 0 || req.approx {
            if let Some(p) = self.counters.get_mut(&req.counter.prev()) {
                *p = p.saturating_sub(req.give_back);
                if req.approx {
                    prev = *p;
                }
            }
        }
        let limit = self.limit(req.limit);
        let (granted, total) = match self.counters.get_mut(&req.counter) {
            Some(cur) => {
                let granted = req.want.min(limit.saturating_sub(*cur));
                *cur += granted;
                (granted, *cur)
            }
            None => {
                let granted = req.want.min(limit);
                if granted > 0 {
                    let at = req
                        .counter
                        .expires_at(req.ttl_ms)
                        .saturating_add(MEMORY_MARGIN_MS);
                    self.counters.insert(&req.counter, at, granted);
                }
                (granted, granted)
            }
        };
        Lease {
            granted,
            total,
            prev,
        }
    }

    fn expire(&mut self, now: i64) {
        while self.counters.pop_due(now).is_some() {}
    }
}

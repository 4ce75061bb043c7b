//! What `consume` and `serve` share around the window store: the
//! failure policy, the wall clock and the check of times ahead of it, and
//! the store's call itself (timed, its conflicts and failures counted,
//! readiness kept up to date). What each does with an undecided call (back
//! off, degrade, answer 503) stays with it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::engine::aggregate::{Gate, MemoryLedger};
use crate::engine::event::CallEvent;
use crate::engine::record::{Decision, Verdict};
use crate::engine::rules::RuleSet;
use crate::engine::window::CallerState;
use crate::error::{chain, EventError, StoreError};
use crate::online::metrics::{Health, Metrics};
use crate::store::memory::MemoryStore;
use crate::store::{Upcoming, WindowStore};

/// How often an idle `serve` or `consume` probes the store for `/readyz`.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

/// What to do when the window store fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StoreErrorPolicy {
    /// Stop consuming and retry with backoff; commit nothing meanwhile, so nothing is lost.
    #[default]
    Block,
    /// Allow the calls, flagged `degraded = true`, and keep going.
    Allow,
    /// Reject the calls, flagged `degraded = true`, and keep going.
    Reject,
    /// Decide the calls on this instance's own window state, kept in
    /// memory from the start of the outage, flagged `degraded = true`, and
    /// keep going; back to the store as soon as it answers.
    Local,
}

/// What happens to a call the store could not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// It waits (`consume`) or is answered 503 (`serve`).
    Wait,
    /// It gets this decision without its windows.
    Fixed(Decision),
    /// It is decided on the instance's own state ([`LocalFallback`]).
    Local,
}

pub use crate::online::clock::now_ms;

impl StoreErrorPolicy {
    /// What a call the store could not decide gets.
    pub fn fallback(self) -> Fallback {
        match self {
            StoreErrorPolicy::Block => Fallback::Wait,
            StoreErrorPolicy::Allow => Fallback::Fixed(Decision::Allow),
            StoreErrorPolicy::Reject => Fallback::Fixed(Decision::Reject),
            StoreErrorPolicy::Local => Fallback::Local,
        }
    }
}

/// The failure policy with what it keeps: the local state under `local`.
pub struct OnStoreError {
    /// The policy.
    pub policy: StoreErrorPolicy,
    local: LocalFallback,
}

impl OnStoreError {
    /// The policy, with no local state yet; `local_share` of each limit
    /// shared between instances is admitted locally under `local`.
    pub fn new(policy: StoreErrorPolicy, local_share: f64) -> Self {
        OnStoreError {
            policy,
            local: LocalFallback::new(local_share),
        }
    }

    /// Decides the calls the store left undecided (`None`) under the
    /// policy; gives the verdicts back unchanged under `block` (the calls
    /// wait, or are answered 503).
    /// `cached` is the store's in-process state of a caller, where the
    /// local fallback starts it from.
    pub fn settle(
        &mut self,
        events: &[CallEvent],
        verdicts: Vec<Option<Verdict>>,
        rules: &RuleSet,
        why: &str,
        metrics: &Metrics,
        cached: &dyn Fn(&str) -> Option<CallerState>,
    ) -> Result<Vec<Verdict>, Vec<Option<Verdict>>> {
        match self.policy.fallback() {
            Fallback::Wait => Err(verdicts),
            Fallback::Fixed(d) => Ok(degrade(events, verdicts, rules, d, why)),
            Fallback::Local => Ok(self
                .local
                .decide_locally(events, verdicts, rules, why, metrics, cached)),
        }
    }

    /// The store decided a whole batch: a local state is dropped.
    pub fn store_answered(&mut self) {
        self.local.store_answered();
    }
}

/// `--on-store-error local`: while the store fails, calls are decided by
/// the reference algorithm on window state this instance keeps in memory,
/// from the state the store held of the caller in process (the cached
/// store's cache: the caller as this instance last saw it), else from the
/// first call it decided so (counts start afresh). Each such record is flagged `degraded`. The
/// state is dropped once the store answers again, so the next outage
/// starts afresh too. The store never learns of these calls: after the
/// outage a caller's windows in Redis lack them. Rules keyed by callee or
/// global are decided on this instance's own credits, `share` of each
/// limit (at least one call per bucket): instances cannot agree while
/// Redis is gone, so each takes its part.
pub struct LocalFallback {
    store: MemoryStore,
    gate: Gate,
    ledger: MemoryLedger,
    share: f64,
    used: bool,
}

impl LocalFallback {
    /// No local state yet; `share` of shared limits.
    pub fn new(share: f64) -> Self {
        LocalFallback {
            store: MemoryStore::default(),
            gate: Gate::new(),
            ledger: MemoryLedger::with_share(share),
            share,
            used: false,
        }
    }

    /// The verdicts of `events`, every undecided one (`None`) decided on
    /// the local state, flagged degraded; logged with `why` the store
    /// failed, counted in `callguard_fallback_decisions_total`.
    pub fn decide_locally(
        &mut self,
        events: &[CallEvent],
        verdicts: Vec<Option<Verdict>>,
        rules: &RuleSet,
        why: &str,
        metrics: &Metrics,
        cached: &dyn Fn(&str) -> Option<CallerState>,
    ) -> Vec<Verdict> {
        if !self.used {
            warn!(error = %why, "store failed; deciding on this instance's own state");
            self.used = true;
        }
        let mut undecided: Vec<CallEvent> = events
            .iter()
            .zip(&verdicts)
            .filter(|(_, v)| v.is_none())
            .map(|(e, _)| e.clone())
            .collect();
        self.gate.run(&mut self.ledger, rules, &mut undecided);
        let mut local = undecided.iter();
        let mut seeded = foldhash::HashSet::default();
        verdicts
            .into_iter()
            .map(|v| {
                v.or_else(|| {
                    let e = local.next()?;
                    metrics.fallback_decisions.inc();
                    if !self.store.holds(&e.caller) {
                        if let Some(state) = cached(&e.caller) {
                            self.store.seed(&e.caller, state);
                            seeded.insert(e.caller.clone());
                        }
                    }
                    let mut v = self.store.apply(rules, e);
                    v.record.degraded = true;
                    // A state kept from the failed batch already holds its
                    // calls, decided as the store decided them before its
                    // write failed: this is their first answer.
                    v.duplicate &= !seeded.contains(&e.caller);
                    Some(v)
                })
            })
            .collect::<Option<Vec<_>>>()
            .unwrap_or_default()
    }

    /// The store answered: the local state of this outage is dropped.
    pub fn store_answered(&mut self) {
        if self.used {
            tracing::info!("store answers again; local fallback state dropped");
            *self = LocalFallback::new(self.share);
        }
    }
}

/// The verdicts of `events` with every undecided one (`None`) decided
/// `decision` without its windows, flagged degraded; logged once with
/// `why` the store failed.
pub fn degrade(
    events: &[CallEvent],
    verdicts: Vec<Option<Verdict>>,
    rules: &RuleSet,
    decision: Decision,
    why: &str,
) -> Vec<Verdict> {
    warn!(error = %why, decision = ?decision, "store failed; deciding degraded");
    events
        .iter()
        .zip(verdicts)
        .map(|(e, v)| v.unwrap_or_else(|| Verdict::degraded(e, rules, decision)))
        .collect()
}

/// Refuses an event whose time is more than `skew` ahead of the wall clock
/// (`ts_out_of_range`); `None` checks nothing.
pub fn check_future_skew(
    event: CallEvent,
    skew: Option<std::time::Duration>,
) -> Result<CallEvent, EventError> {
    let Some(skew) = skew else {
        return Ok(event);
    };
    let now = now_ms();
    if event.ts_ms > now.saturating_add(skew.as_millis() as i64) {
        return Err(EventError::TsOutOfRange {
            ts: event.ts_ms,
            why: format!(
                "more than {} s ahead of the wall clock ({now} ms)",
                skew.as_secs()
            ),
        });
    }
    Ok(event)
}

/// A check's time may lead the server clock by at most the grace: one
/// further ahead is decided at the server clock. A time far ahead would
/// otherwise become its caller's latest, and every later call of the
/// caller, older by more than the grace, would be late: counted 1 and
/// allowed (one check with a bad clock, or a forged one, would switch the
/// caller's limits off). The record, and what is produced to Kafka, carry
/// the time used.
pub fn clamp_to_clock(events: &mut [CallEvent], grace_ms: i64, now: i64, metrics: &Metrics) {
    let latest = now.saturating_add(grace_ms);
    for e in events.iter_mut().filter(|e| e.ts_ms > latest) {
        e.ts_ms = now;
        metrics.clamped.inc();
    }
}

/// Decides `events` through `store` ([`WindowStore::apply_batch_partial`]:
/// `None` for a call left undecided by contention; `next` tells it the
/// batch after, if that has come, to prepare for it) and records the call:
/// store latency, conflicts, `store_errors{kind}` (`contended` when calls
/// were left undecided), and the store's health and detail on a failure.
pub async fn apply_observed<S: WindowStore>(
    store: &mut S,
    rules: &RuleSet,
    events: &[CallEvent],
    next: &mut dyn Upcoming,
    metrics: &Metrics,
    health: &Health,
) -> Result<Vec<Option<Verdict>>, StoreError> {
    let start = Instant::now();
    let before = store.stats();
    let result = store.apply_batch_partial_ahead(rules, events, next).await;
    let took = start.elapsed().as_secs_f64();
    metrics.store_latency.observe(took);
    metrics.status.store_latency(took);
    metrics.count_store_stats(store.stats(), before, health);
    match &result {
        Ok(verdicts) => {
            health.store_ok.store(true, Ordering::Relaxed);
            if verdicts.iter().any(Option::is_none) {
                metrics.store_error("contended");
            }
        }
        Err(e) => {
            metrics.store_error(e.kind());
            health.store_ok.store(false, Ordering::Relaxed);
            if let Ok(mut d) = health.detail.lock() {
                *d = chain(e);
            }
        }
    }
    result
}

/// Whether the store answers, for `/readyz` while no call comes: a
/// probe failing turns readiness off with its reason, one succeeding
/// turns it back on (checks do the same through `apply_observed`).
pub async fn probe_store<S: WindowStore>(store: &mut S, metrics: &Metrics, health: &Health) {
    let before = store.stats();
    let probed = store.probe().await;
    metrics.count_store_stats(store.stats(), before, health);
    match probed {
        Ok(()) => health.store_ok.store(true, Ordering::Relaxed),
        Err(e) => {
            if health.store_ok.swap(false, Ordering::Relaxed) {
                warn!(error = %chain(&e), "the window store does not answer; not ready");
            }
            if let Ok(mut d) = health.detail.lock() {
                *d = chain(&e);
            }
        }
    }
}

/// Readiness while no work comes: [`IdleProbe::recv`] waits for the next
/// job and, while none comes, probes the store once a second
/// ([`probe_store`]), so `/readyz` follows the store, not the last batch.
pub struct IdleProbe {
    tick: tokio::time::Interval,
    last_job: Instant,
}

impl IdleProbe {
    /// Probes the store once now, so readiness starts from an answer
    /// rather than an assumption.
    pub async fn start<S: WindowStore>(store: &mut S, metrics: &Metrics, health: &Health) -> Self {
        probe_store(store, metrics, health).await;
        let mut tick = tokio::time::interval(PROBE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        IdleProbe {
            tick,
            last_job: Instant::now(),
        }
    }

    /// The next job from `rx` (`None` once it is closed), probing the store
    /// while none comes.
    pub async fn recv<T, S: WindowStore>(
        &mut self,
        rx: &mut tokio::sync::mpsc::Receiver<T>,
        store: &mut S,
        metrics: &Metrics,
        health: &Health,
    ) -> Option<T> {
        loop {
            tokio::select! {
                job = rx.recv() => {
                    self.last_job = Instant::now();
                    return job;
                }
                _ = self.tick.tick() => {
                    if self.last_job.elapsed() >= PROBE_EVERY {
                        probe_store(store, metrics, health).await;
                    }
                }
            }
        }
    }
}

//! Deciding a batch through the window store under the store-failure
//! policy, and counting what was decided.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::engine::event::CallEvent;
use crate::engine::record::{Decision, Verdict};
use crate::engine::rules::RuleSet;
use crate::error::{chain, ConsumeError};
use crate::online::consumer::{ConsumeStats, StoreErrorPolicy};
use crate::online::metrics::{Health, Metrics};
use crate::store::WindowStore;

/// Longest wait between retries of a blocked store.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Decides a batch under the failure policy; `None` if shutdown came while blocked.
pub(super) async fn decide<S: WindowStore, F: Future<Output = ()>>(
    store: &mut S,
    rules: &RuleSet,
    events: &[CallEvent],
    policy: StoreErrorPolicy,
    metrics: &Metrics,
    health: &Health,
    shutdown: &mut Pin<&mut F>,
) -> Option<Result<Vec<Verdict>, ConsumeError>> {
    let mut backoff = Duration::from_millis(50);
    loop {
        let start = Instant::now();
        let conflicts = store.conflicts();
        let result = store.apply_batch(rules, events).await;
        metrics.store_latency.observe(start.elapsed().as_secs_f64());
        metrics.count_conflicts(store, conflicts);
        let err = match result {
            Ok(v) => {
                health.store_ok.store(true, Ordering::Relaxed);
                return Some(Ok(v));
            }
            Err(e) => e,
        };
        Metrics::inc(&metrics.store_errors, err.kind());
        health.store_ok.store(false, Ordering::Relaxed);
        let why = chain(&err);
        if let Ok(mut d) = health.detail.lock() {
            d.clone_from(&why);
        }
        let decision = match policy {
            StoreErrorPolicy::Block => {
                if !err.is_transient() {
                    return Some(Err(err.into()));
                }
                warn!(error = %why, retry_in_ms = backoff.as_millis() as u64, "store failed; blocking");
                tokio::select! {
                    _ = shutdown.as_mut() => return None,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
            StoreErrorPolicy::Allow => Decision::Allow,
            StoreErrorPolicy::Reject => Decision::Reject,
        };
        warn!(error = %why, policy = ?policy, "store failed; deciding degraded");
        return Some(Ok(events
            .iter()
            .map(|e| Verdict::degraded(e, rules, decision))
            .collect()));
    }
}

/// Counts one decided call in the stats and metrics.
pub(super) fn count(metrics: &Metrics, stats: &mut ConsumeStats, v: &Verdict) {
    stats.decided += 1;
    stats.rejected += u64::from(v.record.decision == Decision::Reject);
    metrics.count_decided(v);
}

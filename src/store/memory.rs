//! The in-memory store: the reference semantics, in process.

use crate::decision::Verdict;
use crate::error::StoreError;
use crate::event::CallEvent;
use crate::rules::RuleSet;
use crate::store::WindowStore;
use crate::window::CallerState;

/// How many events between sweeps of idle callers.
const SWEEP_EVERY: u64 = 16_384;

/// Window state of all callers in a hash map.
///
/// Memory stays bounded: a caller whose latest event is more than the
/// idempotency horizon (at least the longest window + grace) behind the
/// newest event time seen is dropped. Dropping never changes a result while a
/// caller's events arrive in time order, since state older than the horizons
/// counts as no state.
#[derive(Debug, Default)]
pub struct MemoryStore {
    callers: foldhash::HashMap<String, CallerState>,
    watermark: Option<i64>,
    applied: u64,
    /// When (in events applied) to sweep next.
    next_sweep: u64,
    /// Keep every caller (no sweep): for streams whose partitions may run
    /// far apart in event time.
    keep_all: bool,
}

impl MemoryStore {
    /// An empty store that sweeps idle callers: for time-sorted input (replay).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that never drops a caller: for a stream, where one
    /// partition may run hours ahead of another in event time, so no global
    /// watermark says a caller is idle. Memory grows with distinct callers;
    /// production streams use the Redis store.
    pub fn keeping_all() -> Self {
        MemoryStore {
            keep_all: true,
            ..Self::default()
        }
    }

    /// Applies one event.
    pub fn apply(&mut self, rules: &RuleSet, ev: &CallEvent) -> Verdict {
        self.apply_with(rules, ev, true)
    }

    /// Applies one event; `remember = false` when its call id occurs
    /// nowhere else in the input (see [`CallerState::apply_with`]).
    pub fn apply_with(&mut self, rules: &RuleSet, ev: &CallEvent, remember: bool) -> Verdict {
        self.watermark = Some(self.watermark.map_or(ev.ts_ms, |w| w.max(ev.ts_ms)));
        self.applied += 1;
        // Sweeping costs one look at every caller, so sweep no more often
        // than once per that many events (amortised O(1) per event).
        if !self.keep_all && self.applied >= self.next_sweep {
            self.sweep(rules);
            self.next_sweep = self.applied + SWEEP_EVERY.max(self.callers.len() as u64);
        }
        match self.callers.get_mut(ev.caller.as_str()) {
            Some(state) => state.apply_with(rules, ev, remember),
            None => {
                let mut state = CallerState::default();
                let v = state.apply_with(rules, ev, remember);
                self.callers.insert(ev.caller.clone(), state);
                v
            }
        }
    }

    /// Number of callers with state.
    pub fn callers(&self) -> usize {
        self.callers.len()
    }

    /// Drops callers idle for longer than the idempotency horizon (at least
    /// the retention): on time-sorted input their next event would find
    /// every record of theirs past both horizons, as if they had no state.
    pub fn sweep(&mut self, rules: &RuleSet) {
        if let Some(w) = self.watermark {
            let cutoff = w - rules.dedup_ms();
            self.callers
                .retain(|_, s| s.latest().is_some_and(|l| l > cutoff));
        }
    }
}

impl WindowStore for MemoryStore {
    async fn apply_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, StoreError> {
        Ok(events.iter().map(|e| self.apply(rules, e)).collect())
    }

    async fn apply_batch_once(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
        once: &[bool],
    ) -> Result<Vec<Verdict>, StoreError> {
        Ok(events
            .iter()
            .enumerate()
            .map(|(i, e)| self.apply_with(rules, e, !once.get(i).copied().unwrap_or(false)))
            .collect())
    }
}

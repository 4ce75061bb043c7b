//! The in-memory store: the reference semantics, in process.

use crate::engine::event::{CallEvent, EventKind};
use crate::engine::record::Verdict;
use crate::engine::rules::RuleSet;
use crate::engine::window::{CallerState, LetGo};
use crate::error::StoreError;
use crate::store::WindowStore;

/// How many events at least between evictions of idle callers.
const EVICT_EVERY: u64 = 16_384;

/// Window state of all callers in a hash map.
///
/// Memory stays bounded: a caller whose state can no longer change a
/// decision is dropped ([`CallerState::may_let_go`]): one that keeps only
/// window counts once its latest call is more than the retention (longest
/// window + grace) plus the grace behind the newest event time seen, one
/// with idempotency records or calls in progress once that is more than the
/// idempotency horizon behind. Dropping never changes a result while a
/// caller's events arrive in time order, since state older than the horizons
/// counts as no state.
#[derive(Debug, Default)]
pub struct MemoryStore {
    /// Boxed: the table holds a key and a pointer per caller, so growing it
    /// moves (and faults in) 32 bytes a caller rather than a whole state.
    callers: foldhash::HashMap<compact_str::CompactString, Box<CallerState>>,
    watermark: Option<i64>,
    applied: u64,
    /// When (in events applied) to evict idle callers next.
    next_eviction: u64,
    /// Keep every caller (no eviction): for streams whose partitions may run
    /// far apart in event time.
    keep_all: bool,
    /// States of callers let go, emptied ([`CallerState::reset`]), for the
    /// next new callers: most callers of a log are new to the store (they
    /// call a few times a day, further apart than the windows), so each
    /// would otherwise allocate a state and free one. At most as many as
    /// events until the next eviction.
    #[expect(
        clippy::vec_box,
        reason = "the boxes go back into the table as they are, unmoved"
    )]
    spare: Vec<Box<CallerState>>,
}

impl MemoryStore {
    /// An empty store that evicts idle callers: for time-sorted input (replay).
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

    /// Starts `caller` from `state` unless it already has one here.
    pub fn seed(&mut self, caller: &str, state: CallerState) {
        self.callers
            .entry(caller.into())
            .or_insert_with(|| Box::new(state));
    }

    /// Whether `caller` has state here.
    pub fn holds(&self, caller: &str) -> bool {
        self.callers.contains_key(caller)
    }

    /// Applies one event.
    pub fn apply(&mut self, rules: &RuleSet, ev: &CallEvent) -> Verdict {
        self.apply_unique(rules, ev, false)
    }

    /// Applies one event; `unique = true` when its call id occurs nowhere
    /// else in the input (see [`CallerState::apply_unique`]).
    pub fn apply_unique(&mut self, rules: &RuleSet, ev: &CallEvent, unique: bool) -> Verdict {
        self.watermark = Some(self.watermark.map_or(ev.ts_ms, |w| w.max(ev.ts_ms)));
        self.applied += 1;
        // Evicting costs one look at every caller, so evict no more often
        // than once per that many events (amortised O(1) per event).
        if !self.keep_all && self.applied >= self.next_eviction {
            self.evict_idle(rules);
            self.next_eviction = self.applied + self.eviction_interval();
        }
        if ev.kind == EventKind::End && !rules.caller_uses_ends() {
            // Nothing holds calls open: the end changes nothing.
            return Verdict::of_end(ev, rules);
        }
        match self.callers.get_mut(ev.caller.as_str()) {
            Some(state) => state.apply_unique(rules, ev, unique),
            None => {
                let mut state = self.spare.pop().unwrap_or_default();
                let v = state.apply_unique(rules, ev, unique);
                self.callers.insert(ev.caller.clone(), state);
                v
            }
        }
    }

    /// Number of callers with state.
    pub fn callers(&self) -> usize {
        self.callers.len()
    }

    /// Drops the callers whose state can no longer change a decision
    /// ([`CallerState::may_let_go`]): on time-sorted input their next event
    /// decides as if they had none. A caller with only window counts goes
    /// once they are past the retention (plus the grace); one with
    /// idempotency records or calls in progress, past the idempotency
    /// horizon.
    pub fn evict_idle(&mut self, rules: &RuleSet) {
        let Some(w) = self.watermark else {
            return;
        };
        // The coming new callers are at most the events until the next
        // eviction: as many states are kept, emptied, for them.
        let before = self.eviction_interval() as usize;
        let cut = LetGo::new(rules, w);
        let spare = &mut self.spare;
        for (_, mut state) in self.callers.extract_if(|_, s| s.may_let_go_by(&cut)) {
            if spare.len() < before {
                state.reset();
                spare.push(state);
            }
        }
        let after = self.eviction_interval() as usize;
        self.spare.truncate(after);
    }

    /// Events between two evictions: a look at every caller once per as
    /// many events as callers (amortised O(1) per event), at least
    /// [`EVICT_EVERY`].
    fn eviction_interval(&self) -> u64 {
        EVICT_EVERY.max(self.callers.len() as u64)
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
}

//! Cached callers: their state, the version it was read or written at,
//! where their records and log are kept, and how long their keys live.

use compact_str::CompactString;

use crate::engine::rules::RuleSet;
use crate::engine::window::{CallerState, PackedLog};
use crate::store::redis::RedisConfig;

/// A caller's TTL is set to the needed span (the idempotency horizon plus
/// slack) plus a sixteenth of it, and refreshed only once that sixteenth
/// has passed: a busy caller's writes keep the TTL (`KEEPTTL`, no
/// `PEXPIRE`), and the keys still outlive the needed span after every write. (Wall-clock time, read here
/// for garbage collection only; decisions run on event time.)
const TTL_MARGIN_DIVISOR: u64 = 16;

/// The TTL of a batch's writes (see [`TTL_MARGIN_DIVISOR`]).
#[derive(Clone, Copy)]
pub(super) struct TtlPlan {
    /// What a write sets: the needed span plus the margin (ms).
    pub(super) ms: u64,
    /// When the batch started.
    pub(super) now: std::time::Instant,
    /// The span the keys must outlive from now: the idempotency horizon
    /// (or the retention without records) plus the slack.
    pub(super) needed: std::time::Duration,
}

impl TtlPlan {
    pub(super) fn new(config: &RedisConfig, rules: &RuleSet) -> Self {
        let needed = if config.idempotency {
            rules.dedup_ms()
        } else {
            rules.retention_ms()
        }
        .max(1) as u64
            + config.ttl_slack.as_millis() as u64;
        TtlPlan {
            ms: needed + needed / TTL_MARGIN_DIVISOR,
            now: std::time::Instant::now(),
            needed: std::time::Duration::from_millis(needed),
        }
    }

    /// Whether keys whose TTL runs out at `until` (at the earliest) still
    /// outlive the needed span from now. Compared with the rules of this
    /// batch, so a reload that lengthens the span sets the TTL again.
    pub(super) fn covered_by(&self, until: Option<std::time::Instant>) -> bool {
        until.is_some_and(|u| u >= self.now + self.needed)
    }

    /// When a TTL set by this batch runs out, at the earliest (Redis sets
    /// it a little later than `now`).
    pub(super) fn until(&self) -> std::time::Instant {
        self.now + std::time::Duration::from_millis(self.ms)
    }
}

/// A cached caller: its state and the version it was read or written at
/// (`None`: believed absent from Redis).
#[derive(Debug, Default)]
pub(super) struct Cached {
    pub(super) state: CallerState,
    pub(super) version: Option<u64>,
    /// When the TTL this store last set on the caller's keys runs out, at
    /// the earliest; `None`: unknown, so the next write sets it.
    pub(super) ttl_until: Option<std::time::Instant>,
    /// The batch that last used it (see [`super::CachedStore`]'s eviction).
    pub(super) used: u64,
    /// Where the sliding log is kept: `Inline` in the packed state, or
    /// apart (the string's times, of which the first `dead` are trimmed).
    pub(super) log: PackedLog,
    /// Where the records are kept.
    pub(super) records: Records,
    /// Records trimmed from the state but still in the records hash, to
    /// delete with the caller's next writes (see [`super::SCAN_COUNT`]).
    pub(super) stale: Vec<CompactString>,
}

/// Where a caller's records are kept in Redis.
#[derive(Debug)]
pub(super) enum Records {
    /// In its state string: each record's call id and text, as written.
    Inline(Vec<(CompactString, String)>),
    /// In its records hash.
    Apart,
}

impl Default for Records {
    fn default() -> Self {
        Records::Inline(Vec::new())
    }
}

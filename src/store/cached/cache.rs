//! Cached callers: their state, the version it was read or written at,
//! where their records and log are kept, and how long their keys live.

use std::mem::size_of;

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
        .max(rules.sums_span_ms())
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
    /// delete with the caller's next writes (see [`super::TRIM_COUNT`]).
    pub(super) stale: Vec<CompactString>,
    /// Its size when it went into the cache ([`Cached::approx_bytes`]).
    pub(super) bytes: usize,
    /// While its records are known in part ([`Records::Partial`]): its
    /// batches written at the first try in a row (see
    /// `super::SETTLED_AFTER`).
    pub(super) unopposed: u32,
}

impl Cached {
    /// About how many bytes of memory it holds.
    fn approx_bytes(&self) -> usize {
        let inline: usize = match &self.records {
            Records::Inline(list) => list
                .iter()
                .map(|(id, text)| size_of::<(CompactString, String)>() + id.len() + text.len())
                .sum(),
            Records::Apart | Records::Partial => 0,
        };
        size_of::<Self>()
            + self.state.approx_bytes()
            + inline
            + self.stale.len() * size_of::<CompactString>()
    }
}

/// The cached callers, bounded by count and by memory: past either bound,
/// callers idle beyond the idempotency horizon go first, then the least
/// recently used, down to three quarters of both (the next call of an
/// evicted caller reads it from Redis again; no record changes).
pub(super) struct Cache {
    map: foldhash::HashMap<CompactString, Box<Cached>>,
    max_callers: usize,
    max_bytes: usize,
    /// The entries' `bytes`, summed.
    bytes: usize,
    /// Batches so far: the clock of least recent use.
    clock: u64,
    /// Callers looked up ([`Cache::take`]), and of those found.
    lookups: u64,
    hits: u64,
    /// Callers dropped by [`Cache::evict`].
    evictions: u64,
}

impl Cache {
    pub(super) fn new(max_callers: usize, max_bytes: usize) -> Self {
        Cache {
            map: foldhash::HashMap::default(),
            max_callers: max_callers.max(1),
            max_bytes: max_bytes.max(1),
            bytes: 0,
            clock: 0,
            lookups: 0,
            hits: 0,
            evictions: 0,
        }
    }

    pub(super) fn set_max_bytes(&mut self, n: usize) {
        self.max_bytes = n.max(1);
    }

    /// Callers held.
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// About how many bytes the callers held take.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Forgets every caller.
    pub(super) fn clear(&mut self) {
        self.map.clear();
        self.bytes = 0;
    }

    /// A new batch begins.
    pub(super) fn tick(&mut self) {
        self.clock += 1;
    }

    /// The state held of `caller`, if any (not a use).
    pub(super) fn peek(&self, caller: &str) -> Option<&CallerState> {
        self.map.get(caller).map(|c| &c.state)
    }

    /// Takes `caller` out (a new, empty entry if it is not held): a
    /// lookup, and a hit if it was held.
    pub(super) fn take(&mut self, caller: &str) -> Box<Cached> {
        self.lookups += 1;
        let c = match self.map.remove(caller) {
            Some(c) => {
                self.hits += 1;
                c
            }
            None => Box::default(),
        };
        self.bytes -= c.bytes;
        c
    }

    /// Lookups, hits and evictions so far.
    pub(super) fn counts(&self) -> (u64, u64, u64) {
        (self.lookups, self.hits, self.evictions)
    }

    /// Puts `caller` back, used now.
    pub(super) fn put(&mut self, caller: impl Into<CompactString>, mut c: Box<Cached>) {
        c.used = self.clock;
        c.bytes = c.approx_bytes();
        self.bytes += c.bytes;
        if let Some(old) = self.map.insert(caller.into(), c) {
            self.bytes -= old.bytes;
        }
    }

    /// Keeps the cache within its bounds: callers whose latest call is at
    /// or before `idle_before` go first, then the least recently used.
    pub(super) fn evict(&mut self, idle_before: i64) {
        if !self.over(self.max_callers, self.max_bytes) {
            return;
        }
        self.retain(|c| c.state.latest().is_some_and(|l| l > idle_before));
        let (callers, bytes) = (self.max_callers / 4 * 3, self.max_bytes / 4 * 3);
        if !self.over(callers, bytes) {
            return;
        }
        // The least recently used first, until within both bounds.
        let mut by_use: Vec<(u64, usize, &CompactString)> =
            self.map.iter().map(|(k, c)| (c.used, c.bytes, k)).collect();
        by_use.sort_unstable_by_key(|&(used, _, _)| used);
        let (mut n, mut total) = (self.map.len(), self.bytes);
        let mut gone = Vec::new();
        for (_, b, k) in by_use {
            if n <= callers && total <= bytes {
                break;
            }
            n -= 1;
            total -= b;
            gone.push(k.clone());
        }
        for k in gone {
            if let Some(c) = self.map.remove(&k) {
                self.bytes -= c.bytes;
                self.evictions += 1;
            }
        }
    }

    fn over(&self, callers: usize, bytes: usize) -> bool {
        self.map.len() > callers || self.bytes > bytes
    }

    fn retain(&mut self, keep: impl Fn(&Cached) -> bool) {
        let (mut dropped, mut n) = (0, 0);
        self.map.retain(|_, c| {
            let k = keep(c);
            if !k {
                dropped += c.bytes;
                n += 1;
            }
            k
        });
        self.bytes -= dropped;
        self.evictions += n;
    }
}

/// Where a caller's records are kept in Redis.
#[derive(Debug)]
pub(super) enum Records {
    /// In its state string: each record's call id and text, as written.
    Inline(Vec<(CompactString, String)>),
    /// In its records hash.
    Apart,
    /// In its records hash, of which this store knows only some: a
    /// contended caller read back with only its batch's records (see
    /// `CachedStore::try_batch`). Its other records are neither trimmed
    /// nor moved back inline until the caller is read whole.
    Partial,
}

impl Default for Records {
    fn default() -> Self {
        Records::Inline(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::event::CallEvent;

    /// A caller's entry after `calls` calls ending at `latest`.
    fn entry(rules: &RuleSet, caller: &str, calls: i64, latest: i64) -> Box<Cached> {
        let mut c = Box::<Cached>::default();
        for i in 0..calls {
            let ev = CallEvent::new(format!("{caller}-{i}"), caller, latest - calls + 1 + i);
            c.state.apply(rules, &ev);
        }
        c
    }

    fn rules() -> RuleSet {
        RuleSet::from_args(None, &["s:sliding:60s:1000".into()]).unwrap()
    }

    #[test]
    fn the_least_recently_used_go_first_down_to_three_quarters() {
        let rules = rules();
        let mut cache = Cache::new(8, usize::MAX);
        for i in 0..9 {
            cache.tick();
            cache.put(
                format!("c{i}"),
                entry(&rules, &format!("c{i}"), 1, 1_000_000),
            );
        }
        // c0 is used again: c1 is now the least recently used.
        cache.tick();
        let c0 = cache.take("c0");
        cache.put("c0", c0);
        cache.evict(0);
        assert_eq!(cache.len(), 6);
        // One lookup (c0, held), three dropped.
        assert_eq!(cache.counts(), (1, 1, 3));
        drop(cache.take("c1"));
        assert_eq!(cache.counts(), (2, 1, 3));
        for gone in ["c1", "c2", "c3"] {
            assert!(!cache.map.contains_key(gone), "{gone} kept");
        }
        assert!(cache.map.contains_key("c0"));
    }

    #[test]
    fn idle_callers_go_before_busy_ones() {
        let rules = rules();
        let mut cache = Cache::new(4, usize::MAX);
        for i in 0..5 {
            cache.tick();
            // c4 is the most recently used but idle.
            let latest = if i == 4 { 10 } else { 1_000_000 };
            cache.put(format!("c{i}"), entry(&rules, &format!("c{i}"), 1, latest));
        }
        cache.evict(100);
        // The idle one, then the least recently used down to 3.
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.counts().2, 2, "both counted as evictions");
        assert!(!cache.map.contains_key("c4"));
        assert!(!cache.map.contains_key("c0"));
    }

    #[test]
    fn memory_is_bounded_and_accounted() {
        let rules = rules();
        let mut cache = Cache::new(1_000, usize::MAX);
        cache.tick();
        cache.put("busy", entry(&rules, "busy", 500, 1_000_000));
        let busy = cache.bytes();
        cache.tick();
        cache.put("quiet", entry(&rules, "quiet", 1, 1_000_000));
        let quiet = cache.bytes() - busy;
        assert!(
            busy > 500 * 8 + quiet,
            "a 500-call log counts: {busy} vs {quiet}"
        );
        // Over the bound by a byte: the older caller, the busy one, goes,
        // though two callers are far below the bound on their number.
        cache.set_max_bytes(busy + quiet - 1);
        cache.evict(0);
        assert!(!cache.map.contains_key("busy"));
        assert!(cache.map.contains_key("quiet"));
        assert_eq!(cache.bytes(), quiet);
        let taken = cache.take("quiet");
        assert_eq!(cache.bytes(), 0);
        cache.put("quiet", taken);
        assert_eq!(cache.bytes(), quiet);
        cache.clear();
        assert_eq!((cache.len(), cache.bytes()), (0, 0));
    }
}

//! The cached Redis store: window state decided in process, kept in Redis
//! with a version check.
//!
//! The window script ([`super::redis::RedisStore`]) runs the algorithm in
//! Redis: every event costs Redis several commands plus the script's own
//! work. Here callguard keeps each caller's [`CallerState`] in memory (a
//! consumer owns its partitions' callers, so after the first call the cache
//! is nearly always current), decides a batch with the reference engine,
//! and writes each touched caller back in one atomic `EVALSHA` of
//! `lua/commit.lua` per group of callers: the caller's state string (its
//! version, packed state and, while few, its records), a busy caller's new
//! and trimmed records, the block key. A new caller whose first write
//! needs nothing else is one plain `SET ... NX PX ... GET`, no script.
//!
//! Every write is conditional on the caller's version being the one the
//! cache read (optimistic concurrency). Another writer (a second
//! instance after a rebalance, `serve` beside `consume`, a cache entry
//! evicted and later recreated) changes the version: that caller is not
//! written, the script returns its current state, and callguard decides
//! that caller's calls again on it and commits again. Callers never share
//! state, so the others' writes stand. A caller not in the cache is first
//! assumed new (no key): right for most first sights, and when wrong it
//! costs one more round trip, not a read before every write.
//!
//! Records are the same strings the window script keeps and are read back
//! into the cache when a caller is loaded, so a redelivered call id gets the
//! same record back after a restart, a rebalance or an eviction.

use compact_str::CompactString;
use futures::StreamExt;
use redis::Value;

use crate::engine::event::CallEvent;
use crate::engine::record::{Decision, Verdict};
use crate::engine::rules::RuleSet;
use crate::engine::window::{CallerState, Journal, PackedLog};
use crate::error::StoreError;
use crate::store::redis::{classify, Conn, RedisConfig};
use crate::store::WindowStore;

#[cfg(test)]
mod protocol_tests;

/// The commit script (see its header for KEYS, ARGV and the reply).
pub const COMMIT_LUA: &str = include_str!("../../../lua/commit.lua");

/// This store's name for its way of keeping state (`--redis-mode cached`)
/// and the version of its key layout, as recorded in `<prefix>mode`.
pub const MODE: &str = "cached:2";

/// Most callers written by one script call (it holds Redis while it runs).
const CALLERS_PER_CALL: usize = 64;

/// Rounds of decide-and-commit before a batch gives up on a caller that
/// keeps changing under it (another writer deciding the same caller).
pub const DEFAULT_MAX_ROUNDS: usize = 8;

/// Why a caller's calls were left undecided. Names no caller: it reaches
/// answers, logs and readiness that other callers' calls share.
pub const CONTENDED: &str =
    "a caller changed under each of its commit rounds: another writer is deciding it";

/// A caller's TTL is set to the needed span (the idempotency horizon plus
/// slack) plus a sixteenth of it, and refreshed only once that sixteenth
/// has passed: a busy caller's writes keep the TTL (`KEEPTTL`, no
/// `PEXPIRE`), and the keys still outlive the needed span after every write. (Wall-clock time, read here
/// for garbage collection only; decisions run on event time.)
const TTL_MARGIN_DIVISOR: u64 = 16;

/// A caller's sliding log moves out of its packed state into a string of
/// fixed-width times (`<prefix>{<caller>}:l`) once it holds more times than
/// this, so a flooding caller's writes append its new times instead of
/// rewriting all of them; it moves back in below a quarter of it.
pub const DEFAULT_LOG_APART_ABOVE: usize = 128;

/// A caller's records move out of its state string into a hash
/// (`<prefix>{<caller>}:r`) once it holds more than this many, so a busy
/// caller's writes add its new records instead of rewriting all of them;
/// they move back in at a quarter of it.
pub const DEFAULT_RECORDS_APART_ABOVE: usize = 32;

/// Records read per call when loading a busy caller's records hash
/// (`HSCAN ... COUNT`), and most records deleted from it per write: a
/// flooding caller's records are read and trimmed a bounded amount at a
/// time, never in one call that holds Redis for long.
pub const SCAN_COUNT: usize = 1_000;

/// Default number of callers kept in memory.
pub const DEFAULT_CACHED_CALLERS: usize = 1_000_000;

/// The TTL of a batch's writes (see [`TTL_MARGIN_DIVISOR`]).
#[derive(Clone, Copy)]
struct TtlPlan {
    /// What a write sets: the needed span plus the margin (ms).
    ms: u64,
    /// When the batch started.
    now: std::time::Instant,
    /// The span the keys must outlive from now: the idempotency horizon
    /// (or the retention without records) plus the slack.
    needed: std::time::Duration,
}

impl TtlPlan {
    fn new(config: &RedisConfig, rules: &RuleSet) -> Self {
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
    fn covered_by(&self, until: Option<std::time::Instant>) -> bool {
        until.is_some_and(|u| u >= self.now + self.needed)
    }

    /// When a TTL set by this batch runs out, at the earliest (Redis sets
    /// it a little later than `now`).
    fn until(&self) -> std::time::Instant {
        self.now + std::time::Duration::from_millis(self.ms)
    }
}

/// A cached caller: its state and the version it was read or written at
/// (`None`: believed absent from Redis).
#[derive(Debug, Default)]
struct Cached {
    state: CallerState,
    version: Option<u64>,
    /// When the TTL this store last set on the caller's keys runs out, at
    /// the earliest; `None`: unknown, so the next write sets it.
    ttl_until: Option<std::time::Instant>,
    /// The batch that last used it (see [`CachedStore::evict`]).
    used: u64,
    /// Where the sliding log is kept: `Inline` in the packed state, or
    /// apart (the string's times, of which the first `dead` are trimmed).
    log: PackedLog,
    /// Where the records are kept.
    records: Records,
    /// Records trimmed from the state but still in the records hash, to
    /// delete with the caller's next writes (see [`SCAN_COUNT`]).
    stale: Vec<CompactString>,
}

/// Where a caller's records are kept in Redis.
#[derive(Debug)]
enum Records {
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

/// What a write does to a caller's records hash.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RecordsOp {
    /// Records inline; no hash.
    Inline,
    /// The hash: records set and deleted.
    Hash,
    /// The records moved out: the hash replaced by the ones set.
    Replace,
    /// The records moved back inline: the hash deleted.
    Delete,
}

impl RecordsOp {
    /// Its flag in the commit call's head (see `lua/commit.lua`).
    fn code(self) -> u8 {
        match self {
            RecordsOp::Inline => b'-',
            RecordsOp::Hash => b'H',
            RecordsOp::Replace => b'S',
            RecordsOp::Delete => b'D',
        }
    }
}

/// One caller's part of a batch while it is being decided.
struct Pending<'a> {
    caller: &'a str,
    /// Indices of its events in the batch, in order.
    events: Vec<usize>,
    /// Boxed, so the cache's table holds a pointer per caller: growing it
    /// moves a few bytes per caller, not the whole state.
    cached: Box<Cached>,
}

/// What one caller's commit writes (its keys are written into the call
/// from the caller, see [`CachedStore::invocation`]).
struct Write<'a> {
    caller: &'a str,
    /// Its caller's place in the batch's list of callers.
    pending: usize,
    /// Only check that the caller's version is `expected`; write nothing.
    check: bool,
    expected: Option<u64>,
    version: u64,
    /// The TTL to set (ms), or `None` to leave the keys'.
    ttl_ms: Option<u64>,
    log_op: LogOp,
    /// Where the log is after this write.
    log: PackedLog,
    /// The new state string (see `lua/commit.lua`).
    value: Vec<u8>,
    records_op: RecordsOp,
    sets: Vec<(CompactString, String)>,
    dels: Vec<CompactString>,
    block: Option<(CompactString, i64)>,
}

impl<'a> Write<'a> {
    /// The keys its commit declares, in `lua/commit.lua`'s order, as
    /// (head, tail) of `<prefix><head>{<caller>}<tail>`: the state string,
    /// then the log, the records hash and the block key when it touches
    /// them.
    fn key_parts(&self) -> impl Iterator<Item = (&'static str, &'static str)> {
        [
            Some(("", ":s")),
            (!matches!(self.log_op, LogOp::Inline)).then_some(("", ":l")),
            (self.records_op != RecordsOp::Inline).then_some(("", ":r")),
            self.block.is_some().then_some(("block:", "")),
        ]
        .into_iter()
        .flatten()
    }

    /// A write of nothing that only checks that the caller's version is
    /// still `cached`'s (its calls in the batch were all decided before).
    fn check(caller: &'a str, pending: usize, cached: &Cached) -> Self {
        Write {
            caller,
            pending,
            check: true,
            expected: cached.version,
            version: cached.version.unwrap_or_default(),
            ttl_ms: None,
            log_op: LogOp::Inline,
            log: cached.log,
            value: Vec::new(),
            records_op: RecordsOp::Inline,
            sets: Vec::new(),
            dels: Vec::new(),
            block: None,
        }
    }

    /// The TTL of a write that only creates a new caller's state string
    /// (no log or records apart, no block key): one plain `SET ... NX PX`,
    /// no script. `None` for any other write.
    fn plain_ttl(&self) -> Option<u64> {
        let plain = self.expected.is_none()
            && matches!(self.log_op, LogOp::Inline)
            && self.records_op == RecordsOp::Inline
            && self.block.is_none();
        self.ttl_ms.filter(|_| plain)
    }
}

/// Whether a caller's state string holds its whole state: records inline
/// and the sliding log in the packed state (else they are in other keys).
fn self_contained(value: &[u8]) -> bool {
    value.get(8) == Some(&0)
        && take_bytes(&value[9..])
            .and_then(|(packed, _)| CallerState::unpack(packed))
            .is_some_and(|(_, log)| log == PackedLog::Inline)
}

/// A refused write, with the caller's state as Redis holds it.
struct Refused {
    /// Which of the round's writes.
    write: usize,
    /// The state read; `None` when the caller was written again while its
    /// records were read (the next round reads it again).
    read: Option<Found>,
}

/// A caller's state as read from Redis.
struct Found {
    /// Its state string (`None`: the caller has none).
    value: Option<Vec<u8>>,
    /// Its records hash, as `HGETALL` returns it (empty unless kept apart).
    hash: Vec<Value>,
    /// Its log kept apart, if any.
    log: Option<Vec<u8>>,
}

/// A group of writes sent, and those of them that were refused.
struct Committed<'a> {
    writes: Vec<Write<'a>>,
    refused: Vec<Refused>,
}

/// What a write does to a caller's log kept apart.
enum LogOp {
    /// The log is in the packed state, and no string is kept.
    Inline,
    /// The string stays as it is.
    Keep,
    /// Times appended to the string.
    Append(Vec<u8>),
    /// The string replaced (created, compacted, or changed inside).
    Set(Vec<u8>),
    /// The log moved back into the packed state: the string deleted.
    Delete,
}

impl LogOp {
    /// Its flag in the commit call's head (see `lua/commit.lua`).
    fn code(&self) -> u8 {
        match self {
            LogOp::Inline => b'-',
            LogOp::Keep => b'K',
            LogOp::Append(_) => b'A',
            LogOp::Set(_) => b'S',
            LogOp::Delete => b'D',
        }
    }

    /// The times it sends, if any.
    fn bytes(&self) -> Option<&[u8]> {
        match self {
            LogOp::Append(b) | LogOp::Set(b) => Some(b),
            _ => None,
        }
    }
}

/// The fixed-width (little-endian `i64`) bytes of `times`.
fn time_bytes<'a>(times: impl Iterator<Item = &'a i64>) -> Vec<u8> {
    times.flat_map(|t| t.to_le_bytes()).collect()
}

/// Window state decided in process and kept in Redis under a version check.
pub struct CachedStore {
    conn: Conn,
    sha: String,
    config: RedisConfig,
    cache: foldhash::HashMap<CompactString, Box<Cached>>,
    max_callers: usize,
    /// Newest event time seen: callers idle past the idempotency horizon
    /// leave the cache first.
    watermark: i64,
    /// Commits refused because another writer had changed the caller.
    conflicts: u64,
    /// Writes refused because a caller believed new existed (a first
    /// sight after a restart, a rebalance or an eviction): misses, not
    /// conflicts.
    misses: u64,
    /// Batches so far (the cache's clock for least recent use).
    batches: u64,
    /// When the prefix's mode was last claimed (see [`crate::store::redis::CLAIM_EVERY`]).
    claimed: std::time::Instant,
    /// See [`DEFAULT_MAX_ROUNDS`].
    max_rounds: usize,
    /// See [`DEFAULT_LOG_APART_ABOVE`].
    log_apart_above: usize,
    /// See [`DEFAULT_RECORDS_APART_ABOVE`].
    records_apart_above: usize,
}

impl std::fmt::Debug for CachedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedStore")
            .field("config", &self.config)
            .field("cached_callers", &self.cache.len())
            .field("conflicts", &self.conflicts)
            .finish_non_exhaustive()
    }
}

impl CachedStore {
    /// Connects and loads the commit script; keeps at most `max_callers`
    /// callers in memory (more only cost re-reads, never a result).
    pub async fn connect(config: RedisConfig, max_callers: usize) -> Result<Self, StoreError> {
        let mut conn = Conn::open(&config).await?;
        conn.claim_mode(&config.key_prefix, MODE).await?;
        let sha = conn.load_script(COMMIT_LUA).await?;
        Ok(CachedStore {
            conn,
            sha,
            config,
            cache: foldhash::HashMap::default(),
            max_callers: max_callers.max(1),
            watermark: i64::MIN,
            conflicts: 0,
            misses: 0,
            batches: 0,
            claimed: std::time::Instant::now(),
            max_rounds: DEFAULT_MAX_ROUNDS,
            log_apart_above: DEFAULT_LOG_APART_ABOVE,
            records_apart_above: DEFAULT_RECORDS_APART_ABOVE,
        })
    }

    /// Gives up on a caller refused in `n` rounds in a row (default
    /// [`DEFAULT_MAX_ROUNDS`]; tests use 1 to leave a caller undecided at
    /// its first conflict).
    pub fn with_max_rounds(mut self, n: usize) -> Self {
        self.max_rounds = n.max(1);
        self
    }

    /// Keeps a caller's sliding log apart once it holds more than `n`
    /// times (default [`DEFAULT_LOG_APART_ABOVE`]; tests use small values
    /// to move logs in and out often).
    pub fn with_log_apart_above(mut self, n: usize) -> Self {
        self.log_apart_above = n.max(1);
        self
    }

    /// Keeps a caller's records apart once it holds more than `n` (default
    /// [`DEFAULT_RECORDS_APART_ABOVE`]; tests use small values to move
    /// records in and out often).
    pub fn with_records_apart_above(mut self, n: usize) -> Self {
        self.records_apart_above = n.max(1);
        self
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// Commits refused so far because another writer had changed the
    /// caller (each was decided again on the current state).
    pub fn conflicts(&self) -> u64 {
        self.conflicts
    }

    /// Writes refused so far because a caller believed new existed (its
    /// state was then read, and its calls decided on it).
    pub fn misses(&self) -> u64 {
        self.misses
    }

    /// Callers held in memory.
    pub fn cached_callers(&self) -> usize {
        self.cache.len()
    }

    /// Forgets every cached caller (the next call of each re-reads Redis).
    pub fn clear_cache(&mut self) {
        self.cache.clear();
    }

    /// The key of a caller's records kept apart, `<prefix>{<caller>}:r`.
    pub fn records_key(&self, caller: &str) -> String {
        self.config.caller_key(caller, ":r")
    }

    /// The key of a caller's state string, `<prefix>{<caller>}:s`.
    pub fn state_key(&self, caller: &str) -> String {
        self.config.caller_key(caller, ":s")
    }

    /// The key of a caller's sliding log kept apart, `<prefix>{<caller>}:l`.
    pub fn log_key(&self, caller: &str) -> String {
        self.config.caller_key(caller, ":l")
    }

    /// How a caller's log is written back, and where it then is: `old_len`
    /// times before the batch, `journal` what the batch did to them.
    fn log_write(
        &self,
        state: &CallerState,
        was: PackedLog,
        old_len: usize,
        journal: &Journal,
    ) -> (LogOp, PackedLog) {
        let log = state.log();
        let n = log.len();
        let whole = || {
            (
                LogOp::Set(time_bytes(log.iter())),
                PackedLog::Outside {
                    dead: 0,
                    len: n as u64,
                },
            )
        };
        match was {
            PackedLog::Inline if n > self.log_apart_above => whole(),
            PackedLog::Inline => (LogOp::Inline, PackedLog::Inline),
            PackedLog::Outside { .. } if n < self.log_apart_above / 4 => {
                (LogOp::Delete, PackedLog::Inline)
            }
            PackedLog::Outside { dead, len } => {
                // Only appended, and trimmed at the front among the times
                // kept before: the string's tail grows.
                if journal.log_inserted_inside || journal.log_trimmed > old_len {
                    return whole();
                }
                let dead = dead + journal.log_trimmed as u64;
                let appended = n - (old_len - journal.log_trimmed);
                if dead > n as u64 && dead > self.log_apart_above as u64 {
                    return whole(); // mostly trimmed: compact
                }
                let op = if appended == 0 {
                    LogOp::Keep
                } else {
                    LogOp::Append(time_bytes(log.iter().skip(n - appended)))
                };
                (
                    op,
                    PackedLog::Outside {
                        dead,
                        len: len + appended as u64,
                    },
                )
            }
        }
    }

    /// Decides `p`'s events on its cached state and says what to write.
    /// When every one of them was a call already decided (a duplicate
    /// changes no state), the write only checks that the caller's version
    /// is still the one cached, and writes nothing: the caller keeps its
    /// version, and a cache another writer made stale is still caught.
    fn decide<'a>(
        &self,
        rules: &RuleSet,
        events: &[CallEvent],
        (at, p): (usize, &mut Pending<'a>),
        verdicts: &mut [Option<Verdict>],
        ttl: TtlPlan,
    ) -> Write<'a> {
        let idem = self.config.idempotency;
        let mut journal = Journal::default();
        let old_len = p.cached.state.log().len();
        let mut made: Vec<(CompactString, String)> = Vec::new();
        let mut block = None;
        let mut changed = false;
        for &i in &p.events {
            let ev = &events[i];
            let v = p
                .cached
                .state
                .apply_journaled(rules, ev, !idem, &mut journal);
            if !v.duplicate {
                changed = true;
                if idem {
                    made.push((ev.call_id.clone(), v.to_reply()));
                }
                if self.config.block_keys && v.record.decision == Decision::Reject {
                    if let Some(ms) = v.record.retry_after_ms {
                        block = Some((v.record.reason.clone(), ms));
                    }
                }
            }
            verdicts[i] = Some(v);
        }
        if !changed {
            return Write::check(p.caller, at, &p.cached);
        }
        let state = &p.cached.state;
        let (records_op, sets, dels) = match &mut p.cached.records {
            Records::Inline(list) => {
                // Records trimmed leave; a record trimmed and made again in
                // this batch is replaced.
                if !made.is_empty() || !journal.dropped_records.is_empty() {
                    list.retain(|(id, _)| {
                        state.holds_record(id) && !made.iter().any(|(m, _)| m == id)
                    });
                    list.extend(made.drain(..).filter(|(id, _)| state.holds_record(id)));
                }
                if list.len() > self.records_apart_above {
                    let all = std::mem::take(list);
                    p.cached.records = Records::Apart;
                    (RecordsOp::Replace, all, Vec::new())
                } else {
                    (RecordsOp::Inline, Vec::new(), Vec::new())
                }
            }
            Records::Apart if state.record_count() <= self.records_apart_above / 4 => {
                let all = state
                    .records()
                    .map(|(id, v)| (CompactString::from(id), v.to_reply()))
                    .collect();
                p.cached.records = Records::Inline(all);
                p.cached.stale.clear();
                (RecordsOp::Delete, Vec::new(), Vec::new())
            }
            Records::Apart => {
                // Trimmed records leave the hash at most SCAN_COUNT a
                // write; the rest wait for the caller's next writes. A
                // record trimmed and then made again in this batch stays.
                let stale = &mut p.cached.stale;
                stale.append(&mut journal.dropped_records);
                let n = stale.len().min(SCAN_COUNT);
                let dels = stale
                    .drain(..n)
                    .filter(|id| !state.holds_record(id))
                    .collect();
                (RecordsOp::Hash, made, dels)
            }
        };
        let (log_op, log) = self.log_write(state, p.cached.log, old_len, &journal);
        let version = rand::random::<u64>() | 1;
        let value = state_value(version, state, log, &p.cached.records);
        let fresh = p.cached.version.is_some() && ttl.covered_by(p.cached.ttl_until);
        // SET drops a key's TTL, and a new hash has none: a replaced log
        // or records moved out get it again.
        let must_set_ttl = matches!(log_op, LogOp::Set(_)) || records_op == RecordsOp::Replace;
        Write {
            caller: p.caller,
            pending: at,
            check: false,
            expected: p.cached.version,
            version,
            ttl_ms: (!fresh || must_set_ttl).then_some(ttl.ms),
            log_op,
            log,
            value,
            records_op,
            sets,
            dels,
            block,
        }
    }

    /// The commit call for `writes`.
    /// Keys and arguments are those each write needs (most need the
    /// state key, a head and the new string), as `lua/commit.lua`'s header
    /// lays out.
    /// With `text`, the call carries the script's text (`EVAL`, which
    /// also loads it again), else its SHA.
    fn invocation(&self, writes: &[&Write<'_>], text: bool) -> redis::Cmd {
        let keys: usize = writes.iter().map(|w| w.key_parts().count()).sum();
        let mut cmd = redis::Cmd::with_capacity(
            2 + keys + writes.len() * 3,
            64 + writes.iter().map(|w| 96 + w.value.len()).sum::<usize>(),
        );
        if text {
            cmd.arg("EVAL").arg(COMMIT_LUA);
        } else {
            cmd.arg("EVALSHA").arg(&self.sha);
        }
        cmd.arg(keys);
        // The keys, built in one buffer rather than a string each.
        let mut key = String::new();
        for w in writes {
            for (head, tail) in w.key_parts() {
                self.config.write_tagged(&mut key, head, w.caller, tail);
                cmd.arg(key.as_str());
            }
        }
        for w in writes {
            let mut head = [0u8; 12];
            head[0] = if w.check { b'C' } else { w.log_op.code() };
            head[1] = w.records_op.code();
            head[2] = if w.block.is_some() { b'B' } else { b'-' };
            head[3] = if w.ttl_ms.is_some() { b'T' } else { b'-' };
            let head = match w.expected {
                Some(v) => {
                    head[4..].copy_from_slice(&v.to_le_bytes());
                    &head[..]
                }
                None => &head[..4],
            };
            cmd.arg(head).arg(&w.value[..]);
            if let Some(ms) = w.ttl_ms {
                cmd.arg(ms);
            }
            if let Some(bytes) = w.log_op.bytes() {
                cmd.arg(bytes);
            }
            if let Some((reason, ms)) = &w.block {
                cmd.arg(reason.as_str()).arg(*ms);
            }
            if matches!(w.records_op, RecordsOp::Hash | RecordsOp::Replace) {
                cmd.arg(w.sets.len()).arg(w.dels.len());
                for (id, record) in &w.sets {
                    cmd.arg(id.as_str()).arg(record);
                }
                for id in &w.dels {
                    cmd.arg(id.as_str());
                }
            }
        }
        cmd
    }

    /// Sends the writes (one pipeline; one per hash slot on a Cluster, run
    /// concurrently) and returns them with those that were refused.
    async fn commit<'a>(&self, writes: Vec<Write<'a>>) -> Result<Committed<'a>, redis::RedisError> {
        let groups = self
            .conn
            .groups(writes.len(), |i| self.state_key(writes[i].caller));
        let calls = groups
            .into_iter()
            .map(|group| self.commit_group(&writes, group));
        let mut refused = Vec::new();
        for outcome in futures::future::join_all(calls).await {
            refused.extend(outcome?);
        }
        Ok(Committed { writes, refused })
    }

    /// Sends the writes `group` of `writes` (all in one slot) in one
    /// pipeline and returns the refused ones with their callers' state.
    ///
    /// A plain write (see [`Write::plain_ttl`]) is one `SET ... NX PX ...
    /// GET` outside the script: it creates the caller's state string only
    /// if absent, or returns the string it found; the script also returns
    /// only the state string of a caller it did not write. When that
    /// string says the caller keeps records or a log apart, those are read
    /// back with it in one transaction, so a refusal always carries the
    /// caller's whole state.
    ///
    /// Each reply stands alone: a script call the server no longer knows
    /// (`NOSCRIPT`: restarted, flushed or failed over) ran nothing, and only
    /// that call is sent again, with the script's text, while the plain
    /// writes and other calls of the pipeline stand as written.
    async fn commit_group(
        &self,
        writes: &[Write<'_>],
        group: Vec<usize>,
    ) -> Result<Vec<Refused>, redis::RedisError> {
        let timeout = self.config.timeout * 2;
        let (plain, scripted): (Vec<usize>, Vec<usize>) = group
            .into_iter()
            .partition(|&i| writes[i].plain_ttl().is_some());
        let calls: Vec<Vec<&Write>> = scripted
            .chunks(CALLERS_PER_CALL)
            .map(|chunk| chunk.iter().map(|&i| &writes[i]).collect())
            .collect();
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for ws in &calls {
            pipe.add_command(self.invocation(ws, false));
        }
        let mut key = String::new();
        for &i in &plain {
            let w = &writes[i];
            self.config.write_tagged(&mut key, "", w.caller, ":s");
            pipe.cmd("SET")
                .arg(key.as_str())
                .arg(&w.value[..])
                .arg("NX")
                .arg("PX")
                .arg(w.plain_ttl())
                .arg("GET");
        }
        let mut conn = self.conn.clone();
        let replies = conn.query(&pipe, timeout).await?;
        if replies.len() != calls.len() + plain.len() {
            return Err(unexpected(format!(
                "{} replies to {} commands",
                replies.len(),
                calls.len() + plain.len()
            )));
        }
        let mut replies = replies.into_iter();
        // Per refused write, the state string found (nil: none).
        let mut found: Vec<(usize, Option<Vec<u8>>)> = Vec::new();
        for (ws, chunk) in calls.iter().zip(scripted.chunks(CALLERS_PER_CALL)) {
            let reply = match replies.next() {
                Some(Value::ServerError(e)) if e.code() == "NOSCRIPT" => {
                    let mut again = redis::pipe();
                    again.add_command(self.invocation(ws, true));
                    conn.query(&again, timeout).await?.pop()
                }
                reply => reply,
            };
            refusals(reply, chunk, &mut found)?;
        }
        // Plain writes: nil when written, else the string found.
        for (&i, reply) in plain.iter().zip(replies) {
            if let Some(value) = bulk(reply)? {
                found.push((i, Some(value)));
            }
        }
        let mut refused = Vec::new();
        let mut read_back = Vec::new();
        for (write, value) in found {
            match value {
                Some(value) if !self_contained(&value) => read_back.push(write),
                value => refused.push(Refused {
                    write,
                    read: Some(Found {
                        value,
                        hash: Vec::new(),
                        log: None,
                    }),
                }),
            }
        }
        if !read_back.is_empty() {
            refused.extend(self.read_back(&mut conn, writes, read_back).await?);
        }
        Ok(refused)
    }

    /// The whole state of the callers of `which` writes: state string,
    /// records hash and log kept apart, read in one transaction with the
    /// first [`SCAN_COUNT`] records; a busy caller's further records are
    /// read [`SCAN_COUNT`] at a time (`HSCAN`), so no call holds Redis for
    /// long, and its version is checked again after them: a caller written
    /// meanwhile comes back unread.
    async fn read_back(
        &self,
        conn: &mut Conn,
        writes: &[Write<'_>],
        which: Vec<usize>,
    ) -> Result<Vec<Refused>, redis::RedisError> {
        let mut pipe = redis::pipe();
        pipe.atomic();
        for &i in &which {
            let caller = writes[i].caller;
            pipe.cmd("GET").arg(self.state_key(caller));
            pipe.cmd("HSCAN")
                .arg(self.records_key(caller))
                .arg(0)
                .arg("COUNT")
                .arg(SCAN_COUNT);
            pipe.cmd("GET").arg(self.log_key(caller));
        }
        let mut it = conn
            .query(&pipe, self.config.timeout * 2)
            .await?
            .into_iter();
        let mut out = Vec::with_capacity(which.len());
        for write in which {
            let (Some(value), Some(scan), Some(log)) = (it.next(), it.next(), it.next()) else {
                return Err(unexpected("a malformed read back".into()));
            };
            let value = bulk(value)?;
            let (mut cursor, mut hash) = scanned(scan)?;
            if cursor != 0 {
                let records = self.records_key(writes[write].caller);
                while cursor != 0 {
                    let mut pipe = redis::pipe();
                    pipe.cmd("HSCAN")
                        .arg(&records)
                        .arg(cursor)
                        .arg("COUNT")
                        .arg(SCAN_COUNT);
                    let reply = conn.query(&pipe, self.config.timeout).await?.pop();
                    let (next, more) = scanned(reply.unwrap_or(Value::Nil))?;
                    hash.extend(more);
                    cursor = next;
                }
                let mut pipe = redis::pipe();
                pipe.cmd("GETRANGE")
                    .arg(self.state_key(writes[write].caller))
                    .arg(0)
                    .arg(7);
                let now = bulk(
                    conn.query(&pipe, self.config.timeout)
                        .await?
                        .pop()
                        .unwrap_or(Value::Nil),
                )?;
                let before = value.as_deref().and_then(|v| v.get(..8));
                if now.as_deref() != before {
                    // Written while its records were read: read again in
                    // the next round, which the round limit bounds.
                    out.push(Refused { write, read: None });
                    continue;
                }
                hash = distinct_fields(hash);
            }
            out.push(Refused {
                write,
                read: Some(Found {
                    value,
                    hash,
                    log: bulk(log)?,
                }),
            });
        }
        Ok(out)
    }

    /// One attempt at a batch: up to [`DEFAULT_MAX_ROUNDS`] rounds of deciding and
    /// committing the callers not yet written. The callers it touches are
    /// out of the cache while it runs and go back only once written: after
    /// a failure their next call re-reads Redis, whatever part of the
    /// writes landed. A caller still refused after the last round is left
    /// undecided (`None` for its calls; nothing of them was written).
    async fn try_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        self.batches += 1;
        let mut index: foldhash::HashMap<&str, usize> = foldhash::HashMap::default();
        let mut pending: Vec<Pending<'_>> = Vec::new();
        for (i, ev) in events.iter().enumerate() {
            self.watermark = self.watermark.max(ev.ts_ms);
            let at = *index.entry(ev.caller.as_str()).or_insert_with(|| {
                pending.push(Pending {
                    caller: ev.caller.as_str(),
                    events: Vec::new(),
                    cached: self.cache.remove(ev.caller.as_str()).unwrap_or_default(),
                });
                pending.len() - 1
            });
            pending[at].events.push(i);
        }
        let ttl = TtlPlan::new(&self.config, rules);
        let mut verdicts: Vec<Option<Verdict>> = vec![None; events.len()];
        let mut todo: Vec<usize> = (0..pending.len()).collect();
        for _ in 0..self.max_rounds {
            let outcomes = self
                .round(rules, events, &mut pending, &todo, &mut verdicts, ttl)
                .await
                .map_err(classify)?;
            let mut next = Vec::new();
            for Committed { writes, refused } in outcomes {
                let mut refused_set = vec![false; writes.len()];
                for r in refused {
                    refused_set[r.write] = true;
                    let w = &writes[r.write];
                    // A caller it had never seen is a miss, not a conflict.
                    match w.expected {
                        Some(_) => self.conflicts += 1,
                        None => self.misses += 1,
                    }
                    let p = &mut pending[w.pending];
                    if let Some(Found { value, hash, log }) = r.read {
                        *p.cached = load(p.caller, value, hash, log)?;
                    }
                    next.push(w.pending);
                }
                for (write, _) in writes.iter().zip(refused_set).filter(|(_, r)| !r) {
                    let cached = &mut pending[write.pending].cached;
                    cached.version = Some(write.version);
                    cached.log = write.log;
                    if write.ttl_ms.is_some() {
                        cached.ttl_until = Some(ttl.until());
                    }
                }
            }
            next.sort_unstable();
            todo = next;
            if todo.is_empty() {
                break;
            }
        }
        for &p in &todo {
            // Refused in every round: its calls stay undecided, and its
            // state (just read) is not kept, so its next call reads again.
            for &i in &pending[p].events {
                verdicts[i] = None;
            }
        }
        let mut contended = todo.into_iter().peekable();
        for (at, mut p) in pending.into_iter().enumerate() {
            if contended.next_if_eq(&at).is_none() {
                p.cached.used = self.batches;
                self.cache.insert(p.caller.into(), p.cached);
            }
        }
        self.evict(rules);
        Ok(verdicts)
    }

    /// One round: decides the callers `todo` of `pending` and commits
    /// what changed, a group of callers per script call. Each group is
    /// sent as soon as it is decided, so Redis runs one group's commit
    /// while the next is decided.
    async fn round<'a>(
        &self,
        rules: &RuleSet,
        events: &[CallEvent],
        pending: &mut [Pending<'a>],
        todo: &[usize],
        verdicts: &mut [Option<Verdict>],
        ttl: TtlPlan,
    ) -> Result<Vec<Committed<'a>>, redis::RedisError> {
        let mut inflight = futures::stream::FuturesOrdered::new();
        let mut outcomes = Vec::new();
        for group in todo.chunks(CALLERS_PER_CALL) {
            let writes: Vec<Write> = group
                .iter()
                .map(|&at| self.decide(rules, events, (at, &mut pending[at]), verdicts, ttl))
                .collect();
            inflight.push_back(self.commit(writes));
            // Start sending it (and let the connection's task write it).
            if let std::task::Poll::Ready(Some(out)) = futures::poll!(inflight.next()) {
                outcomes.push(out?);
            }
            tokio::task::yield_now().await;
        }
        while let Some(out) = inflight.next().await {
            outcomes.push(out?);
        }
        Ok(outcomes)
    }

    /// Keeps the cache within its size: callers idle past the idempotency
    /// horizon go first, then the least recently used, down to three
    /// quarters of the size (the next call of an evicted caller re-reads
    /// it).
    fn evict(&mut self, rules: &RuleSet) {
        if self.cache.len() <= self.max_callers {
            return;
        }
        let cutoff = self.watermark.saturating_sub(rules.dedup_ms());
        self.cache
            .retain(|_, c| c.state.latest().is_some_and(|l| l > cutoff));
        let excess = self.cache.len().saturating_sub(self.max_callers * 3 / 4);
        if excess > 0 {
            let mut used: Vec<u64> = self.cache.values().map(|c| c.used).collect();
            let (_, &mut oldest_kept, _) = used.select_nth_unstable(excess);
            self.cache.retain(|_, c| c.used >= oldest_kept);
        }
    }
}

/// The refused writes of one script call's `reply`, as indices of
/// `chunk` (the call's writes), with the state strings found.
fn refusals(
    reply: Option<Value>,
    chunk: &[usize],
    found: &mut Vec<(usize, Option<Vec<u8>>)>,
) -> Result<(), redis::RedisError> {
    let items = match reply {
        Some(Value::Array(items)) => items,
        Some(Value::ServerError(e)) => return Err(e.into()),
        other => return Err(unexpected(format!("{other:?}"))),
    };
    let mut it = items.into_iter();
    while let (Some(idx), Some(value)) = (it.next(), it.next()) {
        let Value::Int(idx) = idx else {
            return Err(unexpected("a malformed refusal".into()));
        };
        let at = usize::try_from(idx)
            .ok()
            .and_then(|i| chunk.get(i))
            .ok_or_else(|| unexpected(format!("caller index {idx}")))?;
        found.push((*at, bulk(value)?));
    }
    Ok(())
}

/// An `HSCAN` reply: the next cursor and the field/value pairs.
fn scanned(reply: Value) -> Result<(u64, Vec<Value>), redis::RedisError> {
    let Value::Array(mut parts) = reply else {
        return Err(unexpected(format!("HSCAN answered {reply:?}")));
    };
    let (Some(Value::Array(items)), Some(cursor)) = (parts.pop(), parts.pop()) else {
        return Err(unexpected("a malformed HSCAN reply".into()));
    };
    let cursor = text(&cursor)
        .and_then(|c| std::str::from_utf8(c).ok()?.parse().ok())
        .ok_or_else(|| unexpected("an HSCAN cursor".into()))?;
    Ok((cursor, items))
}

/// Field/value pairs with each field once (`HSCAN` may return a field
/// twice across calls).
fn distinct_fields(pairs: Vec<Value>) -> Vec<Value> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(pairs.len());
    let mut it = pairs.into_iter();
    while let (Some(field), Some(value)) = (it.next(), it.next()) {
        if text(&field).is_some_and(|f| seen.insert(f.to_vec())) {
            out.push(field);
            out.push(value);
        }
    }
    out
}

/// A string of a reply, or nil.
fn bulk(v: Value) -> Result<Option<Vec<u8>>, redis::RedisError> {
    match v {
        Value::BulkString(b) => Ok(Some(b)),
        Value::Nil => Ok(None),
        Value::ServerError(e) => Err(e.into()),
        other => Err(unexpected(format!("{other:?}"))),
    }
}

/// A caller's state string (see `lua/commit.lua`): version, form, the
/// packed window state and the records when inline.
fn state_value(version: u64, state: &CallerState, log: PackedLog, records: &Records) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&version.to_le_bytes());
    let mut packed = Vec::with_capacity(48);
    state.pack(&mut packed, log);
    match records {
        Records::Inline(list) => {
            out.push(0);
            put_bytes(&mut out, &packed);
            for (id, record) in list {
                put_bytes(&mut out, id.as_bytes());
                put_bytes(&mut out, record.as_bytes());
            }
        }
        Records::Apart => {
            out.push(1);
            put_bytes(&mut out, &packed);
        }
    }
    out
}

/// `bytes` after their length (LEB128).
fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    let mut n = bytes.len() as u64;
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
    out.extend_from_slice(bytes);
}

/// The bytes at the front of `input` after their length (LEB128), and the
/// rest.
fn take_bytes(input: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut n: u64 = 0;
    for (i, &b) in input.iter().enumerate().take(10) {
        n |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            let rest = &input[i + 1..];
            let n = usize::try_from(n).ok().filter(|&n| n <= rest.len())?;
            return Some(rest.split_at(n));
        }
    }
    None
}

fn unexpected(what: String) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Client,
        "unexpected commit script reply",
        what,
    ))
}

fn text(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

/// A caller's cache entry from its state string, records hash (as HGETALL
/// returns it) and log kept apart; no state string: a new caller.
fn load(
    caller: &str,
    value: Option<Vec<u8>>,
    hash: Vec<Value>,
    log: Option<Vec<u8>>,
) -> Result<Cached, StoreError> {
    let bad = |what: &str| {
        StoreError::fatal(format!(
            "unreadable window state of caller {caller} in Redis: {what}"
        ))
    };
    let Some(value) = value else {
        return Ok(Cached::default());
    };
    let (version, rest) = value
        .split_first_chunk::<8>()
        .ok_or_else(|| bad("too short"))?;
    let version = u64::from_le_bytes(*version);
    let (&form, rest) = rest.split_first().ok_or_else(|| bad("too short"))?;
    let (packed, mut rest) = take_bytes(rest).ok_or_else(|| bad("packed state"))?;
    let (mut state, log_form) = CallerState::unpack(packed).ok_or_else(|| bad("packed state"))?;
    if let PackedLog::Outside { dead, len } = log_form {
        let bytes = log.unwrap_or_default();
        let times: Option<std::collections::VecDeque<i64>> =
            (bytes.len() as u64 == len * 8 && dead <= len).then(|| {
                bytes
                    .chunks_exact(8)
                    .skip(dead as usize)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect()
            });
        times
            .and_then(|t| state.restore_log(t))
            .ok_or_else(|| bad("log kept apart"))?;
    }
    let restore = |state: &mut CallerState, id: &[u8], rec: &[u8]| {
        let (Ok(id), Ok(rec)) = (std::str::from_utf8(id), std::str::from_utf8(rec)) else {
            return Err(bad("record not UTF-8"));
        };
        let verdict = Verdict::from_stored(rec, id, caller, false).ok_or_else(|| bad(rec))?;
        state.restore_record(id, verdict);
        Ok((CompactString::from(id), rec.to_string()))
    };
    let records = match form {
        0 => {
            let mut list = Vec::new();
            while !rest.is_empty() {
                let (id, after) = take_bytes(rest).ok_or_else(|| bad("record id"))?;
                let (rec, after) = take_bytes(after).ok_or_else(|| bad("record"))?;
                list.push(restore(&mut state, id, rec)?);
                rest = after;
            }
            Records::Inline(list)
        }
        1 => {
            let mut it = hash.iter();
            while let (Some(id), Some(rec)) = (it.next(), it.next()) {
                let (Some(id), Some(rec)) = (text(id), text(rec)) else {
                    return Err(bad("record not a string"));
                };
                restore(&mut state, id, rec)?;
            }
            Records::Apart
        }
        _ => return Err(bad("unknown form")),
    };
    Ok(Cached {
        state,
        version: Some(version),
        ttl_until: None,
        used: 0,
        stale: Vec::new(),
        log: log_form,
        records,
    })
}

impl WindowStore for CachedStore {
    fn conflicts(&self) -> u64 {
        self.conflicts
    }

    async fn apply_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, StoreError> {
        self.apply_batch_partial(rules, events)
            .await?
            .into_iter()
            .collect::<Option<Vec<Verdict>>>()
            .ok_or_else(|| StoreError::transient(CONTENDED))
    }

    async fn apply_batch_partial(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Option<Verdict>>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let prefix = &self.config.key_prefix;
        self.conn
            .keep_mode_every(prefix, MODE, &mut self.claimed)
            .await?;
        self.try_batch(rules, events).await
    }
}

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
use crate::store::redis::{classify, is_noscript, Conn, RedisConfig};
use crate::store::WindowStore;

/// The commit script (see its header for KEYS, ARGV and the reply).
pub const COMMIT_LUA: &str = include_str!("../../lua/commit.lua");

/// This store's name for its way of keeping state (`--redis-mode cached`)
/// and the version of its key layout, as recorded in `<prefix>mode`.
pub const MODE: &str = "cached:2";

/// Most callers written by one script call (it holds Redis while it runs).
const CALLERS_PER_CALL: usize = 64;

/// Rounds of decide-and-commit before a batch gives up on a caller that
/// keeps changing under it (another writer deciding the same caller).
const MAX_ROUNDS: usize = 8;

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

/// Default number of callers kept in memory.
pub const DEFAULT_CACHED_CALLERS: usize = 1_000_000;

/// The TTL of a batch's writes (see [`TTL_MARGIN_DIVISOR`]).
#[derive(Clone, Copy)]
struct TtlPlan {
    /// What a write sets: the needed span plus the margin (ms).
    ms: u64,
    /// When the batch started.
    now: std::time::Instant,
    /// Until when a TTL set now still covers the needed span.
    fresh_until: std::time::Instant,
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
        let margin = needed / TTL_MARGIN_DIVISOR;
        let now = std::time::Instant::now();
        TtlPlan {
            ms: needed + margin,
            now,
            fresh_until: now + std::time::Duration::from_millis(margin),
        }
    }
}

/// A cached caller: its state and the version it was read or written at
/// (`None`: believed absent from Redis).
#[derive(Debug, Default)]
struct Cached {
    state: CallerState,
    version: Option<u64>,
    /// Until when the TTL this store last set on the caller's keys still
    /// covers a full TTL from now (see [`TTL_MARGIN_DIVISOR`]); `None`:
    /// unknown, so the next write sets it.
    ttl_fresh_until: Option<std::time::Instant>,
    /// Where the sliding log is kept: `Inline` in the packed state, or
    /// apart (the string's times, of which the first `dead` are trimmed).
    log: PackedLog,
    /// Where the records are kept.
    records: Records,
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

impl Write<'_> {
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

/// A commit's outcome: the index of its first write in the round, its
/// writes, and per refused write its index and the caller's current state.
type Committed<'a> = (usize, Vec<Write<'a>>, Vec<Refused>);

/// A refused write: its index, the caller's state string, records hash
/// and log kept apart.
type Refused = (usize, Option<Vec<u8>>, Vec<Value>, Option<Vec<u8>>);

/// Why an attempt at a batch failed.
enum Failed {
    /// The server does not know the script (restarted or flushed).
    NoScript,
    /// Any other store error.
    Store(StoreError),
}

impl From<StoreError> for Failed {
    fn from(e: StoreError) -> Self {
        Failed::Store(e)
    }
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
            log_apart_above: DEFAULT_LOG_APART_ABOVE,
            records_apart_above: DEFAULT_RECORDS_APART_ABOVE,
        })
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
    fn decide<'a>(
        &self,
        rules: &RuleSet,
        events: &[CallEvent],
        p: &mut Pending<'a>,
        verdicts: &mut [Option<Verdict>],
        ttl: TtlPlan,
    ) -> Write<'a> {
        let idem = self.config.idempotency;
        let mut journal = Journal::default();
        let old_len = p.cached.state.log().len();
        let mut made: Vec<(CompactString, String)> = Vec::new();
        let mut block = None;
        for &i in &p.events {
            let ev = &events[i];
            let v = p
                .cached
                .state
                .apply_journaled(rules, ev, !idem, &mut journal);
            if !v.duplicate {
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
                (RecordsOp::Delete, Vec::new(), Vec::new())
            }
            Records::Apart => {
                // A record trimmed and then made again in this batch stays.
                let dels = journal
                    .dropped_records
                    .iter()
                    .filter(|id| !state.holds_record(id))
                    .cloned()
                    .collect();
                (RecordsOp::Hash, made, dels)
            }
        };
        let (log_op, log) = self.log_write(state, p.cached.log, old_len, &journal);
        let version = rand::random::<u64>() | 1;
        let value = state_value(version, state, log, &p.cached.records);
        let fresh = matches!(p.cached.ttl_fresh_until,
            Some(until) if p.cached.version.is_some() && ttl.now < until);
        // SET drops a key's TTL, and a new hash has none: a replaced log
        // or records moved out get it again.
        let must_set_ttl = matches!(log_op, LogOp::Set(_)) || records_op == RecordsOp::Replace;
        Write {
            caller: p.caller,
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
    fn invocation(&self, writes: &[&Write<'_>]) -> redis::Cmd {
        let keys: usize = writes.iter().map(|w| w.key_parts().count()).sum();
        let mut cmd = redis::Cmd::with_capacity(
            2 + keys + writes.len() * 3,
            64 + writes.iter().map(|w| 96 + w.value.len()).sum::<usize>(),
        );
        cmd.arg("EVALSHA").arg(&self.sha).arg(keys);
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
            head[0] = w.log_op.code();
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
    /// concurrently) and returns `base`, the writes and, per write that was
    /// refused, its index and the caller's current state.
    ///
    /// A plain write (see [`Write::plain_ttl`]) is one `SET ... NX PX ...
    /// GET` outside the script: it creates the caller's state string only
    /// if absent, or returns the string it found; the script also returns
    /// only the state string of a caller it did not write. When that
    /// string says the caller keeps records or a log apart, those are read
    /// back with it in one transaction, so a refusal always carries the
    /// caller's whole state.
    async fn commit<'a>(
        &self,
        writes: Vec<Write<'a>>,
        base: usize,
    ) -> Result<Committed<'a>, redis::RedisError> {
        let groups = self
            .conn
            .groups(writes.len(), |i| self.state_key(writes[i].caller));
        let timeout = self.config.timeout * 2;
        let calls = groups.into_iter().map(|group| {
            // Plain writes with their TTLs, and the scripted ones.
            let mut plain: Vec<(usize, u64)> = Vec::new();
            let mut scripted: Vec<usize> = Vec::new();
            for &i in &group {
                match writes[i].plain_ttl() {
                    Some(ttl) => plain.push((i, ttl)),
                    None => scripted.push(i),
                }
            }
            let mut pipe = redis::pipe();
            for chunk in scripted.chunks(CALLERS_PER_CALL) {
                let ws: Vec<&Write> = chunk.iter().map(|&i| &writes[i]).collect();
                pipe.add_command(self.invocation(&ws));
            }
            let mut key = String::new();
            for &(i, ttl) in &plain {
                let w = &writes[i];
                self.config.write_tagged(&mut key, "", w.caller, ":s");
                pipe.cmd("SET")
                    .arg(key.as_str())
                    .arg(&w.value[..])
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl)
                    .arg("GET");
            }
            let mut conn = self.conn.clone();
            let writes = &writes;
            async move {
                let replies = conn.query(&pipe, timeout).await?;
                let n_calls = scripted.len().div_ceil(CALLERS_PER_CALL);
                if replies.len() != n_calls + plain.len() {
                    return Err(unexpected(format!(
                        "{} replies to {} commands",
                        replies.len(),
                        n_calls + plain.len()
                    )));
                }
                let mut replies = replies.into_iter();
                // Per refused write, the state string found (nil: none).
                let mut found: Vec<(usize, Option<Vec<u8>>)> = Vec::new();
                for (chunk, reply) in scripted.chunks(CALLERS_PER_CALL).zip(replies.by_ref()) {
                    let Value::Array(items) = reply else {
                        return Err(unexpected(format!("{reply:?}")));
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
                }
                // Plain writes: nil when written, else the string found.
                for (&(i, _), reply) in plain.iter().zip(replies) {
                    if let Some(value) = bulk(reply)? {
                        found.push((i, Some(value)));
                    }
                }
                let mut refused = Vec::new();
                let mut read_back = Vec::new();
                for (i, value) in found {
                    match value {
                        Some(value) if !self_contained(&value) => read_back.push(i),
                        value => refused.push((i, value, Vec::new(), None)),
                    }
                }
                if !read_back.is_empty() {
                    let mut pipe = redis::pipe();
                    pipe.atomic();
                    for &i in &read_back {
                        let caller = writes[i].caller;
                        pipe.cmd("GET").arg(self.state_key(caller));
                        pipe.cmd("HGETALL").arg(self.records_key(caller));
                        pipe.cmd("GET").arg(self.log_key(caller));
                    }
                    let mut it = conn.query(&pipe, timeout).await?.into_iter();
                    for &i in &read_back {
                        let (Some(value), Some(Value::Array(hash)), Some(log)) =
                            (it.next(), it.next(), it.next())
                        else {
                            return Err(unexpected("a malformed read back".into()));
                        };
                        refused.push((i, bulk(value)?, hash, bulk(log)?));
                    }
                }
                Ok(refused)
            }
        });
        let mut refused = Vec::new();
        for outcome in futures::future::join_all(calls).await {
            refused.extend(outcome?);
        }
        Ok((base, writes, refused))
    }

    /// One attempt at a batch. The callers it touches are out of the cache
    /// while it runs and go back only on success: after a failure their
    /// next call re-reads Redis, whatever part of the writes landed.
    async fn try_batch(
        &mut self,
        rules: &RuleSet,
        events: &[CallEvent],
    ) -> Result<Vec<Verdict>, Failed> {
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
        for _ in 0..MAX_ROUNDS {
            // Each group of callers is sent as soon as it is decided, so
            // Redis runs one group's commit while the next is decided.
            let mut inflight = futures::stream::FuturesOrdered::new();
            let mut outcomes = Vec::new();
            for (g, group) in todo.chunks(CALLERS_PER_CALL).enumerate() {
                let writes: Vec<Write> = group
                    .iter()
                    .map(|&p| self.decide(rules, events, &mut pending[p], &mut verdicts, ttl))
                    .collect();
                inflight.push_back(self.commit(writes, g * CALLERS_PER_CALL));
                // Start sending it (and let the connection's task write it).
                if let std::task::Poll::Ready(Some(out)) = futures::poll!(inflight.next()) {
                    outcomes.push(out);
                }
                tokio::task::yield_now().await;
            }
            while let Some(out) = inflight.next().await {
                outcomes.push(out);
            }
            drop(inflight);
            let mut next = Vec::new();
            for out in outcomes {
                let (base, writes, refused) = out.map_err(|e| {
                    if is_noscript(&e) {
                        Failed::NoScript
                    } else {
                        Failed::Store(classify(e))
                    }
                })?;
                let mut refused_set = vec![false; writes.len()];
                for (w, value, hash, log) in refused {
                    refused_set[w] = true;
                    let p = &mut pending[todo[base + w]];
                    *p.cached = load(p.caller, value, hash, log)?;
                    next.push(todo[base + w]);
                }
                for (w, write) in writes.iter().enumerate() {
                    if !refused_set[w] {
                        let cached = &mut pending[todo[base + w]].cached;
                        cached.version = Some(write.version);
                        cached.log = write.log;
                        if write.ttl_ms.is_some() {
                            cached.ttl_fresh_until = Some(ttl.fresh_until);
                        }
                    }
                }
            }
            self.conflicts += next.len() as u64;
            next.sort_unstable();
            todo = next;
            if todo.is_empty() {
                break;
            }
        }
        if let Some(&p) = todo.first() {
            return Err(Failed::Store(StoreError::transient(format!(
                "caller {} changed under each of {MAX_ROUNDS} commits: another writer is deciding it",
                pending[p].caller
            ))));
        }
        for p in pending {
            self.cache.insert(p.caller.into(), p.cached);
        }
        self.evict(rules);
        verdicts
            .into_iter()
            .map(|v| v.ok_or_else(|| Failed::Store(StoreError::fatal("a call was left undecided"))))
            .collect()
    }

    /// Keeps the cache within its size: callers idle past the idempotency
    /// horizon go first, then any (the next call of an evicted caller
    /// re-reads it).
    fn evict(&mut self, rules: &RuleSet) {
        if self.cache.len() <= self.max_callers {
            return;
        }
        let cutoff = self.watermark.saturating_sub(rules.dedup_ms());
        self.cache
            .retain(|_, c| c.state.latest().is_some_and(|l| l > cutoff));
        let mut excess = self.cache.len().saturating_sub(self.max_callers * 3 / 4);
        if excess > 0 {
            self.cache.retain(|_, _| {
                let keep = excess == 0;
                excess = excess.saturating_sub(1);
                keep
            });
        }
    }
}

/// A string of a reply, or nil.
fn bulk(v: Value) -> Result<Option<Vec<u8>>, redis::RedisError> {
    match v {
        Value::BulkString(b) => Ok(Some(b)),
        Value::Nil => Ok(None),
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
        ttl_fresh_until: None,
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
        if events.is_empty() {
            return Ok(Vec::new());
        }
        match self.try_batch(rules, events).await {
            Ok(v) => Ok(v),
            Err(Failed::Store(e)) => Err(e),
            // A restarted or flushed server lost the script: load it and
            // try once more (a refused call wrote nothing).
            Err(Failed::NoScript) => {
                self.sha = self.conn.load_script(COMMIT_LUA).await?;
                self.try_batch(rules, events).await.map_err(|e| match e {
                    Failed::Store(e) => e,
                    Failed::NoScript => {
                        StoreError::fatal("the commit script vanished right after loading")
                    }
                })
            }
        }
    }
}

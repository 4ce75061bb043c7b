//! Reserve slots in Redis (`lua/slot.lua`): which instance may spend which
//! slot's reserves, and in which buckets ([`crate::engine::aggregate::Span`]).
//!
//! An instance takes a free slot `k < E` with a lease (`SET NX PX`) and
//! keeps it by renewing the lease every third of it. Before a batch with a
//! call at or past its span's end it raises the slot's horizon in Redis
//! (to that call's time plus [`AHEAD_MS`]); only then does its gate spend
//! reserves in the new buckets. A new holder of the slot (after a crash,
//! once the lease has run out) starts its span at the horizon it finds,
//! so no bucket's reserve of a slot is spent by two holders. The holder
//! that lost the slot cannot raise the horizon any more (the script checks
//! the token), so it keeps spending only below it, which is safe.
//!
//! `E` is recorded by the first instance (`<prefix>slot:{slots}:n`); every
//! instance follows the recorded count, whatever its own
//! `--expected-instances`, because the shared part of each limit (`limit -
//! E r`) must be the same in all of them.

use std::time::{Duration, Instant};

use redis::Value;
use tracing::{info, warn};

use crate::engine::aggregate::{Reserves, Span};
use crate::error::StoreError;
use crate::store::redis::classify;
use crate::store::redis::conn::{is_noscript, Conn};
use crate::store::redis::RedisConfig;

/// The slot script.
pub const SLOT_LUA: &str = include_str!("../../../../lua/slot.lua");

/// A slot's lease: a holder that stops renewing frees it after this.
pub const LEASE: Duration = Duration::from_secs(15);

/// How far past the newest call a holder raises its horizon (event time):
/// one Redis call per this much event time, and as long, after a crash,
/// before the slot's next holder spends reserves.
pub const AHEAD_MS: i64 = 300_000;

/// How far past the wall clock a call's time may raise a horizon: a call
/// stamped far in the future would otherwise close the slot's reserves to
/// its next holders until then.
const FUTURE_MS: i64 = 86_400_000;

/// The slot held, and its span.
#[derive(Debug, Clone, Copy)]
struct Holding {
    k: u32,
    span: Span,
    /// When the last call that renewed the lease was sent.
    renewed: Instant,
}

/// One instance's slot: taken, kept and fenced through [`SLOT_LUA`].
#[derive(Debug)]
pub struct Slots {
    /// The instance's own count (`--expected-instances`).
    expected: u32,
    /// The count recorded in Redis, once read.
    recorded: Option<u32>,
    token: String,
    lease: Duration,
    holding: Option<Holding>,
    /// The slot held last (kept through a failed renewal: if Redis still
    /// has this instance as its holder, its span goes on where it was).
    last: Option<Holding>,
    /// No slot free at the last try: the next one not before this.
    retry_at: Option<Instant>,
}

/// What the script answered.
struct Answer {
    slots: u32,
    held: bool,
    /// Taken by this call (not held by this instance already).
    taken: bool,
    before: Option<i64>,
    now: Option<i64>,
}

impl Slots {
    /// An instance's slots, `expected` of them unless Redis has a count
    /// recorded.
    pub fn new(expected: u32) -> Self {
        Slots {
            expected: expected.max(1),
            recorded: None,
            token: format!("{}-{:016x}", std::process::id(), rand::random::<u64>()),
            lease: LEASE,
            holding: None,
            last: None,
            retry_at: None,
        }
    }

    /// The same with another lease (tests: a crashed holder's slot frees
    /// sooner).
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The reserves for a batch whose newest call is at `newest`: takes,
    /// renews or fences the slot as due. `keep_ms` is how long the count
    /// and the horizon outlive the last call (the counters' life plus a
    /// margin). An error before the count is known is returned (no credit
    /// can be leased without it); later ones leave the instance without a
    /// slot until the next try.
    pub(crate) async fn reserves(
        &mut self,
        conn: &mut Conn,
        sha: &str,
        config: &RedisConfig,
        newest: i64,
        keep_ms: i64,
    ) -> Result<Reserves, StoreError> {
        let newest = newest.min(wall_ms().saturating_add(FUTURE_MS));
        let outcome = match self.holding {
            Some(h) => self.keep(conn, sha, config, h, newest, keep_ms).await,
            None => self.take(conn, sha, config, newest, keep_ms).await,
        };
        match outcome {
            Ok(()) => {}
            Err(e) if self.recorded.is_none() => return Err(e),
            Err(e) => {
                warn!(error = %e, "reserve slot not renewed; spending no reserve until it is");
                self.holding = None;
                self.retry_at = Some(Instant::now() + self.lease / 3);
            }
        }
        Ok(Reserves {
            slots: self.recorded.unwrap_or(0),
            span: self.holding.map(|h| h.span),
        })
    }

    /// Renews the lease when a third of it has passed, and raises the
    /// horizon when `newest` is at or past it.
    async fn keep(
        &mut self,
        conn: &mut Conn,
        sha: &str,
        config: &RedisConfig,
        h: Holding,
        newest: i64,
        keep_ms: i64,
    ) -> Result<(), StoreError> {
        let raise = newest >= h.span.until;
        if !raise && h.renewed.elapsed() < self.lease / 3 {
            return Ok(());
        }
        let want = raise.then(|| newest.saturating_add(AHEAD_MS));
        let sent = Instant::now();
        let a = self.call(conn, sha, config, h.k, want, keep_ms).await?;
        if !a.held {
            warn!(
                slot = h.k,
                "reserve slot lost to another instance; taking another"
            );
            self.holding = None;
            return Ok(());
        }
        let until = a.now.unwrap_or(h.span.until).max(h.span.until);
        self.holding = Some(Holding {
            span: Span { until, ..h.span },
            renewed: sent,
            ..h
        });
        self.last = self.holding;
        Ok(())
    }

    /// Tries the slots in turn for a free one (at most every third of a
    /// lease when none was).
    async fn take(
        &mut self,
        conn: &mut Conn,
        sha: &str,
        config: &RedisConfig,
        newest: i64,
        keep_ms: i64,
    ) -> Result<(), StoreError> {
        if self.recorded.is_some() && self.retry_at.is_some_and(|t| Instant::now() < t) {
            return Ok(());
        }
        let mut k = 0;
        while k < self.recorded.unwrap_or(self.expected) {
            let sent = Instant::now();
            let want = Some(newest.saturating_add(AHEAD_MS));
            let a = self.call(conn, sha, config, k, want, keep_ms).await?;
            if a.held {
                let until = a.now.unwrap_or(i64::MIN);
                let from = match self.last {
                    // (Still this instance's: what it spent below the
                    // horizon it spent under this same slot.)
                    Some(last) if !a.taken && last.k == k => last.span.from,
                    _ => a.before.unwrap_or(i64::MIN),
                };
                let span = Span { from, until };
                info!(slot = k, slots = a.slots, "holding a reserve slot");
                self.holding = Some(Holding {
                    k,
                    span,
                    renewed: sent,
                });
                self.last = self.holding;
                self.retry_at = None;
                return Ok(());
            }
            k += 1;
        }
        self.retry_at = Some(Instant::now() + self.lease / 3);
        Ok(())
    }

    /// One script call for slot `k`; records the count it answers.
    async fn call(
        &mut self,
        conn: &mut Conn,
        sha: &str,
        config: &RedisConfig,
        k: u32,
        want: Option<i64>,
        keep_ms: i64,
    ) -> Result<Answer, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(sha)
            .arg(3)
            .arg(slot_key(config, ":n"))
            .arg(slot_key(config, &format!(":{k}")))
            .arg(slot_key(config, &format!(":{k}:h")))
            .arg(&self.token)
            .arg(self.expected)
            .arg(k)
            .arg(self.lease.as_millis() as u64)
            .arg(want.map_or(String::new(), |w| w.to_string()))
            .arg(keep_ms.max(1));
        let mut pipe = redis::pipe();
        pipe.add_command(cmd);
        let values = conn.query(&pipe, config.timeout).await.map_err(|e| {
            if is_noscript(&e) {
                StoreError::transient("the slot script is not loaded (Redis restarted?)")
            } else {
                classify(e)
            }
        })?;
        let a = read_answer(values)?;
        if self.recorded != Some(a.slots) {
            if a.slots != self.expected {
                warn!(
                    recorded = a.slots,
                    expected = self.expected,
                    "the instances on this key prefix share each limit among the recorded \
                     number of reserve slots, not this instance's --expected-instances"
                );
            }
            self.recorded = Some(a.slots);
        }
        Ok(a)
    }
}

/// `<prefix>slot:{slots}<tail>`.
pub fn slot_key(config: &RedisConfig, tail: &str) -> String {
    config.tagged_key("slot:", "slots", tail)
}

/// The wall clock, ms since the epoch.
fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn read_answer(values: Vec<Value>) -> Result<Answer, StoreError> {
    let bad = || StoreError::fatal("unexpected reply from the slot script");
    let Some(Value::Array(items)) = values.into_iter().next() else {
        return Err(bad());
    };
    let [n, held, taken, before, now] = items.as_slice() else {
        return Err(bad());
    };
    let int = |v: &Value| match v {
        Value::Int(i) => Ok(*i),
        _ => Err(bad()),
    };
    let time = |v: &Value| -> Result<Option<i64>, StoreError> {
        let s: String = redis::from_redis_value(v.clone()).map_err(|_| bad())?;
        if s.is_empty() {
            return Ok(None);
        }
        s.parse().map(Some).map_err(|_| bad())
    };
    Ok(Answer {
        slots: u32::try_from(int(n)?).map_err(|_| bad())?,
        held: int(held)? == 1,
        taken: int(taken)? == 1,
        before: time(before)?,
        now: time(now)?,
    })
}

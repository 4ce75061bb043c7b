//! Deciding the next batch while this one commits.
//!
//! A batch's last wait is for its commits. When the consumer has the batch
//! after it ([`Upcoming`]), now or by the time this batch's commits come
//! back, the callers of that batch who are not in this one are decided on
//! their cached state, and their commits are sent on the same connection
//! behind this batch's: this batch returns when its own commits are back,
//! and those land while the consumer produces its records. When the next
//! batch is asked for, its calls decided ahead are ready, and only the
//! callers it shares with the batch before (and any whose commit another
//! writer refused) are left to decide. A caller's calls are decided on its
//! own state alone, so this gives each call the verdict it would get one
//! batch at a time.
//!
//! The effects stay exactly once. The verdicts are kept in the store and
//! handed out only when their batch is asked for, after the batch before
//! has come back. A batch decided ahead and then never asked for (let go
//! on a revoke, or lost in a crash) is written but not produced: it is
//! read again, and its calls get their records back, as after a crash
//! between a commit and its produce. That needs the records, so batches
//! are decided ahead only with idempotency on. A batch under rules keyed
//! by callee or global is not: its events change in the gate first.

use std::borrow::Cow;

use compact_str::CompactString;
use tokio::sync::oneshot;

use tokio::task::JoinHandle;

use super::cache::{Cache, TtlPlan};
use super::plan::Pending;
use super::wire::Committed;
use super::{decide_group, gather, group_size, put_back, settle, Counts, Rounds};
use crate::engine::event::CallEvent;
use crate::engine::record::Verdict;
use crate::engine::rules::RuleSet;
use crate::engine::window::CallerState;
use crate::store::Upcoming;

/// A batch decided ahead, until it is asked for.
#[derive(Debug)]
pub(super) struct DecidedAhead {
    /// The rule set's version it was decided under.
    version: String,
    /// Its events, as the store decides them ([`to_store`]).
    events: Vec<CallEvent>,
    /// Per event, its verdict if it was decided ahead (its caller was
    /// not in the batch before, and its commit was not refused).
    pub(super) verdicts: Vec<Option<Verdict>>,
}

impl DecidedAhead {
    /// Whether it is `events` under `rules`.
    pub(super) fn fits(&self, rules: &RuleSet, events: &[CallEvent]) -> bool {
        self.version == rules.version() && self.events == events
    }

    /// Its newest event time.
    pub(super) fn newest(&self) -> i64 {
        self.events
            .iter()
            .map(|e| e.ts_ms)
            .max()
            .unwrap_or(i64::MIN)
    }
}

/// A batch decided ahead whose commits were sent and may not be back.
pub(super) struct InFlight {
    version: String,
    events: Vec<CallEvent>,
    verdicts: Vec<Option<Verdict>>,
    /// Its callers decided, out of the cache until the commits land.
    pending: Vec<Pending>,
    commits: Vec<JoinHandle<Result<Committed, redis::RedisError>>>,
    ttl: TtlPlan,
}

impl InFlight {
    /// The state of `caller` as decided here, if it is one of its callers
    /// (for a local fallback while it is out of the cache).
    pub(super) fn state_of(&self, caller: &str) -> Option<&CallerState> {
        self.pending
            .iter()
            .find(|p| p.caller == caller)
            .map(|p| &p.cached.state)
    }

    /// Waits for its commits and puts its callers back into `cache` (as
    /// a batch's round does: a refused caller with the state Redis
    /// returned, its calls then left to decide in their turn), counting
    /// its conflicts and misses. If Redis failed any of them: its
    /// callers' states as decided, none of them cached.
    pub(super) async fn land(
        mut self,
        cache: &mut Cache,
        counts: &mut Counts,
    ) -> Result<DecidedAhead, Vec<(CompactString, CallerState)>> {
        let mut outcomes = Vec::with_capacity(self.commits.len());
        let mut failed = false;
        for commit in self.commits.drain(..) {
            match commit.await {
                Ok(Ok(outcome)) => outcomes.push(outcome),
                _ => failed = true,
            }
        }
        let settled = match failed {
            true => None,
            false => settle(outcomes, &mut self.pending, self.ttl, counts).ok(),
        };
        let Some(refused) = settled else {
            let states = self.pending.into_iter();
            return Err(states.map(|p| (p.caller, p.cached.state)).collect());
        };
        for &p in &refused {
            // Refused: decided again when its batch is asked for.
            for &i in &self.pending[p].events {
                self.verdicts[i] = None;
            }
        }
        put_back(cache, self.pending, refused);
        Ok(DecidedAhead {
            version: self.version,
            events: self.events,
            verdicts: self.verdicts,
        })
    }
}

/// The events of a batch the store decides: without a concurrent or sum
/// rule an end changes nothing and is left out (answered without Redis).
pub(super) fn to_store<'e>(rules: &RuleSet, events: &'e [CallEvent]) -> Cow<'e, [CallEvent]> {
    match crate::store::attempts_of(events).filter(|_| !rules.caller_uses_ends()) {
        Some(attempts) => Cow::Owned(attempts),
        None => Cow::Borrowed(events),
    }
}

/// Once this batch's round has sent its commits (`sent`), decides the
/// batch after (`next`: there now, or arriving before this batch's
/// commits are back, `done`) but for the callers of this one (`current`),
/// taken out of `cache`, and sends their commits.
pub(super) async fn decide(
    rounds: Rounds<'_>,
    cache: &mut Cache,
    current: &foldhash::HashMap<&str, usize>,
    next: &mut dyn Upcoming,
    sent: oneshot::Receiver<()>,
    done: oneshot::Receiver<()>,
) -> Option<InFlight> {
    // (An error: this batch's round failed before it had sent them all.)
    sent.await.ok()?;
    if next.peek().is_none() {
        tokio::select! {
            biased;
            _ = done => return None,
            _ = next.arrival() => {}
        }
    }
    let n = next.peek().filter(|n| !n.rules.has_aggregates())?;
    let rules = n.rules;
    let events = to_store(rules, n.events).into_owned();
    let (_, mut pending) = gather(cache, &events, Some(current));
    if pending.is_empty() {
        return None;
    }
    let ttl = TtlPlan::new(&rounds.committer.config, rules);
    let mut verdicts: Vec<Option<Verdict>> = vec![None; events.len()];
    let todo: Vec<usize> = (0..pending.len()).collect();
    let commits = todo
        .chunks(group_size(todo.len()))
        .map(|group| {
            let writes = decide_group(
                rounds,
                rules,
                &events,
                &mut pending,
                group,
                &mut verdicts,
                ttl,
            );
            tokio::spawn(rounds.committer.clone().commit(writes))
        })
        .collect();
    Some(InFlight {
        version: rules.version().to_string(),
        events,
        verdicts,
        pending,
        commits,
        ttl,
    })
}

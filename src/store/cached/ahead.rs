//! Deciding the next batch while this one commits.
//!
//! A batch's last wait is for its commits. When the consumer already has
//! the batch after it ([`Upcoming`]), the callers of that batch who are
//! not in this one are decided on their cached state and committed on the
//! same connection, while this batch's commits are in flight: when that
//! batch is asked for, those calls are decided and written, and only the
//! callers of this batch (and any refused) are left to decide. A caller's
//! calls are decided on its own state alone, so this gives each call the
//! verdict it would get one batch at a time.
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

use super::cache::{Cache, TtlPlan};
use super::{gather, put_back, round, settle, Counts, Rounds};
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

/// What deciding ahead came to.
pub(super) enum AheadOutcome {
    /// Nothing was decided: no batch after, or none of its callers could be.
    Nothing,
    /// Decided, with the round's conflicts and misses.
    Decided(DecidedAhead, Counts),
    /// Redis failed: the states as decided (not cached, Redis may or may
    /// not have them), for a local fallback.
    Failed(Vec<(CompactString, CallerState)>),
}

/// The events of a batch the store decides: without a concurrent or sum
/// rule an end changes nothing and is left out (answered without Redis).
pub(super) fn to_store<'e>(rules: &RuleSet, events: &'e [CallEvent]) -> Cow<'e, [CallEvent]> {
    match crate::store::attempts_of(events).filter(|_| !rules.caller_uses_ends()) {
        Some(attempts) => Cow::Owned(attempts),
        None => Cow::Borrowed(events),
    }
}

/// Once this batch's round has sent its commits (`sent`), decides and
/// commits the batch after (`next`, if it has come) but for the callers
/// of this one (`current`), taken out of `cache`, and puts them back.
pub(super) async fn decide(
    rounds: Rounds<'_>,
    cache: &mut Cache,
    current: &foldhash::HashMap<&str, usize>,
    next: &mut dyn Upcoming,
    sent: oneshot::Receiver<()>,
) -> AheadOutcome {
    if sent.await.is_err() {
        // This batch's round failed before it had sent them all.
        return AheadOutcome::Nothing;
    }
    let Some(n) = next.peek().filter(|n| !n.rules.has_aggregates()) else {
        return AheadOutcome::Nothing;
    };
    let rules = n.rules;
    let events = to_store(rules, n.events);
    let (_, mut pending) = gather(cache, &events, Some(current));
    if pending.is_empty() {
        return AheadOutcome::Nothing;
    }
    let ttl = TtlPlan::new(rounds.committer.config, rules);
    let mut verdicts: Vec<Option<Verdict>> = vec![None; events.len()];
    let todo: Vec<usize> = (0..pending.len()).collect();
    let committed = round(
        rounds,
        rules,
        &events,
        &mut pending,
        &todo,
        &mut verdicts,
        ttl,
        None,
    )
    .await;
    let mut counts = Counts::default();
    let refused = match committed.map(|outcomes| settle(outcomes, &mut pending, ttl, &mut counts)) {
        Ok(Ok(refused)) => refused,
        _ => {
            let states = pending
                .into_iter()
                .map(|p| (CompactString::from(p.caller), p.cached.state))
                .collect();
            return AheadOutcome::Failed(states);
        }
    };
    for &p in &refused {
        // Refused: decided again when its batch is asked for.
        for &i in &pending[p].events {
            verdicts[i] = None;
        }
    }
    put_back(cache, pending, refused);
    let decided = DecidedAhead {
        version: rules.version().to_string(),
        events: events.into_owned(),
        verdicts,
    };
    AheadOutcome::Decided(decided, counts)
}

//! Checkpoints: commits that keep a crash's redeliveries within the
//! idempotency horizon.
//!
//! A redelivered call is recognised only while its caller has moved on by
//! less than the idempotency horizon `D` in event time. Catching up on a
//! backlog covers hours of event time per second, so a crash between two
//! timed commits could redeliver calls whose callers moved on by more than
//! `D`, and they would be decided again, differently.
//!
//! A caller's calls share a partition (events are keyed by caller). Take a
//! redelivered call `e`: its caller's latest time has moved since `e` was
//! first decided only through calls decided after `e`, and those, like `e`
//! itself, are among its partition's uncommitted events. So the caller has
//! moved on from `e`'s time by at most the span (latest minus earliest
//! event time) of those uncommitted events, or not at all since `e`'s first
//! decision. (A call already more than `D` behind its caller when first
//! decided keeps no record, but it is then past the retention too, so it
//! changed nothing and is decided the same again.) So no partition's
//! uncommitted events may span `D` or more
//! ([`span_limit`]: `D - 1` ms): before a batch would pass that, the
//! consumer waits until what it decided is committed. Exactness does not
//! depend on how fast it runs. `tests/it/semantics.rs` checks the bound on
//! random sequences: redelivering the longest suffix that fits gives every
//! call its first record back.
//!
//! Waiting for a commit costs the producer's linger, the broker's
//! acknowledgements and a commit round trip. So a commit is started in the
//! background as soon as a quarter of the allowance is used ([`Early`]), while
//! deciding goes on; the consumer waits only when the allowance runs out
//! before that commit is confirmed.

use std::collections::VecDeque;
use std::sync::Arc;

use futures::FutureExt;
use rdkafka::consumer::StreamConsumer;
use tokio::task::JoinHandle;

use crate::online::consumer::clients::commit;
use crate::online::consumer::delivery::{ByPartition, ConsumerCtx, Shared};
use crate::online::consumer::encode::Item;

/// How much event time a partition's uncommitted events may span, for an
/// idempotency horizon of `dedup_ms`: less than the horizon.
pub fn span_limit(dedup_ms: i64) -> i64 {
    dedup_ms.saturating_sub(1)
}

/// Earliest and latest event time per partition.
#[derive(Debug, Default, Clone)]
pub(super) struct Spans(ByPartition<(i64, i64)>);

impl Spans {
    /// Notes one event time of a partition.
    pub fn note(&mut self, topic: &Arc<str>, partition: i32, ts: i64) {
        self.0.note(topic, partition, (ts, ts), |(lo, hi)| {
            *lo = (*lo).min(ts);
            *hi = (*hi).max(ts);
        });
    }

    /// Notes every span of `other`.
    fn merge(&mut self, other: &Spans) {
        for (t, p, (lo, hi)) in other.0.iter() {
            self.note(t, *p, *lo);
            self.note(t, *p, *hi);
        }
    }

    /// Whether some partition's events span more than `limit` ms.
    pub fn due(&self, limit: i64) -> bool {
        self.0
            .iter()
            .any(|(_, _, (lo, hi))| hi.saturating_sub(*lo) > limit)
    }
}

/// Event time decided per partition and not yet covered by a confirmed
/// commit, kept per batch so that a commit covering the first batches
/// releases their share.
#[derive(Debug, Default)]
pub(super) struct Uncommitted {
    /// (batch sequence number, its spans), oldest first.
    batches: VecDeque<(u64, Spans)>,
    /// All of them together.
    total: Spans,
}

impl Uncommitted {
    /// Notes the spans of batch `seq` (sequence numbers grow).
    pub fn push(&mut self, seq: u64, spans: Spans) {
        self.total.merge(&spans);
        self.batches.push_back((seq, spans));
    }

    /// A commit covered every batch up to `seq`.
    pub fn committed_through(&mut self, seq: u64) {
        let before = self.batches.len();
        while self.batches.front().is_some_and(|(s, _)| *s <= seq) {
            self.batches.pop_front();
        }
        if self.batches.len() != before {
            self.total = Spans::default();
            for (_, s) in &self.batches {
                self.total.merge(s);
            }
        }
    }

    /// Whether some partition's uncommitted events span more than `limit` ms.
    pub fn due(&self, limit: i64) -> bool {
        self.total.due(limit)
    }

    /// How many messages of `batch` can be decided before some partition's
    /// uncommitted events would span more than `limit` ms of event time
    /// (after a commit, at least one: a single event spans nothing).
    pub fn cut(&self, batch: &[Item], limit: i64) -> usize {
        let mut spans = self.total.clone();
        for (i, m) in batch.iter().enumerate() {
            let Ok(e) = &m.event else {
                continue; // a dead letter decides nothing
            };
            spans.note(&m.topic, m.partition, e.ts_ms);
            if spans.due(limit) {
                return i;
            }
        }
        batch.len()
    }
}

/// A commit started in the background, before the allowance runs out.
#[derive(Debug, Default)]
pub(super) enum Early {
    /// None wanted.
    #[default]
    Idle,
    /// Wanted once every batch up to this one is acknowledged and stored.
    Wanted(u64),
    /// Committing (on a blocking thread) the offsets stored through this batch.
    Running(u64, JoinHandle<bool>),
}

impl Early {
    /// Asks for a commit of every batch up to `seq`, unless one is under way.
    pub fn want(&mut self, seq: u64) {
        if matches!(self, Early::Idle) {
            *self = Early::Wanted(seq);
        }
    }

    /// Moves on without waiting: starts the wanted commit once its batches
    /// are stored, and applies a finished one to `uncommitted`.
    pub fn step(
        &mut self,
        consumer: &Arc<StreamConsumer<ConsumerCtx>>,
        shared: &Shared,
        uncommitted: &mut Uncommitted,
    ) {
        match self {
            Early::Idle => {}
            Early::Wanted(seq) => {
                let stored = shared.stored_through();
                if stored >= *seq {
                    let consumer = consumer.clone();
                    let task = tokio::task::spawn_blocking(move || commit(&consumer));
                    *self = Early::Running(stored, task);
                }
            }
            Early::Running(seq, task) => {
                if let Some(done) = task.now_or_never() {
                    if done.unwrap_or(false) {
                        uncommitted.committed_through(*seq);
                    }
                    *self = Early::Idle;
                }
            }
        }
    }

    /// Waits for a running commit and applies it to `uncommitted`; a wanted
    /// one that has not started is dropped (the caller commits everything).
    pub async fn finish(&mut self, uncommitted: &mut Uncommitted) {
        if let Early::Running(seq, task) = std::mem::take(self) {
            if task.await.unwrap_or(false) {
                uncommitted.committed_through(seq);
            }
        }
    }
}

/// The consumer's checkpoint bookkeeping, one method per moment of a
/// batch: what fits before it is admitted ([`Checkpoint::fits`]), its
/// spans once admitted ([`Checkpoint::admitted`]), the background commit
/// moved on after offsets are stored ([`Checkpoint::after_settle`]) and
/// asked for after its records are produced
/// ([`Checkpoint::after_produce`]), and a synchronous commit's outcome.
pub(super) struct Checkpoint {
    uncommitted: Uncommitted,
    early: Early,
    /// The allowance of the current rules ([`span_limit`]).
    span_limit: i64,
    /// A commit is due (the allowance ran out) and not confirmed yet.
    due: bool,
}

impl Checkpoint {
    pub(super) fn new(dedup_ms: i64) -> Self {
        Checkpoint {
            uncommitted: Uncommitted::default(),
            early: Early::default(),
            span_limit: span_limit(dedup_ms),
            due: false,
        }
    }

    /// How many of `items` fit in the allowance of rules with the
    /// idempotency horizon `dedup_ms` (none while a commit is due).
    pub(super) fn fits(&mut self, items: &[Item], dedup_ms: i64) -> usize {
        self.span_limit = span_limit(dedup_ms);
        if self.due {
            return 0;
        }
        self.uncommitted.cut(items, self.span_limit)
    }

    /// A batch admitted as number `seq`, with its spans.
    pub(super) fn admitted(&mut self, seq: u64, spans: Spans) {
        self.uncommitted.push(seq, spans);
    }

    /// Offsets were stored: starts a wanted background commit whose
    /// batches are stored, and applies a finished one.
    pub(super) fn after_settle(
        &mut self,
        consumer: &Arc<StreamConsumer<ConsumerCtx>>,
        shared: &Shared,
    ) {
        self.early.step(consumer, shared, &mut self.uncommitted);
    }

    /// Batch `seq`'s records were produced: once a quarter of the
    /// allowance is used (or `cut`: the next batch did not fit), a commit
    /// is started in the background while deciding goes on.
    pub(super) fn after_produce(
        &mut self,
        seq: u64,
        cut: bool,
        consumer: &Arc<StreamConsumer<ConsumerCtx>>,
        shared: &Shared,
    ) {
        if cut || self.uncommitted.due(self.span_limit / 4) {
            self.early.want(seq);
        }
        self.early.step(consumer, shared, &mut self.uncommitted);
    }

    /// Waits for the background commit under way, if any.
    pub(super) async fn settle_background(&mut self) {
        self.early.finish(&mut self.uncommitted).await;
    }

    /// A synchronous commit confirmed everything decided, or failed: then
    /// nothing more fits until one is confirmed.
    pub(super) fn committed(&mut self, ok: bool) {
        self.due = !ok;
        if ok {
            self.uncommitted = Uncommitted::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(parts: &[(i32, i64, i64)]) -> Spans {
        let mut s = Spans::default();
        let t: Arc<str> = "t".into();
        for (p, lo, hi) in parts {
            s.note(&t, *p, *lo);
            s.note(&t, *p, *hi);
        }
        s
    }

    #[test]
    fn a_commit_releases_only_the_batches_it_covers() {
        let mut u = Uncommitted::default();
        u.push(1, spans(&[(0, 0, 100)]));
        u.push(2, spans(&[(0, 100, 300), (1, 5, 6)]));
        u.push(3, spans(&[(1, 6, 400)]));
        assert!(u.due(300) && u.due(390) && !u.due(400));
        u.committed_through(1);
        // Partition 0 now spans 100..300, partition 1 5..400.
        assert!(u.due(390) && !u.due(395));
        u.committed_through(2);
        assert!(u.due(393) && !u.due(394));
        u.committed_through(3);
        assert!(u.batches.is_empty() && !u.due(0));
        // A commit of nothing new changes nothing.
        u.push(4, spans(&[(0, 1000, 1200)]));
        u.committed_through(3);
        assert!(u.due(199) && !u.due(200));
    }
}

//! Deciding a batch through the window store under the store-failure
//! policy, on a task of its own ([`Decider`]), and counting what was
//! decided.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::Shared;
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use crate::engine::event::CallEvent;
use crate::engine::record::{Decision, Verdict};
use crate::engine::rules::RuleSet;
use crate::error::{chain, ConsumeError};
use crate::online::consumer::delivery::{Offsets, OutRecord};
use crate::online::consumer::{ConsumeConfig, ConsumeStats, StoreErrorPolicy};
use crate::online::metrics::{Health, Metrics};
use crate::online::policy::{apply_observed, IdleProbe, OnStoreError};
use crate::store::CONTENDED;
use crate::store::{Next, Upcoming, WindowStore};

/// Longest wait between retries of a blocked store.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// A batch handed to the [`Decider`], with what the loop keeps of it
/// meanwhile.
pub(super) struct Deciding {
    /// Sequence number (from 1).
    pub(super) seq: u64,
    /// The last offset per partition of the messages it came from (stored
    /// once its records are produced).
    pub(super) offsets: Offsets,
    /// Its dead letters, to which the records are added.
    pub(super) out: Vec<OutRecord>,
    /// When each of its messages was read.
    pub(super) read_at: Vec<Instant>,
    /// The verdicts, on their way.
    pub(super) reply: oneshot::Receiver<Decided>,
    /// The verdicts, when they arrived while the next batch was collected
    /// (an error: the decider stopped).
    pub(super) ready: Option<Result<Decided, oneshot::error::RecvError>>,
}

/// The window store on a task of its own: it decides a batch while the
/// loop collects and decodes the next and encodes and produces the one
/// before. Batches are decided one at a time in the order
/// submitted, so a partition's order holds.
pub(super) struct Decider {
    jobs: mpsc::Sender<Job>,
}

/// A batch to decide.
struct Job {
    rules: RuleSet,
    events: Vec<CallEvent>,
    reply: oneshot::Sender<Decided>,
}

/// A batch back from the [`Decider`].
pub(super) struct Decided {
    /// One verdict per event; `None` if shutdown came while the store was
    /// failing under `block`.
    pub verdicts: Option<Result<Vec<Verdict>, ConsumeError>>,
    /// The rules it was decided with.
    pub rules: RuleSet,
    /// The events, as submitted.
    pub events: Vec<CallEvent>,
}

impl Decider {
    /// Starts the task; it ends when the `Decider` is dropped.
    pub fn spawn<S, F>(
        mut store: S,
        config: ConsumeConfig,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
        mut shutdown: Shared<F>,
    ) -> Self
    where
        S: WindowStore + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        // One batch queued behind the one being decided.
        let (jobs, mut rx) = mpsc::channel::<Job>(1);
        tokio::spawn(async move {
            // Readiness from a probe while no batch comes (a quiet topic,
            // or Redis gone while idle), as `serve` keeps it.
            let mut idle = IdleProbe::start(&mut store, &metrics, &health).await;
            let mut on_error = OnStoreError::new(config.on_store_error, config.local_share);
            // The batch queued behind the one being decided, once the store
            // has looked for it (to prepare for it meanwhile).
            let mut queued: Option<Job> = None;
            loop {
                let job = match queued.take() {
                    Some(job) => job,
                    None => match idle.recv(&mut rx, &mut store, &metrics, &health).await {
                        Some(job) => job,
                        None => break,
                    },
                };
                let mut next = Queued {
                    rx: &mut rx,
                    job: &mut queued,
                };
                let verdicts = decide_under_policy(
                    &mut store,
                    &job,
                    &mut next,
                    &mut on_error,
                    &metrics,
                    &health,
                    &mut Pin::new(&mut shutdown),
                )
                .await;
                let _ = job.reply.send(Decided {
                    verdicts,
                    rules: job.rules,
                    events: job.events,
                });
            }
        });
        Decider { jobs }
    }

    /// Queues a batch; its verdicts come back on the receiver.
    pub async fn submit(
        &self,
        rules: RuleSet,
        events: Vec<CallEvent>,
    ) -> Result<oneshot::Receiver<Decided>, ConsumeError> {
        let (reply, rx) = oneshot::channel();
        self.jobs
            .send(Job {
                rules,
                events,
                reply,
            })
            .await
            .map_err(|_| ConsumeError::DeciderStopped)?;
        Ok(rx)
    }
}

/// The decider's queue seen from the store: the batch queued behind the
/// one being decided, taken from the queue when the store asks for it.
struct Queued<'a> {
    rx: &'a mut mpsc::Receiver<Job>,
    job: &'a mut Option<Job>,
}

impl Upcoming for Queued<'_> {
    fn peek(&mut self) -> Option<Next<'_>> {
        if self.job.is_none() {
            *self.job = self.rx.try_recv().ok();
        }
        self.job.as_ref().map(|j| Next {
            rules: &j.rules,
            events: &j.events,
        })
    }

    fn arrival(&mut self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            if self.job.is_none() {
                // (Cancel-safe: a job received is kept, none is lost.)
                match self.rx.recv().await {
                    Some(job) => *self.job = Some(job),
                    // The loop is gone: no batch will come.
                    None => std::future::pending().await,
                }
            }
        })
    }
}

/// Decides a batch under the failure policy; `None` if shutdown came while
/// blocked. Calls the store left undecided (their caller kept changing
/// under it: another writer) are tried again alone under `block`, or
/// decided degraded under `allow`, `reject` and `local`; the others' verdicts
/// stand.
async fn decide_under_policy<S: WindowStore, F: Future<Output = ()>>(
    store: &mut S,
    job: &Job,
    next: &mut dyn Upcoming,
    on_error: &mut OnStoreError,
    metrics: &Metrics,
    health: &Health,
    shutdown: &mut Pin<&mut F>,
) -> Option<Result<Vec<Verdict>, ConsumeError>> {
    let (rules, events) = (&job.rules, job.events.as_slice());
    let mut backoff = Duration::from_millis(50);
    let mut verdicts: Vec<Option<Verdict>> = vec![None; events.len()];
    // The calls still undecided, when not the whole batch.
    let mut left: Option<Vec<usize>> = None;
    // Only the first try looks ahead.
    let mut next = Some(next);
    loop {
        let retried: Vec<CallEvent>;
        let batch = match &left {
            None => events,
            Some(idx) => {
                retried = idx.iter().map(|&i| events[i].clone()).collect();
                &retried
            }
        };
        let why = match apply_observed(
            store,
            rules,
            batch,
            next.take().unwrap_or(&mut ()),
            metrics,
            health,
        )
        .await
        {
            Ok(got) => {
                match &left {
                    None => verdicts = got,
                    Some(idx) => {
                        for (&i, v) in idx.iter().zip(got) {
                            verdicts[i] = v;
                        }
                    }
                }
                let undecided: Vec<usize> = (0..events.len())
                    .filter(|&i| verdicts[i].is_none())
                    .collect();
                if undecided.is_empty() {
                    on_error.store_answered();
                    return Some(Ok(verdicts.into_iter().flatten().collect()));
                }
                left = Some(undecided);
                CONTENDED.to_string()
            }
            Err(err) if on_error.policy == StoreErrorPolicy::Block && !err.is_transient() => {
                return Some(Err(err.into()));
            }
            Err(err) => chain(&err),
        };
        let settled = {
            let cached = |c: &str| store.cached_state(c);
            on_error.settle(events, verdicts, rules, &why, metrics, &cached)
        };
        match settled {
            Ok(decided) => return Some(Ok(decided)),
            Err(undecided) => verdicts = undecided,
        }
        warn!(error = %why, retry_in_ms = backoff.as_millis() as u64, "store failed; blocking");
        tokio::select! {
            _ = shutdown.as_mut() => return None,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Counts a decided batch in the stats and metrics.
pub(super) fn count(metrics: &Metrics, stats: &mut ConsumeStats, verdicts: &[Verdict]) {
    stats.decided += verdicts.iter().filter(|v| !v.end).count() as u64;
    stats.rejected += verdicts
        .iter()
        .filter(|v| v.record.decision == Decision::Reject)
        .count() as u64;
    metrics.count_batch(verdicts);
}

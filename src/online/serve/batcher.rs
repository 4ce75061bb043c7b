//! The batcher: checks queued by the handlers, decided in arrival order a
//! batch per store round trip, published to Kafka, and answered.

use std::sync::Arc;
use std::time::Instant;

use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::warn;

use crate::engine::event::CallEvent;
use crate::engine::record::{Row, Schema, Verdict};
use crate::engine::rules::RuleSet;
use crate::error::chain;
use crate::online::metrics::{Health, Metrics};
use crate::online::policy::{apply_observed, clamp_to_clock, now_ms, IdleProbe, OnStoreError};
use crate::online::produce::event_json;
use crate::store::WindowStore;
use crate::store::CONTENDED;

use super::ratelimit::{limits, RuleLimit};
use super::uncertain::Uncertain;
use super::{Job, Outcome, ServeConfig, ServeTopics};

/// The store's answer for a batch: a verdict per call (`None`: undecided),
/// why some are missing, and whether those may still have been applied.
struct Decided {
    verdicts: Vec<Option<Verdict>>,
    why: Option<String>,
    /// Whether undecided calls may still have been applied: `"unknown"`
    /// when the store call failed after it was sent; `"no"` when nothing
    /// of them was written: a caller contended by another writer was left
    /// out, or the connection was refused before anything was sent.
    applied: &'static str,
    /// Calls left undecided because another writer kept changing their
    /// caller, to be tried again in the next batch (nothing of them was
    /// written); their verdicts are `None`, and they are not answered.
    retry: Vec<usize>,
}

/// Batches after the first that may take a call left undecided because
/// another writer kept changing its caller (each batch gives the store its
/// rounds again) before it is answered as the failure policy says. Two
/// instances deciding one flooding caller can starve the slower one for a
/// batch's rounds on a loaded machine; a call is tried again, within its
/// answer deadline, rather than answered 503.
pub(super) const CONTENDED_RETRIES: u8 = 3;

/// Tops a batch up to the batch size within the linger.
async fn collect(config: &ServeConfig, rx: &mut mpsc::Receiver<Job>, jobs: &mut Vec<Job>) {
    let deadline = Instant::now() + config.linger;
    while jobs.len() < config.batch_size {
        match rx.try_recv() {
            Ok(j) => jobs.push(j),
            Err(_) if config.linger.is_zero() => break,
            Err(_) => match tokio::time::timeout_at(deadline.into(), rx.recv()).await {
                Ok(Some(j)) => jobs.push(j),
                _ => break,
            },
        }
    }
}

/// Decides queued checks, one batch per store round trip.
pub(super) struct Batcher<S> {
    store: S,
    rules: watch::Receiver<RuleSet>,
    current: RuleSet,
    schema: Arc<Schema>,
    features: Schema,
    /// The rules' limits, for the rate-limit headers.
    limits: Arc<[RuleLimit]>,
    config: Arc<ServeConfig>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    producer: Option<(FutureProducer, ServeTopics)>,
    /// Calls answered 503 that the store may have applied.
    uncertain: Uncertain,
    /// The failure policy, with its local state under `local`.
    on_error: OnStoreError,
}

impl<S: WindowStore> Batcher<S> {
    /// A batcher deciding through `store` on the rules `rules` carries.
    pub fn new(
        store: S,
        mut rules: watch::Receiver<RuleSet>,
        config: Arc<ServeConfig>,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
        producer: Option<(FutureProducer, ServeTopics)>,
    ) -> Self {
        let current = rules.borrow_and_update().clone();
        Batcher {
            store,
            schema: Arc::new(Schema::decisions(&current)),
            features: Schema::features(&current),
            limits: limits(&current).into(),
            current,
            rules,
            metrics,
            health,
            uncertain: Uncertain::default(),
            on_error: OnStoreError::new(config.on_store_error, config.local_share),
            producer,
            config,
        }
    }

    /// Decides queued checks in arrival order until every sender is gone.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        // Ready once the store answers (at once, unless Redis is down at
        // start); while idle, readiness from a probe, not from the last
        // check.
        let mut idle = IdleProbe::start(&mut self.store, &self.metrics, &self.health).await;
        let mut jobs: Vec<Job> = Vec::with_capacity(self.config.batch_size);
        // Calls a batch left undecided for contention: first in the next.
        let mut retry: Vec<Job> = Vec::new();
        loop {
            if retry.is_empty() {
                let Some(first) = idle
                    .recv(&mut rx, &mut self.store, &self.metrics, &self.health)
                    .await
                else {
                    break;
                };
                jobs.push(first);
            } else {
                jobs.append(&mut retry);
            }
            collect(&self.config, &mut rx, &mut jobs).await;
            self.follow_rules();
            self.handle(&mut jobs, &mut retry).await;
        }
    }

    /// Takes a reloaded rule set.
    fn follow_rules(&mut self) {
        if self.rules.has_changed().unwrap_or(false) {
            self.current = self.rules.borrow_and_update().clone();
            self.schema = Arc::new(Schema::decisions(&self.current));
            self.features = Schema::features(&self.current);
            self.limits = limits(&self.current).into();
        }
    }

    /// Decides a batch, publishes its first decisions and answers each
    /// check; the calls to try again for contention go to `retry`.
    async fn handle(&mut self, jobs: &mut Vec<Job>, retry: &mut Vec<Job>) {
        // Calls whose handler gave up at its deadline are dropped unapplied.
        let mut events = Vec::with_capacity(jobs.len());
        let mut replies = Vec::with_capacity(jobs.len());
        let mut claims = Vec::with_capacity(jobs.len());
        let mut contended = Vec::with_capacity(jobs.len());
        for j in jobs.drain(..).filter(|j| j.claim.send()) {
            events.push(j.event);
            replies.push(Some(j.reply));
            claims.push(j.claim);
            contended.push(j.contended);
        }
        if events.is_empty() {
            return;
        }
        clamp_to_clock(&mut events, self.current.grace_ms, now_ms(), &self.metrics);
        self.metrics.batch_size.observe(events.len() as f64);
        let decided = self.store_verdicts(&events, &contended).await;
        for &i in &decided.retry {
            if let Some(reply) = replies[i].take() {
                claims[i].requeue();
                retry.push(Job {
                    event: events[i].clone(),
                    reply,
                    claim: claims[i].clone(),
                    contended: contended[i] + 1,
                });
            }
        }
        if self.producer.is_some() {
            let publishable = self.publishable(&events, &decided);
            if let Some((p, topics)) = &self.producer {
                let schemas = (&*self.schema, &self.features);
                publish(
                    p,
                    topics,
                    schemas,
                    &events,
                    &decided.verdicts,
                    &publishable,
                    &self.metrics,
                );
            }
        }
        self.answer(replies, decided);
    }

    /// The store's verdicts under the failure policy: undecided calls stay
    /// so under `block` (answered 503), or are decided degraded; calls
    /// left undecided for contention are tried again instead while each
    /// has batches left (`contended[i]`: batches that left call `i` so).
    async fn store_verdicts(&mut self, events: &[CallEvent], contended: &[u8]) -> Decided {
        let rules = &self.current;
        let (verdicts, why, applied) = match apply_observed(
            &mut self.store,
            rules,
            events,
            &mut (),
            &self.metrics,
            &self.health,
        )
        .await
        {
            // Calls of a caller another writer kept changing: only they
            // are left undecided, and nothing of them written.
            Ok(v) => {
                let why = v.iter().any(Option::is_none).then(|| CONTENDED.to_string());
                (v, why, "no")
            }
            Err(e) => {
                let applied = if e.is_unsent() { "no" } else { "unknown" };
                (vec![None; events.len()], Some(chain(&e)), applied)
            }
        };
        let Some(reason) = &why else {
            self.on_error.store_answered();
            return Decided {
                verdicts,
                why,
                applied,
                retry: Vec::new(),
            };
        };
        let undecided = || (0..events.len()).filter(|&i| verdicts[i].is_none());
        // Contended, nothing of them written, each with a batch left.
        if why.as_deref() == Some(CONTENDED)
            && undecided().all(|i| contended.get(i).copied().unwrap_or(u8::MAX) < CONTENDED_RETRIES)
        {
            let retry = undecided().collect();
            return Decided {
                verdicts,
                why,
                applied,
                retry,
            };
        }
        let settled = {
            let store = &self.store;
            let cached = |c: &str| store.cached_state(c);
            self.on_error
                .settle(events, verdicts, rules, reason, &self.metrics, &cached)
        };
        let verdicts = match settled {
            Ok(decided) => decided.into_iter().map(Some).collect(),
            Err(verdicts) => {
                let failed = verdicts.iter().filter(|v| v.is_none()).count();
                warn!(error = %reason, calls = failed, "store failed; answering 503");
                verdicts
            }
        };
        Decided {
            verdicts,
            why,
            applied,
            retry: Vec::new(),
        }
    }

    /// Which calls to publish: first decisions, and duplicates of calls
    /// whose first answer had no verdict (their record was never
    /// published).
    fn publishable(&mut self, events: &[CallEvent], decided: &Decided) -> Vec<bool> {
        let applied = decided.applied;
        events
            .iter()
            .zip(&decided.verdicts)
            .map(|(e, v)| match v {
                Some(v) => !v.duplicate || self.uncertain.settle(&e.call_id),
                None => {
                    if applied == "unknown" {
                        self.uncertain.insert(&e.call_id);
                    }
                    false
                }
            })
            .collect()
    }

    /// Answers each check with its verdict, or that the store failed; a
    /// reply taken for another try (`None`) is skipped.
    fn answer(&self, replies: Vec<Option<oneshot::Sender<Outcome>>>, decided: Decided) {
        let applied = decided.applied;
        self.metrics.count_batch(decided.verdicts.iter().flatten());
        for (reply, v) in replies.into_iter().zip(decided.verdicts) {
            let Some(reply) = reply else { continue };
            let outcome = match v {
                Some(v) => Outcome::Decided(Box::new(v), self.schema.clone(), self.limits.clone()),
                None => Outcome::Unavailable {
                    why: format!(
                        "window store failed: {}",
                        decided.why.as_deref().unwrap_or_default()
                    ),
                    applied,
                },
            };
            let _ = reply.send(outcome);
        }
    }
}

/// Produces the decided calls of a batch marked `publishable` (first
/// decisions, not duplicates, save those never published) to the events,
/// decisions and features topics, keyed by caller; delivery failures are
/// logged and counted (`publish_failures`), never block an answer.
fn publish(
    producer: &FutureProducer,
    topics: &ServeTopics,
    (decisions, features): (&Schema, &Schema),
    events: &[CallEvent],
    verdicts: &[Option<Verdict>],
    publishable: &[bool],
    metrics: &Arc<Metrics>,
) {
    let mut pending = Vec::new();
    let decided = events
        .iter()
        .zip(verdicts)
        .zip(publishable)
        .filter(|(_, publish)| **publish)
        .filter_map(|((e, v), _)| Some((e, v.as_ref()?)));
    for (e, v) in decided {
        let row = Row {
            event: e,
            verdict: v,
        };
        // A call's end goes to the events topic only: it has no decision.
        let out = [
            Some((&topics.events, event_json(e).into_bytes())),
            (!v.end).then(|| (&topics.decisions, decisions.json_bytes(row))),
            (!v.end).then(|| (&topics.features, features.json_bytes(row))),
        ];
        for (topic, payload) in out.into_iter().flatten() {
            let record = FutureRecord::to(topic)
                .key(e.caller.as_str())
                .payload(&payload);
            match producer.send_result(record) {
                Ok(f) => pending.push(f),
                Err((err, _)) => {
                    warn!(error = %err, topic, "could not queue a record");
                    metrics.publish_failures.inc();
                }
            }
        }
    }
    let metrics = metrics.clone();
    tokio::spawn(async move {
        for f in pending {
            match f.await {
                Ok(Ok(_)) => {}
                Ok(Err((err, _))) => {
                    warn!(error = %err, "a record was not delivered");
                    metrics.publish_failures.inc();
                }
                Err(_) => {
                    metrics.publish_failures.inc();
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::StoreError;
    use crate::online::serve::Claim;
    use crate::store::memory::MemoryStore;

    /// A store that leaves every call undecided, as a caller another
    /// writer kept changing, for its first `refusals` batches.
    struct Contended {
        inner: MemoryStore,
        refusals: usize,
        batches: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl WindowStore for Contended {
        async fn apply_batch(
            &mut self,
            rules: &RuleSet,
            events: &[CallEvent],
        ) -> Result<Vec<Verdict>, StoreError> {
            self.inner.apply_batch(rules, events).await
        }

        async fn apply_batch_partial(
            &mut self,
            rules: &RuleSet,
            events: &[CallEvent],
        ) -> Result<Vec<Option<Verdict>>, StoreError> {
            self.batches
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if self.refusals > 0 {
                self.refusals -= 1;
                return Ok(vec![None; events.len()]);
            }
            let verdicts = self.inner.apply_batch(rules, events).await?;
            Ok(verdicts.into_iter().map(Some).collect())
        }
    }

    /// One check through a batcher on a store refusing its first
    /// `refusals` batches: its outcome and the batches the store saw.
    fn check_with(refusals: usize) -> (Outcome, usize) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let rules = RuleSet::from_args(None, &["m:sliding:60s:5".into()]).unwrap();
            let (_keep, rules_rx) = watch::channel(rules);
            let batches = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let store = Contended {
                inner: MemoryStore::new(),
                refusals,
                batches: batches.clone(),
            };
            let batcher = Batcher::new(
                store,
                rules_rx,
                Arc::new(ServeConfig::default()),
                Arc::new(Metrics::new()),
                Arc::new(Health::default()),
                None,
            );
            let (tx, rx) = mpsc::channel(8);
            let run = tokio::spawn(batcher.run(rx));
            let (reply, answer) = oneshot::channel();
            let job = Job {
                event: CallEvent::new("c-1", "+34600000001", now_ms()),
                reply,
                claim: Arc::new(Claim::default()),
                contended: 0,
            };
            tx.send(job).await.unwrap();
            let outcome = answer.await.unwrap();
            drop(tx);
            run.await.unwrap();
            (outcome, batches.load(std::sync::atomic::Ordering::SeqCst))
        })
    }

    #[test]
    fn a_contended_call_is_tried_again_in_the_next_batches() {
        let (outcome, batches) = check_with(2);
        assert!(
            matches!(&outcome, Outcome::Decided(v, _, _) if !v.duplicate),
            "not decided after 2 contended batches"
        );
        assert_eq!(batches, 3);
    }

    #[test]
    fn a_call_contended_in_every_try_is_answered_not_applied() {
        let (outcome, batches) = check_with(100);
        match outcome {
            Outcome::Unavailable { why, applied } => {
                assert_eq!(applied, "no");
                assert!(why.contains(CONTENDED), "{why}");
            }
            Outcome::Decided(..) => panic!("decided by a store that refused every batch"),
        }
        assert_eq!(batches, 1 + usize::from(CONTENDED_RETRIES));
    }
}

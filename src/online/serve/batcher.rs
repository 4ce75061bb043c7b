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
}

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
        while let Some(first) = idle
            .recv(&mut rx, &mut self.store, &self.metrics, &self.health)
            .await
        {
            jobs.push(first);
            collect(&self.config, &mut rx, &mut jobs).await;
            self.follow_rules();
            self.handle(&mut jobs).await;
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
    /// check.
    async fn handle(&mut self, jobs: &mut Vec<Job>) {
        // Calls whose handler gave up at its deadline are dropped unapplied.
        let (mut events, replies): (Vec<CallEvent>, Vec<oneshot::Sender<Outcome>>) = jobs
            .drain(..)
            .filter(|j| j.claim.send())
            .map(|j| (j.event, j.reply))
            .unzip();
        if events.is_empty() {
            return;
        }
        clamp_to_clock(&mut events, self.current.grace_ms, now_ms(), &self.metrics);
        self.metrics.batch_size.observe(events.len() as f64);
        let decided = self.store_verdicts(&events).await;
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
    /// so under `block` (answered 503), or are decided degraded.
    async fn store_verdicts(&mut self, events: &[CallEvent]) -> Decided {
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
            };
        };
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

    /// Answers each check with its verdict, or that the store failed.
    fn answer(&self, replies: Vec<oneshot::Sender<Outcome>>, decided: Decided) {
        let applied = decided.applied;
        self.metrics.count_batch(decided.verdicts.iter().flatten());
        for (reply, v) in replies.into_iter().zip(decided.verdicts) {
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

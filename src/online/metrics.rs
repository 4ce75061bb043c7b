//! Prometheus metrics, `/healthz` and `/readyz` of the stream processor,
//! and the status page (`/`, `/v1/stats`, see [`crate::online::status`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::engine::event::{CallEvent, BAD_CALLER};
use crate::engine::record::Verdict;
use crate::online::status::{Counters, HealthView, Status, PAGE};
use crate::store::{CacheStats, LeaseStats, PoolStats, StoreStats};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Json};
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Default address of `/metrics`, `/healthz` and `/readyz`.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9898";

/// Labels of decided events.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `allow` or `reject`.
    pub decision: String,
    /// The record's reason.
    pub reason: String,
}

/// A single `kind` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// What kind.
    pub kind: String,
}

/// A single `field` label: a canonical event field (a bounded set).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FieldLabel {
    /// The field.
    pub field: String,
}

/// Labels of a rule.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabel {
    /// The rule's name.
    pub rule: String,
}

/// Labels of a partition.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PartitionLabels {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: String,
}

/// All metrics of the consumer.
pub struct Metrics {
    registry: Registry,
    /// Decided events by decision and reason.
    pub events: Family<DecisionLabels, Counter>,
    /// Calls decided on the instance's own state while the store failed
    /// (`--on-store-error local`).
    pub fallback_decisions: Counter,
    /// Calls over a rule's `warn` level and allowed, by that rule
    /// (redeliveries not counted again).
    pub warnings: Family<RuleLabel, Counter>,
    /// Events sent to the dead-letter topic, by error kind.
    pub dlq: Family<KindLabel, Counter>,
    /// Dead letters that could not be produced (dropped, logged).
    pub dlq_failures: Counter,
    /// Redelivered call ids answered from the store.
    pub duplicates: Counter,
    /// Events later than the grace period.
    pub late: Counter,
    /// Events decided by the fallback policy while the store failed.
    pub degraded: Counter,
    /// Latency of one store batch call, seconds.
    pub store_latency: Histogram,
    /// Store errors by kind (`transient`, `fatal`).
    pub store_errors: Family<KindLabel, Counter>,
    /// Cached store: writes refused because another writer had changed the
    /// caller since it was read (each was decided again on the current
    /// state). A steady rise means two instances decide the same callers.
    pub store_conflicts: Counter,
    /// Cached store: callers looked up in memory, one per batch with calls
    /// of theirs, by result (`hit`; `miss`: new, or dropped earlier).
    pub cache_lookups: Family<KindLabel, Counter>,
    /// Cached store: callers not in memory whose state Redis had, read
    /// back before deciding (dropped earlier, or another instance's).
    pub cache_rereads: Counter,
    /// Cached store: callers dropped from memory to keep within
    /// --cached-callers and --cached-mib.
    pub cache_evictions: Counter,
    /// Cached store: calls decided and written while the batch before
    /// them was committed.
    pub cache_decided_ahead: Counter,
    /// Cached store: callers in memory now.
    pub cache_callers: Gauge,
    /// Cached store: about how many bytes they take.
    pub cache_bytes: Gauge,
    /// Lease calls for the rules keyed by callee or global (batches that
    /// needed credits not held).
    pub lease_calls: Counter,
    /// Counters leased, by way (`increment`, `script`, `in_process`,
    /// `reserve`).
    pub lease_counters: Family<KindLabel, Counter>,
    /// Credits by outcome (`granted`; `short`: wanted, not granted, the
    /// counter at its limit).
    pub lease_credits: Family<KindLabel, Counter>,
    /// Time in lease calls, seconds (part of the store's latency).
    pub lease_seconds: Counter<f64, AtomicU64>,
    /// Batches the pools settled (in Redis: pool script calls).
    pub pool_calls: Counter,
    /// Events the pools took (attempts a pool sees, and every end).
    pub pool_events: Counter,
    /// Time in the pools' step, seconds (part of the store's latency).
    pub pool_seconds: Counter<f64, AtomicU64>,
    /// Events per batch.
    pub batch_size: Histogram,
    /// consume: per message, from reading it to handing its records (or
    /// its dead letter) to the producer: callguard's own share of a
    /// decision's latency.
    pub decision_delay: Histogram,
    /// consume: per batch, from reading its first message to handing the
    /// batch to the store (collecting it and waiting for the batch before).
    pub batch_wait: Histogram,
    /// Batches produced but not yet acknowledged by the broker.
    pub in_flight: Gauge,
    /// Consumer lag per partition (from librdkafka statistics).
    pub lag: Family<PartitionLabels, Gauge>,
    /// Rebalances by kind (`assign`, `revoke`, `error`).
    pub rebalances: Family<KindLabel, Counter>,
    /// Partitions of the input topic this consumer owns (after each
    /// rebalance).
    pub assigned_partitions: Gauge,
    /// Rule reloads by result (`ok`, `error`).
    pub rule_reloads: Family<KindLabel, Counter>,
    /// `serve`: records of decided calls that could not be produced to
    /// Kafka (dropped and logged; the answer was given).
    pub publish_failures: Counter,
    /// `serve`: checks whose time was ahead of the server clock by more
    /// than the grace, decided at the server clock instead.
    pub clamped: Counter,
    /// Times the store found Redis had lost every key of the prefix (a
    /// restart without persistence, a flush, a failover to a replica that
    /// had not received them): every window and record was gone.
    pub store_data_lost: Counter,
    /// `serve`: checks refused as invalid (400), by dead-letter kind
    /// (`serve` has no dead-letter topic; `dlq` counts `consume`'s).
    pub invalid_checks: Family<KindLabel, Counter>,
    /// Decided calls whose caller was unusable (decided under
    /// `bad_caller`, as the rule set's policy says).
    pub bad_callers: Counter,
    /// Fields of events that could not be read and were dropped, the call
    /// kept (a label `unknown`, a duration `1.5`, an unusable caller), by
    /// field.
    pub dropped_fields: Family<FieldLabel, Counter>,
    /// `serve`: fields of checks the decoder does not read (a misspelled
    /// `calee`, a switch's own), ignored and named in the answer.
    pub ignored_fields: Counter,
    /// Calls' ends applied (not decided: not in the decision counts).
    pub call_ends: Counter,
    /// `serve`: connections shed or closed by the server, by reason
    /// (`cap`: over `--max-connections`, closed at once; `timeout`: a
    /// request's header or body not sent in time, or idle too long).
    pub connections_shed: Family<KindLabel, Counter>,
    /// The live status behind `/v1/stats` and the page.
    pub status: Status,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Buckets for a call's time inside `consume`: 0.25 ms to about 2 s,
/// each 1.5 times the last (a p99 read from them is within that step).
fn delay_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.00025, 1.5, 23)
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut m = Metrics {
            registry: Registry::with_prefix("callguard"),
            events: Family::default(),
            warnings: Family::default(),
            fallback_decisions: Counter::default(),
            dlq: Family::default(),
            dlq_failures: Counter::default(),
            duplicates: Counter::default(),
            late: Counter::default(),
            clamped: Counter::default(),
            store_data_lost: Counter::default(),
            invalid_checks: Family::default(),
            bad_callers: Counter::default(),
            dropped_fields: Family::default(),
            ignored_fields: Counter::default(),
            call_ends: Counter::default(),
            connections_shed: Family::default(),
            degraded: Counter::default(),
            store_latency: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            store_errors: Family::default(),
            store_conflicts: Counter::default(),
            cache_lookups: Family::default(),
            cache_rereads: Counter::default(),
            cache_decided_ahead: Counter::default(),
            cache_evictions: Counter::default(),
            cache_callers: Gauge::default(),
            cache_bytes: Gauge::default(),
            lease_calls: Counter::default(),
            lease_counters: Family::default(),
            lease_credits: Family::default(),
            lease_seconds: Counter::default(),
            pool_calls: Counter::default(),
            pool_events: Counter::default(),
            pool_seconds: Counter::default(),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            decision_delay: Histogram::new(delay_buckets()),
            batch_wait: Histogram::new(delay_buckets()),
            in_flight: Gauge::default(),
            lag: Family::default(),
            rebalances: Family::default(),
            assigned_partitions: Gauge::default(),
            rule_reloads: Family::default(),
            publish_failures: Counter::default(),
            status: Status::default(),
        };
        m.register_decisions();
        m.register_store();
        m.register_pipeline();
        m
    }

    /// Decided calls, duplicates, late and degraded ones, and what was refused.
    fn register_decisions(&mut self) {
        let r = &mut self.registry;
        r.register("events", "Decided call events", self.events.clone());
        r.register(
            "fallback_decisions",
            "Calls decided on the instance's own state while the store failed (--on-store-error local)",
            self.fallback_decisions.clone(),
        );
        r.register(
            "warnings",
            "Allowed calls over a rule's warn level, by the first such rule",
            self.warnings.clone(),
        );
        r.register(
            "bad_callers",
            "Decided calls whose caller was unusable (missing, garbage, or national without --default-country-code)",
            self.bad_callers.clone(),
        );
        r.register(
            "dropped_fields",
            "Fields of call events that could not be read, dropped with the call kept, by field",
            self.dropped_fields.clone(),
        );
        r.register(
            "call_ends",
            "Calls' ends applied (they free the calls' slots of concurrent rules; not decisions)",
            self.call_ends.clone(),
        );
        r.register(
            "duplicates",
            "Redelivered call ids answered from the store",
            self.duplicates.clone(),
        );
        r.register(
            "late",
            "Events later than the grace period",
            self.late.clone(),
        );
        r.register(
            "clamped",
            "serve: check times ahead of the clock by more than the grace, decided at the clock",
            self.clamped.clone(),
        );
        r.register(
            "degraded",
            "Events decided by the fallback policy while the store failed",
            self.degraded.clone(),
        );
        r.register(
            "invalid_checks",
            "serve: checks refused as invalid (400), by kind",
            self.invalid_checks.clone(),
        );
        r.register(
            "ignored_fields",
            "serve: fields of checks that callguard does not read, ignored (named in the answer)",
            self.ignored_fields.clone(),
        );
        r.register(
            "dlq",
            "Events sent to the dead-letter topic",
            self.dlq.clone(),
        );
        r.register(
            "dlq_failures",
            "Dead letters that could not be produced (dropped and logged)",
            self.dlq_failures.clone(),
        );
    }

    /// The window store: latency, errors, conflicts, data loss.
    fn register_store(&mut self) {
        let r = &mut self.registry;
        r.register(
            "store_latency_seconds",
            "Latency of one store batch call",
            self.store_latency.clone(),
        );
        r.register(
            "store_errors",
            "Window store errors",
            self.store_errors.clone(),
        );
        r.register(
            "store_conflicts",
            "Cached store writes refused because another writer had changed the caller (decided again)",
            self.store_conflicts.clone(),
        );
        r.register(
            "cache_lookups",
            "Cached store: callers looked up in memory, one per batch with calls of theirs, by result (hit; miss: new, or dropped earlier)",
            self.cache_lookups.clone(),
        );
        r.register(
            "cache_rereads",
            "Cached store: callers not in memory whose state Redis had, read back before deciding",
            self.cache_rereads.clone(),
        );
        r.register(
            "cache_decided_ahead",
            "Cached store: calls decided and written while the batch before them was committed",
            self.cache_decided_ahead.clone(),
        );
        r.register(
            "cache_evictions",
            "Cached store: callers dropped from memory to keep within --cached-callers and --cached-mib",
            self.cache_evictions.clone(),
        );
        r.register(
            "cache_callers",
            "Cached store: callers held in memory",
            self.cache_callers.clone(),
        );
        r.register(
            "cache_bytes",
            "Cached store: about how many bytes the callers in memory take (windows, records, logs; allocator slack on top)",
            self.cache_bytes.clone(),
        );
        r.register(
            "store_data_lost",
            "Times Redis was found to have lost every key of the prefix",
            self.store_data_lost.clone(),
        );
        r.register(
            "lease_calls",
            "Lease calls for the rules keyed by callee or global (batches needing credits not held)",
            self.lease_calls.clone(),
        );
        r.register(
            "lease_counters",
            "Counters leased, by way (increment: Redis HINCRBY; script: the lease script; in_process; reserve: from the instance's reserve slot, no Redis call)",
            self.lease_counters.clone(),
        );
        r.register(
            "lease_credits",
            "Credits by outcome (granted; short: wanted, not granted, the counter at its limit)",
            self.lease_credits.clone(),
        );
        r.register(
            "lease_seconds",
            "Time in lease calls (part of the store latency)",
            self.lease_seconds.clone(),
        );
        r.register(
            "pool_calls",
            "Batches the pools (concurrent and sum rules keyed by account, callee or global) settled; in Redis, pool script calls",
            self.pool_calls.clone(),
        );
        r.register(
            "pool_events",
            "Events the pools took: attempts a pool sees, and every call end",
            self.pool_events.clone(),
        );
        r.register(
            "pool_seconds",
            "Time in the pools' step (part of the store latency; in Redis one script call a batch, on one hash slot)",
            self.pool_seconds.clone(),
        );
    }

    /// Batches, Kafka, rules and connections.
    fn register_pipeline(&mut self) {
        let r = &mut self.registry;
        r.register("batch_size", "Events per batch", self.batch_size.clone());
        r.register(
            "decision_delay_seconds",
            "consume: per message, from reading it to producing its records (a call's decision and features, or a dead letter); the broker's time not included",
            self.decision_delay.clone(),
        );
        r.register(
            "batch_wait_seconds",
            "consume: per batch, from reading its first message to handing it to the store",
            self.batch_wait.clone(),
        );
        r.register(
            "in_flight_batches",
            "Batches awaiting broker acknowledgement",
            self.in_flight.clone(),
        );
        r.register(
            "consumer_lag",
            "Consumer lag per partition",
            self.lag.clone(),
        );
        r.register(
            "rebalances",
            "Consumer group rebalances",
            self.rebalances.clone(),
        );
        r.register(
            "assigned_partitions",
            "Partitions of the input topic this consumer owns",
            self.assigned_partitions.clone(),
        );
        r.register(
            "rule_reloads",
            "Rule set reloads",
            self.rule_reloads.clone(),
        );
        r.register(
            "publish_failures",
            "Records of calls decided by serve that could not be produced",
            self.publish_failures.clone(),
        );
        r.register(
            "connections_shed",
            "serve: connections shed (over the cap) or closed (too slow or idle)",
            self.connections_shed.clone(),
        );
    }

    /// What `/v1/stats` answers.
    pub fn snapshot(&self, health: &Health) -> Option<crate::online::status::Snapshot> {
        let counters = Counters {
            duplicates: self.duplicates.get(),
            late: self.late.get(),
            fallbacks: self.degraded.get(),
            local_fallbacks: self.fallback_decisions.get(),
            bad_callers: self.bad_callers.get(),
            ignored_fields: self.ignored_fields.get(),
            conflicts: self.store_conflicts.get(),
            data_lost: self.store_data_lost.get(),
            publish_failures: self.publish_failures.get(),
            in_flight: self.in_flight.get(),
        };
        let text = |m: &Mutex<String>| m.lock().map(|d| d.clone()).unwrap_or_default();
        let health = HealthView {
            ready: health.ready(),
            detail: text(&health.detail),
            note: text(&health.note),
        };
        self.status.snapshot(counters, health)
    }

    /// Counts a store call that failed, by kind.
    pub fn store_error(&self, kind: &str) {
        Self::inc(&self.store_errors, kind);
        self.status.store_error();
    }

    /// Counts an event sent to the dead-letter topic, by kind.
    pub fn dead_letter(&self, kind: &str) {
        Self::inc(&self.dlq, kind);
        self.status.dead_letter();
    }

    /// Counts the fields of `event` that could not be read (the call kept).
    pub fn dropped_fields(&self, event: &CallEvent) {
        for e in event.dropped.iter().flatten() {
            let field = e.field().unwrap_or("other").to_string();
            self.dropped_fields
                .get_or_create(&FieldLabel { field })
                .inc();
        }
    }

    /// Counts a check refused as invalid, by kind.
    pub fn invalid_check(&self, kind: &str) {
        Self::inc(&self.invalid_checks, kind);
        self.status.invalid_check();
    }

    /// Counts what a store met since its statistics were `before`: the
    /// writes refused by another writer, and the data losses it found,
    /// which it also says in the readiness detail (readiness itself stays:
    /// the store answers, with every window started afresh).
    pub fn count_store_stats(&self, now: StoreStats, before: StoreStats, health: &Health) {
        let conflicts = now.conflicts.saturating_sub(before.conflicts);
        if conflicts > 0 {
            self.store_conflicts.inc_by(conflicts);
        }
        self.count_leases(&now.lease, &before.lease);
        self.count_pools(&now.pools, &before.pools);
        self.count_cache(&now.cache, &before.cache);
        let n = now.data_losses.saturating_sub(before.data_losses);
        if n > 0 {
            self.store_data_lost.inc_by(n);
            if let Ok(mut d) = health.note.lock() {
                *d = format!(
                    "Redis lost every key of the prefix (restart without persistence, flush or \
                     failover), {n} time(s) more: every window and record started afresh \
                     (callguard_store_data_lost_total)"
                );
            }
        }
    }

    /// Counts what the cached store's memory did between two snapshots,
    /// and sets its size now.
    fn count_cache(&self, now: &CacheStats, before: &CacheStats) {
        let hits = now.hits.saturating_sub(before.hits);
        let misses = now
            .lookups
            .saturating_sub(before.lookups)
            .saturating_sub(hits);
        for (kind, n) in [("hit", hits), ("miss", misses)] {
            if n > 0 {
                self.cache_lookups
                    .get_or_create(&KindLabel { kind: kind.into() })
                    .inc_by(n);
            }
        }
        self.cache_rereads
            .inc_by(now.rereads.saturating_sub(before.rereads));
        self.cache_evictions
            .inc_by(now.evictions.saturating_sub(before.evictions));
        self.cache_decided_ahead
            .inc_by(now.decided_ahead.saturating_sub(before.decided_ahead));
        self.cache_callers.set(now.callers as i64);
        self.cache_bytes.set(now.bytes as i64);
    }

    /// Counts what the pools did between two snapshots.
    fn count_pools(&self, now: &PoolStats, before: &PoolStats) {
        self.pool_calls
            .inc_by(now.calls.saturating_sub(before.calls));
        self.pool_events
            .inc_by(now.events.saturating_sub(before.events));
        if now.micros > before.micros {
            self.pool_seconds
                .inc_by((now.micros - before.micros) as f64 / 1e6);
        }
    }

    /// Counts what the gate leased between two snapshots.
    fn count_leases(&self, now: &LeaseStats, before: &LeaseStats) {
        let by = |family: &Family<KindLabel, Counter>, kind: &str, n: u64, b: u64| {
            if n > b {
                family
                    .get_or_create(&KindLabel { kind: kind.into() })
                    .inc_by(n - b);
            }
        };
        if now.calls > before.calls {
            self.lease_calls.inc_by(now.calls - before.calls);
        }
        by(
            &self.lease_counters,
            "increment",
            now.increments,
            before.increments,
        );
        by(
            &self.lease_counters,
            "script",
            now.scripted,
            before.scripted,
        );
        by(
            &self.lease_counters,
            "in_process",
            now.in_process,
            before.in_process,
        );
        by(
            &self.lease_counters,
            "reserve",
            now.reserved,
            before.reserved,
        );
        by(&self.lease_credits, "granted", now.granted, before.granted);
        by(&self.lease_credits, "short", now.short, before.short);
        if now.micros > before.micros {
            self.lease_seconds
                .inc_by((now.micros - before.micros) as f64 / 1e6);
        }
    }

    /// Counts a batch of decided calls: the counters per call, the status
    /// page once.
    pub fn count_batch<'v>(&self, verdicts: impl IntoIterator<Item = &'v Verdict> + Clone) {
        // A call's end is applied, not decided: no decision to count.
        for v in verdicts.clone() {
            if v.end {
                self.call_ends.inc();
            } else {
                self.count_decided(v);
            }
        }
        self.status.decided(verdicts.into_iter().filter(|v| !v.end));
    }

    /// Counts one decided call by decision and reason, and its flags.
    fn count_decided(&self, v: &Verdict) {
        let r = &v.record;
        self.events
            .get_or_create(&DecisionLabels {
                decision: r.decision.as_str().to_string(),
                reason: r.reason.to_string(),
            })
            .inc();
        if r.caller == BAD_CALLER && !v.duplicate {
            self.bad_callers.inc();
        }
        if v.duplicate {
            self.duplicates.inc();
        } else if let Some(w) = &r.warn {
            self.warnings
                .get_or_create(&RuleLabel {
                    rule: w.to_string(),
                })
                .inc();
        }
        if r.late {
            self.late.inc();
        }
        if r.degraded {
            self.degraded.inc();
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// Adds one to a labelled counter.
    pub fn inc(family: &Family<KindLabel, Counter>, kind: &str) {
        family
            .get_or_create(&KindLabel {
                kind: kind.to_string(),
            })
            .inc();
    }
}

/// Liveness and readiness flags.
#[derive(Debug, Default)]
pub struct Health {
    /// The consumer has partitions assigned (or is otherwise able to work).
    pub assigned: AtomicBool,
    /// The window store answers.
    pub store_ok: AtomicBool,
    /// Why not ready, if known.
    pub detail: Mutex<String>,
    /// Something an operator should know while ready (shown after
    /// `ready` by `/readyz`): the last data loss found in the store.
    pub note: Mutex<String>,
}

impl Health {
    /// Ready: partitions assigned and the store answering.
    pub fn ready(&self) -> bool {
        self.assigned.load(Ordering::Relaxed) && self.store_ok.load(Ordering::Relaxed)
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
}

async fn metrics_handler(State(s): State<AppState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}

async fn ready_handler(State(s): State<AppState>) -> impl IntoResponse {
    if s.health.ready() {
        let note = s.health.note.lock().map(|n| n.clone()).unwrap_or_default();
        if note.is_empty() {
            (StatusCode::OK, "ready\n".to_string())
        } else {
            (StatusCode::OK, format!("ready\nnote: {note}\n"))
        }
    } else {
        let detail = s
            .health
            .detail
            .lock()
            .map(|d| d.clone())
            .unwrap_or_default();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {detail}\n"),
        )
    }
}

async fn stats_handler(State(s): State<AppState>) -> impl IntoResponse {
    match s.metrics.snapshot(&s.health) {
        Some(snapshot) => Json(snapshot).into_response(),
        None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// The `/metrics`, `/healthz`, `/readyz`, `/v1/stats` and `/` (status
/// page) routes.
pub fn routes(metrics: Arc<Metrics>, health: Arc<Health>) -> Router {
    Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route("/v1/stats", get(stats_handler))
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .with_state(AppState { metrics, health })
}

/// Serves `/metrics`, `/healthz` and `/readyz` until `shutdown` resolves.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<SocketAddr> {
    let app = routes(metrics, health);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error = %e, "metrics server failed");
        }
    });
    Ok(bound)
}

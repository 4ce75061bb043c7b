//! `callguard serve`: the check API a switch calls while the INVITE waits.
//!
//! An SBC or PBX (Kamailio `http_client`, OpenSIPS `rest_client`,
//! FreeSWITCH `mod_curl`, Asterisk `CURL()`) sends one call event and gets
//! its decision record back in the same request, decided by the same rules
//! and window store as `consume` and `replay`:
//!
//! * `POST /v1/check` with the Kafka payload's JSON (`ts` optional: the
//!   server's clock in ms; a `ts` ahead of the server's clock by more than
//!   the rule set's grace is replaced by the clock, see `clamp_to_clock`);
//! * `GET /v1/check?call_id=...&caller=...[&callee=...][&ts=...]` for
//!   dialplans that can only GET;
//! * `POST /v1/end` (or `GET /v1/end?...`, or a check with `"event":
//!   "end"`) when a call ends: the same fields, `ts` the hang-up time
//!   (optional: the server's clock). The end is applied (it frees the
//!   call's slot of the concurrent rules), never decided; the answer is
//!   `{"call_id", "caller", "ts", "ended": true}`, or 503 when the store
//!   failed (the end was not applied; `max_duration` still closes the
//!   call).
//!
//! The answer is the `call-decisions` record as JSON plus `duplicate`.
//! Rejects answer 200 unless [`ServeConfig::reject_status`] is set, then
//! that status with a `Retry-After` header (seconds, rounded up). An invalid
//! event answers 400 with `{"error", "kind"}` (the dead-letter kinds).
//!
//! Requests are decided by one batcher task in arrival order: requests that
//! arrive while a batch is at the store (and within
//! [`ServeConfig::linger`] of the first) form the next batch, one pipelined
//! round trip. A caller's calls are therefore decided in arrival order, and
//! a call id sent twice (a SIP retransmission, two racing requests) is
//! decided once: the second gets the first's record back, flagged
//! `duplicate` (with the store's idempotency on, as by default).
//!
//! With Kafka topics configured, every decided call (not duplicates, not
//! calls the store could not decide) is also produced to the events,
//! decisions and features topics, keyed by caller, as `consume` would have:
//! calls decided inline feed replays and training data like consumed ones.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use rdkafka::producer::FutureProducer;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::info;

use crate::engine::event::{CallEvent, Decoder, EventKind};
use crate::engine::record::{Decision, Row, Schema, Verdict};
use crate::engine::rules::RuleSet;
use crate::error::{EventError, KafkaError};
use crate::online::kafka::{client_err, producer_config};
use crate::online::metrics::{self, Health, Metrics};
use crate::online::policy::{check_future_skew, now_ms, StoreErrorPolicy};
use crate::store::WindowStore;

mod batcher;
mod listener;
mod ratelimit;
mod uncertain;

use batcher::Batcher;

pub use listener::{Limits, Listener};

/// Default listening address.
pub const DEFAULT_ADDR: &str = "127.0.0.1:8080";
/// Default largest request body, bytes.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 * 1024;
/// Default largest batch of requests per store round trip.
pub const DEFAULT_BATCH_SIZE: usize = 256;
/// Default extra wait for more requests after the first of a batch.
pub const DEFAULT_LINGER_US: u64 = 0;
/// Default most connections open at once on the check API.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4_096;
/// Default deadline for a request's header (and idle time between requests).
pub const DEFAULT_HEADER_TIMEOUT_MS: u64 = 5_000;
/// Default longest wait for a check's answer: below the 1 s timeout of the
/// shipped Kamailio, Asterisk and FreeSWITCH snippets, so a switch sees the
/// 503 rather than its own timeout.
pub const DEFAULT_ANSWER_DEADLINE_MS: u64 = 800;
/// Default deadline for a request's body.
pub const DEFAULT_BODY_TIMEOUT_MS: u64 = 5_000;
/// Most connections open at once on the admin listener.
const ADMIN_MAX_CONNECTIONS: usize = 64;
/// Requests queued for the batcher at most; beyond, answers 503.
const QUEUE: usize = 16_384;
/// Retry-After (seconds) of a 503 when the store fails under `block`.
const STORE_RETRY_AFTER_S: u64 = 1;

/// Where decided calls are produced (optional).
#[derive(Debug, Clone)]
pub struct ServeTopics {
    /// Bootstrap servers.
    pub brokers: String,
    /// Extra librdkafka settings.
    pub settings: Vec<(String, String)>,
    /// Call events (canonical JSON, as `callguard produce` writes).
    pub events: String,
    /// Decision records.
    pub decisions: String,
    /// Feature records.
    pub features: String,
}

/// Configuration of the check API.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Field names and number normalisation, as for Kafka payloads.
    pub decoder: Decoder,
    /// What to answer when the store fails: `block` answers 503 with a
    /// Retry-After; `allow` and `reject` answer degraded records.
    pub on_store_error: StoreErrorPolicy,
    /// Under `local`: the share of each limit shared between instances
    /// (rules keyed by callee or global) this instance admits alone.
    pub local_share: f64,
    /// Status of a reject (with a `Retry-After` header); `None`: 200.
    pub reject_status: Option<StatusCode>,
    /// Largest request body; larger ones are refused (413).
    pub max_body_bytes: usize,
    /// Connections: the cap, and the deadline for each request's header.
    pub limits: Limits,
    /// Deadline for a request's body (then 408 and the connection closed).
    pub body_timeout: Duration,
    /// Largest batch per store round trip.
    pub batch_size: usize,
    /// Extra wait for more requests after the first of a batch.
    pub linger: Duration,
    /// Event times further ahead of the wall clock are refused (400).
    pub max_future_skew: Option<Duration>,
    /// Longest a check waits for its answer: past it, 503 (a call still
    /// queued is then never applied; one already at the store is answered
    /// `"applied": "unknown"`). `None`: no deadline.
    pub answer_deadline: Option<Duration>,
    /// Refuse checks with fields the decoder does not read (400) instead
    /// of answering them with those fields under `"ignored"`.
    pub strict_fields: bool,
    /// Produce decided calls to these topics.
    pub topics: Option<ServeTopics>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            decoder: Decoder::default(),
            on_store_error: StoreErrorPolicy::Block,
            local_share: 1.0,
            reject_status: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            limits: Limits {
                max_connections: DEFAULT_MAX_CONNECTIONS,
                header_timeout: Duration::from_millis(DEFAULT_HEADER_TIMEOUT_MS),
            },
            body_timeout: Duration::from_millis(DEFAULT_BODY_TIMEOUT_MS),
            batch_size: DEFAULT_BATCH_SIZE,
            linger: Duration::from_micros(DEFAULT_LINGER_US),
            max_future_skew: Some(Duration::from_secs(300)),
            answer_deadline: Some(Duration::from_millis(DEFAULT_ANSWER_DEADLINE_MS)),
            strict_fields: false,
            topics: None,
        }
    }
}

/// What the batcher answers for one request.
enum Outcome {
    /// Decided, with the columns and limits of the rules that decided.
    Decided(Box<Verdict>, Arc<Schema>, Arc<[ratelimit::RuleLimit]>),
    /// The store failed under `block`: no verdict. `applied` says whether
    /// the call may still have been applied (`"unknown"`: the store call
    /// failed after it was sent) or surely was not (`"no"`: a caller
    /// contended by another writer, nothing of it written).
    Unavailable { why: String, applied: &'static str },
}

/// One request waiting for its decision.
struct Job {
    event: CallEvent,
    reply: oneshot::Sender<Outcome>,
    /// Who has the call: see [`Claim`].
    claim: Arc<Claim>,
    /// Batches that left the call undecided because another writer kept
    /// changing its caller (see [`batcher::CONTENDED_RETRIES`]).
    contended: u8,
}

/// Who has a queued call: the batcher, once it sends the call to the
/// store, or the handler, once the answer deadline passed first. Exactly
/// one of them wins, so a call answered "not decided" is never applied.
#[derive(Default)]
struct Claim(std::sync::atomic::AtomicU8);

impl Claim {
    const QUEUED: u8 = 0;
    const SENT: u8 = 1;
    const ABANDONED: u8 = 2;

    /// The batcher takes the call for the store; false if it was abandoned.
    fn send(&self) -> bool {
        self.swap_from_queued(Claim::SENT)
    }

    /// The handler gives the call up; false if it is already at the store.
    fn abandon(&self) -> bool {
        self.swap_from_queued(Claim::ABANDONED)
    }

    /// The batcher queues the call again: the store left it undecided and
    /// wrote nothing of it, so the handler may give it up again.
    fn requeue(&self) {
        let _ = self.0.compare_exchange(
            Claim::SENT,
            Claim::QUEUED,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    fn swap_from_queued(&self, to: u8) -> bool {
        self.0
            .compare_exchange(Claim::QUEUED, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

#[derive(Clone)]
struct AppState {
    jobs: mpsc::Sender<Job>,
    config: Arc<ServeConfig>,
    metrics: Arc<Metrics>,
}

/// Where `serve` listens: the check API (with `/metrics`, `/healthz` and
/// `/readyz` too) and, if given, an admin listener with only those three,
/// whose own small cap keeps them answering however many connections the
/// check API holds.
pub struct Listeners {
    /// The check API.
    pub api: TcpListener,
    /// The admin listener.
    pub admin: Option<TcpListener>,
}

impl From<TcpListener> for Listeners {
    fn from(api: TcpListener) -> Self {
        Listeners { api, admin: None }
    }
}

/// Serves the check API on `listeners` until `shutdown` resolves, then
/// answers the requests already queued and returns.
pub async fn run<S: WindowStore + 'static>(
    listeners: impl Into<Listeners>,
    config: ServeConfig,
    store: S,
    rules: watch::Receiver<RuleSet>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), KafkaError> {
    let producer = match &config.topics {
        Some(t) => Some((producer(t)?, t.clone())),
        None => None,
    };
    health.assigned.store(true, Ordering::Relaxed);
    let config = Arc::new(config);
    let (tx, rx) = mpsc::channel(QUEUE);
    let batcher = Batcher::new(
        store,
        rules,
        config.clone(),
        metrics.clone(),
        health.clone(),
        producer,
    );
    let batcher = tokio::spawn(batcher.run(rx));
    let state = AppState {
        jobs: tx,
        config: config.clone(),
        metrics: metrics.clone(),
    };
    let admin_routes = metrics::routes(metrics.clone(), health);
    let app = Router::new()
        // HEAD would run a check (axum answers HEAD with the GET route).
        .route(
            "/v1/check",
            post(check_post).get(check_get).head(method_not_allowed),
        )
        .route(
            "/v1/end",
            post(end_post).get(end_get).head(method_not_allowed),
        )
        .with_state(state)
        .merge(admin_routes.clone());
    let Listeners { api, admin } = listeners.into();
    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let admin = admin.map(|tcp| {
        if let Ok(addr) = tcp.local_addr() {
            info!(%addr, "admin listener: /metrics, /healthz, /readyz");
        }
        let limits = Limits {
            max_connections: ADMIN_MAX_CONNECTIONS,
            ..config.limits
        };
        let listener = Listener::new(tcp, limits, metrics.clone(), "admin");
        tokio::spawn(listener.run(admin_routes, stop.clone()))
    });
    let listener = Listener::new(api, config.limits, metrics, "check API");
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, cap = listener.cap(), "check API on /v1/check; metrics on /metrics, health on /healthz and /readyz");
    }
    listener.run(app, stop).await;
    if let Some(a) = admin {
        let _ = a.await;
    }
    // The router (and its job sender) is gone: the batcher ends once the
    // queued requests are answered.
    let _ = batcher.await;
    Ok(())
}

/// `HEAD /v1/check`: 405 (a check has effects; only POST and GET run one).
async fn method_not_allowed() -> Response {
    let mut r = StatusCode::METHOD_NOT_ALLOWED.into_response();
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET, POST"));
    r
}

fn producer(t: &ServeTopics) -> Result<FutureProducer, KafkaError> {
    producer_config(&t.brokers, &[("linger.ms", "5")], &t.settings)
        .create()
        .map_err(client_err("creating the producer"))
}

async fn check_post(State(s): State<AppState>, request: Request) -> Response {
    answer_post(&s, request, false).await
}

/// `POST /v1/end`: a call's end, with a check's body (whatever its
/// `event` says).
async fn end_post(State(s): State<AppState>, request: Request) -> Response {
    answer_post(&s, request, true).await
}

/// A check's (or, with `end`, a call end's) JSON body, decoded and
/// answered.
async fn answer_post(s: &AppState, request: Request, end: bool) -> Response {
    let body = match read_body(s, request).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let mut ignored = Vec::new();
    let decoded = s
        .config
        .decoder
        .decode_json_noting(&body, Some(now_ms()), Some(&mut ignored));
    answer_check(s, decoded.map(|e| as_end_if(e, end)), ignored).await
}

/// The request's body, within `--max-body-bytes` (else 413) and the body
/// deadline (else 408, and the connection is closed: a client sending a
/// byte a second must not hold it).
async fn read_body(s: &AppState, request: Request) -> Result<Bytes, Response> {
    let limit = s.config.max_body_bytes;
    let read = axum::body::to_bytes(request.into_body(), limit);
    match tokio::time::timeout(s.config.body_timeout, read).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(_)) => Err(error_answer(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("request body over {limit} bytes (or cut short)"),
            "body_too_large",
        )),
        Err(_) => {
            Metrics::inc(&s.metrics.connections_shed, "timeout");
            let mut r = error_answer(
                StatusCode::REQUEST_TIMEOUT,
                "request body not received in time",
                "body_timeout",
            );
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            Err(r)
        }
    }
}

/// An error answer: `{"error", "kind"}`, like a 400's.
fn error_answer(status: StatusCode, error: &str, kind: &str) -> Response {
    (status, axum::Json(json!({ "error": error, "kind": kind }))).into_response()
}

async fn check_get(
    State(s): State<AppState>,
    Query(fields): Query<HashMap<String, String>>,
) -> Response {
    answer_get(&s, fields, false).await
}

/// `GET /v1/end?call_id=...&caller=...[&ts=...]`.
async fn end_get(
    State(s): State<AppState>,
    Query(fields): Query<HashMap<String, String>>,
) -> Response {
    answer_get(&s, fields, true).await
}

/// A check's (or, with `end`, a call end's) query fields, decoded and
/// answered.
async fn answer_get(s: &AppState, mut fields: HashMap<String, String>, end: bool) -> Response {
    unescaped_plus(&mut fields, s.config.decoder.map.source("caller"));
    unescaped_plus(&mut fields, s.config.decoder.map.source("callee"));
    let ignored = s
        .config
        .decoder
        .other_fields(fields.keys().map(String::as_str));
    let decoded = s.config.decoder.decode_fields(&fields, Some(now_ms()));
    answer_check(s, decoded.map(|e| as_end_if(e, end)), ignored).await
}

/// The event as a call's end when `end` (the end routes), else as sent.
fn as_end_if(e: CallEvent, end: bool) -> CallEvent {
    if !end {
        return e;
    }
    CallEvent {
        kind: EventKind::End,
        ..e
    }
}

/// A number sent in a query string with its `+` not escaped (`%2B`) reads
/// as a leading space (`+` means a space there): taken as the `+` it was,
/// rather than as a national number, when what follows is digits.
fn unescaped_plus(fields: &mut HashMap<String, String>, name: &str) {
    if let Some(v) = fields.get_mut(name) {
        let digits = v.strip_prefix(' ').filter(|d| {
            !d.is_empty()
                && d.bytes()
                    .all(|b| b.is_ascii_digit() || b == b' ' || b == b'-')
        });
        if let Some(d) = digits {
            *v = format!("+{d}");
        }
    }
}

/// Decides one decoded check (after the future-skew check) and answers it.
/// `ignored` are the check's fields the decoder does not read: refused
/// under `--strict-fields`, else named in the answer.
async fn answer_check(
    s: &AppState,
    decoded: Result<CallEvent, EventError>,
    ignored: Vec<String>,
) -> Response {
    if !ignored.is_empty() {
        if s.config.strict_fields {
            return unknown_fields(s, &ignored);
        }
        s.metrics.ignored_fields.inc_by(ignored.len() as u64);
    }
    let decoded = decoded.and_then(|e| check_future_skew(e, s.config.max_future_skew));
    let event = match decoded {
        Ok(e) => {
            s.metrics.dropped_fields(&e);
            e
        }
        Err(e) => {
            s.metrics.invalid_check(e.kind());
            let mut body = json!({ "error": e.to_string(), "kind": e.kind() });
            if !ignored.is_empty() {
                // A missing field may be one of these, misspelled.
                body["ignored"] = json!(ignored);
            }
            return (StatusCode::BAD_REQUEST, axum::Json(body)).into_response();
        }
    };
    let is_end = event.kind == EventKind::End;
    let (reply, answer) = oneshot::channel();
    let claim = Arc::new(Claim::default());
    let job = Job {
        event,
        reply,
        claim: claim.clone(),
        contended: 0,
    };
    if s.jobs.try_send(job).is_err() {
        return unavailable("too many requests queued");
    }
    let answer = match s.config.answer_deadline {
        None => answer.await,
        Some(d) => match tokio::time::timeout(d, answer).await {
            Ok(a) => a,
            Err(_) => return past_deadline(&s.metrics, &claim),
        },
    };
    match answer {
        Ok(Outcome::Decided(v, _, _)) if is_end && !v.end => {
            // The store failed and the policy decided in its place: an end
            // has no decision to stand in for it.
            unavailable_applied("window store failed; the end was not applied", "no")
        }
        Ok(Outcome::Decided(v, _, _)) if is_end => ended(&v, &ignored),
        Ok(Outcome::Decided(v, schema, limits)) => {
            decided(&v, &schema, &limits, s.config.reject_status, &ignored)
        }
        Ok(Outcome::Unavailable { why, applied }) => unavailable_applied(&why, applied),
        Err(_) => unavailable("shutting down"),
    }
}

/// The 400 of a check with fields the decoder does not read, under
/// `--strict-fields`: names them and the fields that are read.
fn unknown_fields(s: &AppState, ignored: &[String]) -> Response {
    s.metrics.invalid_check("unknown_field");
    let known = s.config.decoder.known_fields();
    let body = json!({
        "error": format!("unknown fields: {} (known: {})", ignored.join(", "), known.join(", ")),
        "kind": "unknown_field",
        "ignored": ignored,
        "known": known,
    });
    (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
}

/// The 503 of a check whose answer deadline passed: the call is given up
/// (never applied) if still queued; if it is already at the store, it may
/// yet be applied (and, with `--brokers`, published once decided), and the
/// answer says `"applied": "unknown"`.
fn past_deadline(metrics: &Metrics, claim: &Claim) -> Response {
    let (why, applied) = if claim.abandon() {
        ("answer deadline passed; the call was not decided", "no")
    } else {
        (
            "answer deadline passed while the store decided the call",
            "unknown",
        )
    };
    metrics.store_error("deadline");
    let body = json!({ "error": why, "kind": "unavailable", "applied": applied });
    let mut r = (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(STORE_RETRY_AFTER_S));
    r
}

/// 503 with a Retry-After: the call was not decided.
fn unavailable(why: &str) -> Response {
    let body = json!({ "error": why, "kind": "unavailable" });
    service_unavailable(body)
}

/// 503 for a call the store gave no verdict for, saying whether it may
/// still have been applied (`"applied"`, as past the answer deadline).
fn unavailable_applied(why: &str, applied: &str) -> Response {
    let body = json!({ "error": why, "kind": "unavailable", "applied": applied });
    service_unavailable(body)
}

fn service_unavailable(body: serde_json::Value) -> Response {
    let mut r = (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(STORE_RETRY_AFTER_S));
    r
}

/// The answer to a call's end: which call, when, and that it was applied.
fn ended(v: &Verdict, ignored: &[String]) -> Response {
    let r = &v.record;
    let mut body = json!({
        "call_id": r.call_id,
        "caller": r.caller,
        "ts": r.ts_ms,
        "ended": true,
    });
    if !ignored.is_empty() {
        body["ignored"] = json!(ignored);
    }
    (StatusCode::OK, axum::Json(body)).into_response()
}

/// The decision record as JSON, with the rate-limit headers and the
/// check's fields that were `ignored` (if any); a reject with its status
/// and Retry-After.
fn decided(
    v: &Verdict,
    schema: &Schema,
    limits: &[ratelimit::RuleLimit],
    reject_status: Option<StatusCode>,
    ignored: &[String],
) -> Response {
    let status = match (v.record.decision, reject_status) {
        (Decision::Reject, Some(s)) => s,
        _ => StatusCode::OK,
    };
    let json = [(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    )];
    let mut r = (status, json, decided_body(v, schema, limits, ignored)).into_response();
    ratelimit::add_headers(r.headers_mut(), limits, v);
    if status != StatusCode::OK {
        if let Some(ms) = v.record.retry_after_ms {
            let secs = (ms.max(0) as u64).div_ceil(1000);
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
    }
    r
}

/// A decided check's body: the decision record's JSON with `duplicate`,
/// `ignored` (if any) and `ratelimit` (if a rule limits the call) merged
/// in, keys in order; written directly, a check at a time.
fn decided_body(
    v: &Verdict,
    schema: &Schema,
    limits: &[ratelimit::RuleLimit],
    ignored: &[String],
) -> Vec<u8> {
    let ignored = (!ignored.is_empty()).then(|| serde_json::to_vec(ignored).unwrap_or_default());
    let ratelimit = ratelimit::body(limits, v);
    let duplicate: &[u8] = if v.duplicate { b"true" } else { b"false" };
    let extra = [
        Some(("duplicate", duplicate)),
        ignored.as_deref().map(|i| ("ignored", i)),
        ratelimit.as_deref().map(|r| ("ratelimit", r)),
    ];
    let extra: smallvec::SmallVec<[(&str, &[u8]); 3]> = extra.into_iter().flatten().collect();
    let mut out = Vec::with_capacity(384);
    schema.write_json_with(Row::of_verdict(v), &extra, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::online::policy::clamp_to_clock;

    /// A check's body is the text of the decision record's map with
    /// `duplicate`, `ignored` and `ratelimit` inserted, as serde writes it.
    #[test]
    fn the_decided_body_is_the_map_s_text() {
        let rules = RuleSet::from_args(
            None,
            &["burst:fixed:1s:2".into(), "minute:sliding:60s:10".into()],
        )
        .unwrap();
        let schema = Schema::decisions(&rules);
        let limits = ratelimit::limits(&rules);
        let event = CallEvent::new("c\"1", "+34911000001", 1_764_547_200_123);
        let mut v = Verdict::degraded(&event, &rules, Decision::Reject);
        v.record.reason = "minute".into();
        v.record.counts = smallvec::smallvec![1, 11];
        v.record.retry_after_ms = Some(12_300);
        for (duplicate, ignored) in [
            (false, vec![]),
            (true, vec!["calee".to_string(), "x\"y".into()]),
        ] {
            v.duplicate = duplicate;
            let mut expected = schema.to_json(Row::of_verdict(&v));
            expected["duplicate"] = json!(duplicate);
            if !ignored.is_empty() {
                expected["ignored"] = json!(ignored);
            }
            let rl = ratelimit::body(&limits, &v).unwrap();
            expected["ratelimit"] = serde_json::from_slice(&rl).unwrap();
            let body = decided_body(&v, &schema, &limits, &ignored);
            assert_eq!(String::from_utf8(body).unwrap(), expected.to_string());
        }
    }

    #[test]
    fn only_times_ahead_by_more_than_the_grace_are_clamped() {
        let metrics = Metrics::new();
        let now = 1_764_547_200_000;
        let at = |ts| CallEvent::new("c", "+34911000001", ts);
        let mut events = vec![
            at(now - 60_000),
            at(now + 5_000),
            at(now + 5_001),
            at(now + 290_000),
        ];
        clamp_to_clock(&mut events, 5_000, now, &metrics);
        let times: Vec<i64> = events.iter().map(|e| e.ts_ms).collect();
        assert_eq!(times, [now - 60_000, now + 5_000, now, now]);
        assert_eq!(metrics.clamped.get(), 2);
    }
}

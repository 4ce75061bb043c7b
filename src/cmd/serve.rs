//! `callguard serve`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::http::StatusCode;
use clap::{Args, ValueEnum};

use callguard::error::StoreError;
use callguard::online::consumer;
use callguard::online::metrics::{Health, Metrics};
use callguard::online::serve::{self, ServeConfig, ServeTopics};
use callguard::store::connecting::Connecting;
use callguard::store::gated::Gated;

use crate::cmd::args::{KafkaSettingsArgs, OnlineArgs, StoreKind};
use crate::cmd::consume::PolicyArg;
use crate::cmd::shutdown_signal;

/// Answer a switch's check per call in the same request: an HTTP API on
/// the same rules and window store as `consume`.
///
/// `POST /v1/check` with a call event as JSON (the Kafka payload's fields;
/// `ts` optional, default this server's clock in ms), or
/// `GET /v1/check?call_id=..&caller=..[&callee=..][&ts=..]`, answers the
/// decision record as JSON (plus `duplicate`). A SIP retransmission with
/// the same call id gets the same record back. Also `/metrics`, `/healthz`
/// and `/readyz` on the same address (and on `--admin-listen`). HTTP/1.1
/// only; connections are capped and slow or idle ones closed.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "CALLGUARD_LISTEN", default_value = serve::DEFAULT_ADDR)]
    pub listen: std::net::SocketAddr,
    /// Answer rejects with this status and a `Retry-After` header (seconds,
    /// rounded up) instead of 200; the body is the record either way.
    #[arg(long, value_enum, env = "CALLGUARD_REJECT_STATUS")]
    pub reject_status: Option<RejectStatus>,
    /// The rules, the store, the events' fields, pseudonyms.
    #[command(flatten)]
    pub online: OnlineArgs,
    /// What to answer when the window store fails: `block` (503 with a
    /// Retry-After: the switch applies its own fallback), `allow` or
    /// `reject` (a record flagged `degraded = true`), `local` (a real
    /// decision on this instance's own windows, flagged `degraded = true`;
    /// limits shared between instances cut to --local-share; back to Redis
    /// when it answers).
    #[arg(long, value_enum, env = "CALLGUARD_ON_STORE_ERROR", default_value_t = PolicyArg::Block)]
    pub on_store_error: PolicyArg,
    /// Refuse a check with a field callguard does not read (400,
    /// `unknown_field`, naming the known fields) instead of answering it
    /// with the fields listed under `"ignored"`: a misspelled `calee` would
    /// otherwise drop the callee silently. Off by default, since switches
    /// may send fields of their own.
    #[arg(long, env = "CALLGUARD_STRICT_FIELDS")]
    pub strict_fields: bool,
    /// Largest request body, bytes (larger: 413).
    #[arg(long, env = "CALLGUARD_MAX_BODY_BYTES", default_value_t = serve::DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Most connections open at once; a new one beyond is closed at once
    /// (logged, `callguard_connections_shed_total{kind="cap"}`). Lowered to
    /// fit the open-file limit if that is smaller.
    #[arg(long, env = "CALLGUARD_MAX_CONNECTIONS", default_value_t = serve::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// A request's header must arrive within this many milliseconds of the
    /// server being ready for it; a connection idle this long between
    /// requests is closed too (`kind="timeout"`). A switch's keep-alive
    /// connection reconnects in a fraction of a millisecond.
    #[arg(long, env = "CALLGUARD_HEADER_TIMEOUT_MS", default_value_t = serve::DEFAULT_HEADER_TIMEOUT_MS)]
    pub header_timeout_ms: u64,
    /// A request's body must arrive within this many milliseconds (else
    /// 408, and the connection is closed).
    #[arg(long, env = "CALLGUARD_BODY_TIMEOUT_MS", default_value_t = serve::DEFAULT_BODY_TIMEOUT_MS)]
    pub body_timeout_ms: u64,
    /// Longest a check waits for its answer, milliseconds: past it, 503
    /// with `Retry-After: 1`. A call still queued (behind a slow batch) is
    /// then never applied (`"applied": "no"`); one already at the store may
    /// be (`"applied": "unknown"`; with `--brokers` its record is published
    /// once decided). Keep it below the switch's own timeout (the shipped
    /// snippets wait 1 s). 0: no deadline.
    #[arg(long, env = "CALLGUARD_ANSWER_DEADLINE_MS", default_value_t = serve::DEFAULT_ANSWER_DEADLINE_MS)]
    pub answer_deadline_ms: u64,
    /// Also serve `/metrics`, `/healthz` and `/readyz` on this address,
    /// with a cap of its own, so a load balancer's probes are answered
    /// however many connections the check API holds.
    #[arg(long, env = "CALLGUARD_ADMIN_LISTEN")]
    pub admin_listen: Option<std::net::SocketAddr>,
    /// Largest batch of checks per store round trip. Checks that arrive
    /// while a batch is at the store form the next one.
    #[arg(long, env = "CALLGUARD_BATCH_SIZE", default_value_t = serve::DEFAULT_BATCH_SIZE)]
    pub batch_size: usize,
    /// Extra wait for more checks after the first of a batch, microseconds
    /// (0: none; batches form from checks that arrive meanwhile).
    #[arg(long, env = "CALLGUARD_BATCH_LINGER_US", default_value_t = serve::DEFAULT_LINGER_US)]
    pub batch_linger_us: u64,
    /// Event times more than this many seconds ahead of the wall clock are
    /// refused (400, `ts_out_of_range`: a clock that wrong is worth
    /// seeing); 0 turns the check off. Times ahead by more than the rule
    /// set's grace but within this are decided at this server's clock, so
    /// no check can make its caller's later calls late.
    #[arg(long, env = "CALLGUARD_MAX_FUTURE_SKEW_S", default_value_t = consumer::DEFAULT_MAX_FUTURE_SKEW_S)]
    pub max_future_skew_s: u64,
    /// Also produce every decided call to Kafka (events, decisions and
    /// features topics, keyed by caller), as `consume` would: bootstrap
    /// servers HOST:PORT,... Off when not given.
    #[arg(long, env = "CALLGUARD_BROKERS")]
    pub brokers: Option<String>,
    /// librdkafka settings (with `--brokers`).
    #[command(flatten)]
    pub settings: KafkaSettingsArgs,
    /// Topic the decided calls' events go to.
    #[arg(long, env = "CALLGUARD_INPUT_TOPIC", default_value = consumer::DEFAULT_INPUT_TOPIC)]
    pub events_topic: String,
    /// Topic of decision records.
    #[arg(long, env = "CALLGUARD_DECISIONS_TOPIC", default_value = consumer::DEFAULT_DECISIONS_TOPIC)]
    pub decisions_topic: String,
    /// Topic of feature records.
    #[arg(long, env = "CALLGUARD_FEATURES_TOPIC", default_value = consumer::DEFAULT_FEATURES_TOPIC)]
    pub features_topic: String,
}

/// `--reject-status` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RejectStatus {
    /// 403 Forbidden.
    #[value(name = "403")]
    Forbidden,
    /// 429 Too Many Requests.
    #[value(name = "429")]
    TooMany,
    /// 503 Service Unavailable.
    #[value(name = "503")]
    Unavailable,
}

impl ServeArgs {
    fn config(&self) -> Result<ServeConfig> {
        let decoder = self.online.event_decoder()?;
        let topics = match &self.brokers {
            Some(brokers) => Some(ServeTopics {
                brokers: brokers.clone(),
                settings: self.settings.parse()?,
                events: self.events_topic.clone(),
                decisions: self.decisions_topic.clone(),
                features: self.features_topic.clone(),
            }),
            None => None,
        };
        Ok(ServeConfig {
            decoder,
            on_store_error: self.on_store_error.into(),
            local_share: self.online.fallback.share()?,
            reject_status: self.reject_status.map(|s| match s {
                RejectStatus::Forbidden => StatusCode::FORBIDDEN,
                RejectStatus::TooMany => StatusCode::TOO_MANY_REQUESTS,
                RejectStatus::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            }),
            max_body_bytes: self.max_body_bytes,
            limits: serve::Limits {
                max_connections: self.max_connections.max(1),
                header_timeout: Duration::from_millis(self.header_timeout_ms.max(1)),
            },
            body_timeout: Duration::from_millis(self.body_timeout_ms.max(1)),
            batch_size: self.batch_size.max(1),
            linger: Duration::from_micros(self.batch_linger_us),
            max_future_skew: (self.max_future_skew_s > 0)
                .then(|| Duration::from_secs(self.max_future_skew_s)),
            strict_fields: self.strict_fields,
            answer_deadline: (self.answer_deadline_ms > 0)
                .then(|| Duration::from_millis(self.answer_deadline_ms)),
            topics,
        })
    }
}

/// Runs `callguard serve` until SIGINT or SIGTERM.
pub async fn run(args: ServeArgs) -> Result<()> {
    let config = args.config()?;
    let metrics = Arc::new(Metrics::new());
    metrics.status.set_role("serve");
    let health = Arc::new(Health::default());
    let rules_rx = args.online.watch_rules(&metrics)?;
    let store = match args.online.store.open(StoreKind::Redis).await {
        Ok(store) => Connecting::now(store),
        // Redis down at start: serve anyway, not ready, until it is up.
        Err(e)
            if e.downcast_ref::<StoreError>()
                .is_some_and(|s| s.kind() == "transient") =>
        {
            tracing::warn!(
                error = format!("{e:#}"),
                "Redis is not reachable; serving, not ready, until it is"
            );
            Connecting::later(
                args.online.store.redis_config(),
                args.online.store.cache_limit(),
            )
        }
        Err(e) => return Err(e),
    };
    let store = Gated::new(
        store,
        args.online
            .store
            .ledger(StoreKind::Redis, args.online.fallback.expected_instances)?,
    );
    let api = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let admin = match args.admin_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("listening on {addr}"))?,
        ),
        None => None,
    };
    serve::run(
        serve::Listeners { api, admin },
        config,
        store,
        rules_rx,
        metrics,
        health,
        shutdown_signal(),
    )
    .await?;
    tracing::info!("stopped");
    Ok(())
}

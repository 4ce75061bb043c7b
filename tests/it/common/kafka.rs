//! Kafka helpers for the consumer tests: reading topics back, producing raw
//! messages, and running `callguard consume` as a child process.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::Value;

/// One message read back.
#[derive(Debug, Clone)]
pub struct Read {
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: HashMap<String, String>,
    pub partition: i32,
    pub offset: i64,
}

/// Reads `topic` from the beginning until `done(message)` says so (it sees
/// each new message once) or the timeout.
pub async fn read_topic(
    brokers: &str,
    topic: &str,
    timeout: Duration,
    mut done: impl FnMut(&Read) -> bool,
) -> Vec<Read> {
    // A group of its own per read: a second read in the same group would
    // wait for the first reader's session to expire before it got the
    // partitions.
    static READS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let c: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set(
            "group.id",
            format!("reader-{}-{}-{n}", topic, std::process::id()),
        )
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    c.subscribe(&[topic]).expect("subscribe");
    let mut out = Vec::new();
    let deadline = Instant::now() + timeout;
    let mut finished = false;
    while !finished && Instant::now() < deadline {
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(300), c.recv()).await {
            let mut headers = HashMap::new();
            if let Some(h) = m.headers() {
                for i in 0..h.count() {
                    let hd = h.get(i);
                    headers.insert(
                        hd.key.to_string(),
                        hd.value
                            .map(|v| String::from_utf8_lossy(v).into_owned())
                            .unwrap_or_default(),
                    );
                }
            }
            let r = Read {
                key: m.key().map(<[u8]>::to_vec),
                payload: m.payload().unwrap_or_default().to_vec(),
                headers,
                partition: m.partition(),
                offset: m.offset(),
            };
            finished = done(&r);
            out.push(r);
        }
    }
    out
}

/// Reads decision records until `expected` distinct call ids were seen.
/// Returns every record (duplicates included) as JSON.
pub async fn read_decisions(
    brokers: &str,
    topic: &str,
    expected: usize,
    timeout: Duration,
) -> Vec<Value> {
    let mut ids = std::collections::HashSet::new();
    let msgs = read_topic(brokers, topic, timeout, |m| {
        if let Ok(v) = serde_json::from_slice::<Value>(&m.payload) {
            if let Some(id) = v["call_id"].as_str() {
                ids.insert(id.to_string());
            }
        }
        ids.len() >= expected
    })
    .await;
    msgs.iter()
        .map(|m| serde_json::from_slice(&m.payload).expect("decision JSON"))
        .collect()
}

/// Groups records by call id: every id must have one distinct record.
pub fn by_call_id(records: &[Value]) -> HashMap<String, Value> {
    let mut map: HashMap<String, Value> = HashMap::new();
    for r in records {
        let id = r["call_id"].as_str().expect("call_id").to_string();
        if let Some(prev) = map.get(&id) {
            assert_eq!(prev, r, "call {id} was decided twice differently");
        } else {
            map.insert(id, r.clone());
        }
    }
    map
}

/// Produces raw messages (key, payload).
pub async fn produce_raw(brokers: &str, topic: &str, msgs: &[(Option<&[u8]>, &[u8])]) {
    let p: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("partitioner", "murmur2_random")
        .set("message.max.bytes", "10000000")
        .create()
        .expect("producer");
    for (k, v) in msgs {
        let mut r = FutureRecord::<[u8], [u8]>::to(topic).payload(v);
        if let Some(k) = k {
            r = r.key(k);
        }
        p.send(r, Duration::from_secs(10)).await.expect("produce");
    }
}

/// Starts `callguard consume` as a child process.
pub fn spawn_consumer(
    brokers: &str,
    redis_url: &str,
    group: &str,
    rules: &Path,
    extra: &[&str],
) -> Child {
    let metrics: &[&str] = if extra.contains(&"--metrics-addr") {
        &[]
    } else {
        &["--metrics-addr", "127.0.0.1:0"]
    };
    Command::new(super::bin())
        .args([
            "consume",
            "--brokers",
            brokers,
            "--group",
            group,
            "--store",
            "redis",
            "--redis-url",
            redis_url,
        ])
        .arg("--rules")
        .arg(rules)
        .args(metrics)
        .args(["--log-format", "json"])
        .args(extra)
        .env("CALLGUARD_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log_file(group))
        .spawn()
        .expect("start callguard consume")
}

/// Sends a signal to a child.
pub fn signal(child: &Child, sig: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{sig}"), &child.id().to_string()])
        .status();
}

/// A log file for a consumer child, kept in the system temp dir for diagnosis.
fn log_file(group: &str) -> Stdio {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!(
        "callguard-test-{}-{group}-{n}.log",
        std::process::id()
    ));
    match std::fs::File::create(&path) {
        Ok(f) => Stdio::from(f),
        Err(_) => Stdio::null(),
    }
}

/// A stream processor running in this process (see [`in_process`]).
pub struct InProcess {
    stop: tokio::sync::watch::Sender<bool>,
    /// The running consumer.
    pub task: tokio::task::JoinHandle<
        Result<callguard::online::consumer::ConsumeStats, callguard::error::ConsumeError>,
    >,
    /// Its metrics.
    pub metrics: std::sync::Arc<callguard::online::metrics::Metrics>,
    /// Its readiness.
    pub health: std::sync::Arc<callguard::online::metrics::Health>,
}

/// Starts `consumer::run` in this process with fixed rules.
pub fn in_process<S>(
    config: callguard::online::consumer::ConsumeConfig,
    store: S,
    rules: callguard::engine::rules::RuleSet,
) -> InProcess
where
    S: callguard::store::WindowStore + 'static,
{
    use std::sync::Arc;
    let (stop, mut stop_rx) = tokio::sync::watch::channel(false);
    let (rules_tx, rules_rx) = tokio::sync::watch::channel(rules);
    let metrics = Arc::new(callguard::online::metrics::Metrics::new());
    let health = Arc::new(callguard::online::metrics::Health::default());
    let task = tokio::spawn(callguard::online::consumer::run(
        config,
        store,
        rules_rx,
        metrics.clone(),
        health.clone(),
        async move {
            let _ = stop_rx.wait_for(|s| *s).await;
            drop(rules_tx);
        },
    ));
    InProcess {
        stop,
        task,
        metrics,
        health,
    }
}

impl InProcess {
    /// Asks it to stop, waits, and returns its stats (it must not have failed).
    pub async fn stop(self) -> callguard::online::consumer::ConsumeStats {
        let _ = self.stop.send(true);
        self.task
            .await
            .expect("consumer task")
            .expect("consumer run")
    }
}

/// The consumer's topics, as `consume`'s defaults name them: calls,
/// decisions, features, dead letters.
pub const TOPICS: [&str; 4] = ["calls", "call-decisions", "call-features", "calls-dlq"];

/// The embedded mock cluster with these topics (name, partitions), and its
/// bootstrap address.
pub fn mock_cluster(topics: &[(&str, i32)]) -> (callguard::online::kafka::EmbeddedKafka, String) {
    let kafka = callguard::online::kafka::EmbeddedKafka::start().expect("mock cluster");
    for (t, p) in topics {
        kafka.create_topic(t, *p).expect("create topic");
    }
    let brokers = kafka.bootstrap();
    (kafka, brokers)
}

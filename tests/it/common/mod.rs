//! Test harness: real redis-server processes on free loopback ports, and
//! helpers shared by the test suites.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub mod kafka;
pub mod random;
pub mod reference;
pub mod scenarios;
pub mod sentinel;

use callguard::engine::event::CallEvent;

/// A free loopback port whose cluster bus port (+10000) is free as well.
///
/// `text` written as `rules.toml` in `dir`: its path.
pub fn rules_file(dir: &std::path::Path, text: &str) -> std::path::PathBuf {
    let path = dir.join("rules.toml");
    std::fs::write(&path, text).expect("write rules.toml");
    path
}

/// A port is handed out at most once per test process: tests run in
/// parallel threads, and two of them starting a server on the same port
/// would talk to each other's server.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = l.local_addr().unwrap().port();
        if port < 55_000
            && !given.contains(&port)
            && !given.contains(&(port + 10_000))
            && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
        {
            given.extend([port, port + 10_000]);
            return port;
        }
    }
    panic!("no free loopback port pair found");
}

pub fn require(binary: &str) {
    let found = Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if found.is_err() {
        panic!(
            "`{binary}` is not installed: these tests run it for real (Redis, Kamailio, SIPp, Chromium, \
             promtool are Debian packages). The README's test command, scripts/test-all.sh, installs it."
        );
    }
}

/// A plain HTTP/1.1 GET on loopback; the whole response, if any.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// Sends one inline command and returns the raw reply.
pub fn raw_command(port: u16, cmd: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(format!("{cmd}\r\n").as_bytes()).ok()?;
    let mut buf = vec![0u8; 65_536];
    let n = s.read(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// A child process killed on drop (a failed assertion must not leave it
/// running).
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A redis-server child process, killed on drop.
pub struct RedisServer {
    child: Child,
    /// Its port.
    pub port: u16,
    /// Its working directory (AOF, cluster config).
    pub dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts a standalone server with extra `--option value` arguments.
    pub fn start(extra: &[&str]) -> Self {
        let port = free_port();
        let dir = tempfile::tempdir().expect("temp dir");
        Self::start_in(port, dir, extra)
    }

    /// Starts (or restarts) a server on a given port and directory.
    pub fn start_in(port: u16, dir: tempfile::TempDir, extra: &[&str]) -> Self {
        require("redis-server");
        let mut args: Vec<String> = vec![
            "--port".into(),
            port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--save".into(),
            "".into(),
            "--dir".into(),
            dir.path().display().to_string(),
        ];
        if !extra.contains(&"--appendonly") {
            args.extend(["--appendonly".into(), "no".into()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let child = Command::new("redis-server")
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let mut server = RedisServer { child, port, dir };
        let pid = format!("process_id:{}\r\n", server.child.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!(
                    "redis-server on port {port} exited at start ({status}): is the port taken?"
                );
            }
            // The server that answers must be this child, not another
            // process that holds the port.
            // PING also waits out loading an append-only file.
            let ours = match raw_command(port, "PING") {
                Some(r) if r.starts_with("-NOAUTH") => true,
                Some(r) if r.starts_with("+PONG") => {
                    raw_command(port, "INFO server").is_some_and(|r| r.contains(&pid))
                }
                _ => false,
            };
            if ours {
                return server;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {port} did not answer within 10 s");
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A blocking client connection to it.
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .expect("connect to the test redis-server")
    }

    /// `INFO memory`'s `used_memory`, bytes.
    pub fn used_memory(&self) -> i64 {
        raw_command(self.port, "INFO memory")
            .expect("INFO memory")
            .lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("used_memory in INFO memory")
    }

    /// Caps memory at `extra` bytes above what is used now (with
    /// `--maxmemory-policy noeviction`, writes beyond it are refused).
    pub fn cap_memory_above_use(&self, extra: i64) {
        let cap = self.used_memory() + extra;
        let ok =
            raw_command(self.port, &format!("CONFIG SET maxmemory {cap}")).expect("CONFIG SET");
        assert!(ok.starts_with("+OK"), "{ok}");
    }

    /// Stops the server (SIGKILL) and hands back its directory for a restart.
    pub fn stop(mut self) -> (u16, tempfile::TempDir) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let port = self.port;
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("temp dir"));
        (port, dir)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A 3-master Redis Cluster on loopback ports.
pub struct RedisCluster {
    /// The nodes.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three cluster-enabled servers and joins them.
    pub fn start() -> Self {
        Self::start_with_replicas(0)
    }

    /// The arguments of a cluster node with its config file in its directory.
    pub fn node_args(port: u16) -> Vec<String> {
        [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            &format!("nodes-{port}.conf"),
            "--cluster-node-timeout",
            "2000",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// Starts three primaries with `replicas` replicas each and joins them.
    pub fn start_with_replicas(replicas: usize) -> Self {
        require("redis-cli");
        let mut nodes = Vec::new();
        for _ in 0..3 * (1 + replicas) {
            let port = free_port();
            let args = Self::node_args(port);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            nodes.push(RedisServer::start_in(
                port,
                tempfile::tempdir().expect("temp dir"),
                &args,
            ));
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let ok = nodes.iter().all(|n| {
                raw_command(n.port, "CLUSTER INFO").is_some_and(|r| r.contains("cluster_state:ok"))
            }) && nodes.iter().all(|n| {
                raw_command(n.port, "INFO replication").is_some_and(|r| {
                    r.contains("role:master") || r.contains("master_link_status:up")
                })
            });
            if ok {
                return RedisCluster { nodes };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the Redis Cluster did not reach cluster_state:ok within 30 s");
    }

    /// Seed URLs of all nodes.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }
}

/// An event with the given caller, id and time.
pub fn ev(caller: &str, id: &str, ts: i64) -> CallEvent {
    CallEvent::new(id, caller, ts)
}

/// The inputs of `data/model.onnx`, in its order.
pub const MODEL_INPUTS: &str =
    "count_burst,count_minute,count_hour,since_prev_ms,distinct_callees,local_hour";

/// `data/rules.toml` with `[model]` `data/model.onnx` (by its absolute
/// path), in shadow or enforcing, at `threshold`, written as `rules.toml`
/// in `dir`: its path.
pub fn model_rules(dir: &std::path::Path, shadow: bool, threshold: f32) -> PathBuf {
    model_rules_of(
        dir,
        &std::fs::canonicalize("data/model.onnx").unwrap(),
        shadow,
        threshold,
    )
}

/// [`model_rules`] with the model at `model`.
pub fn model_rules_of(
    dir: &std::path::Path,
    model: &std::path::Path,
    shadow: bool,
    threshold: f32,
) -> PathBuf {
    let inputs: Vec<String> = MODEL_INPUTS.split(',').map(|i| format!("{i:?}")).collect();
    rules_file(
        dir,
        &format!(
            "{}\n[model]\npath = {:?}\ninputs = [{}]\nthreshold = {threshold}\nshadow = {shadow}\n",
            std::fs::read_to_string("data/rules.toml").unwrap(),
            model.display().to_string(),
            inputs.join(", ")
        ),
    )
}

/// Path of the built `callguard` binary.
pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_callguard"))
}

/// A generated, labelled call log written as CSV in a temporary
/// directory: the directory (keep it alive) and the file.
pub fn generated_csv(rows: usize, seed: u64) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calls.csv");
    callguard::offline::generate::write_csv(
        &path,
        &callguard::offline::generate::generate(rows, seed),
    )
    .unwrap();
    (dir, path)
}

/// [`generated_csv`], read whole and sorted by time.
pub fn generated_log(
    rows: usize,
    seed: u64,
) -> (
    tempfile::TempDir,
    PathBuf,
    callguard::offline::read::CallLog,
) {
    let (dir, path) = generated_csv(rows, seed);
    let mut log = callguard::offline::read::read_call_log(&path, &Default::default()).unwrap();
    log.sort_by_time();
    (dir, path, log)
}

/// A tansu broker process (a real Kafka-protocol broker), killed on drop.
pub struct Tansu {
    child: Child,
    /// Its port.
    pub port: u16,
    /// Storage directory (for `sqlite://`).
    pub dir: tempfile::TempDir,
}

impl Tansu {
    /// Starts tansu on a free loopback port, with sqlite storage in a
    /// directory of its own.
    ///
    /// Not tansu 0.6's in-memory storage: a fetch from an offset inside a
    /// record batch gets the batches *after* that batch, not the one
    /// holding the offset. A consumer that resumes from a committed offset
    /// (after a crash or a rebalance) inside a batch the producer wrote
    /// whole would skip the rest of it: calls lost by the broker, which the
    /// crash tests caught (one replay of `consume::tansu_call_ends_with_
    /// sigkills_decide_as_replay` lost 1,463 calls of one partition, offsets
    /// 581-3,468, the tail of its first batch). sqlite storage serves the
    /// batch holding the offset, as Kafka does.
    pub fn start() -> Self {
        Self::start_sqlite()
    }

    /// Starts tansu with sqlite storage in its directory (topics, offsets
    /// and groups survive a restart) on a free loopback port.
    pub fn start_sqlite() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        Self::start_on(free_port(), dir)
    }

    /// Kills the broker (SIGKILL) and starts it again on the same port and
    /// storage.
    pub fn restart(mut self) -> Self {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let port = self.port;
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("temp dir"));
        drop(self);
        // The port is ours again once the killed process is gone.
        Self::start_on(port, dir)
    }

    fn start_on(port: u16, dir: tempfile::TempDir) -> Self {
        let found = Command::new("tansu")
            .arg("--help")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if found.is_err() {
            panic!(
                "`tansu` is not installed: the consumer tests need a real Kafka-protocol broker \
                 (cargo install tansu --locked --features dynostore,libsql). The README's test command installs it."
            );
        }
        let url = format!("tcp://127.0.0.1:{port}");
        // tansu resolves the sqlite path against its working directory.
        let storage = "sqlite://tansu.db";
        let child = Command::new("tansu")
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .args(["--storage-engine", storage])
            .current_dir(dir.path())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu");
        let t = Tansu { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return t;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("tansu did not listen on port {port} within 20 s");
    }

    /// `127.0.0.1:<port>`.
    /// Creates `topics` (name, partitions) and returns the bootstrap
    /// address.
    pub fn with_topics(&self, topics: &[(&str, u32)]) -> String {
        for (t, p) in topics {
            self.create_topic(t, *p);
        }
        self.bootstrap()
    }

    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Creates a topic.
    pub fn create_topic(&self, name: &str, partitions: u32) {
        let out = Command::new("tansu")
            .args([
                "topic",
                "create",
                name,
                "--partitions",
                &partitions.to_string(),
            ])
            .args(["--broker", &format!("tcp://127.0.0.1:{}", self.port)])
            .output()
            .expect("run tansu topic create");
        assert!(
            out.status.success(),
            "tansu topic create {name} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The decision records `replay` gives for events in processing order, as
/// JSON by call id (the consumer's encoding).
pub fn replay_records(
    events: &[CallEvent],
    rules: &callguard::engine::rules::RuleSet,
) -> std::collections::HashMap<String, serde_json::Value> {
    use callguard::engine::record::{Row, Schema};
    let schema = Schema::decisions(rules);
    let mut store = callguard::store::memory::MemoryStore::new();
    // Rules keyed by callee or global: counted in processing order first.
    let mut events = events.to_vec();
    callguard::engine::aggregate::Gate::new().run(
        &mut callguard::engine::aggregate::MemoryLedger::new(),
        rules,
        &mut events,
    );
    let mut verdicts: Vec<_> = events.iter().map(|e| store.apply(rules, e)).collect();
    // A model scores after the store.
    callguard::store::settle_by_model(rules, verdicts.iter_mut());
    events
        .iter()
        .zip(&verdicts)
        .map(|(event, verdict)| {
            (
                event.call_id.to_string(),
                schema.to_json(Row { event, verdict }),
            )
        })
        .collect()
}

/// Every call has one distinct record (the decisions topic may repeat a
/// redelivered one identically), equal to the replay's.
pub fn assert_records_equal_replay(
    records: &[serde_json::Value],
    expected: &std::collections::HashMap<String, serde_json::Value>,
) {
    let got = kafka::by_call_id(records);
    assert_eq!(got.len(), expected.len(), "distinct decided calls");
    let mut differ = 0;
    for (id, want) in expected {
        if got.get(id) != Some(want) {
            if differ < 3 {
                eprintln!("call {id}: got {:?}, replay says {want}", got.get(id));
            }
            differ += 1;
        }
    }
    assert_eq!(differ, 0, "{differ} decisions differ from the replay");
}

/// One HTTP/1.1 response: status, headers (lowercase names) and body.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// A keep-alive HTTP/1.1 connection on loopback (requests with a body
/// carry Content-Length; responses are read by their Content-Length).
pub struct HttpConn {
    stream: std::io::BufReader<TcpStream>,
}

impl HttpConn {
    /// The connection itself (what it had buffered is dropped).
    pub fn into_stream(self) -> TcpStream {
        self.stream.into_inner()
    }

    /// Connects to `127.0.0.1:port`.
    pub fn connect(port: u16) -> Self {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the HTTP server");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        HttpConn {
            stream: std::io::BufReader::new(s),
        }
    }

    /// Sends one request and reads its response.
    pub fn request(&mut self, method: &str, path: &str, body: &[u8]) -> HttpResponse {
        use std::io::BufRead;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let s = self.stream.get_mut();
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body).unwrap();
        let mut line = String::new();
        self.stream.read_line(&mut line).expect("status line");
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {line:?}"));
        let mut headers = Vec::new();
        loop {
            line.clear();
            self.stream.read_line(&mut line).expect("header line");
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((n, v)) = l.split_once(':') {
                headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
        let len: usize = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        let mut buf = vec![0; len];
        self.stream.read_exact(&mut buf).expect("body");
        HttpResponse {
            status,
            headers,
            body: String::from_utf8_lossy(&buf).into_owned(),
        }
    }

    /// POSTs a JSON body.
    pub fn post(&mut self, path: &str, body: &str) -> HttpResponse {
        self.request("POST", path, body.as_bytes())
    }

    /// GETs a path.
    pub fn get(&mut self, path: &str) -> HttpResponse {
        self.request("GET", path, b"")
    }
}

/// Percent-encodes a query value (everything but unreserved characters).
pub fn query_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

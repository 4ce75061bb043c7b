//! A redis-server of a unit test's own (the library's tests that need a
//! server's behaviour: the commit script's bytes, a connection's identity).
//!
//! `cargo test --lib` on a machine without `redis-server` skips those
//! tests, saying so; the full suite (`scripts/test-all.sh`, which installs
//! it) sets `CALLGUARD_REQUIRE_SERVERS=1`, and there a missing server fails.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A redis-server of this test's own on a free loopback port.
pub struct Server {
    child: Child,
    /// Its port.
    pub port: u16,
    /// Its working directory: a replica writes the primary's snapshot
    /// there when it syncs, and nothing may land in the checkout.
    _dir: tempfile::TempDir,
}

impl Server {
    /// Starts a standalone server.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// Whether a test that needs `redis-server` can run here: false (and
    /// said on stderr) when it is not installed, unless the full suite
    /// requires it (`CALLGUARD_REQUIRE_SERVERS`), which then fails.
    pub fn available(test: &str) -> bool {
        let found = Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found && std::env::var_os("CALLGUARD_REQUIRE_SERVERS").is_none() {
            eprintln!(
                "{test}: skipped, `redis-server` is not installed (Debian: apt-get install \
                 redis-server; scripts/test-all.sh installs it and runs this test)"
            );
        }
        found || std::env::var_os("CALLGUARD_REQUIRE_SERVERS").is_some()
    }

    /// Starts one; a replica of `primary` when given.
    pub fn start_with(primary: Option<u16>) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|e| panic!("no free loopback port: {e}"));
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("no temporary directory: {e}"));
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .args(primary.map_or_else(Vec::new, |p| {
                vec![
                    "--replicaof".to_string(),
                    "127.0.0.1".to_string(),
                    p.to_string(),
                ]
            }))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("`redis-server` is needed (Debian: apt-get install redis-server): {e}")
            });
        let server = Server {
            child,
            port,
            _dir: dir,
        };
        let client = redis::Client::open(server.url()).unwrap();
        for _ in 0..500 {
            if let Ok(mut c) = client.get_connection() {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return server;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {port} did not answer within 10 s");
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

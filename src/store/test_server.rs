//! A redis-server of a unit test's own (the library's tests that need a
//! server's behaviour: the commit script's bytes, a connection's identity).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A redis-server of this test's own on a free loopback port.
pub struct Server {
    child: Child,
    /// Its port.
    pub port: u16,
}

impl Server {
    /// Starts a standalone server.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// Starts one; a replica of `primary` when given.
    pub fn start_with(primary: Option<u16>) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|e| panic!("no free loopback port: {e}"));
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
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
        let server = Server { child, port };
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

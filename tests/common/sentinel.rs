//! A Redis primary, its replicas and three sentinels on loopback ports,
//! for failover tests (Debian's `redis-server` and `redis-sentinel`).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, raw_command, require, RedisServer};

/// The name the sentinels monitor the primary under.
pub const MASTER: &str = "cg";

/// A primary, `n` replicas and three sentinels (quorum 2, primary down
/// after 1 s).
pub struct SentinelGroup {
    /// The first primary, until [`SentinelGroup::kill_primary`].
    pub primary: Option<RedisServer>,
    /// The replicas.
    pub replicas: Vec<RedisServer>,
    sentinels: Vec<(Child, u16)>,
    _dir: tempfile::TempDir,
}

impl SentinelGroup {
    /// Starts the primary and `replicas` replicas, waits until they are in
    /// sync, then starts the sentinels and waits until each knows the
    /// replicas and the other sentinels.
    pub fn start(replicas: usize) -> Self {
        require("redis-sentinel");
        let primary = RedisServer::start(&[]);
        let of = primary.port.to_string();
        let replicas: Vec<RedisServer> = (0..replicas)
            .map(|_| RedisServer::start(&["--replicaof", "127.0.0.1", &of]))
            .collect();
        wait_until(Duration::from_secs(20), "replicas in sync", || {
            replicas.iter().all(|r| {
                raw_command(r.port, "INFO replication")
                    .is_some_and(|i| i.contains("master_link_status:up"))
            })
        });
        let dir = tempfile::tempdir().expect("temp dir");
        let sentinels: Vec<(Child, u16)> = (0..3)
            .map(|i| {
                let port = free_port();
                let conf = dir.path().join(format!("sentinel-{i}.conf"));
                std::fs::write(
                    &conf,
                    format!(
                        "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\n\
                         logfile {dir}/sentinel-{i}.log\n\
                         sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n\
                         sentinel down-after-milliseconds {MASTER} 1000\n\
                         sentinel failover-timeout {MASTER} 5000\n\
                         sentinel parallel-syncs {MASTER} 2\n",
                        dir = dir.path().display(),
                        primary = primary.port,
                    ),
                )
                .expect("write a sentinel config");
                let child = Command::new("redis-sentinel")
                    .arg(&conf)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start redis-sentinel");
                (child, port)
            })
            .collect();
        let want = format!("slaves={},sentinels=3", replicas.len());
        wait_until(
            Duration::from_secs(30),
            "sentinels to know the group",
            || {
                sentinels.iter().all(|(_, port)| {
                    raw_command(*port, "INFO sentinel").is_some_and(|i| i.contains(&want))
                })
            },
        );
        SentinelGroup {
            primary: Some(primary),
            replicas,
            sentinels,
            _dir: dir,
        }
    }

    /// The sentinels' addresses, comma-separated (`--redis-sentinel`).
    pub fn addrs(&self) -> String {
        self.sentinels
            .iter()
            .map(|(_, p)| format!("127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The primary's port, as the first sentinel names it.
    pub fn primary_port(&self) -> Option<u16> {
        let reply = raw_command(
            self.sentinels[0].1,
            &format!("SENTINEL get-master-addr-by-name {MASTER}"),
        )?;
        // An array of two bulk strings: the host, then the port.
        reply
            .lines()
            .filter(|l| !l.starts_with(['*', '$']))
            .nth(1)?
            .trim()
            .parse()
            .ok()
    }

    /// Cuts the replicas off the primary while leaving them promotable:
    /// the primary starts requiring a password (connections already open,
    /// such as callguard's and the sentinels', stay authenticated) and drops
    /// its replicas, which then cannot sync again. Writes from now on
    /// reach the primary only, as when replication lags.
    pub fn cut_replication(&self) {
        let port = self.primary.as_ref().expect("the primary runs").port;
        // One connection for both: it stays authenticated after the first.
        let ok = raw_command(
            port,
            "CONFIG SET requirepass cut-off\r\nCLIENT KILL TYPE replica",
        )
        .expect("CONFIG SET");
        assert!(ok.starts_with("+OK"), "{ok}");
        wait_until(Duration::from_secs(10), "replicas cut off", || {
            self.replicas.iter().all(|r| {
                raw_command(r.port, "INFO replication")
                    .is_some_and(|i| i.contains("master_link_status:down"))
            })
        });
    }

    /// Kills the primary (SIGKILL) and returns its port.
    pub fn kill_primary(&mut self) -> u16 {
        let primary = self.primary.take().expect("the primary runs");
        primary.stop().0
    }

    /// Waits until the sentinels name a primary other than `old`, and it
    /// answers as a primary; returns its port.
    pub fn wait_for_failover(&self, old: u16) -> u16 {
        let mut new = 0;
        let log = self._dir.path().join("sentinel-0.log");
        let why = || std::fs::read_to_string(&log).unwrap_or_default();
        let deadline = Instant::now() + Duration::from_secs(40);
        wait_until(Duration::from_secs(41), "a failover", || {
            if Instant::now() > deadline {
                panic!(
                    "no failover within 40 s; the first sentinel's log:\n{}",
                    why()
                );
            }
            match self.primary_port() {
                Some(p) if p != old => {
                    new = p;
                    raw_command(p, "ROLE").is_some_and(|r| r.contains("master"))
                }
                _ => false,
            }
        });
        new
    }
}

impl Drop for SentinelGroup {
    fn drop(&mut self) {
        for (child, _) in &mut self.sentinels {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Polls `ok` every 50 ms until it holds, or panics naming `what`.
pub fn wait_until(within: Duration, what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

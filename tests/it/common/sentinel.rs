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

    /// Cuts the replicas off the primary (see [`cut_off`]): writes from
    /// now on reach the primary only, as when replication lags.
    pub fn cut_replication(&self) {
        for r in &self.replicas {
            cut_off(r.port);
        }
    }

    /// Lets the replicas sync again (with whichever primary is named).
    pub fn heal_replication(&self) {
        for r in &self.replicas {
            heal(r.port);
        }
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

/// Cuts a replica off its primary while leaving it promotable: it is given
/// a password for a primary that has none, and its link is dropped, so it
/// cannot sync again (the primary and its clients are untouched).
pub fn cut_off(replica: u16) {
    let ok = raw_command(
        replica,
        "CONFIG SET masterauth cut-off\r\nCLIENT KILL TYPE master",
    )
    .expect("CONFIG SET masterauth");
    assert!(ok.starts_with("+OK"), "{ok}");
    wait_until(Duration::from_secs(10), "a replica cut off", || {
        raw_command(replica, "INFO replication")
            .is_some_and(|i| i.contains("master_link_status:down"))
    });
}

/// Undoes [`cut_off`].
pub fn heal(replica: u16) {
    let ok = raw_command(replica, "CONFIG SET masterauth \"\"").expect("CONFIG SET masterauth");
    assert!(ok.starts_with("+OK"), "{ok}");
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

/// A highly available Redis for failover tests: a Sentinel group, or a
/// Cluster of three primaries with a replica each.
pub enum Ha {
    Sentinel(SentinelGroup),
    Cluster {
        cluster: super::RedisCluster,
        /// The primary to be killed (node 0) and its replica.
        victim: usize,
        replica: usize,
    },
}

impl Ha {
    /// A Sentinel group with two replicas.
    pub fn sentinel() -> Self {
        Ha::Sentinel(SentinelGroup::start(2))
    }

    /// A Cluster of three primaries with one replica each.
    pub fn cluster() -> Self {
        let cluster = super::RedisCluster::start_with_replicas(1);
        let victim = 0;
        let port = cluster.nodes[victim].port;
        let replica = cluster
            .nodes
            .iter()
            .position(|n| {
                raw_command(n.port, "INFO replication")
                    .is_some_and(|i| i.contains(&format!("master_port:{port}\r")))
            })
            .expect("node 0's replica");
        Ha::Cluster {
            cluster,
            victim,
            replica,
        }
    }

    /// callguard's arguments to reach it.
    pub fn args(&self) -> Vec<String> {
        match self {
            Ha::Sentinel(g) => vec![
                "--redis-sentinel".into(),
                g.addrs(),
                "--redis-master".into(),
                MASTER.into(),
            ],
            Ha::Cluster { cluster, .. } => vec!["--redis-url".into(), cluster.urls().join(",")],
        }
    }

    /// Whether a caller's keys live on the primary that will be killed.
    pub fn on_victim(&self, caller: &str) -> bool {
        match self {
            Ha::Sentinel(_) => true,
            Ha::Cluster {
                cluster, victim, ..
            } => {
                let port = cluster.nodes[*victim].port;
                let mut conn = cluster.nodes[*victim].connection();
                let slot: u16 = redis::cmd("CLUSTER")
                    .arg("KEYSLOT")
                    .arg(format!("{{{caller}}}"))
                    .query(&mut conn)
                    .expect("CLUSTER KEYSLOT");
                let mine: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query(&mut conn)
                    .expect("CLUSTER SLOTS");
                mine.iter().any(|range| {
                    let int = |v: &redis::Value| match v {
                        redis::Value::Int(i) => *i,
                        _ => -1,
                    };
                    let owner = match &range[2] {
                        redis::Value::Array(node) => int(&node[1]),
                        _ => -1,
                    };
                    owner == i64::from(port)
                        && int(&range[0]) <= i64::from(slot)
                        && i64::from(slot) <= int(&range[1])
                })
            }
        }
    }

    /// Cuts every replica off its primary (see [`cut_off`]).
    pub fn cut_replication(&self) {
        match self {
            Ha::Sentinel(g) => g.cut_replication(),
            Ha::Cluster { cluster, .. } => {
                for n in &cluster.nodes {
                    if raw_command(n.port, "ROLE").is_some_and(|r| r.contains("slave")) {
                        cut_off(n.port);
                    }
                }
            }
        }
    }

    /// Kills the primary, lets the replicas sync again and waits until one
    /// is promoted. On a Cluster the killed node is then started again
    /// (empty) and waits to be in sync as the promoted node's replica, so
    /// `WAIT 1` can be met again.
    pub fn fail_over(&mut self) {
        match self {
            Ha::Sentinel(g) => {
                let old = g.kill_primary();
                g.heal_replication();
                let new = g.wait_for_failover(old);
                assert_ne!(new, old);
            }
            Ha::Cluster {
                cluster,
                victim,
                replica,
            } => {
                let promoted = cluster.nodes[*replica].port;
                let (port, dir) = cluster.nodes.remove(*victim).stop();
                for n in &cluster.nodes {
                    if raw_command(n.port, "ROLE").is_some_and(|r| r.contains("slave")) {
                        heal(n.port);
                    }
                }
                wait_until(Duration::from_secs(40), "the replica's promotion", || {
                    raw_command(promoted, "ROLE").is_some_and(|r| r.contains("master"))
                        && raw_command(promoted, "CLUSTER INFO")
                            .is_some_and(|r| r.contains("cluster_state:ok"))
                });
                let args = super::RedisCluster::node_args(port);
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                let back = RedisServer::start_in(port, dir, &args);
                wait_until(
                    Duration::from_secs(40),
                    "the old primary back as a replica",
                    || {
                        raw_command(port, "INFO replication")
                            .is_some_and(|i| i.contains("master_link_status:up"))
                    },
                );
                cluster.nodes.insert(*victim, back);
            }
        }
    }
}

//! A Redis Cluster connection that is rebuilt when it stops answering.
//!
//! The Cluster client repairs itself after a node fails (it refreshes its
//! slot map and reconnects), but a repair that started while a failed
//! primary's replica was not yet promoted was seen to hang, and every
//! later call then timed out for good. So after a call fails on a lost or
//! slow connection, `Nodes::follow` opens a new connection (at most once
//! a second) and the calls after it use that one.

use std::sync::RwLock;
use std::time::{Duration, Instant};

use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::RedisError;

/// Opens a new connection at most this often, however many calls fail.
const REBUILD_EVERY: Duration = Duration::from_secs(1);

/// The Cluster's client and its current connection.
pub(crate) struct Nodes {
    client: ClusterClient,
    current: RwLock<ClusterConnection>,
    /// When a new connection was last opened; one opener at a time.
    rebuilt: tokio::sync::Mutex<Instant>,
    timeout: Duration,
}

impl Nodes {
    pub(crate) fn new(client: ClusterClient, conn: ClusterConnection, timeout: Duration) -> Self {
        Nodes {
            client,
            current: RwLock::new(conn),
            rebuilt: tokio::sync::Mutex::new(Instant::now()),
            timeout,
        }
    }

    /// The current connection (cheap: clones share it).
    pub(crate) fn conn(&self) -> ClusterConnection {
        match self.current.read() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// After `e`, opens a new connection if the error says the current one
    /// is lost or stuck. A failure to open is logged; the call's own error
    /// stands and its retry tries again.
    pub(crate) async fn follow(&self, e: &RedisError) {
        let lost = e.is_io_error()
            || e.is_timeout()
            || e.is_connection_dropped()
            || e.is_connection_refusal();
        if !lost {
            return;
        }
        let mut rebuilt = self.rebuilt.lock().await;
        if rebuilt.elapsed() < REBUILD_EVERY {
            return;
        }
        *rebuilt = Instant::now();
        let open = tokio::time::timeout(self.timeout * 2, self.client.get_async_connection());
        match open.await {
            Ok(Ok(conn)) => {
                tracing::info!("reconnected to the Redis Cluster after a failed call");
                match self.current.write() {
                    Ok(mut c) => *c = conn,
                    Err(poisoned) => *poisoned.into_inner() = conn,
                }
            }
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "reconnecting to the Redis Cluster failed")
            }
            Err(_) => tracing::warn!("reconnecting to the Redis Cluster timed out"),
        }
    }
}

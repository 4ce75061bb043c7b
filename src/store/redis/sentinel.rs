//! A standalone primary found through Redis Sentinel, followed across
//! failovers: `Primary` holds the connection to the primary the sentinels
//! named last, and asks them again when a call fails in a way a failover
//! explains (the old primary gone, or answering `READONLY` as a replica).

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{IntoConnectionInfo, RedisError};

use crate::error::StoreError;
use crate::store::redis::config::classify;

/// Asks the sentinels again at most this often, however many calls fail at
/// once.
const ASK_EVERY: Duration = Duration::from_millis(200);

/// Where to find the primary: the sentinels and the name they know it by.
#[derive(Clone, Debug)]
pub struct SentinelConfig {
    /// Sentinel addresses (`host:port` or `redis://[:pass@]host:port`).
    pub sentinels: Vec<String>,
    /// The name the sentinels monitor the primary under (`mymaster`).
    pub master: String,
}

/// The primary's connection, shared by every clone of a store's connection.
pub(crate) struct Primary {
    /// The connection to the primary named last, and its address.
    current: RwLock<(ConnectionManager, String)>,
    /// The sentinels' client, one asker at a time, and when it last asked.
    sentinel: tokio::sync::Mutex<(SentinelClient, Instant)>,
    master: String,
    manager: ConnectionManagerConfig,
    timeout: Duration,
}

impl Primary {
    /// Asks the sentinels for `config.master`'s primary and connects to it.
    /// `node` carries the primary's user, password and database (from
    /// `--redis-url`; its host is not used).
    pub(crate) async fn connect(
        config: &SentinelConfig,
        node: Option<&str>,
        manager: ConnectionManagerConfig,
        timeout: Duration,
    ) -> Result<Arc<Self>, StoreError> {
        let sentinels = config
            .sentinels
            .iter()
            .map(|s| sentinel_url(s).into_connection_info())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::Fatal {
                context: "bad --redis-sentinel address".into(),
                source: Some(e),
            })?;
        let mut info = SentinelNodeConnectionInfo::default();
        if let Some(url) = node {
            let node = url.into_connection_info().map_err(|e| StoreError::Fatal {
                context: "bad Redis URL".into(),
                source: Some(e),
            })?;
            info = info.set_redis_connection_info(node.redis_settings().clone());
            if let redis::ConnectionAddr::TcpTls { .. } = node.addr() {
                info = info.set_tls_mode(redis::TlsMode::Secure);
            }
        }
        let tcp = redis::io::tcp::TcpSettings::default().set_nodelay(true);
        info = info.set_tcp_settings(tcp);
        let mut client = SentinelClient::build(
            sentinels,
            config.master.clone(),
            Some(info),
            SentinelServerType::Master,
        )
        .map_err(|e| StoreError::Fatal {
            context: "bad Redis Sentinel settings".into(),
            source: Some(e),
        })?;
        let (conn, addr) = open(&mut client, &manager, timeout).await?;
        tracing::info!(master = %config.master, primary = %addr, "connected to the primary the sentinels name");
        Ok(Arc::new(Primary {
            current: RwLock::new((conn, addr)),
            sentinel: tokio::sync::Mutex::new((client, Instant::now())),
            master: config.master.clone(),
            manager,
            timeout,
        }))
    }

    /// The connection to the primary named last (cheap: clones share it).
    pub(crate) fn conn(&self) -> ConnectionManager {
        match self.current.read() {
            Ok(c) => c.0.clone(),
            Err(poisoned) => poisoned.into_inner().0.clone(),
        }
    }

    /// After `e`, asks the sentinels again if a failover would explain it,
    /// and moves to the primary they name if it changed. Errors of the
    /// asking are logged, not returned: the call's own error stands, and
    /// its retry asks again.
    pub(crate) async fn follow(&self, e: &RedisError) {
        let moved = e.is_io_error()
            || e.is_timeout()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"));
        if !moved {
            return;
        }
        let mut sentinel = self.sentinel.lock().await;
        if sentinel.1.elapsed() < ASK_EVERY {
            return;
        }
        sentinel.1 = Instant::now();
        match open(&mut sentinel.0, &self.manager, self.timeout).await {
            Ok((conn, addr)) => {
                let mut current = match self.current.write() {
                    Ok(c) => c,
                    Err(poisoned) => poisoned.into_inner(),
                };
                if current.1 != addr {
                    tracing::warn!(master = %self.master, from = %current.1, to = %addr, "the sentinels name a new primary: moved to it");
                    *current = (conn, addr);
                }
            }
            Err(err) => {
                tracing::warn!(master = %self.master, error = %err, "asking the sentinels for the primary failed")
            }
        }
    }
}

/// Asks the sentinels for the primary and connects to it.
async fn open(
    client: &mut SentinelClient,
    manager: &ConnectionManagerConfig,
    timeout: Duration,
) -> Result<(ConnectionManager, String), StoreError> {
    let ask = async {
        let primary = client.async_get_client().await?;
        let addr = primary.get_connection_info().addr().to_string();
        let conn = ConnectionManager::new_with_config(primary, manager.clone()).await?;
        Ok::<_, RedisError>((conn, addr))
    };
    tokio::time::timeout(timeout * 2, ask)
        .await
        .map_err(|_| StoreError::transient("timed out asking the sentinels for the primary"))?
        .map_err(classify)
}

/// A sentinel address as a URL (`host:port` alone is allowed).
fn sentinel_url(s: &str) -> String {
    if s.contains("://") {
        s.to_string()
    } else {
        format!("redis://{s}")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_bare_address_is_a_url() {
        assert_eq!(
            super::sentinel_url("127.0.0.1:26379"),
            "redis://127.0.0.1:26379"
        );
        assert_eq!(super::sentinel_url("redis://:pw@h:1"), "redis://:pw@h:1");
    }
}

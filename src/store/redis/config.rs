//! How to reach Redis and name its keys: [`RedisConfig`], its defaults and
//! the key naming every Redis store shares.
//!
//! Every key of a caller carries the caller in a hash tag
//! (`<prefix>{+34911234567}:m`), so all of a caller's state lives in one
//! Redis Cluster slot and one script call can touch all of it.

use std::time::Duration;

use redis::RedisError;

use crate::error::StoreError;

/// Default Redis URL.
pub const DEFAULT_URL: &str = "redis://127.0.0.1:6379";
/// Default prefix of every key.
pub const DEFAULT_KEY_PREFIX: &str = "cg:";
/// Default timeout of connecting and of every call, milliseconds.
pub const DEFAULT_TIMEOUT_MS: u64 = 2_000;
/// Default slack added to every TTL, seconds.
pub const DEFAULT_TTL_SLACK_S: u64 = 60;

/// How to reach Redis and how to use it.
#[derive(Clone)]
pub struct RedisConfig {
    /// One `redis://` or `rediss://` URL (user and password in the URL for
    /// ACL), or several seed URLs of a Cluster.
    pub urls: Vec<String>,
    /// Use the Cluster client (implied by more than one URL).
    pub cluster: bool,
    /// Prefix of every key, to separate environments (`cg:`).
    pub key_prefix: String,
    /// Keep each call's record so a redelivered call id counts once and gets
    /// the same record back. Off: redeliveries count again.
    pub idempotency: bool,
    /// Timeout of connecting and of every call.
    pub timeout: Duration,
    /// Added to every key's TTL. The contract runs on event time and the
    /// script trims by event time, so TTLs only collect garbage; the slack
    /// keeps state alive through processing pauses (Redis restarts,
    /// rebalances, consumer lag) that would otherwise expire it early.
    pub ttl_slack: Duration,
    /// PEM file of the CA that signed the server certificate (`rediss://`
    /// with a private CA); the system trust store otherwise.
    pub tls_ca: Option<std::path::PathBuf>,
    /// On a reject by a rule, set the caller's block key
    /// (`<prefix>block:{<caller>}`, see [`RedisConfig::block_key`]) to the
    /// reason with a TTL of the retry-after, in the same script call, so a
    /// switch can refuse the caller's next calls with one `EXISTS`.
    pub block_keys: bool,
    /// With the cached store under `consume`: decide the next batch's other
    /// callers while this batch's commits are in flight (see
    /// `store::cached`'s `ahead.rs`; needs `idempotency`). Off by default.
    pub decide_ahead: bool,
    /// Find the primary through Redis Sentinel and follow it across
    /// failovers; `urls` then only lend the primary their user, password,
    /// database and TLS (their host is not used).
    pub sentinel: Option<crate::store::redis::SentinelConfig>,
    /// Replicas that must acknowledge a batch's writes (`WAIT`) before its
    /// verdicts are returned, so a failover to one of them loses no decision
    /// that was answered or produced. 0: Redis's asynchronous replication,
    /// whose last writes a failed primary may take with it.
    pub wait_replicas: u32,
}

/// A URL with its password replaced by `***`, for logs.
pub fn redact(url: &str) -> String {
    // Credentials start after the scheme, or at the start when a URL
    // lacks one (`user:pass@host`, a typo worth an error, not a leak).
    let start = url.find("://").map_or(0, |s| s + 3);
    match url.rfind('@') {
        Some(at) if at >= start => {
            let creds = &url[start..at];
            let user = creds.split(':').next().unwrap_or_default();
            format!("{}{user}:***{}", &url[..start], &url[at..])
        }
        _ => url.to_string(),
    }
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field(
                "urls",
                &self.urls.iter().map(|u| redact(u)).collect::<Vec<_>>(),
            )
            .field("cluster", &self.cluster)
            .field("key_prefix", &self.key_prefix)
            .field("idempotency", &self.idempotency)
            .field("timeout", &self.timeout)
            .field("ttl_slack", &self.ttl_slack)
            .field("tls_ca", &self.tls_ca)
            .field("block_keys", &self.block_keys)
            .field("decide_ahead", &self.decide_ahead)
            .field("sentinel", &self.sentinel)
            .field("wait_replicas", &self.wait_replicas)
            .finish()
    }
}

impl RedisConfig {
    /// A key of a caller, `<prefix>{<caller>}<tail>`: hash-tagged by the
    /// caller, so all of its keys share a Cluster slot. Built without
    /// `format!`: a few per caller and batch.
    pub fn caller_key(&self, caller: &str, tail: &str) -> String {
        self.tagged("", caller, tail)
    }

    /// The block key of a caller, `<prefix>block:{<caller>}`. Set (with
    /// [`RedisConfig::block_keys`]) to the reason of a reject, expiring when
    /// the caller's retry-after ends; both stores write it.
    pub fn block_key(&self, caller: &str) -> String {
        self.tagged("block:", caller, "")
    }

    /// `<prefix><head>{<tag>}<tail>`, for keys tagged other than by caller.
    pub fn tagged_key(&self, head: &str, tag: &str, tail: &str) -> String {
        self.tagged(head, tag, tail)
    }

    /// `<prefix><head>{<caller>}<tail>`.
    fn tagged(&self, head: &str, caller: &str, tail: &str) -> String {
        let mut key = String::new();
        self.write_tagged(&mut key, head, caller, tail);
        key
    }

    /// Writes `<prefix><head>{<caller>}<tail>` into `key`, replacing what
    /// it held (a buffer reused for many keys).
    pub(crate) fn write_tagged(&self, key: &mut String, head: &str, caller: &str, tail: &str) {
        let prefix = &self.key_prefix;
        key.clear();
        key.reserve(prefix.len() + head.len() + caller.len() + tail.len() + 2);
        key.push_str(prefix);
        key.push_str(head);
        key.push('{');
        key.push_str(caller);
        key.push('}');
        key.push_str(tail);
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            urls: vec![DEFAULT_URL.into()],
            cluster: false,
            key_prefix: DEFAULT_KEY_PREFIX.into(),
            idempotency: true,
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
            ttl_slack: Duration::from_secs(DEFAULT_TTL_SLACK_S),
            tls_ca: None,
            block_keys: false,
            decide_ahead: false,
            sentinel: None,
            wait_replicas: 0,
        }
    }
}

/// Server error codes that retrying may get past.
const TRANSIENT_CODES: [&str; 8] = [
    "LOADING",
    "BUSY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "READONLY",
    "MOVED",
    "ASK",
];

/// The connection settings of a Redis URL, with Nagle's algorithm off
/// (`TCP_NODELAY`, as hiredis sets it): the stores pipeline several small
/// calls on one connection, and none should wait for the acknowledgement
/// of the one before (on loopback no change was measured).
pub(crate) fn without_nagle(url: &str) -> Result<redis::ConnectionInfo, StoreError> {
    use redis::IntoConnectionInfo;
    let info = url.into_connection_info().map_err(|e| StoreError::Fatal {
        context: "bad Redis URL".into(),
        source: Some(e),
    })?;
    let tcp = info.tcp_settings().clone().set_nodelay(true);
    Ok(info.set_tcp_settings(tcp))
}

/// Classifies a Redis error as transient (retry), out of memory (retry
/// later) or fatal. A pipeline's error carries one server error per failed
/// call: it is out of memory or transient only if every one of them is, and
/// it is summarised by its first failure, not printed whole.
pub fn classify(e: RedisError) -> StoreError {
    let failures = e
        .clone()
        .into_server_errors()
        .unwrap_or_else(|| Vec::new().into());
    if failures.len() > 1 {
        let codes: Vec<&str> = failures.iter().map(|(_, f)| f.code()).collect();
        let first = RedisError::from(failures[0].1.clone());
        let context = format!("{} calls of a pipeline failed; the first", failures.len());
        return if codes
            .iter()
            .all(|c| *c == "OOM" || TRANSIENT_CODES.contains(c))
        {
            if codes.contains(&"OOM") {
                StoreError::OutOfMemory { source: first }
            } else {
                StoreError::Transient {
                    context,
                    source: Some(first),
                }
            }
        } else {
            StoreError::Fatal {
                context,
                source: Some(first),
            }
        };
    }
    let code = failures
        .first()
        .map(|(_, f)| f.code().to_string())
        .or_else(|| e.code().map(str::to_string));
    if code.as_deref() == Some("OOM") {
        return StoreError::OutOfMemory { source: e };
    }
    if e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || code.is_some_and(|c| TRANSIENT_CODES.contains(&c.as_str()))
    {
        StoreError::Transient {
            context: "Redis call failed".into(),
            source: Some(e),
        }
    } else {
        StoreError::Fatal {
            context: "Redis call failed".into(),
            source: Some(e),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redacts_passwords() {
        assert_eq!(
            super::redact("redis://cg:s3cret@host:6379/0"),
            "redis://cg:***@host:6379/0"
        );
        assert_eq!(super::redact("redis://host:6379"), "redis://host:6379");
        // Without a scheme (a typo) the password is hidden all the same.
        assert_eq!(super::redact("cg:s3cret@host:6379"), "cg:***@host:6379");
        assert_eq!(super::redact("host:6379"), "host:6379");
        let cfg = super::RedisConfig {
            urls: vec!["rediss://u:p@h:1".into()],
            ..Default::default()
        };
        assert!(!format!("{cfg:?}").contains(":p@"));
    }
}

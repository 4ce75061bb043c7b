//! The Redis stores' common ground and the script store.
//!
//! - [`config`]: [`RedisConfig`], defaults, key naming (hash-tagged per caller).
//! - [`conn`]: the connection (standalone or Cluster), the mode claim of a
//!   key prefix, error classification.
//! - [`cluster`]: a Cluster connection rebuilt when it stops answering.
//! - [`sentinel`]: a standalone primary found through Redis Sentinel and
//!   followed across failovers.
//! - [`aggregate`]: the rules keyed by callee or global: credits leased
//!   per counter (`aggregate::lease`, `lua/lease.lua`) and reserve slots
//!   fenced per slot (`aggregate::slot`, `lua/slot.lua`).
//! - [`script`]: the script store, [`RedisStore`]: the window algorithm as
//!   atomic Lua calls (`lua/window.lua`).
//!
//! The cached store (`store::cached`) uses the same connection and config.

pub mod aggregate;
pub mod cluster;
pub mod config;
pub mod conn;
pub mod script;
pub mod sentinel;

pub use config::classify;
pub use config::{
    redact, RedisConfig, DEFAULT_KEY_PREFIX, DEFAULT_TIMEOUT_MS, DEFAULT_TTL_SLACK_S, DEFAULT_URL,
};
pub(crate) use conn::Conn;
pub use conn::{PrefixReuse, ReplayClaim, CLAIM_EVERY};

/// Takes `config`'s key prefix for a replay under the rule set `version`.
/// A prefix that holds records of another rule set, or keys whose rule set
/// is unknown (an online command's), would answer the replay's calls with
/// their old records: it is refused, unless `reuse` says to continue on it
/// or to delete its keys first. A prefix of the same version continues
/// (every record comes back, as idempotency promises).
pub async fn claim_replay(
    config: &RedisConfig,
    version: &str,
    reuse: PrefixReuse,
) -> Result<ReplayClaim, crate::error::StoreError> {
    let mut conn = Conn::open(config).await?;
    conn.claim_replay(&config.key_prefix, version, reuse).await
}
pub use script::{RedisStore, EVENTS_PER_CALL, MODE, WINDOW_LUA};
pub use sentinel::SentinelConfig;

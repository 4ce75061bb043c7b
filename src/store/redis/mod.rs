//! The Redis stores' common ground and the script store.
//!
//! - [`config`]: [`RedisConfig`], defaults, key naming (hash-tagged per caller).
//! - [`conn`]: the connection (standalone or Cluster), the mode claim of a
//!   key prefix, error classification.
//! - [`cluster`]: a Cluster connection rebuilt when it stops answering.
//! - [`sentinel`]: a standalone primary found through Redis Sentinel and
//!   followed across failovers.
//! - [`lease`]: credits of the rules keyed by callee or global
//!   (`lua/lease.lua`).
//! - [`slot`]: reserve slots, the credits of those rules an instance may
//!   spend without asking, fenced per slot (`lua/slot.lua`).
//! - [`script`]: the script store, [`RedisStore`]: the window algorithm as
//!   atomic Lua calls (`lua/window.lua`).
//!
//! The cached store (`store::cached`) uses the same connection and config.

pub mod cluster;
pub mod config;
pub mod conn;
pub mod lease;
pub mod script;
pub mod sentinel;
pub mod slot;

pub use config::{
    redact, RedisConfig, DEFAULT_KEY_PREFIX, DEFAULT_TIMEOUT_MS, DEFAULT_TTL_SLACK_S, DEFAULT_URL,
};
pub(crate) use conn::Conn;
pub use conn::{classify, CLAIM_EVERY};
pub use script::{RedisStore, EVENTS_PER_CALL, MODE, WINDOW_LUA};
pub use sentinel::SentinelConfig;

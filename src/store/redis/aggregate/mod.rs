//! The Redis side of the limits keyed by callee or global, exact across
//! instances: the engine's gate (`crate::engine::aggregate`) decides from
//! credits, and these are where the credits come from.
//!
//! - [`lease`]: credits leased per counter (`lua/lease.lua`, or plain
//!   increments for a counter nobody holds), never past the limit.
//! - [`pool`]: concurrent rules keyed by account, callee or global, one
//!   script call per batch after the caller's rules (`lua/pool.lua`).
//! - [`slot`]: reserve slots, the credits an instance may spend without
//!   asking, fenced per slot (`lua/slot.lua`).

pub mod lease;
pub mod pool;
pub mod slot;

//! The semantics of callguard, with no I/O and no clock: time is always the
//! event's, passed in.
//!
//! * [`event`]: the call event and its decoder (JSON payloads and call-log
//!   rows share it).
//! * [`rules`]: rule sets (windows, limits, lists, shadow mode) and the
//!   decision order; [`rule`] one rule, [`rule_file`] the TOML operators
//!   write, [`filter`] which calls a rule sees.
//! * [`window`]: the reference window algorithm for one caller: the
//!   contract every store implements.
//! * [`aggregate`]: rules keyed by callee or global, decided from leased
//!   credits before the caller's rules.
//! * [`pool`]: concurrent rules keyed by account, callee or global,
//!   decided after the caller's rules for the calls they allow.
//! * [`record`]: decision records, verdicts and the one column schema of
//!   every output.

pub mod aggregate;
pub mod duration;
pub mod event;
pub mod filter;
pub mod local_time;
pub mod model;
pub mod pool;
pub mod rates;
pub mod record;
pub mod rule;
pub mod rule_file;
pub mod rules;
pub mod window;

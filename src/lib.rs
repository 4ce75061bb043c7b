//! callguard: anti-fraud call rejection.
//!
//! One calling number placing too many calls in a short time is the mark of
//! robocalls, wangiri bursts and SIP floods. callguard counts each number's
//! calls in fixed or sliding windows and decides every call (allow or reject,
//! with the reason), online from Kafka with the windows in Redis, and offline
//! from call logs with exactly the same semantics.
//!
//! * [`event`]: the call event and its decoder (JSON and call-log rows).
//! * [`rules`]: rule sets (windows, limits, lists, shadow mode).
//! * [`window`]: the reference window algorithm for one caller.
//! * [`store`]: where window state lives: in memory or in Redis (Lua).
//! * [`decision`]: decision records, the one output record.
//! * [`calllog`]: reading call logs and writing tables.
//! * [`replay`]: `callguard replay`.

pub mod calllog;
pub mod cli;
pub mod consumer;
pub mod decision;
pub mod demo;
pub mod error;
pub mod event;
pub mod features;
pub mod generate;
pub mod kafka;
pub mod metrics;
pub mod plot;
pub mod produce;
pub mod reload;
pub mod replay;
pub mod rules;
pub mod store;
pub mod tune;
pub mod window;

//! callguard: anti-fraud call rejection.
//!
//! One calling number placing too many calls in a short time is the mark of
//! robocalls, wangiri bursts and SIP floods. callguard counts each number's
//! calls in fixed or sliding windows and decides every call (allow or reject,
//! with the reason), online from Kafka with the windows in Redis, and offline
//! from call logs with exactly the same semantics.
//!
//! The library is layered; imports only go downwards:
//!
//! * [`engine`]: the semantics, with no I/O: call events and their decoder,
//!   rule sets, the reference window algorithm, and the one record schema
//!   every output is built from.
//! * [`store`]: where window state lives, behind one trait: in memory (the
//!   engine itself) or in Redis (the same algorithm in Lua).
//! * [`online`]: the stream processor (`consume`) and its Kafka, metrics and
//!   reload plumbing; no polars here.
//! * [`offline`]: call logs on disk: reading and ordering, tables, `replay`,
//!   `tune`, `features`, plots and the generator.
//! * [`demo`]: the online pipeline checked against the offline replay.
//! * [`progress`]: progress bars for long work.
//! * [`process`]: process-wide settings the binary applies at start.
//!
//! The command line (`src/cmd/`, in the binary) maps its arguments onto the
//! configurations these modules take.

pub mod demo;
pub mod engine;
pub mod error;
pub mod offline;
pub mod online;
pub mod process;
pub mod progress;
pub mod store;

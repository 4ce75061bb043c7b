//! callguard: anti-fraud call rejection.
//!
//! Too many calls in a short time — from one number, to one number, or from
//! everyone at once — is the mark of robocalls, wangiri bursts, IRSF and SIP
//! floods. callguard counts calls in windows and decides every call (allow
//! or reject, with the reason and a Retry-After), from Kafka (`consume`), in
//! a switch's own request (`serve`) and offline from call logs (`replay`,
//! `tune`, `features`), with exactly the same semantics.
//!
//! # Layout
//!
//! Imports only go downwards:
//!
//! * [`engine`]: the semantics, no I/O and no clock: call events and their
//!   one decoder, rule sets and their decision order, the reference window
//!   algorithm per caller, the gate of the rules keyed by callee or global,
//!   and the one record schema every output is built from.
//! * [`store`]: where window state lives, behind [`store::WindowStore`]:
//!   in memory (the engine itself, or split by caller over the cores for
//!   offline work), or in Redis, either decided in process on cached state
//!   written back under a version check (`store::cached`, the default) or
//!   decided in Lua (`store::redis::RedisStore`); the callee and global
//!   rules' credits (`store::gated`, `store::redis::aggregate::lease`).
//! * [`online`]: `consume` (the Kafka stream processor) and `serve` (the
//!   check API), what they share around the store (`online::policy`), the
//!   status page, metrics and rule reloads; no polars here.
//! * [`offline`]: call logs on disk: reading and ordering, tables, `replay`,
//!   `tune`, `features`, plots and the generator.
//! * [`demo`]: the online pipeline checked against the offline replay.
//! * [`error`]: every error type of the library.
//! * [`progress`], [`process`]: progress bars, process-wide settings.
//!
//! The command line (`src/cmd/`, in the binary) is the only place that
//! knows clap; it maps arguments onto the configurations these modules take.
//! ARCHITECTURE.md walks a call through the three paths.

#[cfg(test)]
mod child_test;
pub mod demo;
pub mod engine;
pub mod error;
pub mod offline;
pub mod online;
pub mod process;
pub mod progress;
pub mod store;

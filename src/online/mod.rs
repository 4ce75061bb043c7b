//! The online path: call events from Kafka (or a switch's HTTP check),
//! decided through a window store, decisions and features back to Kafka.
//! Nothing here reads files or uses polars.
//!
//! * [`consumer`]: `callguard consume`, the stream processor.
//! * [`produce`]: loading call events into a topic, keyed by caller.
//! * [`kafka`]: client settings and the embedded mock cluster.
//! * [`metrics`]: Prometheus metrics, `/healthz` and `/readyz`.
//! * [`status`]: the live status page (`/`) and its JSON (`/v1/stats`).
//! * [`policy`]: what both paths share around the store: the failure
//!   policy, the future-time check, the store call timed and counted.
//! * [`clock`]: the wall clock.
//! * [`reload`]: rule reloads on SIGHUP and file changes.
//! * [`serve`]: `callguard serve`, the check API a switch calls per INVITE.

pub mod clock;
pub mod consumer;
pub mod kafka;
pub mod metrics;
pub mod policy;
pub mod produce;
pub mod reload;
pub mod serve;
pub mod status;

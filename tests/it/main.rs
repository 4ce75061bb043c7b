//! Every integration test of callguard, in one binary (one link of polars
//! and rdkafka instead of one per area): a module per area, the shared
//! harness in `common/`.

mod common;

mod aggregate;
mod cached_store;
mod cdr;
mod chaos;
mod conformance;
mod consume;
mod deploy;
mod failover;
mod features;
mod fuzz;
mod model;
mod notebook;
mod reliability;
mod replay_cli;
mod rule_kinds;
mod semantics;
mod serve;
mod sip;
mod spill;
mod status_page;
mod tree_walk;
mod tune;

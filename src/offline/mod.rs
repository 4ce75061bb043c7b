//! Call logs on disk: the offline tools.
//!
//! The path of a log is read → order → decide → write: [`read`] decodes
//! rows into call events with the same decoder as the online path,
//! [`order`] puts them in processing order (stable by event time) a chunk
//! at a time, [`replay`] decides them through a window store, and [`table`]
//! writes the records as CSV or Parquet from the one record schema.
//!
//! * [`replay`]: `callguard replay`, and the replay-to-table pipeline.
//! * [`features`]: `callguard features`, point-in-time features.
//! * [`tune`]: `callguard tune`, the limit sweep and its recommendation.
//! * [`plot`]: the sweep's plot.
//! * [`generate`]: a synthetic, labelled call log.
//! * [`cdr`]: switches' call records (Asterisk, FreeSWITCH, Kamailio).

pub mod cdr;
pub mod columns;
pub mod features;
pub mod generate;
pub mod order;
pub mod plot;
pub mod read;
pub mod replay;
pub mod spill;
pub mod table;
pub mod tune;

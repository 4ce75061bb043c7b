//! Typed errors of the library, all in one place. The binary wraps them in
//! `anyhow` at the top.
//!
//! Errors that wrap another keep it as their [`std::error::Error::source`]
//! and do not repeat its text in their own message, so a report of the chain
//! ([`chain`], or `anyhow`'s `{:#}`) names every cause once.

use std::path::PathBuf;

use thiserror::Error;

/// Why an input record is not a valid call event. Such events are reported
/// (replay: side file; consume: dead-letter topic), never silently dropped.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EventError {
    /// A required field is missing or empty.
    #[error("missing field `{0}`")]
    Missing(&'static str),
    /// A field has the wrong JSON type.
    #[error("field `{field}` has the wrong type ({found})")]
    WrongType {
        /// Canonical field name.
        field: &'static str,
        /// What was found instead.
        found: &'static str,
    },
    /// A number (telephone number or numeric field) is malformed.
    #[error("bad {field}: {value}")]
    BadNumber {
        /// Canonical field name.
        field: &'static str,
        /// The offending value (escaped, truncated).
        value: String,
    },
    /// The timestamp is in none of the accepted forms.
    #[error(
        "bad timestamp {0}: expected epoch milliseconds or RFC 3339 \
         (2025-12-01T10:00:00Z, 2025-12-01T11:00:00+01:00); a call log may also have \
         YYYY-MM-DD HH:MM:SS in --timezone, epoch seconds mapped as ts=COLUMN:s, or \
         any form named with --ts-format"
    )]
    BadTimestamp(String),
    /// The event time lies outside the accepted range: before 2000, from
    /// 2100 on, or (online) too far ahead of the wall clock.
    #[error("timestamp {ts} ms is out of range: {why}")]
    TsOutOfRange {
        /// The event time, epoch milliseconds.
        ts: i64,
        /// Which bound it crosses.
        why: String,
    },
    /// `account` is too long or holds characters other than `A-Z a-z 0-9
    /// . _ - : @ +`.
    #[error("bad account {0}: at most 64 of A-Z a-z 0-9 . _ - : @ +")]
    BadAccount(String),
    /// `event` is neither `attempt` nor `end`.
    #[error("bad event {0}: expected attempt or end")]
    BadEventKind(String),
    /// The label is not one of 1/0, true/false, fraud/legit.
    #[error("bad label {0}: expected 1/0, true/false or fraud/legit")]
    BadLabel(String),
    /// The call id is too long or contains control characters.
    #[error("bad call_id {0:?}: at most 256 bytes, no control characters")]
    BadCallId(String),
    /// The payload is not valid JSON (or not UTF-8, or not an object).
    #[error("bad JSON: {0}")]
    Json(String),
    /// The payload exceeds the size limit.
    #[error("payload of {size} bytes exceeds the {limit}-byte limit")]
    Oversized {
        /// Payload size.
        size: usize,
        /// Configured limit.
        limit: usize,
    },
    /// A `--map` entry is malformed.
    #[error("bad field mapping {0}: expected FIELD=COLUMN")]
    BadMapping(String),
    /// The pseudonymisation key is too short.
    #[error("the number-hashing key has {0} bytes; it needs at least 16 (e.g. 32 random bytes)")]
    BadHashKey(usize),
    /// The default country code is not 1 to 3 digits.
    #[error("bad default country code {0:?}: expected 1 to 3 digits")]
    BadCountryCode(String),
    /// A switch's record of something other than a call attempt (a
    /// Kamailio `acc` row of a BYE or CANCEL transaction).
    #[error("not a call attempt: {column} is {value:?}, calls are {wanted} rows")]
    NotACallAttempt {
        /// The column telling.
        column: &'static str,
        /// What it holds (truncated).
        value: String,
        /// What a call attempt's holds.
        wanted: &'static str,
    },
}

impl EventError {
    /// The canonical field the error is about, if one.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            EventError::Missing(f) => Some(f),
            EventError::WrongType { field, .. } | EventError::BadNumber { field, .. } => {
                Some(field)
            }
            EventError::BadTimestamp(_) | EventError::TsOutOfRange { .. } => Some("ts"),
            EventError::BadLabel(_) => Some("label"),
            EventError::BadEventKind(_) => Some("event"),
            EventError::BadAccount(_) => Some("account"),
            EventError::BadCallId(_) => Some("call_id"),
            _ => None,
        }
    }

    /// A short, stable machine-readable kind (metrics label, dead-letter header).
    pub fn kind(&self) -> &'static str {
        match self {
            EventError::Missing(_) => "missing_field",
            EventError::WrongType { .. } => "wrong_type",
            EventError::BadNumber { .. } => "bad_number",
            EventError::BadTimestamp(_) => "bad_timestamp",
            EventError::TsOutOfRange { .. } => "ts_out_of_range",
            EventError::BadLabel(_) => "bad_label",
            EventError::BadEventKind(_) => "bad_event",
            EventError::BadAccount(_) => "bad_account",
            EventError::BadCallId(_) => "bad_call_id",
            EventError::Json(_) => "bad_json",
            EventError::Oversized { .. } => "oversized",
            EventError::BadMapping(_) => "bad_mapping",
            EventError::BadCountryCode(_) => "bad_country_code",
            EventError::BadHashKey(_) => "bad_hash_key",
            EventError::NotACallAttempt { .. } => "not_a_call_attempt",
        }
    }
}

/// A rule set that cannot be used.
#[derive(Debug, Error)]
pub enum RulesError {
    /// The TOML file cannot be read.
    #[error("cannot read rules file {path}")]
    Read {
        /// File path.
        path: String,
        /// I/O error.
        source: std::io::Error,
    },
    /// The TOML is malformed.
    #[error("bad rules file: {0}")]
    Toml(String),
    /// A semantic problem (duplicate names, bad window, ...).
    #[error("bad rule set: {0}")]
    Invalid(String),
}

/// A failure of a window store.
#[derive(Debug, Error)]
pub enum StoreError {
    /// A failure that may go away (connection lost, timeout, busy, failover): retry.
    #[error("transient store error: {context}")]
    Transient {
        /// What failed.
        context: String,
        /// The Redis error, if one caused it.
        #[source]
        source: Option<redis::RedisError>,
    },
    /// Redis refuses writes: `maxmemory` is reached. Transient: it passes
    /// when keys expire or an operator raises the limit.
    #[error("Redis is out of memory (maxmemory reached; raise it or add memory)")]
    OutOfMemory {
        /// The Redis error.
        source: redis::RedisError,
    },
    /// A failure that will not go away by retrying (bad script, auth, bad config).
    #[error("fatal store error: {context}")]
    Fatal {
        /// What failed.
        context: String,
        /// The Redis error, if one caused it.
        #[source]
        source: Option<redis::RedisError>,
    },
}

impl StoreError {
    /// Whether retrying the same call may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Transient { .. } | StoreError::OutOfMemory { .. }
        )
    }

    /// Whether the failure happened before anything was sent to Redis
    /// (the connection was refused): no write of the call can have landed.
    pub fn is_unsent(&self) -> bool {
        match self {
            StoreError::Transient { source, .. } | StoreError::Fatal { source, .. } => source
                .as_ref()
                .is_some_and(redis::RedisError::is_connection_refusal),
            StoreError::OutOfMemory { .. } => false,
        }
    }

    /// The metric label: `transient`, `oom` or `fatal`.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Transient { .. } => "transient",
            StoreError::OutOfMemory { .. } => "oom",
            StoreError::Fatal { .. } => "fatal",
        }
    }

    /// A transient error with no underlying cause.
    pub fn transient(context: impl Into<String>) -> Self {
        StoreError::Transient {
            context: context.into(),
            source: None,
        }
    }

    /// A fatal error with no underlying cause.
    pub fn fatal(context: impl Into<String>) -> Self {
        StoreError::Fatal {
            context: context.into(),
            source: None,
        }
    }
}

/// Input/output failures of the offline tools.
#[derive(Debug, Error)]
pub enum IoError {
    /// Polars failed to read or write.
    #[error("{context}")]
    Polars {
        /// What was being done.
        context: String,
        /// The polars error.
        source: polars::prelude::PolarsError,
    },
    /// A plain I/O error.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The input file does not exist.
    #[error("{0}: no such file")]
    NoSuchFile(PathBuf),
    /// A column the field mapping needs is not in the input.
    #[error("column `{column}` (for `{field}`) not found; columns are: {columns} (map with --map {field}=COLUMN)")]
    MissingColumn {
        /// The input's column name.
        column: String,
        /// The canonical field it was to provide.
        field: &'static str,
        /// The columns the input has, comma-separated.
        columns: String,
    },
    /// The input has the wrong shape for its format.
    #[error("{path}: {problem}")]
    BadShape {
        /// The input file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// An output file's extension names no format callguard writes.
    #[error("{path}: unknown output format; name the file with {expected}")]
    UnknownExtension {
        /// The output file.
        path: PathBuf,
        /// The extensions that are understood.
        expected: &'static str,
    },
    /// A plot could not be drawn.
    #[error("drawing the plot {path}: {problem}")]
    Plot {
        /// The plot file.
        path: PathBuf,
        /// What failed.
        problem: String,
    },
    /// A worker thread of the offline pipeline stopped without a result.
    #[error("the {0} thread stopped unexpectedly")]
    WorkerLost(&'static str),
}

/// Failures of a replay over a call log: reading or writing, or the store.
#[derive(Debug, Error)]
pub enum ReplayError {
    /// Reading the log or writing the output failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// The window store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An output column asked for does not exist.
    #[error(transparent)]
    Column(#[from] UnknownColumn),
}

/// Failures of a sweep over a file.
#[derive(Debug, Error)]
pub enum TuneError {
    /// The rule set cannot take a limit.
    #[error(transparent)]
    Rules(#[from] RulesError),
    /// Reading the log failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// The replay a model's sweep reads its scores from failed.
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// A model's sweep found no labelled attempt.
    #[error("no labelled attempt to tune the model on ({0} without a label): give --label-column")]
    NoLabels(u64),
}

/// Kafka failures.
#[derive(Debug, Error)]
pub enum KafkaError {
    /// A `-X key=value` setting is malformed.
    #[error("bad Kafka setting ({0}): expected KEY=VALUE")]
    BadSetting(String),
    /// librdkafka refused or failed.
    #[error("{context}")]
    Client {
        /// What was being done.
        context: String,
        /// The librdkafka error.
        source: rdkafka::error::KafkaError,
    },
    /// A produced message was not acknowledged.
    #[error("delivery failed: {0}")]
    Delivery(String),
}

/// Failures that stop the stream processor.
#[derive(Debug, Error)]
pub enum ConsumeError {
    /// Kafka failed.
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// The store failed with a fatal error.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The task that decides batches stopped (it panicked).
    #[error("the deciding task stopped unexpectedly")]
    DeciderStopped,
    /// The configuration cannot work.
    #[error("consume configuration: {0}")]
    Config(String),
}

/// Failures of `callguard demo`.
#[derive(Debug, Error)]
pub enum DemoError {
    /// Reading the call log failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// The embedded Kafka failed.
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// The stream processor stopped with an error.
    #[error(transparent)]
    Consume(#[from] ConsumeError),
    /// The offline replay for the parity check failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The consumer task panicked or was cancelled.
    #[error("the consumer task failed: {0}")]
    Task(String),
}

/// An error and its causes as one line, `outer: inner: ...` (for logs).
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_name_each_cause_once() {
        let e = IoError::Io {
            context: "reading x.csv".into(),
            source: std::io::Error::other("disk on fire"),
        };
        assert_eq!(chain(&e), "reading x.csv: disk on fire");
        let s = StoreError::fatal("bad script");
        assert_eq!(chain(&s), "fatal store error: bad script");
    }
}

/// A column asked for by name that the output does not have.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("no column `{name}`; the columns are: {columns}")]
pub struct UnknownColumn {
    /// The name asked for.
    pub name: String,
    /// The columns there are, comma-separated.
    pub columns: String,
}

//! Typed errors of the library. The binary wraps them in `anyhow` at the top.

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
    /// The timestamp is neither epoch milliseconds nor RFC 3339.
    #[error("bad timestamp {0}: expected epoch milliseconds or RFC 3339")]
    BadTimestamp(String),
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
    /// The default country code is not 1 to 3 digits.
    #[error("bad default country code {0:?}: expected 1 to 3 digits")]
    BadCountryCode(String),
}

impl EventError {
    /// A short, stable machine-readable kind (metrics label, dead-letter header).
    pub fn kind(&self) -> &'static str {
        match self {
            EventError::Missing(_) => "missing_field",
            EventError::WrongType { .. } => "wrong_type",
            EventError::BadNumber { .. } => "bad_number",
            EventError::BadTimestamp(_) => "bad_timestamp",
            EventError::BadLabel(_) => "bad_label",
            EventError::BadCallId(_) => "bad_call_id",
            EventError::Json(_) => "bad_json",
            EventError::Oversized { .. } => "oversized",
            EventError::BadMapping(_) => "bad_mapping",
            EventError::BadCountryCode(_) => "bad_country_code",
        }
    }
}

/// A rule set that cannot be used.
#[derive(Debug, Error)]
pub enum RulesError {
    /// The TOML file cannot be read.
    #[error("cannot read rules file {path}: {source}")]
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
    #[error("transient store error: {0}")]
    Transient(String),
    /// A failure that will not go away by retrying (bad script, auth, bad config).
    #[error("fatal store error: {0}")]
    Fatal(String),
}

impl StoreError {
    /// Whether retrying the same call may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Transient(_))
    }
}

/// Input/output failures of the offline tools.
#[derive(Debug, Error)]
pub enum IoError {
    /// Polars failed to read or write.
    #[error("{context}: {source}")]
    Polars {
        /// What was being done.
        context: String,
        /// The polars error.
        source: polars::prelude::PolarsError,
    },
    /// A plain I/O error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The input lacks something it needs.
    #[error("{0}")]
    Input(String),
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
}

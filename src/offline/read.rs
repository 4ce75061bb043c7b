//! Reading call logs: CSV, Parquet and Asterisk CDR files into
//! [`CallEvent`]s.
//!
//! Every row becomes either an event or an [`InvalidRow`]: nothing is
//! dropped silently. CSV cells are read as text (no type inference, so a
//! `+34...` or `0034...` number keeps its digits) and decoded by the same
//! [`Decoder`] as Kafka payloads.

use std::fs::File;
use std::path::Path;

use chrono::{NaiveDateTime, TimeZone};
use chrono_tz::Tz;
use polars::prelude::*;

use crate::engine::event::{CallEvent, Decoder, FieldMap, RawValue, FIELDS};
use crate::error::{EventError, IoError};
use crate::progress::progress_bar;

/// Column names of an Asterisk `Master.csv` (cdr_csv), in file order.
pub const ASTERISK_COLUMNS: [&str; 18] = [
    "accountcode",
    "src",
    "dst",
    "dcontext",
    "clid",
    "channel",
    "dstchannel",
    "lastapp",
    "lastdata",
    "start",
    "answer",
    "end",
    "duration",
    "billsec",
    "disposition",
    "amaflags",
    "uniqueid",
    "userfield",
];

/// The layout of an input file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputFormat {
    /// By file extension: `.parquet` is Parquet, anything else CSV.
    Auto,
    /// CSV with a header row.
    Csv,
    /// Parquet.
    Parquet,
    /// Asterisk `Master.csv`: no header; `src` is the caller, `uniqueid` the
    /// call id, `start` the time (local time, see `--timezone`).
    Asterisk,
}

/// How to read a call log.
#[derive(Debug, Clone)]
pub struct ReadOptions {
    /// File layout.
    pub format: InputFormat,
    /// Field mapping and number normalisation.
    pub decoder: Decoder,
    /// Time zone of naive `YYYY-MM-DD HH:MM:SS` times (Asterisk); UTC if unset.
    pub timezone: Option<Tz>,
    /// Show a progress bar (only drawn on a terminal).
    pub progress: bool,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            format: InputFormat::Auto,
            decoder: Decoder::default(),
            timezone: None,
            progress: false,
        }
    }
}

/// A row that is not a valid call event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidRow {
    /// 1-based data row number (the header is not counted).
    pub row: u64,
    /// Why.
    pub error: EventError,
}

/// A decoded call log.
#[derive(Debug, Default)]
pub struct CallLog {
    /// Valid events with their 1-based row numbers, in file order.
    pub events: Vec<(u64, CallEvent)>,
    /// Rows that are not valid events.
    pub invalid: Vec<InvalidRow>,
    /// When known (same length as `events`): the event's call id occurs on
    /// no other row of the input, so no duplicate of it can follow and a
    /// store may skip its idempotency record. Empty when unknown.
    pub unique: Vec<bool>,
}

impl CallLog {
    /// Sorts events stably by event time (ties keep file order): the offline
    /// processing order. `unique` is dropped (it is optional);
    /// [`crate::offline::order::OrderedLog`] yields logs already sorted,
    /// with it.
    pub fn sort_by_time(&mut self) {
        self.unique.clear();
        self.events.sort_by_key(|(_, e)| e.ts_ms);
    }
}

/// Wraps a polars error with what was being done.
pub fn polars_err(context: impl Into<String>) -> impl FnOnce(PolarsError) -> IoError {
    let context = context.into();
    move |source| IoError::Polars { context, source }
}

/// Reads a whole file into a data frame of text columns.
pub fn read_frame(path: &Path, format: InputFormat) -> Result<DataFrame, IoError> {
    read_frame_columns(path, format, None)
}

/// Reads a file into a data frame of text columns; with `wanted`, only those
/// of its columns that exist (the others are never materialised). Asterisk
/// files are read whole: their columns are known by position.
pub fn read_frame_columns(
    path: &Path,
    format: InputFormat,
    wanted: Option<&[&str]>,
) -> Result<DataFrame, IoError> {
    let ctx = format!("reading {}", path.display());
    if !path.exists() {
        return Err(IoError::NoSuchFile(path.to_path_buf()));
    }
    let format = resolve_format(path, format);
    let df = match format {
        InputFormat::Parquet => {
            let file = File::open(path).map_err(|source| IoError::Io {
                context: ctx.clone(),
                source,
            })?;
            let mut reader = ParquetReader::new(file);
            if let Some(wanted) = wanted {
                let schema = reader.schema().map_err(polars_err(ctx.clone()))?;
                let present: Vec<String> = wanted
                    .iter()
                    .filter(|w| schema.contains(w))
                    .map(|w| w.to_string())
                    .collect();
                reader = reader.with_columns(Some(present));
            }
            let df = reader.finish().map_err(polars_err(ctx.clone()))?;
            to_text_columns(df).map_err(polars_err(ctx))?
        }
        InputFormat::Asterisk => {
            let mut df = CsvReadOptions::default()
                .with_has_header(false)
                .with_infer_schema_length(Some(0))
                .try_into_reader_with_file_path(Some(path.into()))
                .map_err(polars_err(ctx.clone()))?
                .finish()
                .map_err(polars_err(ctx.clone()))?;
            let width = df.width();
            if width < ASTERISK_COLUMNS.len() {
                return Err(IoError::BadShape {
                    path: path.to_path_buf(),
                    problem: format!(
                        "{width} columns, an Asterisk Master.csv has {}",
                        ASTERISK_COLUMNS.len()
                    ),
                });
            }
            let names: Vec<PlSmallStr> = (0..width)
                .map(|i| {
                    ASTERISK_COLUMNS
                        .get(i)
                        .map_or_else(|| format!("extra_{i}").into(), |n| (*n).into())
                })
                .collect();
            df.set_column_names(&names).map_err(polars_err(ctx))?;
            df
        }
        _ => {
            let csv = || {
                CsvReadOptions::default()
                    .with_has_header(true)
                    .with_infer_schema_length(Some(0))
            };
            let columns = match wanted {
                Some(wanted) => {
                    // The header alone tells which wanted columns exist.
                    let header = csv()
                        .with_n_rows(Some(0))
                        .try_into_reader_with_file_path(Some(path.into()))
                        .map_err(polars_err(ctx.clone()))?
                        .finish()
                        .map_err(polars_err(ctx.clone()))?;
                    let present: Vec<PlSmallStr> = wanted
                        .iter()
                        .filter(|w| header.column(w).is_ok())
                        .map(|w| (*w).into())
                        .collect();
                    Some(present.into())
                }
                None => None,
            };
            csv()
                .with_columns(columns)
                .try_into_reader_with_file_path(Some(path.into()))
                .map_err(polars_err(ctx.clone()))?
                .finish()
                .map_err(polars_err(ctx))?
        }
    };
    Ok(df)
}

fn resolve_format(path: &Path, format: InputFormat) -> InputFormat {
    match format {
        InputFormat::Auto
            if path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("parquet")) =>
        {
            InputFormat::Parquet
        }
        InputFormat::Auto => InputFormat::Csv,
        f => f,
    }
}

/// Casts every column to text; datetimes become epoch milliseconds.
fn to_text_columns(df: DataFrame) -> PolarsResult<DataFrame> {
    let cols = df
        .columns()
        .iter()
        .map(|c| {
            let c = match c.dtype() {
                DataType::Datetime(_, _) => c
                    .cast(&DataType::Datetime(TimeUnit::Milliseconds, None))?
                    .cast(&DataType::Int64)?,
                _ => c.clone(),
            };
            c.cast(&DataType::String)
        })
        .collect::<PolarsResult<Vec<_>>>()?;
    DataFrame::new(df.height(), cols)
}

/// The field mapping implied by a format (Asterisk's fixed columns), merged with the user's.
pub fn effective_map(format: InputFormat, user: &FieldMap) -> FieldMap {
    if format != InputFormat::Asterisk {
        return user.clone();
    }
    let mut entries = vec!["call_id=uniqueid,caller=src,ts=start,callee=dst".to_string()];
    for f in FIELDS {
        let s = user.source(f);
        if s != f {
            entries.push(format!("{f}={s}"));
        }
    }
    FieldMap::parse(&entries).unwrap_or_else(|_| user.clone())
}

/// Index of `ts` in [`FIELDS`].
const TS_FIELD: usize = 2;

/// Reads and decodes a call log.
pub fn read_call_log(path: &Path, opts: &ReadOptions) -> Result<CallLog, IoError> {
    let mut decoder = opts.decoder.clone();
    decoder.map = effective_map(opts.format, &opts.decoder.map);
    let wanted: Vec<&str> = FIELDS.iter().map(|f| decoder.map.source(f)).collect();
    let df = read_frame_columns(path, opts.format, Some(&wanted))?;
    decode_frame(&df, &decoder, opts.timezone, opts.progress)
}

/// Decodes a frame of text columns into events (row numbers start at 1).
pub fn decode_frame(
    df: &DataFrame,
    decoder: &Decoder,
    tz: Option<Tz>,
    progress: bool,
) -> Result<CallLog, IoError> {
    let names: Vec<String> = df
        .get_column_names()
        .iter()
        .map(|s| s.to_string())
        .collect();
    for required in ["call_id", "caller", "ts"] {
        let src = decoder.map.source(required);
        if !names.iter().any(|n| n == src) {
            return Err(IoError::MissingColumn {
                column: src.to_string(),
                field: required,
                columns: names.join(", "),
            });
        }
    }
    let mut columns: Vec<(String, Option<StringChunked>)> = Vec::new();
    for f in FIELDS {
        let src = decoder.map.source(f);
        let col = match df.column(src) {
            Ok(c) => Some(
                c.cast(&DataType::String)
                    .and_then(|c| Ok(c.str()?.clone()))
                    .map_err(polars_err(format!("reading column `{src}`")))?,
            ),
            Err(_) => None,
        };
        columns.push((src.to_string(), col));
    }
    let n = df.height();
    let bar = progress_bar(n as u64, progress, "decoding");
    let mut iters: Vec<Option<Box<dyn Iterator<Item = Option<&str>> + '_>>> = columns
        .iter()
        .map(|(_, c)| {
            c.as_ref()
                .map(|c| Box::new(c.iter()) as Box<dyn Iterator<Item = Option<&str>>>)
        })
        .collect();
    let mut log = CallLog {
        events: Vec::with_capacity(n),
        ..CallLog::default()
    };
    let mut values: Vec<Option<&str>> = vec![None; FIELDS.len()];
    let mut ts_buf = String::new();
    for row in 1..=n as u64 {
        for (slot, it) in values.iter_mut().zip(iters.iter_mut()) {
            *slot = it.as_mut().and_then(|i| i.next()).flatten();
        }
        // Naive local times (Asterisk's `YYYY-MM-DD HH:MM:SS`) become epoch milliseconds first.
        ts_buf.clear();
        if let Some(ms) = values[TS_FIELD].and_then(|raw| naive_to_ms(raw, tz)) {
            ts_buf.push_str(&ms.to_string());
        }
        let ts_value = if ts_buf.is_empty() {
            values[TS_FIELD]
        } else {
            Some(ts_buf.as_str())
        };
        let result = decoder.decode(
            |name| match columns.iter().position(|(src, _)| src == name) {
                Some(TS_FIELD) => ts_value.map_or(RawValue::Null, RawValue::Str),
                Some(i) => values[i].map_or(RawValue::Null, RawValue::Str),
                None => RawValue::Null,
            },
        );
        match result {
            Ok(ev) => log.events.push((row, ev)),
            Err(error) => log.invalid.push(InvalidRow { row, error }),
        }
        if row.is_multiple_of(65_536) {
            bar.set_position(row);
        }
    }
    bar.finish_and_clear();
    Ok(log)
}

/// A row's event time as the decoder reads it (naive local times first).
pub(crate) fn row_ts(raw: &str, tz: Option<Tz>) -> Option<i64> {
    naive_to_ms(raw, tz).or_else(|| crate::engine::event::parse_ts(RawValue::Str(raw)).ok())
}

/// Parses `YYYY-MM-DD HH:MM:SS[.fff]` in a time zone (UTC if none).
fn naive_to_ms(raw: &str, tz: Option<Tz>) -> Option<i64> {
    let raw = raw.trim();
    if raw.len() < 19 || raw.as_bytes().get(10) != Some(&b' ') {
        return None;
    }
    let naive = NaiveDateTime::parse_from_str(raw, "%Y-%m-%d %H:%M:%S%.f").ok()?;
    let tz = tz.unwrap_or(chrono_tz::UTC);
    // In a DST fold take the earlier instant; in a gap, fall back to UTC offset of the zone's standard time.
    tz.from_local_datetime(&naive)
        .earliest()
        .or_else(|| {
            tz.from_local_datetime(&(naive + chrono::Duration::hours(1)))
                .earliest()
        })
        .map(|d| d.timestamp_millis())
}

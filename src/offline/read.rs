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
    /// Field delimiter of CSV input (`,`; European exports often use `;`).
    pub delimiter: u8,
    /// Show a progress bar (only drawn on a terminal).
    pub progress: bool,
    /// Read the callee column. Work that never uses callees (`tune`) skips
    /// it: a callee never makes a row invalid (a bad one is no callee), so
    /// the same rows are valid either way.
    pub callees: bool,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            format: InputFormat::Auto,
            decoder: Decoder::default(),
            timezone: None,
            delimiter: b',',
            progress: false,
            callees: true,
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

/// Reads a whole comma-separated (or Parquet) file into a data frame of
/// text columns.
pub fn read_frame(path: &Path, format: InputFormat) -> Result<DataFrame, IoError> {
    read_frame_columns(path, format, b',', None)
}

/// The CSV reader's options: every cell as text (no type inference, so a
/// `+34...` or `0034...` number keeps its digits), and rows with more fields
/// than the header cut to the header's width (rows with fewer get nulls: a
/// missing field, listed as an invalid row).
fn csv_options(has_header: bool, delimiter: u8) -> CsvReadOptions {
    CsvReadOptions::default()
        .with_has_header(has_header)
        .with_infer_schema_length(Some(0))
        .with_parse_options(
            CsvParseOptions::default()
                .with_separator(delimiter)
                .with_truncate_ragged_lines(true),
        )
}

/// Reads a CSV file with `options`, turning a polars failure into an error
/// that names the file and, for an unclosed quote, its line. A file with
/// invalid UTF-8 is read again with the bad bytes replaced by U+FFFD (the
/// rows holding them then fail decoding and are listed with their numbers);
/// strict decoding first, as it is markedly faster on clean files.
fn read_csv(path: &Path, options: CsvReadOptions) -> Result<DataFrame, IoError> {
    let ctx = format!("reading {}", path.display());
    let attempt = |options: CsvReadOptions| {
        options
            .try_into_reader_with_file_path(Some(path.into()))
            .and_then(|r| r.finish())
    };
    let read = attempt(options.clone()).or_else(|e| {
        if e.to_string().contains("utf-8") {
            let lossy = options
                .parse_options
                .as_ref()
                .clone()
                .with_encoding(CsvEncoding::LossyUtf8);
            attempt(options.with_parse_options(lossy))
        } else {
            Err(e)
        }
    });
    read.map_err(|source| match unclosed_quote_line(path) {
        Some(line) => IoError::BadShape {
            path: path.to_path_buf(),
            problem: format!(
                "line {line}: a quoted field is never closed (the rest of the file would be one cell)"
            ),
        },
        None => IoError::Polars {
            context: ctx,
            source,
        },
    })
}

/// The line (1-based) where a `"` opens a field that is never closed.
fn unclosed_quote_line(path: &Path) -> Option<u64> {
    let bytes = std::fs::read(path).ok()?;
    let (mut line, mut open_at, mut quoted) = (1u64, 0u64, false);
    for &b in &bytes {
        match b {
            b'"' => {
                quoted = !quoted;
                if quoted {
                    open_at = line;
                }
            }
            b'\n' => line += 1,
            _ => {}
        }
    }
    quoted.then_some(open_at)
}

/// A header of one column that contains another common delimiter means the
/// file was read with the wrong one: say which to pass.
fn check_delimiter(path: &Path, names: &[String], delimiter: u8) -> Result<(), IoError> {
    if let [only] = names {
        for d in [b';', b'\t', b'|', b','] {
            if d != delimiter && only.as_bytes().contains(&d) {
                let shown = if d == b'\t' {
                    "\\t".to_string()
                } else {
                    (d as char).to_string()
                };
                return Err(IoError::BadShape {
                    path: path.to_path_buf(),
                    problem: format!(
                        "the header is one column `{}`: the file looks `{shown}`-separated; pass --delimiter '{shown}'",
                        only.chars().take(80).collect::<String>()
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Reads a file into a data frame of text columns; with `wanted`, only those
/// of its columns that exist (the others are never materialised). Asterisk
/// files are read whole: their columns are known by position.
pub fn read_frame_columns(
    path: &Path,
    format: InputFormat,
    delimiter: u8,
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
            let mut df = read_csv(path, csv_options(false, b','))?;
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
            // The header alone tells the delimiter is right and which
            // wanted columns exist.
            let header = read_csv(path, csv_options(true, delimiter).with_n_rows(Some(0)))?;
            let names: Vec<String> = header
                .get_column_names()
                .iter()
                .map(|n| n.to_string())
                .collect();
            check_delimiter(path, &names, delimiter)?;
            let columns = match wanted {
                Some(wanted) => {
                    let present: Vec<PlSmallStr> = wanted
                        .iter()
                        .filter(|w| names.iter().any(|n| n == *w))
                        .map(|w| (*w).into())
                        .collect();
                    if present.is_empty() {
                        return Err(IoError::MissingColumn {
                            column: wanted.first().copied().unwrap_or("call_id").to_string(),
                            field: "call_id",
                            columns: names.join(", "),
                        });
                    }
                    Some(present.into())
                }
                None => None,
            };
            read_csv(path, csv_options(true, delimiter).with_columns(columns))?
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

/// The input's column names to read for `opts`: every mapped field, but the
/// callee when `opts.callees` is false.
pub fn wanted_columns<'a>(map: &'a FieldMap, opts: &ReadOptions) -> Vec<&'a str> {
    FIELDS
        .iter()
        .filter(|f| opts.callees || **f != "callee")
        .map(|f| map.source(f))
        .collect()
}

/// Reads and decodes a call log.
pub fn read_call_log(path: &Path, opts: &ReadOptions) -> Result<CallLog, IoError> {
    let mut decoder = opts.decoder.clone();
    decoder.map = effective_map(opts.format, &opts.decoder.map);
    let wanted = wanted_columns(&decoder.map, opts);
    let df = read_frame_columns(path, opts.format, opts.delimiter, Some(&wanted))?;
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

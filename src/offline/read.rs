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

use crate::engine::event::{CallEvent, Decoder, FieldMap, RawValue, FIELDS, TS};
use crate::error::{EventError, IoError};
use crate::offline::columns::EventColumns;
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
    /// When known (same length as `events`): a number per event's caller,
    /// the same for all of one caller's events in the whole input and
    /// dense (0, 1, ... in order of first appearance), so per-caller
    /// tallies can live in arrays. Empty when unknown.
    pub callers: Vec<u32>,
}

impl CallLog {
    /// Sorts events stably by event time (ties keep file order): the offline
    /// processing order. `unique` is dropped (it is optional);
    /// [`crate::offline::order::OrderedLog`] yields logs already sorted,
    /// with it.
    pub fn sort_by_time(&mut self) {
        self.unique.clear();
        self.callers.clear();
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

/// The column names of an Asterisk `Master.csv` of `width` columns (the
/// known ones, then `extra_<i>`); an error for fewer than it has.
fn asterisk_names(path: &Path, width: usize) -> Result<Vec<String>, IoError> {
    if width < ASTERISK_COLUMNS.len() {
        return Err(IoError::BadShape {
            path: path.to_path_buf(),
            problem: format!(
                "{width} columns, an Asterisk Master.csv has {}",
                ASTERISK_COLUMNS.len()
            ),
        });
    }
    Ok((0..width)
        .map(|i| {
            ASTERISK_COLUMNS
                .get(i)
                .map_or_else(|| format!("extra_{i}"), |n| (*n).to_string())
        })
        .collect())
}

/// An error naming the first required field (call id, caller, time) whose
/// column is not among `names`.
fn check_required(decoder: &Decoder, names: &[String]) -> Result<(), IoError> {
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
    Ok(())
}

/// The column names of a Parquet file, from its metadata.
fn parquet_columns(path: &Path) -> Result<Vec<String>, IoError> {
    let ctx = format!("reading {}", path.display());
    let file = File::open(path).map_err(|source| IoError::Io {
        context: ctx.clone(),
        source,
    })?;
    let schema = ParquetReader::new(file).schema().map_err(polars_err(ctx))?;
    Ok(schema.iter_names().map(|n| n.to_string()).collect())
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
                // Each column once, even when two fields map to it.
                let mut present: Vec<String> = Vec::with_capacity(wanted.len());
                for w in wanted.iter().filter(|w| schema.contains(w)) {
                    if !present.iter().any(|p| p == w) {
                        present.push(w.to_string());
                    }
                }
                reader = reader.with_columns(Some(present));
            }
            let df = reader.finish().map_err(polars_err(ctx.clone()))?;
            to_text_columns(df).map_err(polars_err(ctx))?
        }
        InputFormat::Asterisk => {
            let mut df = read_csv(path, csv_options(false, b','))?;
            let names: Vec<PlSmallStr> = asterisk_names(path, df.width())?
                .into_iter()
                .map(PlSmallStr::from)
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

/// The input's column names to read for `opts`: every mapped field, but the
/// callee when `opts.callees` is false.
pub fn wanted_columns<'a>(map: &'a FieldMap, opts: &ReadOptions) -> Vec<&'a str> {
    FIELDS
        .iter()
        .filter(|f| opts.callees || **f != "callee")
        .map(|f| map.source(f))
        .collect()
}

/// Reads and decodes a call log, in file order (see [`read_events`]).
pub fn read_call_log(path: &Path, opts: &ReadOptions) -> Result<CallLog, IoError> {
    let (events, invalid) = read_events(path, opts)?;
    Ok(CallLog {
        events: (0..events.len())
            .map(|i| (events.row(i), events.event(i)))
            .collect(),
        invalid,
        ..CallLog::default()
    })
}

/// Reads and decodes a call log into compact columns, in file order, and
/// lists its invalid rows by row number.
///
/// CSV (and Asterisk) files are streamed: one thread parses records while
/// others decode them, and no text column of the whole file is ever held.
/// A row's number is its place among the data records (the header and
/// blank lines are not counted). Parquet files are read whole, then
/// decoded.
pub fn read_events(
    path: &Path,
    opts: &ReadOptions,
) -> Result<(EventColumns, Vec<InvalidRow>), IoError> {
    if !path.exists() {
        return Err(IoError::NoSuchFile(path.to_path_buf()));
    }
    let mut decoder = opts.decoder.clone();
    decoder.map = effective_map(opts.format, &opts.decoder.map);
    match resolve_format(path, opts.format) {
        InputFormat::Parquet => {
            // A missing column is named against all of the file's columns,
            // not only those the projection would read.
            check_required(&decoder, &parquet_columns(path)?)?;
            let wanted = wanted_columns(&decoder.map, opts);
            let df = read_frame_columns(path, InputFormat::Parquet, b',', Some(&wanted))?;
            let mut events = EventColumns::with_capacity(df.height());
            let mut invalid = Vec::new();
            decode_frame(
                &df,
                &decoder,
                opts.timezone,
                opts.progress,
                |row, event| match event {
                    Ok(e) => events.push(row, &e),
                    Err(error) => invalid.push(InvalidRow { row, error }),
                },
            )?;
            Ok((events, invalid))
        }
        format => read_csv_events(path, opts, &decoder, format == InputFormat::Asterisk),
    }
}

/// Records handed from the parsing thread to a decoding one at a time.
const CSV_BATCH: usize = 4_096;

/// [`read_events`] for CSV and Asterisk files.
fn read_csv_events(
    path: &Path,
    opts: &ReadOptions,
    decoder: &Decoder,
    asterisk: bool,
) -> Result<(EventColumns, Vec<InvalidRow>), IoError> {
    let ctx = || format!("reading {}", path.display());
    let io = |source| IoError::Io {
        context: ctx(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    let mut reader = csv::ReaderBuilder::new()
        .delimiter(opts.delimiter)
        .has_headers(false)
        .flexible(true)
        .buffer_capacity(1 << 20)
        .from_reader(file);
    let csv_err = |e: csv::Error| IoError::BadShape {
        path: path.to_path_buf(),
        problem: e.to_string(),
    };
    let mut first = csv::ByteRecord::new();
    if !reader.read_byte_record(&mut first).map_err(csv_err)? {
        return Err(IoError::BadShape {
            path: path.to_path_buf(),
            problem: "no data: empty CSV".into(),
        });
    }
    let names: Vec<String> = if asterisk {
        asterisk_names(path, first.len())?
    } else {
        let names: Vec<String> = first
            .iter()
            .map(|n| String::from_utf8_lossy(n).into_owned())
            .collect();
        check_delimiter(path, &names, opts.delimiter)?;
        names
    };
    check_required(decoder, &names)?;
    let wanted = wanted_columns(&decoder.map, opts);
    let mut fields = [None; FIELDS.len()];
    for (slot, f) in fields.iter_mut().zip(FIELDS) {
        let src = decoder.map.source(f);
        if wanted.contains(&src) {
            *slot = names.iter().position(|n| n == src);
        }
    }
    let bar = progress_bar(size, opts.progress, "reading");
    let mut events = EventColumns::with_capacity((size / 64) as usize);
    let mut invalid = Vec::new();
    let mut last_multiline = false;
    // One thread parses records, the others decode batches of them; the
    // batches are put back in file order here.
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
    let (full_tx, full_rx) =
        std::sync::mpsc::sync_channel::<(usize, Vec<csv::ByteRecord>)>(2 * workers);
    let full_rx = std::sync::Mutex::new(full_rx);
    let (done_tx, done_rx) = std::sync::mpsc::channel::<DecodedBatch>();
    let (empty_tx, empty_rx) = std::sync::mpsc::channel::<Vec<csv::ByteRecord>>();
    let parsed = std::thread::scope(|s| {
        let parser = s.spawn(move || -> Result<(), csv::Error> {
            // Batches come back to be refilled: records are allocated once.
            let (mut batch, mut filled) = if asterisk {
                (vec![first], 1)
            } else {
                (Vec::new(), 0)
            };
            for seq in 0.. {
                if batch.len() < CSV_BATCH {
                    batch.resize_with(CSV_BATCH, csv::ByteRecord::new);
                }
                while filled < CSV_BATCH && reader.read_byte_record(&mut batch[filled])? {
                    filled += 1;
                }
                let done = filled < CSV_BATCH;
                batch.truncate(filled);
                if filled > 0 && full_tx.send((seq, batch)).is_err() {
                    break;
                }
                if done {
                    break;
                }
                batch = empty_rx.try_recv().unwrap_or_default();
                filled = 0;
            }
            Ok(())
        });
        for _ in 0..workers {
            let (full_rx, done_tx) = (&full_rx, done_tx.clone());
            let fields = &fields;
            s.spawn(move || {
                let mut row = RowDecoder::new(decoder, opts.timezone);
                loop {
                    let next = match full_rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    let Ok((seq, batch)) = next else { return };
                    let decoded = row.decode_records(seq, batch, fields);
                    if done_tx.send(decoded).is_err() {
                        return;
                    }
                }
            });
        }
        drop(done_tx);
        let mut waiting = std::collections::BTreeMap::new();
        let mut next = 0;
        for decoded in done_rx {
            waiting.insert(decoded.seq, decoded);
            while let Some(d) = waiting.remove(&next) {
                events.append(d.events);
                invalid.extend(d.invalid);
                if let Some(last) = d.records.last() {
                    last_multiline = last.iter().any(|f| f.contains(&b'\n'));
                    bar.set_position(last.position().map_or(0, |p| p.byte()));
                }
                // The parser may have finished (or failed) already.
                let _ = empty_tx.send(d.records);
                next += 1;
            }
        }
        parser
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    });
    bar.finish_and_clear();
    parsed.map_err(csv_err)?;
    // A quote that is never closed runs to the end of the file: the last
    // record then spans lines. Say where it opened rather than read the
    // rest of the file as one cell.
    if last_multiline {
        if let Some(line) = unclosed_quote_line(path) {
            return Err(IoError::BadShape {
                path: path.to_path_buf(),
                problem: format!(
                    "line {line}: a quoted field is never closed (the rest of the file would be one cell)"
                ),
            });
        }
    }
    Ok((events, invalid))
}

/// A batch of CSV records, decoded.
struct DecodedBatch {
    /// The batch's place in the file.
    seq: usize,
    events: EventColumns,
    invalid: Vec<InvalidRow>,
    /// The records, to be refilled.
    records: Vec<csv::ByteRecord>,
}

/// Decodes rows given as their text per field of [`FIELDS`].
struct RowDecoder<'d> {
    decoder: &'d Decoder,
    tz: Option<Tz>,
    ts_buf: String,
}

impl<'d> RowDecoder<'d> {
    fn new(decoder: &'d Decoder, tz: Option<Tz>) -> Self {
        RowDecoder {
            decoder,
            tz,
            ts_buf: String::new(),
        }
    }

    /// Decodes batch `seq` of CSV records (every batch but the last holds
    /// [`CSV_BATCH`]); `fields[i]` is the column of field `FIELDS[i]`, if
    /// read. A row's number is its record's place among the data records
    /// (the header and blank lines are not counted).
    fn decode_records(
        &mut self,
        seq: usize,
        records: Vec<csv::ByteRecord>,
        fields: &[Option<usize>; FIELDS.len()],
    ) -> DecodedBatch {
        let mut events = EventColumns::with_capacity(records.len());
        let mut invalid = Vec::new();
        let mut lossy: [String; FIELDS.len()] = Default::default();
        let first_row = (seq * CSV_BATCH) as u64 + 1;
        for (record, n) in records.iter().zip(first_row..) {
            // The record's text is checked once, whole (a few fields of a
            // few bytes each cost more checked one by one); a field is its
            // slice of it unless a multi-byte character straddles its edge.
            let whole = std::str::from_utf8(record.as_slice()).ok();
            // Invalid UTF-8 is replaced (the row then fails decoding and
            // is listed, not the file).
            let mut values: [Option<&str>; FIELDS.len()] = [None; FIELDS.len()];
            let mut bad = [false; FIELDS.len()];
            for (f, col) in fields.iter().enumerate() {
                let Some(range) = col.and_then(|c| record.range(c)).filter(|r| !r.is_empty())
                else {
                    continue;
                };
                let text = whole.and_then(|w| w.get(range.clone())).map_or_else(
                    || std::str::from_utf8(&record.as_slice()[range.clone()]),
                    Ok,
                );
                match text {
                    Ok(s) => values[f] = Some(s),
                    Err(_) => {
                        lossy[f] = String::from_utf8_lossy(&record.as_slice()[range]).into_owned();
                        bad[f] = true;
                    }
                }
            }
            for (f, l) in lossy.iter().enumerate().filter(|(f, _)| bad[*f]) {
                values[f] = Some(l.as_str());
            }
            match self.decode(&values) {
                Ok(e) => events.push(n, &e),
                Err(error) => invalid.push(InvalidRow { row: n, error }),
            }
        }
        DecodedBatch {
            seq,
            events,
            invalid,
            records,
        }
    }

    /// One row: `values[i]` is field `FIELDS[i]`'s text, if present.
    fn decode(&mut self, values: &[Option<&str>]) -> Result<CallEvent, EventError> {
        use std::fmt::Write;
        // Naive local times (Asterisk's `YYYY-MM-DD HH:MM:SS`) become epoch milliseconds first.
        self.ts_buf.clear();
        if let Some(ms) = values[TS].and_then(|raw| naive_to_ms(raw, self.tz)) {
            let _ = write!(self.ts_buf, "{ms}");
        }
        let ts_value = if self.ts_buf.is_empty() {
            values[TS]
        } else {
            Some(self.ts_buf.as_str())
        };
        self.decoder.decode_indexed(|i| {
            let value = if i == TS {
                ts_value
            } else {
                values.get(i).copied().flatten()
            };
            value.map_or(RawValue::Null, RawValue::Str)
        })
    }
}

/// Decodes a frame of text columns, handing each row's number (from 1)
/// and event or error to `sink`, in order.
pub fn decode_frame(
    df: &DataFrame,
    decoder: &Decoder,
    tz: Option<Tz>,
    progress: bool,
    mut sink: impl FnMut(u64, Result<CallEvent, EventError>),
) -> Result<(), IoError> {
    let names: Vec<String> = df
        .get_column_names()
        .iter()
        .map(|s| s.to_string())
        .collect();
    check_required(decoder, &names)?;
    let mut columns: Vec<Option<StringChunked>> = Vec::new();
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
        columns.push(col);
    }
    let n = df.height();
    let bar = progress_bar(n as u64, progress, "decoding");
    let mut iters: Vec<Option<Box<dyn Iterator<Item = Option<&str>> + '_>>> = columns
        .iter()
        .map(|c| {
            c.as_ref()
                .map(|c| Box::new(c.iter()) as Box<dyn Iterator<Item = Option<&str>>>)
        })
        .collect();
    let mut decode = RowDecoder::new(decoder, tz);
    let mut values: Vec<Option<&str>> = vec![None; FIELDS.len()];
    for row in 1..=n as u64 {
        for (slot, it) in values.iter_mut().zip(iters.iter_mut()) {
            *slot = it.as_mut().and_then(|i| i.next()).flatten();
        }
        sink(row, decode.decode(&values));
        if row.is_multiple_of(65_536) {
            bar.set_position(row);
        }
    }
    bar.finish_and_clear();
    Ok(())
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

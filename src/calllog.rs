//! Call logs on disk: reading CSV, Parquet and Asterisk CDR files into
//! [`CallEvent`]s, and writing tables as CSV or Parquet.
//!
//! Every row becomes either an event or an [`InvalidRow`]: nothing is
//! dropped silently. CSV cells are read as text (no type inference, so a
//! `+34...` or `0034...` number keeps its digits) and decoded by the same
//! [`Decoder`] as Kafka payloads.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::{NaiveDateTime, TimeZone};
use chrono_tz::Tz;
use indicatif::{ProgressBar, ProgressStyle};
use polars::prelude::*;

use crate::error::{EventError, IoError};
use crate::event::{CallEvent, Decoder, FieldMap, RawValue, FIELDS};

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
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
    pub once: Vec<bool>,
}

impl CallLog {
    /// Sorts events stably by event time (ties keep file order): the offline
    /// processing order. The `once` hints are dropped (they are optional);
    /// [`OrderedLog`] yields logs already sorted, with hints.
    pub fn sort_by_time(&mut self) {
        self.once.clear();
        self.events.sort_by_key(|(_, e)| e.ts_ms);
    }
}

fn polars_err(context: impl Into<String>) -> impl FnOnce(PolarsError) -> IoError {
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
        return Err(IoError::Input(format!("{}: no such file", path.display())));
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
                return Err(IoError::Input(format!(
                    "{}: {width} columns, an Asterisk Master.csv has {}",
                    path.display(),
                    ASTERISK_COLUMNS.len()
                )));
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
            return Err(IoError::Input(format!(
                "column `{src}` (for `{required}`) not found; columns are: {} (map with --map {required}=COLUMN)",
                names.join(", ")
            )));
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

/// Rows decoded per chunk of an [`OrderedLog`].
pub const CHUNK_ROWS: usize = 65_536;

/// A call log in its processing order, decoded a chunk at a time.
///
/// Only the mapped columns are read, as Arrow text columns; the event times
/// are parsed once to sort the row indices stably (ties keep file order, as
/// [`CallLog::sort_by_time`]). Events exist only for the chunk being
/// processed, so a log of millions of rows never becomes millions of
/// objects.
pub struct OrderedLog {
    frame: DataFrame,
    order: Vec<IdxSize>,
    /// Per file row: its call id occurs on no other row.
    once: Vec<bool>,
    /// The text of times that do not parse, by file row (their column holds
    /// null), to report them as they were.
    bad_ts: foldhash::HashMap<IdxSize, String>,
    decoder: Decoder,
    tz: Option<Tz>,
}

impl OrderedLog {
    /// Reads `path` and computes the processing order.
    pub fn open(path: &Path, opts: &ReadOptions) -> Result<Self, IoError> {
        let mut decoder = opts.decoder.clone();
        decoder.map = effective_map(opts.format, &opts.decoder.map);
        let wanted: Vec<&str> = FIELDS.iter().map(|f| decoder.map.source(f)).collect();
        let mut frame = read_frame_columns(path, opts.format, Some(&wanted))?;
        if frame.height() > IdxSize::MAX as usize {
            return Err(IoError::Input(format!(
                "{}: {} rows, more than this build's {} row limit",
                path.display(),
                frame.height(),
                IdxSize::MAX
            )));
        }
        // Checks the columns now, before any work.
        decode_frame(&frame.head(Some(0)), &decoder, opts.timezone, false)?;
        let ts_src = decoder.map.source("ts");
        let mut ts: Vec<Option<i64>> = Vec::with_capacity(frame.height());
        let mut bad_ts = foldhash::HashMap::default();
        {
            let ts_col = frame
                .column(ts_src)
                .and_then(|c| c.cast(&DataType::String))
                .map_err(polars_err(format!("reading column `{ts_src}`")))?;
            let ts_text = ts_col
                .str()
                .map_err(polars_err(format!("reading column `{ts_src}`")))?;
            for (i, raw) in ts_text.iter().enumerate() {
                let parsed = raw.and_then(|r| row_ts(r, opts.timezone));
                if let (Some(r), None) = (raw, parsed) {
                    bad_ts.insert(i as IdxSize, r.to_string());
                }
                ts.push(parsed);
            }
        }
        // Rows whose time does not parse are invalid; they go last.
        let mut order: Vec<IdxSize> = (0..frame.height() as IdxSize).collect();
        order.sort_by_key(|&i| ts[i as usize].unwrap_or(i64::MAX));
        // The parsed milliseconds replace the text (8 bytes a row instead of
        // about 40); they decode to the same times.
        frame
            .with_column(Column::new(ts_src.into(), ts))
            .map_err(polars_err(format!("replacing column `{ts_src}`")))?;
        let once = unique_ids(&frame, decoder.map.source("call_id"))?;
        Ok(OrderedLog {
            frame,
            order,
            once,
            bad_ts,
            decoder,
            tz: opts.timezone,
        })
    }

    /// Rows in the file (valid or not).
    pub fn rows(&self) -> usize {
        self.order.len()
    }

    /// The log in processing order, `size` rows at a time. Row numbers are
    /// the file's (1-based); invalid rows come with the chunk they sort into.
    pub fn chunks(&self, size: usize) -> impl Iterator<Item = Result<CallLog, IoError>> + '_ {
        self.order.chunks(size.max(1)).map(move |idx| {
            let take = IdxCa::from_vec("row".into(), idx.to_vec());
            let sub = self
                .frame
                .take(&take)
                .map_err(polars_err("gathering a chunk of rows"))?;
            let mut log = decode_frame(&sub, &self.decoder, self.tz, false)?;
            let file_row = |r: u64| u64::from(idx[(r - 1) as usize]) + 1;
            for (row, _) in &mut log.events {
                *row = file_row(*row);
            }
            for bad in &mut log.invalid {
                bad.row = file_row(bad.row);
                let raw = self.bad_ts.get(&((bad.row - 1) as IdxSize));
                if let (EventError::Missing("ts"), Some(raw)) = (&bad.error, raw) {
                    if let Err(e) = crate::event::parse_ts(RawValue::Str(raw)) {
                        bad.error = e;
                    }
                }
            }
            log.once = log
                .events
                .iter()
                .map(|(row, _)| self.once[(*row - 1) as usize])
                .collect();
            Ok(log)
        })
    }

    /// Decodes the chunks on a thread of its own, handing each to `send` in
    /// order, so decoding overlaps the window work; stops when `send`
    /// returns false (the consumer is gone). Bound the channel behind `send`
    /// to bound the chunks in memory.
    pub fn decode_ahead(
        self: Arc<Self>,
        size: usize,
        mut send: impl FnMut(Result<CallLog, IoError>) -> bool + Send + 'static,
    ) {
        std::thread::spawn(move || {
            for chunk in self.chunks(size) {
                if !send(chunk) {
                    break;
                }
            }
        });
    }

    /// The whole log, decoded and in processing order (for small logs).
    pub fn read_all(&self) -> Result<CallLog, IoError> {
        let mut all = CallLog::default();
        for chunk in self.chunks(CHUNK_ROWS) {
            let chunk = chunk?;
            all.events.extend(chunk.events);
            all.invalid.extend(chunk.invalid);
            all.once.extend(chunk.once);
        }
        all.invalid.sort_by_key(|r| r.row);
        Ok(all)
    }
}

/// Per row: whether its call id (as the decoder trims it) occurs on no
/// other row. Compares 64-bit hashes, so a collision can only make an id
/// look repeated, which is safe: it keeps its idempotency record.
fn unique_ids(frame: &DataFrame, src: &str) -> Result<Vec<bool>, IoError> {
    use std::hash::BuildHasher;
    let ctx = || format!("reading column `{src}`");
    let col = frame
        .column(src)
        .and_then(|c| c.cast(&DataType::String))
        .map_err(polars_err(ctx()))?;
    let ids = col.str().map_err(polars_err(ctx()))?;
    let state = foldhash::fast::RandomState::default();
    let hashes: Vec<u64> = ids
        .iter()
        .map(|v| v.map_or(0, |s| state.hash_one(s.trim())))
        .collect();
    let mut sorted = hashes.clone();
    sorted.sort_unstable();
    let repeated: foldhash::HashSet<u64> = sorted
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| w[0])
        .collect();
    Ok(hashes.iter().map(|h| !repeated.contains(h)).collect())
}

/// A row's event time as the decoder reads it (naive local times first).
fn row_ts(raw: &str, tz: Option<Tz>) -> Option<i64> {
    naive_to_ms(raw, tz).or_else(|| crate::event::parse_ts(RawValue::Str(raw)).ok())
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

/// A progress bar on stderr, drawn only on a terminal and only if wanted.
pub fn progress_bar(len: u64, wanted: bool, what: &str) -> ProgressBar {
    if !wanted {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    let style = ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} ({per_sec}, {eta})")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what.to_string());
    bar
}

/// Output formats of tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFormat {
    /// CSV with a header.
    Csv,
    /// Parquet (zstd).
    Parquet,
}

impl TableFormat {
    /// By extension: `.parquet` is Parquet, anything else CSV.
    pub fn from_path(path: &Path) -> Self {
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
        {
            TableFormat::Parquet
        } else {
            TableFormat::Csv
        }
    }
}

/// Writes a frame as CSV or Parquet, chosen by the file extension.
pub fn write_frame(path: &Path, df: &mut DataFrame) -> Result<(), IoError> {
    let ctx = format!("writing {}", path.display());
    let file = File::create(path).map_err(|source| IoError::Io {
        context: ctx.clone(),
        source,
    })?;
    match TableFormat::from_path(path) {
        TableFormat::Csv => CsvWriter::new(file)
            .include_header(true)
            .finish(df)
            .map_err(polars_err(ctx))?,
        TableFormat::Parquet => {
            ParquetWriter::new(file)
                .with_compression(ParquetCompression::Zstd(None))
                .finish(df)
                .map_err(polars_err(ctx))?;
        }
    }
    Ok(())
}

/// Writes a table a batch at a time, as CSV or Parquet by the file extension
/// (a Parquet row group per batch), so a large output is never one frame.
pub struct TableWriter {
    inner: TableSink,
    context: String,
    rows: u64,
}

enum TableSink {
    Csv(polars::io::csv::write::BatchedWriter<File>),
    Parquet(Box<polars::io::parquet::write::BatchedWriter<File>>),
}

impl TableWriter {
    /// Creates `path` for tables of `schema`.
    pub fn create(path: &Path, schema: &Schema) -> Result<Self, IoError> {
        let context = format!("writing {}", path.display());
        let file = File::create(path).map_err(|source| IoError::Io {
            context: context.clone(),
            source,
        })?;
        let inner = match TableFormat::from_path(path) {
            TableFormat::Csv => TableSink::Csv(
                CsvWriter::new(file)
                    .include_header(true)
                    .batched(schema)
                    .map_err(polars_err(context.clone()))?,
            ),
            TableFormat::Parquet => TableSink::Parquet(Box::new(
                ParquetWriter::new(file)
                    .with_compression(ParquetCompression::Zstd(None))
                    .batched(schema)
                    .map_err(polars_err(context.clone()))?,
            )),
        };
        Ok(TableWriter {
            inner,
            context,
            rows: 0,
        })
    }

    /// Appends a batch (same schema as at creation).
    pub fn write(&mut self, df: &mut DataFrame) -> Result<(), IoError> {
        if df.height() == 0 {
            return Ok(());
        }
        df.align_chunks();
        match &mut self.inner {
            TableSink::Csv(w) => w.write_batch(df),
            TableSink::Parquet(w) => w.write_batch(df),
        }
        .map_err(polars_err(self.context.clone()))?;
        self.rows += df.height() as u64;
        Ok(())
    }

    /// Completes the file (header or footer); returns the rows written.
    pub fn finish(mut self) -> Result<u64, IoError> {
        match &mut self.inner {
            TableSink::Csv(w) => w.finish(),
            TableSink::Parquet(w) => w.finish().map(|_| ()),
        }
        .map_err(polars_err(self.context.clone()))?;
        Ok(self.rows)
    }
}

/// A [`TableWriter`] on a thread of its own: each item is turned into a
/// batch (`build`) and written there while the sender goes on, at most two
/// items behind.
pub struct BackgroundWriter<T> {
    tx: Option<std::sync::mpsc::SyncSender<T>>,
    handle: Option<std::thread::JoinHandle<Result<u64, IoError>>>,
}

impl<T: Send + 'static> BackgroundWriter<T> {
    /// Creates `path` for tables of `schema` and starts the writer thread.
    pub fn spawn(
        path: &Path,
        schema: &Schema,
        mut build: impl FnMut(T) -> Result<DataFrame, IoError> + Send + 'static,
    ) -> Result<Self, IoError> {
        let mut out = TableWriter::create(path, schema)?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<T>(2);
        let handle = std::thread::spawn(move || {
            for item in rx {
                out.write(&mut build(item)?)?;
            }
            out.finish()
        });
        Ok(BackgroundWriter {
            tx: Some(tx),
            handle: Some(handle),
        })
    }

    /// Hands over the next item; if the writer has failed, its error.
    pub fn send(&mut self, item: T) -> Result<(), IoError> {
        let sent = self.tx.as_ref().is_some_and(|tx| tx.send(item).is_ok());
        if sent {
            return Ok(());
        }
        self.tx = None;
        match self.join() {
            Err(e) => Err(e),
            Ok(_) => Err(IoError::Input("the table writer stopped".into())),
        }
    }

    /// Waits for every batch to be written; returns the rows written.
    pub fn finish(mut self) -> Result<u64, IoError> {
        self.tx = None;
        self.join()
    }

    fn join(&mut self) -> Result<u64, IoError> {
        match self.handle.take().map(|h| h.join()) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(IoError::Input("the table writer panicked".into())),
            None => Err(IoError::Input("the table writer stopped".into())),
        }
    }
}

/// Writes invalid rows (`row`, `error_kind`, `error`) next to an output file
/// (`decisions.csv` → `decisions.invalid.csv`); returns the path, if any were written.
pub fn write_invalid(output: &Path, invalid: &[InvalidRow]) -> Result<Option<PathBuf>, IoError> {
    if invalid.is_empty() {
        return Ok(None);
    }
    let stem = output
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    let path = output.with_file_name(format!("{stem}.invalid.csv"));
    let mut df = DataFrame::new(
        invalid.len(),
        vec![
            Column::new(
                "row".into(),
                invalid.iter().map(|r| r.row).collect::<Vec<u64>>(),
            ),
            Column::new(
                "error_kind".into(),
                invalid
                    .iter()
                    .map(|r| r.error.kind())
                    .collect::<Vec<&str>>(),
            ),
            Column::new(
                "error".into(),
                invalid
                    .iter()
                    .map(|r| r.error.to_string())
                    .collect::<Vec<String>>(),
            ),
        ],
    )
    .map_err(polars_err("building the invalid-rows table"))?;
    let ctx = format!("writing {}", path.display());
    let file = File::create(&path).map_err(|source| IoError::Io {
        context: ctx.clone(),
        source,
    })?;
    CsvWriter::new(file)
        .include_header(true)
        .finish(&mut df)
        .map_err(polars_err(ctx))?;
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(n: i64) -> DataFrame {
        DataFrame::new(1, vec![Column::new("n".into(), vec![n])]).unwrap()
    }

    #[test]
    fn background_writer_writes_in_order_and_reports_failures() {
        let dir = tempfile::tempdir().unwrap();
        let schema = batch(0).schema().as_ref().clone();
        let path = dir.path().join("ok.csv");
        let mut w = BackgroundWriter::spawn(&path, &schema, |n: i64| Ok(batch(n))).unwrap();
        for n in 0..100 {
            w.send(n).unwrap();
        }
        assert_eq!(w.finish().unwrap(), 100);
        let text = std::fs::read_to_string(&path).unwrap();
        let expected: String = std::iter::once("n".to_string())
            .chain((0..100).map(|n| n.to_string()))
            .map(|l| l + "\n")
            .collect();
        assert_eq!(text, expected);

        // A batch that cannot be built stops the writer; the sender learns why.
        let path = dir.path().join("bad.csv");
        let mut w = BackgroundWriter::spawn(&path, &schema, |n: i64| {
            if n == 3 {
                Err(IoError::Input("batch 3 is bad".into()))
            } else {
                Ok(batch(n))
            }
        })
        .unwrap();
        let mut first_error = None;
        for n in 0..50 {
            if let Err(e) = w.send(n) {
                first_error = Some(e.to_string());
                break;
            }
        }
        let reported = match first_error {
            Some(e) => e,
            None => w.finish().unwrap_err().to_string(),
        };
        assert_eq!(reported, "batch 3 is bad");
    }
}

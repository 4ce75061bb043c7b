//! Reading call logs: CSV, Parquet and switches' CDR files (the presets
//! of [`crate::offline::cdr`]) into [`CallEvent`]s.
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
use crate::offline::cdr::{self, detect, Layout, Preset};
use crate::offline::columns::EventColumns;
use crate::progress::progress_bar;

pub use crate::offline::cdr::InputFormat;

/// How to read a call log.
#[derive(Debug, Clone)]
pub struct ReadOptions {
    /// File layout.
    pub format: InputFormat,
    /// Field mapping and number normalisation.
    pub decoder: Decoder,
    /// Time zone of naive `YYYY-MM-DD HH:MM:SS` times (switches' CDRs); UTC if unset.
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
/// of its columns that exist (the others are never materialised). A
/// switch's CDR file (an explicit preset; `Auto` is plain CSV here) is read
/// whole, its columns named by its header or by position.
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
        InputFormat::Asterisk | InputFormat::FreeSwitch | InputFormat::KamailioAcc => {
            let preset = format
                .preset()
                .ok_or_else(|| bad_shape(path, "no preset"))?;
            read_preset_frame(path, preset, delimiter)?
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

/// `Auto` on a `.parquet` file is Parquet; anything else as given (an
/// `Auto` CSV is told by its first line, [`detect`]).
fn resolve_format(path: &Path, format: InputFormat) -> InputFormat {
    match format {
        InputFormat::Auto
            if path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("parquet")) =>
        {
            InputFormat::Parquet
        }
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

/// The field mapping implied by a format (a preset's columns), merged with
/// the user's `--map` entries, which win.
pub fn effective_map(format: InputFormat, user: &FieldMap) -> FieldMap {
    let Some(preset) = format.preset() else {
        return user.clone();
    };
    let mut entries = vec![preset.map_entries()];
    for f in FIELDS {
        let s = user.source(f);
        if s != f {
            entries.push(format!("{f}={s}"));
        }
    }
    FieldMap::parse(&entries).unwrap_or_else(|_| user.clone())
}

fn bad_shape(path: &Path, problem: impl Into<String>) -> IoError {
    IoError::BadShape {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// The column names of a preset's file whose first record is `first`:
/// its header (lower-cased), or the preset's columns by position.
fn preset_names(
    path: &Path,
    preset: &Preset,
    layout: Layout,
    first: &[String],
) -> Result<Vec<String>, IoError> {
    if layout.header {
        return Ok(first
            .iter()
            .map(|c| c.trim().to_ascii_lowercase())
            .collect());
    }
    preset.names(first.len()).ok_or_else(|| {
        bad_shape(
            path,
            format!(
                "{} columns, {} has at least {}",
                first.len(),
                preset.label,
                preset.min_width
            ),
        )
    })
}

/// A preset's file as a frame of text columns (the polars reader).
fn read_preset_frame(path: &Path, preset: &Preset, delimiter: u8) -> Result<DataFrame, IoError> {
    let ctx = format!("reading {}", path.display());
    let mut df = read_csv(path, csv_options(false, delimiter))?;
    let first: Vec<String> = match df.get_row(0) {
        Ok(row) => row
            .0
            .iter()
            .map(|v| v.get_str().unwrap_or_default().to_string())
            .collect(),
        Err(_) => return Err(bad_shape(path, "no data: empty CSV")),
    };
    let cells: Vec<&str> = first.iter().map(String::as_str).collect();
    let layout = detect(preset.format, &cells, &[]);
    let names: Vec<PlSmallStr> = preset_names(path, preset, layout, &first)?
        .into_iter()
        .map(PlSmallStr::from)
        .collect();
    df.set_column_names(&names).map_err(polars_err(ctx))?;
    if layout.header {
        df = df.slice(1, df.height().saturating_sub(1));
    }
    Ok(df)
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
    match resolve_format(path, opts.format) {
        InputFormat::Parquet => {
            let mut decoder = opts.decoder.clone();
            decoder.map = effective_map(InputFormat::Parquet, &opts.decoder.map);
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
                InputFormat::Parquet,
                opts.timezone,
                opts.progress,
                |row, event| match event {
                    Ok(e) => events.push(row, &e),
                    Err(error) => invalid.push(InvalidRow { row, error }),
                },
            )?;
            Ok((events, invalid))
        }
        format => read_csv_events(path, opts, format),
    }
}

/// Records handed from the parsing thread to a decoding one at a time.
const CSV_BATCH: usize = 4_096;

/// What a CSV-like file's first record tells: how to decode its rows.
struct Header {
    /// The decoder with the format's field mapping.
    decoder: Decoder,
    /// The switch's preset, if the file is a CDR file.
    preset: Option<&'static Preset>,
    /// `fields[i]` is the column of field `FIELDS[i]`, if read.
    fields: [Option<usize>; FIELDS.len()],
    /// The column telling call attempts from other rows (Kamailio's method).
    attempt: Option<usize>,
    /// The first record is a data row, not a header.
    first_is_data: bool,
}

/// Tells a CSV-like file's layout from its first record `first` (as text)
/// and checks that the required columns are there.
fn resolve_header(
    path: &Path,
    opts: &ReadOptions,
    format: InputFormat,
    first: &[String],
) -> Result<Header, IoError> {
    let cells: Vec<&str> = first.iter().map(String::as_str).collect();
    let user = &opts.decoder.map;
    let mapped = [
        user.source("call_id"),
        user.source("caller"),
        user.source("ts"),
    ];
    let layout = detect(format, &cells, &mapped);
    let mut decoder = opts.decoder.clone();
    decoder.map = effective_map(layout.format, user);
    let preset = layout.format.preset();
    let names = match preset {
        Some(p) => preset_names(path, p, layout, first)?,
        None => {
            check_delimiter(path, first, opts.delimiter)?;
            first.to_vec()
        }
    };
    check_required(&decoder, &names)?;
    let wanted = wanted_columns(&decoder.map, opts);
    let mut fields = [None; FIELDS.len()];
    for (slot, f) in fields.iter_mut().zip(FIELDS) {
        let src = decoder.map.source(f);
        if wanted.contains(&src) {
            *slot = names.iter().position(|n| n == src);
        }
    }
    let attempt = preset
        .and_then(|p| p.attempt)
        .and_then(|(col, _)| names.iter().position(|n| n == col));
    Ok(Header {
        decoder,
        preset,
        fields,
        attempt,
        first_is_data: !layout.header,
    })
}

/// [`read_events`] for CSV files and switches' CDR files.
fn read_csv_events(
    path: &Path,
    opts: &ReadOptions,
    format: InputFormat,
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
    let csv_err = |e: csv::Error| bad_shape(path, e.to_string());
    let mut first = csv::ByteRecord::new();
    if !reader.read_byte_record(&mut first).map_err(csv_err)? {
        return Err(bad_shape(path, "no data: empty CSV"));
    }
    let first_text: Vec<String> = first
        .iter()
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect();
    let header = resolve_header(path, opts, format, &first_text)?;
    let (decoder, fields) = (&header.decoder, header.fields);
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
            let (mut batch, mut filled) = if header.first_is_data {
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
                let mut row = RowDecoder::new(decoder, header.preset, opts.timezone);
                row.attempt_column = header.attempt;
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
    /// The switch's preset: units of times and durations, call attempts.
    preset: Option<&'static Preset>,
    tz: Option<Tz>,
    /// The record's column telling call attempts (see [`Preset::attempt`]).
    attempt_column: Option<usize>,
    ts_buf: String,
    duration_buf: String,
}

impl<'d> RowDecoder<'d> {
    fn new(decoder: &'d Decoder, preset: Option<&'static Preset>, tz: Option<Tz>) -> Self {
        RowDecoder {
            decoder,
            preset,
            tz,
            attempt_column: None,
            ts_buf: String::new(),
            duration_buf: String::new(),
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
            let attempt = self
                .attempt_column
                .and_then(|c| record.get(c))
                .map(|m| std::str::from_utf8(m).unwrap_or("?"));
            match self.decode(&values, attempt) {
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

    /// One row: `values[i]` is field `FIELDS[i]`'s text, if present;
    /// `attempt` the preset's attempt column's text, if it has one.
    fn decode(
        &mut self,
        values: &[Option<&str>],
        attempt: Option<&str>,
    ) -> Result<CallEvent, EventError> {
        use std::fmt::Write;
        if let (Some((column, wanted)), Some(found)) =
            (self.preset.and_then(|p| p.attempt), attempt)
        {
            if !found.trim().eq_ignore_ascii_case(wanted) {
                return Err(EventError::NotACallAttempt {
                    column,
                    value: found.trim().chars().take(32).collect(),
                    wanted,
                });
            }
        }
        // Naive local times (`YYYY-MM-DD HH:MM:SS`) and a switch's epoch
        // seconds become epoch milliseconds first.
        self.ts_buf.clear();
        let ts_seconds = self.preset.is_some_and(|p| p.ts_seconds);
        if let Some(ms) = values[TS].and_then(|raw| {
            naive_to_ms(raw, self.tz)
                .or_else(|| ts_seconds.then(|| cdr::seconds_to_ms(raw)).flatten())
        }) {
            let _ = write!(self.ts_buf, "{ms}");
        }
        let ts_value = if self.ts_buf.is_empty() {
            values[TS]
        } else {
            Some(self.ts_buf.as_str())
        };
        // A switch's whole seconds become milliseconds (anything else is
        // left for the decoder to report).
        self.duration_buf.clear();
        if self.preset.is_some_and(|p| p.duration_seconds) {
            if let Some(ms) = values[DURATION].and_then(cdr::seconds_to_ms) {
                let _ = write!(self.duration_buf, "{ms}");
            }
        }
        let duration_value = if self.duration_buf.is_empty() {
            values[DURATION]
        } else {
            Some(self.duration_buf.as_str())
        };
        self.decoder.decode_indexed(|i| {
            let value = match i {
                TS => ts_value,
                DURATION => duration_value,
                _ => values.get(i).copied().flatten(),
            };
            value.map_or(RawValue::Null, RawValue::Str)
        })
    }
}

/// The place of `duration_ms` in [`FIELDS`].
const DURATION: usize = 4;

/// Decodes a frame of text columns, handing each row's number (from 1)
/// and event or error to `sink`, in order.
pub fn decode_frame(
    df: &DataFrame,
    decoder: &Decoder,
    format: InputFormat,
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
    let text_column = |src: &str| -> Result<Option<StringChunked>, IoError> {
        match df.column(src) {
            Ok(c) => Ok(Some(
                c.cast(&DataType::String)
                    .and_then(|c| Ok(c.str()?.clone()))
                    .map_err(polars_err(format!("reading column `{src}`")))?,
            )),
            Err(_) => Ok(None),
        }
    };
    let mut columns: Vec<Option<StringChunked>> = Vec::new();
    for f in FIELDS {
        columns.push(text_column(decoder.map.source(f))?);
    }
    let preset = format.preset();
    let attempt = match preset.and_then(|p| p.attempt) {
        Some((col, _)) => text_column(col)?,
        None => None,
    };
    let n = df.height();
    let bar = progress_bar(n as u64, progress, "decoding");
    let mut iters: Vec<Option<Box<dyn Iterator<Item = Option<&str>> + '_>>> = columns
        .iter()
        .chain(std::iter::once(&attempt))
        .map(|c| {
            c.as_ref()
                .map(|c| Box::new(c.iter()) as Box<dyn Iterator<Item = Option<&str>>>)
        })
        .collect();
    let mut decode = RowDecoder::new(decoder, preset, tz);
    let mut values: Vec<Option<&str>> = vec![None; FIELDS.len() + 1];
    for row in 1..=n as u64 {
        for (slot, it) in values.iter_mut().zip(iters.iter_mut()) {
            *slot = it.as_mut().and_then(|i| i.next()).flatten();
        }
        let attempt = values[FIELDS.len()];
        sink(row, decode.decode(&values[..FIELDS.len()], attempt));
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

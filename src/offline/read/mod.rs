//! Reading call logs: CSV, Parquet and switches' CDR files (the presets
//! of [`crate::offline::cdr`]) into [`CallEvent`]s.
//!
//! Every row becomes either an event or an [`InvalidRow`]: nothing is
//! dropped silently. CSV cells are read as text (no type inference, so a
//! `+34...` or `0034...` number keeps its digits) and decoded by the same
//! [`Decoder`] as Kafka payloads.

use std::fs::File;
use std::path::Path;

use chrono_tz::Tz;
use polars::prelude::*;

use crate::engine::event::{CallEvent, Decoder, FieldMap, FIELDS};
use crate::error::{EventError, IoError};
use crate::offline::cdr::{Layout, Preset};
use crate::offline::columns::EventColumns;
use crate::progress::progress_bar;

#[cfg(any(test, feature = "testing"))]
mod polars_csv;
mod row;
mod stream;

pub use row::{check_ts_format, decode_frame};
use stream::read_csv_events;

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
    /// The form of the time column (`--ts-format`, chrono's strftime
    /// syntax, e.g. `%d/%m/%Y %H:%M:%S`): with an offset (`%z`) it is read
    /// as that instant, without one in `timezone`.
    pub ts_format: Option<String>,
    /// Field delimiter of CSV input (`,`; European exports often use `;`).
    pub delimiter: u8,
    /// Show a progress bar (only drawn on a terminal).
    pub progress: bool,
    /// Read the callee column. Work that never uses callees (`tune`) skips
    /// it: a callee never makes a row invalid (a bad one is no callee), so
    /// the same rows are valid either way.
    pub callees: bool,
    /// Read `duration_ms`. Work whose rules never use a call's end (`tune`
    /// of a rule set without concurrent and sum rules) skips it, as it
    /// skips callees: an optional field never makes a row invalid, so the
    /// same rows are kept either way (only the note that a row was kept
    /// without a bad one is not made).
    pub durations: bool,
    /// Read `talk_ms`: work without sum rules skips it (as `durations`).
    pub talk: bool,
    /// Read `account`: work without rules keyed by account skips it (as
    /// `durations`).
    pub accounts: bool,
    /// Rows held in memory to put the log in processing order; a longer
    /// log is sorted in runs of this many on disk
    /// ([`crate::offline::spill`]).
    pub sort_rows: usize,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            format: InputFormat::Auto,
            decoder: Decoder::default(),
            timezone: None,
            ts_format: None,
            delimiter: b',',
            progress: false,
            callees: true,
            durations: true,
            talk: true,
            accounts: true,
            sort_rows: crate::offline::spill::DEFAULT_SORT_ROWS,
        }
    }
}

/// A row that is not a valid call event, or whose call was kept without
/// an optional field that could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidRow {
    /// 1-based data row number (the header is not counted).
    pub row: u64,
    /// Why.
    pub error: EventError,
    /// The row's call was kept, without the field `error` names (a label
    /// `unknown`, a duration `1.5`); otherwise the row was not decided.
    pub kept: bool,
}

impl InvalidRow {
    /// A row that is not a call event.
    pub fn new(row: u64, error: EventError) -> Self {
        InvalidRow {
            row,
            error,
            kept: false,
        }
    }

    /// The rows an event's dropped fields make (see
    /// [`CallEvent::dropped`]): the call kept, each field reported.
    pub fn dropped(row: u64, event: &CallEvent) -> impl Iterator<Item = InvalidRow> + '_ {
        event.dropped.iter().flatten().map(move |e| InvalidRow {
            row,
            error: e.clone(),
            kept: true,
        })
    }
}

/// Of a list of problem rows, those whose call was not decided.
pub fn not_kept(rows: &[InvalidRow]) -> usize {
    rows.iter().filter(|r| !r.kept).count()
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
/// text columns (CSV: `testing` feature).
pub fn read_frame(path: &Path, format: InputFormat) -> Result<DataFrame, IoError> {
    read_frame_columns(path, format, b',', None)
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

/// An error naming the first field whose column is not among `names`: a
/// required one (call id, caller, time), or an optional one the user named
/// (`--map label=verdict`, `--label-column`), which a misspelling would
/// otherwise leave empty on every row without a word.
fn check_required(decoder: &Decoder, user: &FieldMap, names: &[String]) -> Result<(), IoError> {
    let checked = FIELDS
        .iter()
        .filter(|f| ["call_id", "caller", "ts"].contains(f) || user.is_named(f));
    for &field in checked {
        let src = decoder.map.source(field);
        if !names.iter().any(|n| n == src) {
            return Err(IoError::MissingColumn {
                column: src.to_string(),
                field,
                columns: names.join(", "),
            });
        }
    }
    Ok(())
}

/// A reader of the Parquet file at `path`, and the context its errors name.
fn parquet_reader(path: &Path) -> Result<(ParquetReader<File>, String), IoError> {
    let ctx = format!("reading {}", path.display());
    let file = File::open(path).map_err(|source| IoError::Io {
        context: ctx.clone(),
        source,
    })?;
    Ok((ParquetReader::new(file), ctx))
}

/// The column names of a Parquet file, from its metadata.
fn parquet_columns(path: &Path) -> Result<Vec<String>, IoError> {
    let (mut reader, ctx) = parquet_reader(path)?;
    let schema = reader.schema().map_err(polars_err(ctx))?;
    Ok(schema.iter_names().map(|n| n.to_string()).collect())
}

/// Rows of a Parquet file.
fn parquet_rows(path: &Path) -> Result<usize, IoError> {
    let (mut reader, ctx) = parquet_reader(path)?;
    reader.num_rows().map_err(polars_err(ctx))
}

/// Bytes of a text log's beginning read to estimate its rows.
const ROW_SAMPLE_BYTES: u64 = 1 << 20;

/// About how many rows the log file at `path` holds, without reading it
/// through: a Parquet file's count from its metadata; a text file's lines
/// after the first, counted in its first MiB and scaled to its size
/// (exact for a file that short). `None` when the file cannot be read or
/// its first MiB holds no line after the first.
pub fn estimated_rows(path: &Path, opts: &ReadOptions) -> Option<u64> {
    if resolve_format(path, opts.format) == InputFormat::Parquet {
        return parquet_rows(path).ok().map(|n| n as u64);
    }
    let mut file = File::open(path).ok()?;
    let size = file.metadata().ok()?.len();
    let mut head = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(&mut file, ROW_SAMPLE_BYTES),
        &mut head,
    )
    .ok()?;
    let first_end = head.iter().position(|&b| b == b'\n')? + 1;
    let rest = &head[first_end..];
    let lines = rest.iter().filter(|&&b| b == b'\n').count() as u64;
    if head.len() as u64 == size {
        return Some(lines + u64::from(rest.last().is_some_and(|&b| b != b'\n')));
    }
    let sampled = rest.iter().rposition(|&b| b == b'\n')? as u64 + 1;
    Some((size - first_end as u64) * lines / sampled)
}

/// A Parquet file's rows `slice` (offset, length; all with `None`) as a
/// frame of text columns; with `wanted`, only those of its columns that
/// exist.
fn read_parquet_slice(
    path: &Path,
    wanted: Option<&[&str]>,
    slice: Option<(usize, usize)>,
) -> Result<DataFrame, IoError> {
    let (reader, ctx) = parquet_reader(path)?;
    let mut reader = reader.with_slice(slice);
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
    to_text_columns(df).map_err(polars_err(ctx))
}

/// Reads a file into a data frame of text columns; with `wanted`, only those
/// of its columns that exist (the others are never materialised). CSV and
/// switches' CDR files (an explicit preset; `Auto` is plain CSV here) are
/// read with polars' CSV reader only as the tests' oracle of the streamed
/// reader (`testing` feature); the library streams them
/// ([`read_events`]).
pub fn read_frame_columns(
    path: &Path,
    format: InputFormat,
    delimiter: u8,
    wanted: Option<&[&str]>,
) -> Result<DataFrame, IoError> {
    if !path.exists() {
        return Err(IoError::NoSuchFile(path.to_path_buf()));
    }
    let format = resolve_format(path, format);
    let df = match format {
        InputFormat::Parquet => read_parquet_slice(path, wanted, None)?,
        #[cfg(any(test, feature = "testing"))]
        InputFormat::Asterisk | InputFormat::FreeSwitch | InputFormat::KamailioAcc => {
            let preset = format
                .preset()
                .ok_or_else(|| bad_shape(path, "no preset"))?;
            polars_csv::read_preset_frame(path, preset, delimiter)?
        }
        #[cfg(any(test, feature = "testing"))]
        _ => polars_csv::read_csv_frame(path, delimiter, wanted)?,
        #[cfg(not(any(test, feature = "testing")))]
        _ => {
            let _ = (delimiter, wanted);
            return Err(bad_shape(
                path,
                "only Parquet is read into a frame; CSV is streamed (read_events)",
            ));
        }
    };
    Ok(df)
}

/// `Auto` on a `.parquet` file is Parquet; anything else as given (an
/// `Auto` CSV is told by its first line, [`crate::offline::cdr::detect`]).
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
    entries.extend(FIELDS.iter().filter_map(|f| user.entry(f)));
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

/// The input's column names to read for `opts`: every mapped field but
/// those `opts` leaves out (the callee, the durations, the account).
pub fn wanted_columns<'a>(map: &'a FieldMap, opts: &ReadOptions) -> Vec<&'a str> {
    FIELDS
        .iter()
        .filter(|f| match **f {
            "callee" => opts.callees,
            "duration_ms" => opts.durations,
            "talk_ms" => opts.talk,
            "account" => opts.accounts,
            _ => true,
        })
        .map(|f| map.source(f))
        .collect()
}

/// Reads and decodes a call log whole, in file order (see
/// [`read_events`]): a test oracle of the chunked readers (`testing`
/// feature).
#[cfg(any(test, feature = "testing"))]
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
    let mut events = EventColumns::default();
    let invalid = read_events_into(path, opts, &mut |batch| {
        events.append(batch);
        Ok(())
    })?;
    Ok((events, invalid))
}

/// Rows the Parquet reader hands on at a time.
const PARQUET_BATCH: usize = 65_536;

/// [`read_events_into`] for Parquet: the file read a slice of rows at a
/// time (at most [`PARQUET_SLICE`], and no more than `opts.sort_rows`), so
/// its frame never holds the whole file.
fn read_parquet_events(
    path: &Path,
    opts: &ReadOptions,
    decoder: &Decoder,
    wanted: &[&str],
    sink: &mut dyn FnMut(EventColumns) -> Result<(), IoError>,
) -> Result<Vec<InvalidRow>, IoError> {
    let total = parquet_rows(path)?;
    let slice = PARQUET_SLICE.min(opts.sort_rows).max(1);
    let bar = progress_bar(total as u64, opts.progress, "reading");
    let mut events = EventColumns::with_capacity(total.min(PARQUET_BATCH));
    let mut invalid = Vec::new();
    let mut sink_error = None;
    let mut offset = 0;
    loop {
        let df = read_parquet_slice(path, Some(wanted), Some((offset, slice)))?;
        let first = offset as u64;
        decode_frame(
            &df,
            decoder,
            InputFormat::Parquet,
            opts.timezone,
            opts.ts_format.as_deref(),
            false,
            |row, event| match event {
                Ok(e) => {
                    let row = first + row;
                    invalid.extend(InvalidRow::dropped(row, &e));
                    events.push(row, &e);
                    if events.len() >= PARQUET_BATCH && sink_error.is_none() {
                        sink_error = sink(std::mem::take(&mut events)).err();
                    }
                }
                Err(error) => invalid.push(InvalidRow::new(first + row, error)),
            },
        )?;
        if let Some(e) = sink_error {
            return Err(e);
        }
        offset += df.height();
        bar.set_position(offset as u64);
        if df.height() == 0 || offset >= total {
            break;
        }
    }
    bar.finish_and_clear();
    sink(events)?;
    Ok(invalid)
}

/// Rows of a Parquet log read into a frame at a time.
const PARQUET_SLICE: usize = 1 << 20;

/// [`read_events`], handing the events to `sink` in file order, a batch at
/// a time (a sink's error ends the read); returns the invalid rows.
pub fn read_events_into(
    path: &Path,
    opts: &ReadOptions,
    sink: &mut dyn FnMut(EventColumns) -> Result<(), IoError>,
) -> Result<Vec<InvalidRow>, IoError> {
    if !path.exists() {
        return Err(IoError::NoSuchFile(path.to_path_buf()));
    }
    match resolve_format(path, opts.format) {
        InputFormat::Parquet => {
            let mut decoder = opts.decoder.clone();
            decoder.map = effective_map(InputFormat::Parquet, &opts.decoder.map);
            // A missing column is named against all of the file's columns,
            // not only those the projection would read.
            check_required(&decoder, &opts.decoder.map, &parquet_columns(path)?)?;
            let wanted = wanted_columns(&decoder.map, opts);
            read_parquet_events(path, opts, &decoder, &wanted, sink)
        }
        format => read_csv_events(path, opts, format, sink),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csv_of(rows: usize, dir: &Path) -> std::path::PathBuf {
        let path = dir.join(format!("calls-{rows}.csv"));
        let mut text = String::from("call_id,caller,ts\n");
        for i in 0..rows {
            text.push_str(&format!(
                "c{i},+3491{:07},{}\n",
                i % 997,
                1_764_547_200_000u64 + i as u64
            ));
        }
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_short_text_file_is_counted_and_a_long_one_estimated_from_its_first_mib() {
        let dir = tempfile::tempdir().unwrap();
        let opts = ReadOptions::default();
        assert_eq!(
            estimated_rows(&csv_of(5_000, dir.path()), &opts),
            Some(5_000)
        );
        let long = csv_of(100_000, dir.path());
        assert!(std::fs::metadata(&long).unwrap().len() > 3 * ROW_SAMPLE_BYTES);
        let estimate = estimated_rows(&long, &opts).unwrap();
        assert!(
            (95_000..=105_000).contains(&estimate),
            "100,000 rows estimated at {estimate}"
        );
        let unterminated = dir.path().join("last.csv");
        std::fs::write(&unterminated, "call_id,caller,ts\na,+341,1\nb,+341,2").unwrap();
        assert_eq!(estimated_rows(&unterminated, &opts), Some(2));
        let header_only = dir.path().join("header.csv");
        std::fs::write(&header_only, "call_id,caller,ts").unwrap();
        assert_eq!(estimated_rows(&header_only, &opts), None);
    }

    #[test]
    fn a_parquet_file_is_counted_from_its_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("calls.parquet");
        let mut df = df!("call_id" => ["a", "b", "c"], "caller" => ["+1", "+1", "+2"]).unwrap();
        ParquetWriter::new(File::create(&path).unwrap())
            .finish(&mut df)
            .unwrap();
        assert_eq!(estimated_rows(&path, &ReadOptions::default()), Some(3));
    }
}

//! Decoding one row's text into a call event: a switch's local times and
//! units, call attempts, and frames of text columns.

use chrono::NaiveDateTime;
use chrono_tz::Tz;
use polars::prelude::*;

use crate::engine::event::{CallEvent, Decoder, RawValue, FIELDS, TS};
use crate::error::{EventError, IoError};
use crate::offline::cdr::{self, InputFormat, Preset};
use crate::offline::columns::EventColumns;
use crate::progress::progress_bar;

use super::{check_required, polars_err, InvalidRow};

/// Records handed from the parsing thread to a decoding one at a time.
pub(super) const CSV_BATCH: usize = 4_096;

/// Bytes read from a file at a time when its lines are handed on whole
/// (see [`LineBlock`]).
pub(super) const LINE_READ: usize = 1 << 20;

/// A batch of a CSV file's records, decoded.
pub(super) struct DecodedBatch {
    /// The batch's place in the file.
    pub(super) seq: usize,
    pub(super) events: EventColumns,
    pub(super) invalid: Vec<InvalidRow>,
    /// The batch's text, to be refilled.
    pub(super) text: BatchText,
    /// The byte offset in the file where the batch ends.
    pub(super) end: u64,
    /// The batch's last record spans lines (an unclosed quote, perhaps).
    pub(super) last_multiline: bool,
}

/// A batch's records: parsed by the `csv` crate, or a block of whole
/// lines of a file without quotes or carriage returns (see
/// [`LineBlock`]).
pub(super) enum BatchText {
    Records(Vec<csv::ByteRecord>),
    Lines(LineBlock),
}

/// Whole lines of a CSV file in which no byte is a quote or a carriage
/// return: there every line is a record and every delimiter ends a field,
/// exactly as the `csv` crate reads them (blank lines are not records).
#[derive(Default)]
pub(super) struct LineBlock {
    /// The lines' text, each ended by `\n` (the file's last may not be).
    pub(super) bytes: Vec<u8>,
    /// Where each non-blank line starts and ends in `bytes` (without its
    /// `\n`).
    pub(super) lines: Vec<(usize, usize)>,
}

/// One record's text and its fields' places in it.
pub(super) trait Record {
    /// The record's text.
    fn text(&self) -> &[u8];
    /// Where field `c` is in [`Record::text`], if the record has it.
    fn field(&self, c: usize) -> Option<std::ops::Range<usize>>;
}

impl Record for &csv::ByteRecord {
    fn text(&self) -> &[u8] {
        self.as_slice()
    }

    fn field(&self, c: usize) -> Option<std::ops::Range<usize>> {
        self.range(c)
    }
}

/// A line of a [`LineBlock`], its fields found up to the last one read.
pub(super) struct Line<'a> {
    text: &'a [u8],
    /// Field `i` runs from `starts[i]` to `starts[i + 1] - 1`, the last
    /// one found to the end of the line.
    starts: smallvec::SmallVec<[usize; 16]>,
}

impl<'a> Line<'a> {
    /// `line` split at `delimiter` up to field `last` (the fields after
    /// it are not looked for).
    pub(super) fn split(line: &'a [u8], delimiter: u8, last: usize) -> Self {
        let mut starts = smallvec::SmallVec::new();
        starts.push(0);
        for at in memchr::memchr_iter(delimiter, line) {
            starts.push(at + 1);
            // Field `last + 1`'s start bounds field `last`.
            if starts.len() > last + 1 {
                break;
            }
        }
        Line { text: line, starts }
    }
}

impl Record for Line<'_> {
    fn text(&self) -> &[u8] {
        self.text
    }

    fn field(&self, c: usize) -> Option<std::ops::Range<usize>> {
        let start = *self.starts.get(c)?;
        let end = self
            .starts
            .get(c + 1)
            .map_or(self.text.len(), |next| next - 1);
        Some(start..end)
    }
}

/// Decodes rows given as their text per field of [`FIELDS`].
pub(super) struct RowDecoder<'d> {
    decoder: &'d Decoder,
    /// The switch's preset: units of times and durations, call attempts.
    preset: Option<&'static Preset>,
    tz: Option<Tz>,
    /// The time column's form, if given (`--ts-format`).
    ts_format: Option<String>,
    /// The record's column telling call attempts (see [`Preset::attempt`]).
    pub(super) attempt_column: Option<usize>,
    ts_buf: String,
    duration_buf: String,
}

impl<'d> RowDecoder<'d> {
    pub(super) fn new(
        decoder: &'d Decoder,
        preset: Option<&'static Preset>,
        tz: Option<Tz>,
        ts_format: Option<&str>,
    ) -> Self {
        RowDecoder {
            decoder,
            preset,
            tz,
            ts_format: ts_format.map(str::to_string),
            attempt_column: None,
            ts_buf: String::new(),
            duration_buf: String::new(),
        }
    }

    /// Decodes a batch of records, the first of which is data row
    /// `first_row`; `fields[i]` is the column of field `FIELDS[i]`, if
    /// read. A row's number is its record's place among the data records
    /// (the header and blank lines are not counted).
    pub(super) fn decode_records<R: Record>(
        &mut self,
        first_row: u64,
        records: impl ExactSizeIterator<Item = R>,
        fields: &[Option<usize>; FIELDS.len()],
    ) -> (EventColumns, Vec<InvalidRow>) {
        let mut events = EventColumns::with_capacity(records.len());
        let mut invalid = Vec::new();
        for (record, n) in records.zip(first_row..) {
            match self.decode_record(&record, fields) {
                Ok(e) => {
                    invalid.extend(InvalidRow::dropped(n, &e));
                    events.push(n, &e);
                }
                Err(error) => invalid.push(InvalidRow::new(n, error)),
            }
        }
        (events, invalid)
    }

    /// The last column a record's decoding reads.
    pub(super) fn last_column(&self, fields: &[Option<usize>; FIELDS.len()]) -> usize {
        fields
            .iter()
            .chain(std::iter::once(&self.attempt_column))
            .flatten()
            .copied()
            .max()
            .unwrap_or(0)
    }

    /// One record, its fields as `fields` places them.
    fn decode_record(
        &mut self,
        record: &impl Record,
        fields: &[Option<usize>; FIELDS.len()],
    ) -> Result<CallEvent, EventError> {
        let bytes = record.text();
        // The record's text is checked once, whole (a few fields of a few
        // bytes each cost more checked one by one); a field is its slice
        // of it unless a multi-byte character straddles its edge.
        let whole = std::str::from_utf8(bytes).ok();
        // Invalid UTF-8 is replaced (the row then fails decoding and is
        // listed, not the file).
        let mut lossy: [Option<String>; FIELDS.len()] = Default::default();
        let mut values: [Option<&str>; FIELDS.len()] = [None; FIELDS.len()];
        for (f, col) in fields.iter().enumerate() {
            let Some(range) = col.and_then(|c| record.field(c)).filter(|r| !r.is_empty()) else {
                continue;
            };
            let text = whole
                .and_then(|w| w.get(range.clone()))
                .map_or_else(|| std::str::from_utf8(&bytes[range.clone()]), Ok);
            match text {
                Ok(s) => values[f] = Some(s),
                Err(_) => lossy[f] = Some(String::from_utf8_lossy(&bytes[range]).into_owned()),
            }
        }
        for (f, l) in lossy.iter().enumerate() {
            if let Some(l) = l {
                values[f] = Some(l.as_str());
            }
        }
        let attempt = self
            .attempt_column
            .and_then(|c| record.field(c))
            .map(|r| std::str::from_utf8(&bytes[r]).unwrap_or("?"));
        self.decode(&values, attempt)
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
        // Times in the form given (`--ts-format`), naive local times
        // (`YYYY-MM-DD HH:MM:SS`) and a switch's epoch seconds become epoch
        // milliseconds first (unless the mapping names the time's unit).
        self.ts_buf.clear();
        let ts_seconds =
            self.preset.is_some_and(|p| p.ts_seconds) && self.decoder.map.ts_unit().is_none();
        if let Some(ms) = values[TS].and_then(|raw| {
            self.formatted_ms(raw)
                .or_else(|| naive_to_ms(raw, self.tz))
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
        if self.preset.is_some_and(|p| p.duration_seconds)
            && self.decoder.map.duration_unit().is_none()
        {
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

impl RowDecoder<'_> {
    /// A time in the `--ts-format` form, as epoch milliseconds: the instant
    /// its offset names, or without one a local time in the time zone.
    fn formatted_ms(&self, raw: &str) -> Option<i64> {
        let fmt = self.ts_format.as_deref()?;
        let raw = raw.trim();
        chrono::DateTime::parse_from_str(raw, fmt)
            .map(|d| d.timestamp_millis())
            .ok()
            .or_else(|| {
                let naive = NaiveDateTime::parse_from_str(raw, fmt).ok()?;
                local_to_ms(naive, self.tz)
            })
    }
}

/// Checks a `--ts-format` before any row is read: chrono's strftime
/// syntax, with a date and a time of day.
pub fn check_ts_format(fmt: &str) -> Result<(), String> {
    use chrono::format::{Item, StrftimeItems};
    if StrftimeItems::new(fmt).any(|i| matches!(i, Item::Error)) {
        return Err(format!(
            "--ts-format {fmt:?}: not a strftime format (e.g. %d/%m/%Y %H:%M:%S)"
        ));
    }
    use std::fmt::Write;
    // A time written in the form and read back must be the same instant.
    let whole = || {
        format!(
            "--ts-format {fmt:?} does not name a whole time to the second \
             (a date, hours, minutes and seconds, e.g. %d/%m/%Y %H:%M:%S)"
        )
    };
    let offset = chrono::FixedOffset::east_opt(3_600).ok_or_else(whole)?;
    let sample = chrono::DateTime::from_timestamp(1_764_583_245, 0)
        .ok_or_else(whole)?
        .with_timezone(&offset);
    let mut shown = String::new();
    write!(shown, "{}", sample.format(fmt)).map_err(|_| whole())?;
    let instant = chrono::DateTime::parse_from_str(&shown, fmt).map(|d| d == sample);
    let local = NaiveDateTime::parse_from_str(&shown, fmt).map(|n| n == sample.naive_local());
    match (instant, local) {
        (Ok(true), _) | (_, Ok(true)) => Ok(()),
        _ => Err(whole()),
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
    ts_format: Option<&str>,
    progress: bool,
    mut sink: impl FnMut(u64, Result<CallEvent, EventError>),
) -> Result<(), IoError> {
    let names: Vec<String> = df
        .get_column_names()
        .iter()
        .map(|s| s.to_string())
        .collect();
    check_required(decoder, &crate::engine::event::FieldMap::default(), &names)?;
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
    let mut decode = RowDecoder::new(decoder, preset, tz, ts_format);
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
    local_to_ms(naive, tz)
}

/// A local time in a time zone (UTC if none) as epoch milliseconds.
fn local_to_ms(naive: NaiveDateTime, tz: Option<Tz>) -> Option<i64> {
    crate::engine::filter::local_ms(tz.unwrap_or(chrono_tz::UTC), naive)
}

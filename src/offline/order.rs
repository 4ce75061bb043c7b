//! A call log in its processing order (stable by event time), decoded a
//! chunk at a time.

use std::path::Path;
use std::sync::Arc;

use chrono_tz::Tz;
use polars::prelude::*;

use crate::engine::event::{parse_ts, Decoder, RawValue};
use crate::error::{EventError, IoError};
use crate::offline::read::{
    decode_frame, effective_map, polars_err, read_frame_columns, row_ts, wanted_columns, CallLog,
    ReadOptions,
};

/// Rows decoded per chunk of an [`OrderedLog`]: a few chunks (decoded ahead,
/// being decided, being written) are in memory at once, each with its
/// events and verdicts, so this bounds their share of the peak.
pub const CHUNK_ROWS: usize = 16_384;

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
    unique: Vec<bool>,
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
        let wanted = wanted_columns(&decoder.map, opts);
        let mut frame = read_frame_columns(path, opts.format, opts.delimiter, Some(&wanted))?;
        if frame.height() > IdxSize::MAX as usize {
            return Err(IoError::BadShape {
                path: path.to_path_buf(),
                problem: format!(
                    "{} rows, more than this build's {} row limit",
                    frame.height(),
                    IdxSize::MAX
                ),
            });
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
        let unique = unique_ids(&frame, decoder.map.source("call_id"))?;
        Ok(OrderedLog {
            frame,
            order,
            unique,
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
                    if let Err(e) = parse_ts(RawValue::Str(raw)) {
                        bad.error = e;
                    }
                }
            }
            log.unique = log
                .events
                .iter()
                .map(|(row, _)| self.unique[(*row - 1) as usize])
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
            all.unique.extend(chunk.unique);
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

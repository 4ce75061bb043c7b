//! A call log in its processing order (stable by event time), handed out
//! a chunk at a time.

use std::path::Path;
use std::sync::Arc;

use crate::error::IoError;
use crate::offline::columns::EventColumns;
use crate::offline::read::{read_events, CallLog, InvalidRow, ReadOptions};

/// Rows handed out per chunk of an [`OrderedLog`]: a few chunks (being
/// built, decided, written) are in memory at once, each with its events
/// and verdicts, so this bounds their share of the peak.
pub const CHUNK_ROWS: usize = 16_384;

/// A call log in its processing order, as events a chunk at a time.
///
/// The file is read and decoded once into [`EventColumns`] (about 40 bytes
/// a call); the processing order is computed from the event times (stable:
/// ties keep file order, as [`CallLog::sort_by_time`]; a log already in
/// time order, as most are, needs no index). Events exist only for the
/// chunk being processed, so a log of millions of rows never becomes
/// millions of objects.
pub struct OrderedLog {
    events: EventColumns,
    /// The events' indices in processing order; `None` when that is the
    /// file order.
    order: Option<Vec<u32>>,
    /// Per event: its call id occurs on no other valid row.
    unique: Vec<bool>,
    /// Per event: its caller's number (see [`CallLog::callers`]).
    callers: Vec<u32>,
    /// Rows that are not valid events, by row number.
    invalid: Vec<InvalidRow>,
}

impl OrderedLog {
    /// Reads `path` and computes the processing order.
    pub fn open(path: &Path, opts: &ReadOptions) -> Result<Self, IoError> {
        let (events, invalid) = read_events(path, opts)?;
        if events.len() > u32::MAX as usize {
            return Err(IoError::BadShape {
                path: path.to_path_buf(),
                problem: format!(
                    "{} rows, more than the {} row limit",
                    events.len(),
                    u32::MAX
                ),
            });
        }
        let ts = events.times();
        let order = (!ts.is_sorted()).then(|| {
            let mut order: Vec<u32> = (0..ts.len() as u32).collect();
            order.sort_by_key(|&i| ts[i as usize]);
            order
        });
        // Two passes over every event, independent: one per core.
        let (unique, callers) = std::thread::scope(|s| {
            let unique = s.spawn(|| unique_ids(&events));
            let callers = events.caller_ids();
            let unique = unique
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            (unique, callers)
        });
        Ok(OrderedLog {
            events,
            order,
            unique,
            callers,
            invalid,
        })
    }

    /// Rows in the file (valid or not).
    pub fn rows(&self) -> usize {
        self.events.len() + self.invalid.len()
    }

    /// The log in processing order, `size` events at a time. Row numbers
    /// are the file's (1-based); the invalid rows come with the first chunk.
    pub fn chunks(&self, size: usize) -> impl Iterator<Item = Result<CallLog, IoError>> + '_ {
        let size = size.max(1);
        let n = self.events.len();
        // At least one chunk when there are invalid rows to hand out.
        let chunks = n.div_ceil(size).max(usize::from(!self.invalid.is_empty()));
        (0..chunks).map(move |c| {
            let at = |p: usize| match &self.order {
                Some(order) => order[p] as usize,
                None => p,
            };
            let range = c * size..((c + 1) * size).min(n);
            let mut log = CallLog {
                events: Vec::with_capacity(range.len()),
                invalid: if c == 0 {
                    self.invalid.clone()
                } else {
                    Vec::new()
                },
                unique: Vec::with_capacity(range.len()),
                callers: Vec::with_capacity(range.len()),
            };
            for p in range {
                let i = at(p);
                log.events.push((self.events.row(i), self.events.event(i)));
                log.unique.push(self.unique[i]);
                log.callers.push(self.callers[i]);
            }
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
            all.callers.extend(chunk.callers);
        }
        all.invalid.sort_by_key(|r| r.row);
        Ok(all)
    }
}

/// Per event: whether its call id occurs on no other event. Compares
/// 64-bit hashes, so a collision can only make an id look repeated, which
/// is safe: it keeps its idempotency record.
fn unique_ids(events: &EventColumns) -> Vec<bool> {
    use std::hash::BuildHasher;
    let state = foldhash::fast::FixedState::with_seed(0x0069_6473);
    let hash = |i: usize| state.hash_one(events.call_id(i));
    let mut sorted: Vec<u64> = (0..events.len()).map(hash).collect();
    sorted.sort_unstable();
    let repeated: foldhash::HashSet<u64> = sorted
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| w[0])
        .collect();
    drop(sorted);
    if repeated.is_empty() {
        return vec![true; events.len()];
    }
    (0..events.len())
        .map(|i| !repeated.contains(&hash(i)))
        .collect()
}

//! A call log in its processing order (stable by event time), handed out
//! a chunk at a time.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use rayon::slice::ParallelSliceMut;

use crate::engine::event::CallEvent;
use crate::error::IoError;
use crate::offline::columns::EventColumns;
use crate::offline::read::{not_kept, read_events_into, CallLog, InvalidRow, ReadOptions};
use crate::offline::spill::{id_hash, Collected, Merged, Spill, Spiller};

/// Rows handed out per chunk of an [`OrderedLog`]: a few chunks (being
/// built, decided, written) are in memory at once, each with its events
/// and verdicts, so this bounds their share of the peak.
pub const CHUNK_ROWS: usize = 16_384;

/// A chunk of a log in processing order, for a replay: the events alone
/// (no row numbers), their call ids' uniqueness, and the invalid rows.
#[derive(Debug, Default)]
pub struct EventChunk {
    /// The events, in processing order.
    pub events: Vec<CallEvent>,
    /// Per event, as [`CallLog::unique`].
    pub unique: Vec<bool>,
    /// Invalid rows (all with the first chunk).
    pub invalid: Vec<InvalidRow>,
}

/// A call log in its processing order, as events a chunk at a time.
///
/// The file is read and decoded once into [`EventColumns`] (about 40 bytes
/// a call); the processing order is computed from the event times (stable:
/// ties keep file order, as [`CallLog::sort_by_time`]; a log already in
/// time order, as most are, needs no index). Events exist only for the
/// chunk being processed, so a log of millions of rows never becomes
/// millions of objects. A log longer than [`ReadOptions::sort_rows`] is
/// put in order on disk instead ([`crate::offline::spill`]): the same
/// order, caller numbers and unique call ids.
pub struct OrderedLog {
    events: EventColumns,
    /// The events' indices in processing order; `None` when that is the
    /// file order.
    order: Option<Vec<u32>>,
    /// With call ends ([`OrderedLog::with_ends`]): the processing order of
    /// the events and of the ends of the calls with a duration, which
    /// replaces `order`.
    ends: Option<Vec<Pos>>,
    /// Per event: its call id occurs on no other valid row.
    unique: Vec<bool>,
    /// Per event: its caller's number (see [`CallLog::callers`]); empty
    /// when not numbered.
    callers: Vec<u32>,
    /// Rows that are not valid events, by row number.
    invalid: Vec<InvalidRow>,
    /// The events, spilled in sorted runs (the columns above then empty).
    spill: Option<Spill>,
    /// With a spill: the calls' ends are merged in ([`OrderedLog::with_ends`]).
    spill_ends: bool,
    /// Whether callers are numbered ([`OrderedLog::open_unnumbered`]).
    numbered: bool,
    /// A spill's runs that could not be read back: the chunks stopped
    /// there ([`OrderedLog::check`]).
    failure: std::sync::Mutex<Option<IoError>>,
}

impl OrderedLog {
    /// Reads `path`, computes the processing order and numbers the callers
    /// (see [`CallLog::callers`]).
    pub fn open(path: &Path, opts: &ReadOptions) -> Result<Self, IoError> {
        Self::open_with(path, opts, true)
    }

    /// [`OrderedLog::open`] without numbering the callers (their chunks'
    /// [`CallLog::callers`] are empty: unknown), for work that never uses
    /// the numbers (a replay).
    pub fn open_unnumbered(path: &Path, opts: &ReadOptions) -> Result<Self, IoError> {
        Self::open_with(path, opts, false)
    }

    fn open_with(path: &Path, opts: &ReadOptions, number: bool) -> Result<Self, IoError> {
        let mut spiller = Spiller::rereading(opts.sort_rows, path, opts);
        if !number {
            spiller = spiller.unnumbered();
        }
        let invalid = read_events_into(path, opts, &mut |batch| spiller.take(batch))?;
        let events = match spiller.finish()? {
            Collected::Whole(events) => *events,
            Collected::Spilled(spill) => {
                return Ok(OrderedLog {
                    events: EventColumns::default(),
                    order: None,
                    ends: None,
                    unique: Vec::new(),
                    callers: Vec::new(),
                    invalid,
                    spill: Some(spill),
                    spill_ends: false,
                    numbered: number,
                    failure: Default::default(),
                })
            }
        };
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
            let callers = if number {
                events.caller_ids()
            } else {
                Vec::new()
            };
            let unique = unique
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            (unique, callers)
        });
        Ok(OrderedLog {
            events,
            order,
            ends: None,
            unique,
            callers,
            invalid,
            spill: None,
            spill_ends: false,
            numbered: number,
            failure: Default::default(),
        })
    }

    /// The log with the ends of its calls: each row with a duration is an
    /// attempt at `ts` and an end at `ts + duration_ms`, and the
    /// processing order is by time with a call's end before an attempt at
    /// the same millisecond (an end at `t` closes the call before a call
    /// at `t` is counted), else file order. For rule sets with concurrent
    /// rules; without them an end changes nothing, and the log keeps one
    /// event per row.
    pub fn with_ends(mut self) -> Self {
        if self.spill.is_some() {
            // A log without ends merges in the same order either way.
            self.spill_ends = true;
            return self;
        }
        let n = self.events.len();
        let ends = (0..n).filter(|&i| self.events.has_end(i)).count();
        let has_end_rows = (0..n).any(|i| self.events.is_end(i));
        if ends == 0 && !has_end_rows {
            return self;
        }
        let mut order: Vec<Pos> = Vec::with_capacity(n + ends);
        for i in 0..n {
            order.push(Pos {
                index: i as u32,
                derived_end: false,
            });
            if self.events.has_end(i) {
                order.push(Pos {
                    index: i as u32,
                    derived_end: true,
                });
            }
        }
        let ts = self.events.times();
        let key = |p: &Pos| {
            let i = p.index as usize;
            if p.derived_end {
                (ts[i].saturating_add(self.events.duration(i)), 0u8)
            } else {
                (ts[i], u8::from(!self.events.is_end(i)))
            }
        };
        order.sort_by_key(key);
        self.order = None;
        self.ends = Some(order);
        self
    }

    /// Events in processing order (rows' events and calls' ends).
    pub fn len(&self) -> usize {
        if let Some(spill) = &self.spill {
            return spill.len(self.spill_ends);
        }
        self.ends.as_ref().map_or(self.events.len(), Vec::len)
    }

    /// No events at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows in the file (valid or not).
    pub fn rows(&self) -> usize {
        let events = self.spill.as_ref().map_or(self.events.len(), Spill::events);
        events + not_kept(&self.invalid)
    }

    /// Whether the log is put in order on disk (longer than its sort
    /// budget), by runs or by reading it again.
    pub fn spilled(&self) -> bool {
        self.spill.is_some()
    }

    /// Of a spilled log: the runs written to disk, and the events read
    /// from the file a second time (its beginning that came in time
    /// order) rather than written to runs.
    pub fn spill_shape(&self) -> Option<(usize, usize)> {
        self.spill.as_ref().map(|s| (s.runs(), s.reread()))
    }

    /// Fails if a spilled log's runs could not be read back whole: its
    /// chunks then stopped early. Call it after taking the chunks.
    pub fn check(&self) -> Result<(), IoError> {
        match self
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn fail(&self, e: IoError) {
        let mut failure = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if failure.is_none() {
            *failure = Some(e);
        }
    }

    /// A spilled log's chunks of `size` events: each chunk's number and
    /// its events as merged. Stops at a run that cannot be read, or that
    /// holds fewer events than were written, recording why
    /// ([`OrderedLog::check`]).
    fn spilled_chunks<'a>(
        &'a self,
        spill: &'a Spill,
        size: usize,
    ) -> impl Iterator<Item = (usize, Vec<Merged>)> + 'a {
        let size = size.max(1);
        let expected = spill.len(self.spill_ends);
        let mut merge = match spill.merge(self.spill_ends) {
            Ok(m) => Some(m),
            Err(e) => {
                self.fail(e);
                None
            }
        };
        let (mut seen, mut c) = (0, 0);
        std::iter::from_fn(move || {
            let m = merge.as_mut()?;
            let mut chunk = Vec::with_capacity(size.min(expected.saturating_sub(seen)).max(1));
            let mut error = None;
            while chunk.len() < size {
                match m.next() {
                    Some(Ok(x)) => chunk.push(x),
                    Some(Err(e)) => {
                        error = Some(e);
                        break;
                    }
                    None => break,
                }
            }
            if let Some(e) = error {
                self.fail(e);
                merge = None;
                return None;
            }
            seen += chunk.len();
            if chunk.is_empty() {
                if seen != expected {
                    self.fail(IoError::Io {
                        context: format!("the sort's runs gave back {seen} of {expected} events"),
                        source: std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                    });
                }
                merge = None;
                return None;
            }
            c += 1;
            Some((c - 1, chunk))
        })
    }

    /// The chunks of `size` events (at least one when there are invalid
    /// rows to hand out): each chunk's number and its range of positions
    /// in processing order.
    fn chunk_ranges(&self, size: usize) -> impl Iterator<Item = (usize, Range<usize>)> {
        let size = size.max(1);
        let n = self.len();
        let chunks = n.div_ceil(size).max(usize::from(!self.invalid.is_empty()));
        (0..chunks).map(move |c| (c, c * size..((c + 1) * size).min(n)))
    }

    /// The index of the event at position `p` in processing order (the
    /// row of a call's end, with [`OrderedLog::with_ends`]).
    fn at(&self, p: usize) -> usize {
        if let Some(ends) = &self.ends {
            return ends[p].index as usize;
        }
        match &self.order {
            Some(order) => order[p] as usize,
            None => p,
        }
    }

    /// The event at position `p` in processing order.
    fn event_at(&self, p: usize) -> CallEvent {
        let i = self.at(p);
        match &self.ends {
            Some(ends) if ends[p].derived_end => self.events.end_of(i).unwrap_or_default(),
            _ => self.events.event(i),
        }
    }

    /// Whether a shard may decode its own events ([`OrderedLog::shard_events`]):
    /// the log is held in memory and its callers are numbered.
    pub fn by_shards(&self) -> bool {
        self.spill.is_none() && self.numbered
    }

    /// The rows that are not valid events, by row number.
    pub fn invalid(&self) -> &[InvalidRow] {
        &self.invalid
    }

    /// A shard's events among the positions `range` (of a log read
    /// [`OrderedLog::by_shards`]), decoded by the shard itself: those
    /// whose caller's number is `shard` modulo `shards`, handed to `f` in
    /// processing order with whether their call id is unique and their
    /// caller's number. Each shard decodes only its own events, on its own
    /// thread, rather than take every event decoded by another: an event
    /// is a few hundred bytes, the columns it comes from forty.
    pub fn shard_events(
        &self,
        range: Range<usize>,
        (shard, shards): (usize, usize),
        mut f: impl FnMut(&CallEvent, bool, u32),
    ) {
        let shards = shards.max(1) as u32;
        for p in range {
            let i = self.at(p);
            let Some(&caller) = self.callers.get(i) else {
                continue;
            };
            if (caller % shards) as usize == shard {
                f(&self.event_at(p), self.unique[i], caller);
            }
        }
    }

    /// The invalid rows for chunk `c`: all of them with the first.
    fn invalid_for(&self, c: usize) -> Vec<InvalidRow> {
        if c == 0 {
            self.invalid.clone()
        } else {
            Vec::new()
        }
    }

    /// The log in processing order, `size` events at a time. Row numbers
    /// are the file's (1-based); the invalid rows come with the first chunk.
    pub fn chunks(&self, size: usize) -> Box<dyn Iterator<Item = CallLog> + '_> {
        match &self.spill {
            Some(spill) => Box::new(
                self.spilled_chunks(spill, size)
                    .map(|(c, items)| self.spilled_call_log(c, items)),
            ),
            None => Box::new(
                self.chunk_ranges(size)
                    .map(|(c, range)| self.call_log(c, range)),
            ),
        }
    }

    /// Chunk `c` of a spilled log, its events as merged, as a [`CallLog`].
    fn spilled_call_log(&self, c: usize, items: Vec<Merged>) -> CallLog {
        let mut log = CallLog {
            events: Vec::with_capacity(items.len()),
            invalid: self.invalid_for(c),
            unique: self.spilled_unique(&items),
            callers: Vec::with_capacity(items.len()),
        };
        for (row, caller, event) in items {
            log.events.push((row, event));
            if self.numbered {
                log.callers.push(caller);
            }
        }
        log
    }

    /// Per merged event: its call id occurs on no other row.
    fn spilled_unique(&self, items: &[Merged]) -> Vec<bool> {
        let Some(spill) = &self.spill else {
            return vec![false; items.len()];
        };
        items
            .iter()
            .map(|(_, _, e)| spill.unique(&e.call_id))
            .collect()
    }

    /// Chunk `c` of a spilled log as an [`EventChunk`] (as
    /// [`OrderedLog::spilled_call_log`]).
    fn spilled_event_chunk(&self, c: usize, items: Vec<Merged>) -> EventChunk {
        EventChunk {
            unique: self.spilled_unique(&items),
            events: items.into_iter().map(|(_, _, e)| e).collect(),
            invalid: self.invalid_for(c),
        }
    }

    /// Chunk `c`, the events at positions `range`, as a [`CallLog`].
    fn call_log(&self, c: usize, range: Range<usize>) -> CallLog {
        let mut log = CallLog {
            events: Vec::with_capacity(range.len()),
            invalid: self.invalid_for(c),
            unique: Vec::with_capacity(range.len()),
            callers: Vec::with_capacity(range.len()),
        };
        for p in range {
            let i = self.at(p);
            log.events.push((self.events.row(i), self.event_at(p)));
            log.unique.push(self.unique[i]);
            if let Some(&n) = self.callers.get(i) {
                log.callers.push(n);
            }
        }
        log
    }

    /// Chunk `c`, the events at positions `range`, as an [`EventChunk`].
    fn event_chunk(&self, c: usize, range: Range<usize>) -> EventChunk {
        let mut chunk = EventChunk {
            events: Vec::with_capacity(range.len()),
            unique: Vec::with_capacity(range.len()),
            invalid: self.invalid_for(c),
        };
        for p in range {
            let i = self.at(p);
            chunk.events.push(self.event_at(p));
            chunk.unique.push(self.unique[i]);
        }
        chunk
    }

    /// Builds the chunks on a thread of its own with `build`, handing each
    /// to `send` in order, so decoding overlaps the work on the chunk
    /// before; stops when `send` returns false (the consumer is gone).
    /// Bound the channel behind `send` to bound the chunks in memory.
    fn ahead<T: 'static>(
        self: Arc<Self>,
        size: usize,
        (build, build_spilled): Builders<T>,
        mut send: impl FnMut(T) -> bool + Send + 'static,
    ) {
        std::thread::spawn(move || {
            if let Some(spill) = &self.spill {
                for (c, items) in self.spilled_chunks(spill, size) {
                    if !send(build_spilled(&self, c, items)) {
                        break;
                    }
                }
                return;
            }
            for (c, range) in self.chunk_ranges(size) {
                if !send(build(&self, c, range)) {
                    break;
                }
            }
        });
    }

    /// [`OrderedLog::chunks`], decoded on a thread of its own (see
    /// [`OrderedLog::events_ahead`]).
    pub fn decode_ahead(
        self: Arc<Self>,
        size: usize,
        send: impl FnMut(CallLog) -> bool + Send + 'static,
    ) {
        self.ahead(size, (Self::call_log, Self::spilled_call_log), send);
    }

    /// The log as [`EventChunk`]s of `size` events, in processing order,
    /// built on a thread of its own like [`OrderedLog::decode_ahead`]'s.
    pub fn events_ahead(
        self: Arc<Self>,
        size: usize,
        send: impl FnMut(EventChunk) -> bool + Send + 'static,
    ) {
        self.ahead(size, (Self::event_chunk, Self::spilled_event_chunk), send);
    }

    /// The whole log, decoded and in processing order (for small logs).
    pub fn read_all(&self) -> Result<CallLog, IoError> {
        let mut all = CallLog::default();
        for chunk in self.chunks(CHUNK_ROWS) {
            all.events.extend(chunk.events);
            all.invalid.extend(chunk.invalid);
            all.unique.extend(chunk.unique);
            all.callers.extend(chunk.callers);
        }
        all.invalid.sort_by_key(|r| r.row);
        self.check()?;
        Ok(all)
    }
}

/// How [`OrderedLog::ahead`] builds a chunk: from a range of positions in
/// memory, or from the events merged from a spill.
type Builders<T> = (
    fn(&OrderedLog, usize, Range<usize>) -> T,
    fn(&OrderedLog, usize, Vec<Merged>) -> T,
);

/// A place in the processing order of a log with its calls' ends.
#[derive(Debug, Clone, Copy)]
struct Pos {
    /// The event's index (its row's).
    index: u32,
    /// The end of the call at `index` (at its time plus its duration),
    /// not the row's event.
    derived_end: bool,
}

/// Per event: whether its call id occurs on no other event. Compares
/// 64-bit hashes ([`id_hash`]), so a collision can only make an id look
/// repeated, which is safe: it keeps its idempotency record.
fn unique_ids(events: &EventColumns) -> Vec<bool> {
    let hash = |i: usize| id_hash(events.call_id(i));
    let mut sorted: Vec<u64> = (0..events.len()).map(hash).collect();
    sorted.par_sort_unstable();
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

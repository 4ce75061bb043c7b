//! A call log longer than the sort budget, put in processing order on
//! disk: the events read so far are sorted and written to a temporary file
//! (a run) each time they reach the budget, and the runs are merged back a
//! chunk at a time. Memory holds one run while reading, and one event a run
//! (plus the calls still in progress, with their ends) while merging,
//! whatever the length or the order of the log.
//!
//! A log file already in time order, as CDR files are, is not written to
//! runs: while its events come in order, they are let go (only their call
//! ids' hashes are kept, written to disk a budget's worth at a time, 8
//! bytes a row), and the merge reads those events from the file a second
//! time ([`Prefix`]). The events are held up to the budget first, in case
//! the log fits it, unless the file's size already says it holds more
//! than twice the budget ([`crate::offline::read::estimated_rows`]); once
//! the budget is passed, each batch is let go as it comes. Memory then
//! holds no more of the log while reading than a batch and the hashes. If
//! the order breaks partway, the events from there on are sorted in runs
//! as above and merged with the file's ordered beginning. Input that cannot
//! be read twice (a pipe) is always sorted in runs.
//!
//! The order is [`super::order::OrderedLog`]'s, exactly: by time, ties in
//! file order; with the calls' ends, an end before an attempt at the same
//! millisecond and a derived end right after its row. Callers are numbered
//! by first appearance in the file, as in memory.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver};
use std::time::SystemTime;

use compact_str::CompactString;

use crate::engine::event::{CallEvent, EventKind};
use crate::error::IoError;
use crate::offline::columns::EventColumns;
use crate::offline::read::{estimated_rows, read_events_into, ReadOptions};

/// Rows a log may hold in memory to be put in processing order (about 120
/// bytes each while reading: 1.2 GB at this default); a longer log is read
/// twice when in time order, else spilled in runs of this many (about 90
/// bytes a row on disk). Ten million holds a few days of a mid-size
/// carrier's calls, which are then read once: reading twice cost `tune`
/// 1.8x its time at 10 M rows (BENCHMARKS.md).
pub const DEFAULT_SORT_ROWS: usize = 10_000_000;

/// An event as merged: its file row, its caller's number and the event.
pub type Merged = (u64, u32, CallEvent);

fn io_error(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> IoError {
    let context = context.into();
    move |source| IoError::Io { context, source }
}

/// The fewest bytes a row of a log file takes (a short call id, a caller
/// and a time, as CSV): bounds the rows a file can hold.
const MIN_ROW_BYTES: u64 = 16;

/// Collects a log's events in file order, spilling a sorted run each time
/// `budget` of them are held (or, while they come in time order from a
/// file that can be read again, letting them go).
pub struct Spiller {
    budget: usize,
    current: EventColumns,
    dir: Option<tempfile::TempDir>,
    /// Runs written to disk.
    runs: usize,
    /// Files of call id hashes written (one per run or events let go).
    id_files: usize,
    events: usize,
    ends: usize,
    numbers: foldhash::HashMap<CompactString, u32>,
    /// Whether callers are numbered ([`Spiller::unnumbered`]).
    numbered: bool,
    /// The file, when it can be read again.
    source: Option<Source>,
    /// Every event taken so far came in time order.
    in_order: bool,
    /// The time of the last event taken.
    last_ts: Option<i64>,
    /// Events let go: the file's first valid events, in time order.
    prefix: usize,
    /// Hashes of the call ids of events let go, not yet written.
    let_go_ids: Vec<u64>,
    /// The file's size says it holds more than twice the budget: its
    /// events are let go as they come while in order, not held first.
    expect_long: bool,
}

/// A log file that can be read a second time, as it was first read.
#[derive(Debug, Clone)]
pub struct Source {
    path: PathBuf,
    opts: ReadOptions,
    /// The file's length and modification time when first read.
    stamp: (u64, Option<SystemTime>),
}

impl Source {
    /// `path` as a source, when it is a regular file (not a pipe).
    fn of(path: &Path, opts: &ReadOptions) -> Option<Source> {
        let meta = std::fs::metadata(path).ok().filter(|m| m.is_file())?;
        Some(Source {
            path: path.to_path_buf(),
            opts: ReadOptions {
                progress: false,
                ..opts.clone()
            },
            stamp: (meta.len(), meta.modified().ok()),
        })
    }

    /// Fails if the file is no longer as first read.
    fn check_unchanged(&self) -> Result<(), IoError> {
        let now = std::fs::metadata(&self.path)
            .map(|m| (m.len(), m.modified().ok()))
            .map_err(io_error(format!("reading {} again", self.path.display())))?;
        if now == self.stamp {
            return Ok(());
        }
        Err(self.changed())
    }

    fn changed(&self) -> IoError {
        IoError::BadShape {
            path: self.path.clone(),
            problem: "the file changed while it was read. A log already in time order and \
                      longer than --sort-rows is read twice (rather than copied to disk): \
                      copy the file and read the copy"
                .into(),
        }
    }
}

/// A log's ordered beginning, let go while reading: its first `events`
/// valid events, read again from `source` when merged.
#[derive(Debug)]
pub struct Prefix {
    source: Source,
    events: usize,
    /// Whether its callers are numbered.
    numbered: bool,
}

/// What a [`Spiller`] holds once the log is read.
pub enum Collected {
    /// The log fit the budget: its events, in file order.
    Whole(Box<EventColumns>),
    /// The log was spilled.
    Spilled(Spill),
}

impl Spiller {
    /// A spiller holding at most `budget` events (at least one), always
    /// sorting in runs.
    pub fn new(budget: usize) -> Self {
        Spiller {
            budget: budget.max(1),
            current: EventColumns::default(),
            dir: None,
            runs: 0,
            id_files: 0,
            events: 0,
            ends: 0,
            numbers: Default::default(),
            numbered: true,
            source: None,
            in_order: true,
            last_ts: None,
            prefix: 0,
            let_go_ids: Vec::new(),
            expect_long: false,
        }
    }

    /// A spiller for the log in `path`, read with `opts`: while its events
    /// come in time order it lets them go rather than write them, to read
    /// them again from the file, when `path` is a regular file.
    pub fn rereading(budget: usize, path: &Path, opts: &ReadOptions) -> Self {
        let source = Source::of(path, opts);
        let expect_long = source.is_some()
            && estimated_rows(path, opts).is_some_and(|rows| rows / 2 > budget as u64);
        Spiller {
            source,
            expect_long,
            ..Spiller::new(budget)
        }
    }

    /// The spiller without caller numbers (all 0), for work that never
    /// uses them (a replay): no map of every caller is kept.
    pub fn unnumbered(self) -> Self {
        Spiller {
            numbered: false,
            ..self
        }
    }

    /// Takes the next events of the file, spilling a run past the budget
    /// (a log of exactly the budget stays in memory).
    pub fn take(&mut self, batch: EventColumns) -> Result<(), IoError> {
        self.note_order(&batch);
        if self.streams() {
            return self.let_go(batch);
        }
        if self.current.is_empty() {
            let mut current = EventColumns::default();
            current.reserve_like(self.expected_rows(batch.len()), &batch);
            current.append(batch);
            self.current = current;
        } else {
            self.current.append(batch);
        }
        if self.current.len() > self.budget {
            self.put_away()?;
        }
        Ok(())
    }

    /// Events to make room for when a batch of `first` starts the events
    /// held: as many as the file can hold (at [`MIN_ROW_BYTES`] a row),
    /// up to the budget. Room reserved and never filled is address space,
    /// not memory; growing by copying would leave each old copy behind
    /// (the allocator keeps freed memory mapped to use again), about as
    /// much again as the columns at their largest.
    fn expected_rows(&self, first: usize) -> usize {
        let fits = self.source.as_ref().map_or(first, |s| {
            usize::try_from(s.stamp.0 / MIN_ROW_BYTES).unwrap_or(usize::MAX)
        });
        fits.min(self.budget).max(first)
    }

    /// Whether the next batch is let go as it comes: the events so far are
    /// the file's ordered beginning, none is held, and the log is known
    /// (the budget was passed) or expected to be longer than the budget.
    fn streams(&self) -> bool {
        self.source.is_some()
            && self.in_order
            && self.current.is_empty()
            && (self.prefix > 0 || self.expect_long)
    }

    /// Notes whether `batch` keeps the events taken in time order.
    fn note_order(&mut self, batch: &EventColumns) {
        if !self.in_order {
            return;
        }
        let ts = batch.times();
        let follows = match (self.last_ts, ts.first()) {
            (Some(last), Some(&first)) => last <= first,
            _ => true,
        };
        if follows && ts.is_sorted() {
            self.last_ts = ts.last().copied().or(self.last_ts);
        } else {
            self.in_order = false;
        }
    }

    /// The events held, let go while they are the file's ordered
    /// beginning, else written as a run.
    fn put_away(&mut self) -> Result<(), IoError> {
        if self.source.is_some() && self.in_order {
            let events = std::mem::take(&mut self.current);
            self.let_go(events)
        } else {
            self.spill()
        }
    }

    /// The log as read: whole when it never reached the budget.
    pub fn finish(mut self) -> Result<Collected, IoError> {
        if self.dir.is_none() {
            return Ok(Collected::Whole(Box::new(self.current)));
        }
        if !self.current.is_empty() {
            self.put_away()?;
        }
        self.write_let_go_ids()?;
        let Some(dir) = self.dir else {
            return Ok(Collected::Whole(Box::new(self.current)));
        };
        let prefix = match self.source {
            Some(source) if self.prefix > 0 => Some(Box::new(Prefix {
                source,
                events: self.prefix,
                numbered: self.numbered,
            })),
            _ => None,
        };
        if self.runs == 0 {
            tracing::info!(
                events = self.events,
                by_its_size = self.expect_long,
                "the log is longer than --sort-rows ({}) and in time order: \
                 read from the file a second time, not sorted on disk",
                self.budget
            );
        } else {
            tracing::info!(
                events = self.events,
                runs = self.runs,
                in_order = self.prefix,
                "the log is longer than --sort-rows ({}): put in time order on disk \
                 (its first events in order read from the file a second time)",
                self.budget
            );
        }
        let repeated = repeated_ids(dir.path(), self.id_files)?;
        Ok(Collected::Spilled(Spill {
            dir,
            runs: self.runs,
            prefix,
            events: self.events,
            ends: self.ends,
            repeated,
        }))
    }

    /// The directory of the runs and id hashes, made on first use.
    fn dir(&mut self) -> Result<PathBuf, IoError> {
        if let Some(dir) = &self.dir {
            return Ok(dir.path().to_path_buf());
        }
        let dir = tempfile::Builder::new()
            .prefix("callguard-sort-")
            .tempdir()
            .map_err(io_error("creating a directory for the sort's runs"))?;
        let path = dir.path().to_path_buf();
        self.dir = Some(dir);
        Ok(path)
    }

    /// Numbers the callers of `events` not seen before, in file order (as
    /// in memory); each event's caller number (none when unnumbered).
    fn number(&mut self, events: &EventColumns) -> Vec<u32> {
        if !self.numbered {
            return Vec::new();
        }
        (0..events.len())
            .map(|i| number_of(&mut self.numbers, events.caller(i)))
            .collect()
    }

    /// Lets `events` go, the next of the log's ordered beginning: their
    /// callers are numbered, their ends counted and their call ids' hashes
    /// kept (written a budget's worth at a time); the merge reads them from
    /// the file again.
    fn let_go(&mut self, events: EventColumns) -> Result<(), IoError> {
        // (The directory marks the log as spilled, hashes written or not.)
        self.dir()?;
        self.number(&events);
        self.ends += (0..events.len()).filter(|&i| events.has_end(i)).count();
        self.let_go_ids
            .extend((0..events.len()).map(|i| id_hash(events.call_id(i))));
        self.events += events.len();
        self.prefix += events.len();
        if self.let_go_ids.len() >= self.budget {
            self.write_let_go_ids()?;
        }
        Ok(())
    }

    /// Writes the hashes of the events let go and not yet written.
    fn write_let_go_ids(&mut self) -> Result<(), IoError> {
        if self.let_go_ids.is_empty() {
            return Ok(());
        }
        let dir = self.dir()?;
        let hashes = std::mem::take(&mut self.let_go_ids);
        write_sorted_hashes(&hashes_path(&dir, self.id_files), hashes)?;
        self.id_files += 1;
        Ok(())
    }

    /// Writes the events held as a run, in processing order (by time,
    /// ties in file order), each with its caller's number.
    fn spill(&mut self) -> Result<(), IoError> {
        let events = std::mem::take(&mut self.current);
        let dir = self.dir()?;
        let path = run_path(&dir, self.runs);
        // Numbered in file order, as in memory; events decoded one at a
        // time as written.
        let numbers = self.number(&events);
        let ts = events.times();
        let mut order: Vec<u32> = (0..events.len() as u32).collect();
        if !ts.is_sorted() {
            order.sort_by_key(|&i| ts[i as usize]);
        }
        let context = format!("writing the sort's run {}", path.display());
        let file = File::create(&path).map_err(io_error(context.clone()))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        for &i in &order {
            let i = i as usize;
            let event = events.event(i);
            let number = numbers.get(i).copied().unwrap_or(0);
            write_event(&mut w, events.row(i), number, &event)
                .map_err(io_error(context.clone()))?;
            self.ends += usize::from(has_end(&event));
        }
        w.flush().map_err(io_error(context))?;
        let hashes = (0..events.len()).map(|i| id_hash(events.call_id(i)));
        write_sorted_hashes(&hashes_path(&dir, self.id_files), hashes.collect())?;
        self.id_files += 1;
        self.events += events.len();
        self.runs += 1;
        Ok(())
    }
}

/// `caller`'s number in `numbers`, the next one if it is new (callers
/// numbered by first appearance).
fn number_of(numbers: &mut foldhash::HashMap<CompactString, u32>, caller: CompactString) -> u32 {
    let next = numbers.len() as u32;
    *numbers.entry(caller).or_insert(next)
}

fn run_path(dir: &Path, run: usize) -> PathBuf {
    dir.join(format!("run-{run}.bin"))
}

fn hashes_path(dir: &Path, run: usize) -> PathBuf {
    dir.join(format!("ids-{run}.bin"))
}

/// A call id's 64-bit hash, for telling ids that occur once in a log
/// (the in-memory order's and the spill's alike). A collision can only make
/// an id look repeated, which is safe: it keeps its idempotency record.
pub fn id_hash(id: &str) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0x0069_6473).hash_one(id)
}

/// Writes call ids' `hashes`, sorted, to `path`.
fn write_sorted_hashes(path: &Path, mut hashes: Vec<u64>) -> Result<(), IoError> {
    let context = format!("writing the sort's id hashes {}", path.display());
    hashes.sort_unstable();
    let file = File::create(path).map_err(io_error(context.clone()))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    for h in hashes {
        w.write_all(&h.to_le_bytes())
            .map_err(io_error(context.clone()))?;
    }
    w.flush().map_err(io_error(context))
}

/// The hashes that occur more than once over all runs' sorted id hashes
/// (merged from disk, then removed): the log's repeated call ids.
fn repeated_ids(dir: &Path, files: usize) -> Result<foldhash::HashSet<u64>, IoError> {
    let next = |r: &mut BufReader<File>, path: &Path| -> Result<Option<u64>, IoError> {
        let mut b = [0u8; 8];
        match r.read_exact(&mut b) {
            Ok(()) => Ok(Some(u64::from_le_bytes(b))),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
            Err(e) => Err(io_error(format!("reading {}", path.display()))(e)),
        }
    };
    let mut readers = Vec::with_capacity(files);
    let mut heap = BinaryHeap::with_capacity(files);
    for run in 0..files {
        let path = hashes_path(dir, run);
        let file = File::open(&path).map_err(io_error(format!("reading {}", path.display())))?;
        let mut r = BufReader::with_capacity(1 << 16, file);
        if let Some(h) = next(&mut r, &path)? {
            heap.push(Reverse((h, run)));
        }
        readers.push((r, path));
    }
    let mut repeated = foldhash::HashSet::default();
    let mut last = None;
    while let Some(Reverse((h, run))) = heap.pop() {
        if last == Some(h) {
            repeated.insert(h);
        }
        last = Some(h);
        let (r, path) = &mut readers[run];
        if let Some(h) = next(r, path)? {
            heap.push(Reverse((h, run)));
        }
    }
    for (_, path) in readers {
        // (Gone with the directory anyway; removed now to free the disk.)
        let _ = std::fs::remove_file(path);
    }
    Ok(repeated)
}

/// A log's events spilled in sorted runs (removed with it).
pub struct Spill {
    dir: tempfile::TempDir,
    /// Runs written to disk.
    runs: usize,
    /// The log's ordered beginning, read from the file again.
    prefix: Option<Box<Prefix>>,
    events: usize,
    ends: usize,
    /// Hashes of the call ids that occur more than once in the log.
    repeated: foldhash::HashSet<u64>,
}

impl Spill {
    /// Whether call id `id` occurs on no other row of the log (as the
    /// in-memory order tells it).
    pub fn unique(&self, id: &str) -> bool {
        !self.repeated.contains(&id_hash(id))
    }

    /// The events spilled (the rows' events, not their derived ends).
    pub fn events(&self) -> usize {
        self.events
    }

    /// Runs written to disk (none for a log file in time order).
    pub fn runs(&self) -> usize {
        self.runs
    }

    /// The events read from the file a second time rather than written to
    /// runs: the log's beginning that came in time order.
    pub fn reread(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.events)
    }

    /// The events in processing order, and with `ends` the derived ends of
    /// the calls with a duration, each with its row and caller number.
    pub fn merge(&self, ends: bool) -> Result<Merge, IoError> {
        let mut merge = Merge {
            runs: Vec::with_capacity(self.runs + 1),
            heads: BinaryHeap::with_capacity(self.runs + 1),
            pending: BinaryHeap::new(),
            group: VecDeque::new(),
            ends,
        };
        if let Some(prefix) = &self.prefix {
            merge.runs.push(Run::File(Box::new(Reread::start(prefix)?)));
        }
        for run in 0..self.runs {
            let path = run_path(self.dir.path(), run);
            let file = File::open(&path).map_err(io_error(format!(
                "reading the sort's run {}",
                path.display()
            )))?;
            merge
                .runs
                .push(Run::Disk(BufReader::with_capacity(1 << 16, file), path));
        }
        for run in 0..merge.runs.len() {
            merge.refill(run)?;
        }
        Ok(merge)
    }

    /// Events in processing order: the rows' events, and with `ends` the
    /// derived ends.
    pub fn len(&self, ends: bool) -> usize {
        self.events + if ends { self.ends } else { 0 }
    }
}

/// The head of a run: its next event, ordered by (time, row).
struct Head {
    ts: i64,
    row: u64,
    run: usize,
    caller: u32,
    event: CallEvent,
}

impl PartialEq for Head {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Head {}
impl PartialOrd for Head {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Head {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.ts, self.row).cmp(&(other.ts, other.row))
    }
}

/// An event placed in processing order by its key: (time, class, row,
/// derived end), class 0 for ends (with `ends`) and 1 for attempts.
struct Placed {
    key: (i64, u8, u64, u8),
    caller: u32,
    event: CallEvent,
}

impl PartialEq for Placed {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}
impl Eq for Placed {}
impl PartialOrd for Placed {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Placed {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key.cmp(&other.key)
    }
}

/// A source of events in processing order, merged with the others.
enum Run {
    /// A run written to disk.
    Disk(BufReader<File>, PathBuf),
    /// The log's ordered beginning, read from its file again.
    File(Box<Reread>),
}

impl Run {
    /// The run's next event; `None` at its end.
    fn next(&mut self) -> Result<Option<Merged>, IoError> {
        match self {
            Run::Disk(reader, path) => read_event(reader).map_err(io_error(format!(
                "reading the sort's run {}",
                path.display()
            ))),
            Run::File(reread) => reread.next(),
        }
    }
}

/// A log file's ordered beginning read a second time, on a thread of its
/// own, its callers numbered again by first appearance (the same numbers:
/// the beginning was numbered first).
struct Reread {
    batches: Receiver<Result<EventColumns, IoError>>,
    batch: EventColumns,
    at: usize,
    /// Events still to hand out.
    left: usize,
    last_ts: i64,
    /// The callers' numbers; `None` when unnumbered (all 0).
    numbers: Option<foldhash::HashMap<CompactString, u32>>,
    source: Source,
}

impl Reread {
    fn start(prefix: &Prefix) -> Result<Self, IoError> {
        prefix.source.check_unchanged()?;
        let (tx, batches) = sync_channel(2);
        let (path, opts, want) = (
            prefix.source.path.clone(),
            prefix.source.opts.clone(),
            prefix.events,
        );
        std::thread::spawn(move || {
            let mut sent = 0;
            let read = read_events_into(&path, &opts, &mut |batch| {
                sent += batch.len();
                let stop = || IoError::Io {
                    context: "the second read stopped".into(),
                    source: std::io::ErrorKind::Interrupted.into(),
                };
                tx.send(Ok(batch)).map_err(|_| stop())?;
                // The rest of the file was sorted in runs.
                if sent >= want {
                    return Err(stop());
                }
                Ok(())
            });
            if let Err(e) = read {
                if sent < want {
                    let _ = tx.send(Err(e));
                }
            }
        });
        Ok(Reread {
            batches,
            batch: EventColumns::default(),
            at: 0,
            left: prefix.events,
            last_ts: i64::MIN,
            numbers: prefix.numbered.then(Default::default),
            source: prefix.source.clone(),
        })
    }

    fn next(&mut self) -> Result<Option<Merged>, IoError> {
        if self.left == 0 {
            return Ok(None);
        }
        while self.at >= self.batch.len() {
            match self.batches.recv() {
                Ok(Ok(batch)) => (self.batch, self.at) = (batch, 0),
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(self.source.changed()),
            }
        }
        let i = self.at;
        self.at += 1;
        self.left -= 1;
        if self.left == 0 {
            // Written to while read again: its events may not be the ones
            // counted the first time.
            self.source.check_unchanged()?;
        }
        let event = self.batch.event(i);
        // Read in order the first time: out of order now, it changed.
        if event.ts_ms < self.last_ts {
            return Err(self.source.changed());
        }
        self.last_ts = event.ts_ms;
        let caller = match &mut self.numbers {
            Some(numbers) => number_of(numbers, self.batch.caller(i)),
            None => 0,
        };
        Ok(Some((self.batch.row(i), caller, event)))
    }
}

/// The runs merged into processing order (see [`Spill::merge`]).
pub struct Merge {
    runs: Vec<Run>,
    heads: BinaryHeap<Reverse<Head>>,
    /// Derived ends later than the events merged so far.
    pending: BinaryHeap<Reverse<Placed>>,
    /// Events of the millisecond being handed out, in order.
    group: VecDeque<Placed>,
    ends: bool,
}

impl Merge {
    /// Reads run `run`'s next event into the heads.
    fn refill(&mut self, run: usize) -> Result<(), IoError> {
        if let Some((row, caller, event)) = self.runs[run].next()? {
            self.heads.push(Reverse(Head {
                ts: event.ts_ms,
                row,
                run,
                caller,
                event,
            }));
        }
        Ok(())
    }

    /// Gathers every event of the earliest millisecond left (rows' events
    /// and derived ends) into `group`, in order; false when none is left.
    fn fill_group(&mut self) -> Result<bool, IoError> {
        let head = self.heads.peek().map(|h| h.0.ts);
        let end = self.pending.peek().map(|p| p.0.key.0);
        let t = match (head, end) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) => a,
            (None, Some(b)) => b,
            (None, None) => return Ok(false),
        };
        let mut group = Vec::new();
        while self.heads.peek().is_some_and(|h| h.0.ts == t) {
            let Some(Reverse(head)) = self.heads.pop() else {
                break;
            };
            self.refill(head.run)?;
            // A derived end at this very millisecond (a duration of 0)
            // joins the group below, with the pending ones.
            if let Some(end) = self.ends.then(|| end_of(&head.event)).flatten() {
                self.pending.push(Reverse(Placed {
                    key: (end.ts_ms, 0, head.row, 1),
                    caller: head.caller,
                    event: end,
                }));
            }
            let class = u8::from(self.ends && head.event.kind != EventKind::End);
            group.push(Placed {
                key: (t, class, head.row, 0),
                caller: head.caller,
                event: head.event,
            });
        }
        while self.pending.peek().is_some_and(|p| p.0.key.0 == t) {
            if let Some(Reverse(placed)) = self.pending.pop() {
                group.push(placed);
            }
        }
        group.sort_unstable();
        self.group.extend(group);
        Ok(true)
    }
}

impl Iterator for Merge {
    type Item = Result<Merged, IoError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.group.is_empty() {
            match self.fill_group() {
                Ok(true) => {}
                Ok(false) => return None,
                Err(e) => return Some(Err(e)),
            }
        }
        self.group
            .pop_front()
            .map(|p| Ok((p.key.2, p.caller, p.event)))
    }
}

/// Whether a call-log row has an end of its own: an attempt with a
/// duration (as [`EventColumns::has_end`]).
fn has_end(e: &CallEvent) -> bool {
    e.kind == EventKind::Attempt && e.duration_ms.is_some()
}

/// A call-log row's end, when it is an attempt with a duration: the end
/// [`EventColumns::end_of`] gives for it.
pub fn end_of(e: &CallEvent) -> Option<CallEvent> {
    let duration = e.duration_ms.filter(|_| has_end(e))?;
    Some(CallEvent {
        call_id: e.call_id.clone(),
        caller: e.caller.clone(),
        ts_ms: e.ts_ms.saturating_add(duration),
        callee: e.callee.clone(),
        kind: EventKind::End,
        talk_ms: e.talk_ms,
        account: e.account.clone(),
        list_number: e.list_number.clone(),
        filter_callee: e.filter_callee.clone(),
        ..Default::default()
    })
}

// A run's record: ts (i64), row (u64), caller number (u32), flags (u8),
// then the duration and talk time (i64) when present, then the texts, each
// a u32 length and its bytes: call id, caller, and when present callee,
// account, list number, filter callee. Little-endian.
const END: u8 = 1;
const DURATION: u8 = 2;
const TALK: u8 = 4;
const LABELLED: u8 = 8;
const FRAUD: u8 = 16;
const CALLEE: u8 = 32;
const ACCOUNT: u8 = 64;
const LIST_NUMBER: u8 = 128;
// A second flags byte.
const FILTER_CALLEE: u8 = 1;

fn write_text(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u32).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_event(w: &mut impl Write, row: u64, caller: u32, e: &CallEvent) -> std::io::Result<()> {
    let mut flags = 0u8;
    flags |= if e.kind == EventKind::End { END } else { 0 };
    flags |= if e.duration_ms.is_some() { DURATION } else { 0 };
    flags |= if e.talk_ms.is_some() { TALK } else { 0 };
    flags |= if e.label.is_some() { LABELLED } else { 0 };
    flags |= if e.label == Some(true) { FRAUD } else { 0 };
    flags |= if e.callee.is_some() { CALLEE } else { 0 };
    flags |= if e.account.is_some() { ACCOUNT } else { 0 };
    flags |= if e.list_number.is_some() {
        LIST_NUMBER
    } else {
        0
    };
    let more = if e.filter_callee.is_some() {
        FILTER_CALLEE
    } else {
        0
    };
    w.write_all(&e.ts_ms.to_le_bytes())?;
    w.write_all(&row.to_le_bytes())?;
    w.write_all(&caller.to_le_bytes())?;
    w.write_all(&[flags, more])?;
    for v in [e.duration_ms, e.talk_ms].into_iter().flatten() {
        w.write_all(&v.to_le_bytes())?;
    }
    write_text(w, &e.call_id)?;
    write_text(w, &e.caller)?;
    let texts = [
        e.callee.as_deref(),
        e.account.as_deref(),
        e.list_number.as_deref(),
        e.filter_callee.as_deref(),
    ];
    for s in texts.into_iter().flatten() {
        write_text(w, s)?;
    }
    Ok(())
}

fn read_array<const N: usize>(r: &mut impl Read) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn read_text(r: &mut impl Read) -> std::io::Result<CompactString> {
    let len = u32::from_le_bytes(read_array(r)?) as usize;
    let mut bytes = vec![0u8; len];
    r.read_exact(&mut bytes)?;
    CompactString::from_utf8(bytes).map_err(std::io::Error::other)
}

/// The next record of a run; `None` at its end.
fn read_event(r: &mut impl Read) -> std::io::Result<Option<Merged>> {
    let mut first = [0u8; 8];
    match r.read_exact(&mut first) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let ts_ms = i64::from_le_bytes(first);
    let row = u64::from_le_bytes(read_array(r)?);
    let caller = u32::from_le_bytes(read_array(r)?);
    let [flags, more] = read_array(r)?;
    let duration_ms = if flags & DURATION != 0 {
        Some(i64::from_le_bytes(read_array(r)?))
    } else {
        None
    };
    let talk_ms = if flags & TALK != 0 {
        Some(i64::from_le_bytes(read_array(r)?))
    } else {
        None
    };
    let call_id = read_text(r)?;
    let caller_number = read_text(r)?;
    let mut text = |bit: bool| -> std::io::Result<Option<CompactString>> {
        if bit {
            read_text(r).map(Some)
        } else {
            Ok(None)
        }
    };
    let callee = text(flags & CALLEE != 0)?;
    let account = text(flags & ACCOUNT != 0)?;
    let list_number = text(flags & LIST_NUMBER != 0)?.map(String::from);
    let filter_callee = text(more & FILTER_CALLEE != 0)?;
    let event = CallEvent {
        call_id,
        caller: caller_number,
        ts_ms,
        callee,
        kind: if flags & END != 0 {
            EventKind::End
        } else {
            EventKind::Attempt
        },
        duration_ms,
        talk_ms,
        account,
        label: (flags & LABELLED != 0).then_some(flags & FRAUD != 0),
        list_number,
        filter_callee,
        ..Default::default()
    };
    Ok(Some((row, caller, event)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_as_written() {
        let full = CallEvent {
            call_id: "c-1".into(),
            caller: "+34600000001".into(),
            ts_ms: -5,
            callee: Some("+900123".into()),
            kind: EventKind::End,
            duration_ms: Some(0),
            talk_ms: Some(12),
            account: Some("trunk-7".into()),
            label: Some(true),
            list_number: Some("+34911".into()),
            filter_callee: Some("+9001".into()),
            ..Default::default()
        };
        let bare = CallEvent {
            label: Some(false),
            ..CallEvent::new("x", "p:ab", i64::MAX)
        };
        let mut buf = Vec::new();
        write_event(&mut buf, 7, 3, &full).unwrap();
        write_event(&mut buf, u64::MAX, 0, &bare).unwrap();
        let mut r = &buf[..];
        assert_eq!(read_event(&mut r).unwrap(), Some((7, 3, full)));
        assert_eq!(read_event(&mut r).unwrap(), Some((u64::MAX, 0, bare)));
        assert_eq!(read_event(&mut r).unwrap(), None);
    }

    fn columns(rows: std::ops::Range<u64>) -> EventColumns {
        let mut c = EventColumns::default();
        for r in rows {
            c.push(r, &CallEvent::new(format!("c{r}"), "+341", r as i64));
        }
        c
    }

    /// A file of `rows` lines after a header: a source a spiller may read
    /// again (the spillers below are given events of their own; the file
    /// only tells its size).
    fn file_of(rows: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "call_id,caller,ts").unwrap();
        for r in 0..rows {
            writeln!(f, "c{r},+341,{r}").unwrap();
        }
        f
    }

    /// Feeds a spiller of budget 10 reading a file of `file_rows` the
    /// batches `steps` (rows of events), checking after each the events
    /// let go and held; returns what it collected.
    fn feed(file_rows: usize, steps: &[(std::ops::Range<u64>, (usize, usize))]) -> Collected {
        let file = file_of(file_rows);
        let mut s = Spiller::rereading(10, file.path(), &ReadOptions::default());
        for (rows, let_go_and_held) in steps {
            s.take(columns(rows.clone())).unwrap();
            assert_eq!(
                (s.prefix, s.current.len()),
                *let_go_and_held,
                "after {rows:?}"
            );
        }
        s.finish().unwrap()
    }

    #[test]
    fn an_ordered_file_of_more_than_twice_the_budget_is_let_go_as_it_comes() {
        // The third batch breaks the order: from there on, events are
        // held for runs.
        let steps = [(0..6, (6, 0)), (6..9, (9, 0)), (3..5, (9, 2))];
        let Collected::Spilled(spill) = feed(100, &steps) else {
            panic!("a log let go was kept whole")
        };
        assert_eq!((spill.runs, spill.events, spill.reread()), (1, 11, 9));
        assert_eq!(spill.repeated.len(), 2, "c3 and c4 occur twice");
    }

    #[test]
    fn an_ordered_file_that_may_fit_is_held_up_to_the_budget_then_let_go() {
        // Past the budget, each batch goes as it comes.
        let steps = [(0..6, (0, 6)), (6..12, (12, 0)), (12..14, (14, 0))];
        let Collected::Spilled(spill) = feed(20, &steps) else {
            panic!("a log over the budget was kept whole")
        };
        assert_eq!((spill.runs, spill.events, spill.reread()), (0, 14, 14));
        assert!(spill.repeated.is_empty());
        let whole = feed(20, &[(0..10, (0, 10))]);
        assert!(matches!(whole, Collected::Whole(c) if c.len() == 10));
    }

    #[test]
    fn a_log_of_exactly_the_budget_stays_in_memory() {
        let mut s = Spiller::new(10);
        s.take(columns(0..6)).unwrap();
        s.take(columns(6..10)).unwrap();
        assert!(matches!(s.finish().unwrap(), Collected::Whole(c) if c.len() == 10));
        let mut s = Spiller::new(10);
        s.take(columns(0..10)).unwrap();
        s.take(columns(10..11)).unwrap();
        match s.finish().unwrap() {
            Collected::Spilled(spill) => {
                assert_eq!((spill.runs, spill.events, spill.reread()), (1, 11, 0))
            }
            Collected::Whole(_) => panic!("a log over the budget was kept whole"),
        }
    }

    #[test]
    fn a_cut_record_is_an_error_not_an_end() {
        let mut buf = Vec::new();
        write_event(&mut buf, 1, 0, &CallEvent::new("a", "+341", 1)).unwrap();
        let mut r = &buf[..buf.len() - 1];
        assert!(read_event(&mut r).is_err());
    }
}

//! `callguard replay`: historical call logs through the same window algorithm.
//!
//! Events are sorted stably by event time (ties keep file order) and applied
//! through a [`ReplayStore`]: the in-memory store split by caller over the
//! cores by default (pipelined chunk by chunk), or any [`WindowStore`]
//! (Redis), in batches, which must produce the same records.

use crate::engine::aggregate::{Gate, MemoryLedger};
use crate::engine::pool::Pools;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use polars::prelude::DataFrame;

use crate::engine::event::{CallEvent, EventKind};
use crate::engine::record::{Row, Schema, Verdict};
use crate::engine::rules::RuleSet;
use crate::error::{IoError, ReplayError, StoreError};
use crate::offline::order::{EventChunk, OrderedLog, CHUNK_ROWS};
use crate::offline::read::{self, polars_err, CallLog, InvalidRow, ReadOptions};
use crate::offline::table::{self, write_invalid, BackgroundWriter};
use crate::progress::progress_bar;
use crate::store::sharded::{decide_share, merge_in_order, split_by_caller, ShardedStore};
use crate::store::WindowStore;

/// What a replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplaySummary {
    /// Valid events decided.
    pub events: u64,
    /// Rows that were not valid events.
    pub invalid: u64,
    /// Calls rejected.
    pub rejected: u64,
    /// Calls shadow mode let through that would have been rejected.
    pub would_reject: u64,
    /// Distinct callers with at least one (would-be) rejected call.
    pub rejected_callers: u64,
    /// Events whose call id had been decided before.
    pub duplicates: u64,
    /// Events later than the grace period.
    pub late: u64,
}

impl ReplaySummary {
    /// Summarises verdicts.
    pub fn new(verdicts: &[Verdict], invalid: usize) -> Self {
        let mut tally = Tally::default();
        tally.add(verdicts);
        tally.finish(invalid)
    }
}

/// Calls that were (or in shadow mode would have been) rejected, and their
/// callers; with labels, how many were fraud and how many legit. The one
/// tally of rejections that `replay` and `tune` share.
#[derive(Debug, Default)]
pub struct Rejections {
    /// Calls rejected or that shadow mode would reject.
    pub calls: u64,
    /// Of those, calls labelled fraud.
    pub fraud_calls: u64,
    /// Of those, calls labelled legit.
    pub legit_calls: u64,
    /// Their distinct callers.
    pub callers: foldhash::HashSet<compact_str::CompactString>,
}

impl Rejections {
    /// Counts one decided call, if it was (or would have been) rejected;
    /// `label` is the event's ground truth, if known.
    pub fn add(&mut self, verdict: &Verdict, label: Option<bool>) {
        if verdict.record.would_reject() {
            self.add_rejected(verdict, label);
        }
    }

    /// Counts one call the caller has found rejected.
    pub fn add_rejected(&mut self, verdict: &Verdict, label: Option<bool>) {
        let r = &verdict.record;
        self.calls += 1;
        self.fraud_calls += u64::from(label == Some(true));
        self.legit_calls += u64::from(label == Some(false));
        if !self.callers.contains(&r.caller) {
            self.callers.insert(r.caller.clone());
        }
    }
}

/// A summary being counted, chunk by chunk (or shard by shard: tallies of
/// disjoint sets of verdicts add up with [`Tally::merge`]).
#[derive(Default)]
struct Tally {
    summary: ReplaySummary,
    rejections: Rejections,
}

impl Tally {
    fn add<'a>(&mut self, verdicts: impl IntoIterator<Item = &'a Verdict>) {
        let s = &mut self.summary;
        // A call's end is no decision: not counted.
        for v in verdicts.into_iter().filter(|v| !v.end) {
            let r = &v.record;
            s.events += 1;
            s.would_reject += u64::from(r.shadow);
            s.duplicates += u64::from(v.duplicate);
            s.late += u64::from(r.late);
            self.rejections.add(v, None);
        }
    }

    /// Adds another tally's counts (its callers joined to these).
    fn merge(&mut self, other: Tally) {
        let (s, o) = (&mut self.summary, other.summary);
        s.events += o.events;
        s.would_reject += o.would_reject;
        s.duplicates += o.duplicates;
        s.late += o.late;
        let (r, o) = (&mut self.rejections, other.rejections);
        r.calls += o.calls;
        r.fraud_calls += o.fraud_calls;
        r.legit_calls += o.legit_calls;
        r.callers.extend(o.callers);
    }

    fn finish(self, invalid: usize) -> ReplaySummary {
        ReplaySummary {
            rejected: self.rejections.calls - self.summary.would_reject,
            rejected_callers: self.rejections.callers.len() as u64,
            invalid: invalid as u64,
            ..self.summary
        }
    }
}

/// What a streamed replay leaves besides its output.
#[derive(Debug, Default)]
pub struct Streamed {
    /// The summary of all verdicts.
    pub summary: ReplaySummary,
    /// Invalid rows, by row number.
    pub invalid: Vec<InvalidRow>,
}

/// A chunk's verdicts: in order, or as the shards' shares, which are put
/// in order only by reference (a verdict is a few hundred bytes; moving
/// every one into a merged list was a tenth of the main thread's work).
enum Verdicts {
    InOrder(Vec<Verdict>),
    Shares {
        /// Per event, its shard.
        of: Vec<usize>,
        /// Per shard, its events' verdicts in their order.
        shares: Vec<Vec<Verdict>>,
    },
}

/// A chunk of a log, decided: its time-sorted events and their verdicts,
/// index for index.
pub struct DecidedChunk {
    /// The events.
    pub events: Vec<CallEvent>,
    verdicts: Verdicts,
}

impl DecidedChunk {
    /// The chunk without its call ends ([`EventKind::End`]: applied, not
    /// decided), so no output writes them.
    fn without_ends(self) -> Self {
        if !self.events.iter().any(|e| e.kind == EventKind::End) {
            return self;
        }
        let (events, verdicts) = self.into_parts();
        let (events, verdicts) = events
            .into_iter()
            .zip(verdicts)
            .filter(|(e, _)| e.kind != EventKind::End)
            .unzip();
        DecidedChunk {
            events,
            verdicts: Verdicts::InOrder(verdicts),
        }
    }

    /// The verdicts, in the events' order.
    pub fn verdicts(&self) -> Vec<&Verdict> {
        match &self.verdicts {
            Verdicts::InOrder(v) => v.iter().collect(),
            Verdicts::Shares { of, shares } => merge_in_order(of, shares.iter().map(|s| s.iter())),
        }
    }

    /// The chunk as output rows, in order.
    pub fn rows(&self) -> Vec<Row<'_>> {
        self.events
            .iter()
            .zip(self.verdicts())
            .map(|(event, verdict)| Row { event, verdict })
            .collect()
    }

    /// The events and their verdicts, in order.
    pub fn into_parts(self) -> (Vec<CallEvent>, Vec<Verdict>) {
        let verdicts = match self.verdicts {
            Verdicts::InOrder(v) => v,
            Verdicts::Shares { of, shares } => {
                merge_in_order(&of, shares.into_iter().map(Vec::into_iter))
            }
        };
        (self.events, verdicts)
    }
}

/// The store a replay decides through, and so how it is driven: chosen
/// where the store is opened.
pub enum ReplayStore<S> {
    /// The in-memory store split by caller over the cores: each shard
    /// decides on a thread of its own while the chunk before is merged and
    /// written.
    Sharded(ShardedStore),
    /// Any store, in batches of [`REPLAY_BATCH`].
    Batched(S),
}

/// Events per store call of a batched replay. Larger than `consume`'s: no
/// caller waits on a replay's answer, the cached store pipelines a batch's
/// commits group after group, and every batch's end drains that pipeline.
/// 4,096 against 512: about 1.7x the events/s of `replay --store redis` on
/// a million calls, the same records (BENCHMARKS.md). 16,384 was faster
/// still, but a batch's pool script call then ran past the 2 s Redis
/// timeout on a loaded machine.
pub const REPLAY_BATCH: usize = 4096;

/// Replays an [`OrderedLog`] a chunk at a time through a store; `sink` gets
/// each chunk decided, in order (its invalid rows are gathered apart).
/// Memory holds the log's columns, the store's state and a few chunks.
pub async fn run_ordered<S: WindowStore>(
    log: Arc<OrderedLog>,
    rules: &RuleSet,
    store: &mut ReplayStore<S>,
    progress: bool,
    mut sink: impl FnMut(DecidedChunk) -> Result<(), IoError>,
) -> Result<Streamed, ReplayError> {
    let store = match store {
        ReplayStore::Sharded(sharded) => return run_sharded(log, rules, sharded, progress, sink),
        ReplayStore::Batched(store) => store,
    };
    let mut replaying = Replaying::new(&log, progress);
    let (tx, mut chunks) = tokio::sync::mpsc::channel(2);
    Arc::clone(&log).events_ahead(CHUNK_ROWS, move |c| tx.blocking_send(c).is_ok());
    while let Some(chunk) = chunks.recv().await {
        // (A batched store keeps every record: the unique-id hint serves
        // the sharded in-memory replay only.)
        let EventChunk {
            events, invalid, ..
        } = chunk;
        let verdicts = apply_events(&events, rules, store).await?;
        replaying.tally.add(&verdicts);
        let chunk = DecidedChunk {
            events,
            verdicts: Verdicts::InOrder(verdicts),
        };
        replaying.decided(chunk, invalid, &mut sink)?;
    }
    log.check()?;
    Ok(replaying.finish())
}

/// A chunk's verdicts settled by the pools (in processing order), the
/// chunk handed on in order.
fn settle_pools(pools: &mut Pools, rules: &RuleSet, chunk: DecidedChunk) -> DecidedChunk {
    let (events, verdicts) = chunk.into_parts();
    let mut verdicts: Vec<Option<Verdict>> = verdicts.into_iter().map(Some).collect();
    pools.apply(rules, &events, &mut verdicts);
    crate::store::settle_by_model(rules, verdicts.iter_mut().flatten());
    DecidedChunk {
        events,
        verdicts: Verdicts::InOrder(verdicts.into_iter().flatten().collect()),
    }
}

/// A streamed replay's progress: the bar, the tally and the invalid rows.
struct Replaying {
    bar: indicatif::ProgressBar,
    tally: Tally,
    invalid: Vec<InvalidRow>,
}

impl Replaying {
    fn new(log: &OrderedLog, progress: bool) -> Self {
        Replaying {
            bar: progress_bar(log.rows() as u64, progress, "replaying"),
            tally: Tally::default(),
            invalid: Vec::new(),
        }
    }

    /// Hands a decided (and tallied) chunk to the sink.
    fn decided(
        &mut self,
        chunk: DecidedChunk,
        invalid: Vec<InvalidRow>,
        sink: &mut impl FnMut(DecidedChunk) -> Result<(), IoError>,
    ) -> Result<(), IoError> {
        let chunk = chunk.without_ends();
        self.bar
            .inc((chunk.events.len() + read::not_kept(&invalid)) as u64);
        self.invalid.extend(invalid);
        sink(chunk)
    }

    fn finish(mut self) -> Streamed {
        self.bar.finish_and_clear();
        self.invalid.sort_by_key(|r| r.row);
        Streamed {
            summary: self.tally.finish(read::not_kept(&self.invalid)),
            invalid: self.invalid,
        }
    }
}

/// One shard's share of a chunk: the indices of its callers' events.
struct ShardJob {
    events: Arc<Vec<CallEvent>>,
    unique: Arc<Vec<bool>>,
    idx: Vec<usize>,
}

/// A chunk whose shares are with the shards.
struct InFlight {
    events: Arc<Vec<CallEvent>>,
    /// Per event, its shard.
    of: Vec<usize>,
    invalid: Vec<InvalidRow>,
}

/// [`run_ordered`] on the in-memory store split by caller, pipelined: each
/// shard decides (and tallies) its callers' events on a thread of its own
/// for the whole run, a chunk as soon as it is split, while this thread
/// hands the chunk before, its verdicts put in processing order, to the
/// sink. Each shard sees its callers' events in the same order as through
/// [`ShardedStore::apply_unique`], so the verdicts are the same.
fn run_sharded(
    log: Arc<OrderedLog>,
    rules: &RuleSet,
    store: &mut ShardedStore,
    progress: bool,
    mut sink: impl FnMut(DecidedChunk) -> Result<(), IoError>,
) -> Result<Streamed, ReplayError> {
    let mut replaying = Replaying::new(&log, progress);
    let (tx, chunks) = std::sync::mpsc::sync_channel(2);
    Arc::clone(&log).events_ahead(CHUNK_ROWS, move |c| tx.send(c).is_ok());
    let shards = store.shards_mut();
    let n = shards.len();
    let lost = || IoError::WorkerLost("shard");
    let tallies = std::thread::scope(|s| -> Result<Vec<Tally>, ReplayError> {
        let mut jobs = Vec::with_capacity(n);
        let mut results = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for (k, shard) in shards.iter_mut().enumerate() {
            let (job_tx, job_rx) = std::sync::mpsc::sync_channel::<ShardJob>(2);
            let (out_tx, out_rx) = std::sync::mpsc::sync_channel::<Vec<Verdict>>(2);
            let thread = std::thread::Builder::new()
                .name(format!("shard-{k}"))
                .spawn_scoped(s, move || {
                    let mut tally = Tally::default();
                    for job in job_rx {
                        let mut verdicts =
                            decide_share(shard, rules, &job.events, &job.unique, &job.idx);
                        // (Pools may still change them: tallied once settled,
                        // and scored then. Without pools, scored here, on
                        // every shard's thread.)
                        if !rules.has_pools() {
                            crate::store::settle_by_model(rules, verdicts.iter_mut());
                            tally.add(&verdicts);
                        }
                        // The chunk's events go back to their owner whole.
                        drop(job);
                        if out_tx.send(verdicts).is_err() {
                            break;
                        }
                    }
                    tally
                })
                .map_err(|source| IoError::Io {
                    context: "starting a shard thread".into(),
                    source,
                })?;
            jobs.push(job_tx);
            results.push(out_rx);
            threads.push(thread);
        }
        let mut pools = Pools::new();
        let mut finish = |c: InFlight| -> Result<(), ReplayError> {
            let mut shares = Vec::with_capacity(n);
            for r in &results {
                shares.push(r.recv().map_err(|_| lost())?);
            }
            let events = Arc::try_unwrap(c.events).unwrap_or_else(|shared| (*shared).clone());
            let mut chunk = DecidedChunk {
                events,
                verdicts: Verdicts::Shares { of: c.of, shares },
            };
            if rules.has_pools() {
                chunk = settle_pools(&mut pools, rules, chunk);
                replaying.tally.add(chunk.verdicts());
            }
            replaying.decided(chunk, c.invalid, &mut sink)?;
            Ok(())
        };
        // Two chunks in flight: the shards decide one while the other is
        // handed on.
        let mut flight = std::collections::VecDeque::with_capacity(2);
        // Rules keyed by callee or global: decided in processing order
        // before the chunk is split by caller.
        let (mut gate, mut ledger) = (Gate::new(), MemoryLedger::new());
        // (Pools: decided after the shards, in processing order.)
        for mut chunk in chunks {
            gate.run(&mut ledger, rules, &mut chunk.events);
            let (of, parts) = split_by_caller(chunk.events.iter().map(|e| e.caller.as_str()), n);
            let events = Arc::new(chunk.events);
            let unique = Arc::new(chunk.unique);
            for (job, idx) in jobs.iter().zip(parts) {
                let (events, unique) = (Arc::clone(&events), Arc::clone(&unique));
                job.send(ShardJob {
                    events,
                    unique,
                    idx,
                })
                .map_err(|_| lost())?;
            }
            flight.push_back(InFlight {
                events,
                of,
                invalid: chunk.invalid,
            });
            if flight.len() > 1 {
                if let Some(c) = flight.pop_front() {
                    finish(c)?;
                }
            }
        }
        while let Some(c) = flight.pop_front() {
            finish(c)?;
        }
        drop(jobs);
        threads
            .into_iter()
            .map(|t| Ok(t.join().unwrap_or_else(|p| std::panic::resume_unwind(p))))
            .collect()
    })?;
    for tally in tallies {
        replaying.tally.merge(tally);
    }
    log.check()?;
    Ok(replaying.finish())
}

impl fmt::Display for ReplaySummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pct = |n: u64| {
            if self.events == 0 {
                0.0
            } else {
                100.0 * n as f64 / self.events as f64
            }
        };
        writeln!(f, "events           {}", self.events)?;
        writeln!(
            f,
            "rejected         {} ({:.3}%)",
            self.rejected,
            pct(self.rejected)
        )?;
        if self.would_reject > 0 {
            writeln!(
                f,
                "would reject     {} ({:.3}%, shadow mode)",
                self.would_reject,
                pct(self.would_reject)
            )?;
        }
        writeln!(f, "rejected callers {}", self.rejected_callers)?;
        writeln!(f, "duplicates       {}", self.duplicates)?;
        writeln!(f, "late             {}", self.late)?;
        write!(f, "invalid rows     {}", self.invalid)
    }
}

/// Applies a time-sorted call log through a store of the caller's rules
/// (not gated: the gate and the pools run here), in batches (for logs
/// already decoded whole; files stream through [`run_ordered`]).
pub async fn run<S: WindowStore>(
    log: &CallLog,
    rules: &RuleSet,
    store: &mut S,
) -> Result<Vec<Verdict>, StoreError> {
    let mut events: Vec<CallEvent> = log.events.iter().map(|(_, e)| e.clone()).collect();
    Gate::new().run(&mut MemoryLedger::new(), rules, &mut events);
    let verdicts = apply_events(&events, rules, store).await?;
    if !rules.has_after_pass() {
        return Ok(verdicts);
    }
    let mut verdicts: Vec<Option<Verdict>> = verdicts.into_iter().map(Some).collect();
    if rules.has_pools() {
        Pools::new().apply(rules, &events, &mut verdicts);
    }
    crate::store::settle_by_model(rules, verdicts.iter_mut().flatten());
    Ok(verdicts.into_iter().flatten().collect())
}

/// Applies events through a store in batches of [`REPLAY_BATCH`].
async fn apply_events<S: WindowStore>(
    events: &[CallEvent],
    rules: &RuleSet,
    store: &mut S,
) -> Result<Vec<Verdict>, StoreError> {
    let mut verdicts = Vec::new();
    for batch in events.chunks(REPLAY_BATCH) {
        let got = store.apply_batch(rules, batch).await?;
        if verdicts.is_empty() {
            // The first batch's list is kept (one batch: no copy at all).
            verdicts = got;
            verdicts.reserve(events.len() - batch.len());
        } else {
            verdicts.extend(got);
        }
    }
    Ok(verdicts)
}

/// Most columns of a table whose columns are all built on the writer's
/// thread (see [`to_table`]).
const NARROW_TABLE: usize = 8;

/// What [`to_table`] wrote.
#[derive(Debug)]
pub struct TableReport {
    /// The summary and the invalid rows.
    pub streamed: Streamed,
    /// Rows written to the table.
    pub rows: u64,
    /// Where the invalid rows went, if there were any.
    pub invalid_file: Option<PathBuf>,
}

/// Replays the call log at `input` through `store` into a table of
/// `schema`'s columns at `output` (CSV, or Parquet for `.parquet`), a chunk
/// at a time; invalid rows go to `<output stem>.invalid.csv` beside it.
pub async fn to_table<S: WindowStore>(
    input: &Path,
    read: &ReadOptions,
    rules: &RuleSet,
    store: &mut ReplayStore<S>,
    schema: Schema,
    output: &Path,
) -> Result<TableReport, ReplayError> {
    // A name of no known format is refused before the log is read.
    table::TableFormat::from_path(output)?;
    let mut log = OrderedLog::open_unnumbered(input, read)?;
    if rules.uses_ends() {
        log = log.with_ends();
    }
    let log = Arc::new(log);
    create_parent(output)?;
    let empty = table::frame(&schema, &[])?.schema().as_ref().clone();
    // The writer's thread encodes and writes each chunk's frame and builds
    // its columns; of a wide table (the 17 feature columns) it builds only
    // the second half, the first half being built here, beside the store's
    // shards: otherwise that thread is the longest stage. A narrow table is
    // built there whole: building it here delays the shards' next chunk
    // more than it saves (measurements in BENCHMARKS.md).
    let at = if schema.columns().len() > NARROW_TABLE {
        schema.columns().len().div_ceil(2)
    } else {
        0
    };
    let (front, back) = schema.split_at(at);
    let mut out = BackgroundWriter::spawn(
        output,
        &empty,
        move |(chunk, mut df): (DecidedChunk, DataFrame)| {
            if !back.columns().is_empty() {
                let rest = table::frame(&back, &chunk.rows())?;
                df.hstack_mut(rest.columns())
                    .map_err(polars_err("building a table"))?;
            }
            Ok(df)
        },
    )?;
    let streamed = run_ordered(log, rules, store, read.progress, |chunk: DecidedChunk| {
        let df = if front.columns().is_empty() {
            DataFrame::empty_with_height(chunk.events.len())
        } else {
            table::frame(&front, &chunk.rows())?
        };
        out.send((chunk, df))
    })
    .await?;
    let rows = out.finish()?;
    let invalid_file = write_invalid(output, &streamed.invalid)?;
    Ok(TableReport {
        streamed,
        rows,
        invalid_file,
    })
}

/// Creates the parent directory of an output file.
fn create_parent(output: &Path) -> Result<(), IoError> {
    match output.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => std::fs::create_dir_all(dir).map_err(|source| IoError::Io {
            context: format!("creating {}", dir.display()),
            source,
        }),
        None => Ok(()),
    }
}

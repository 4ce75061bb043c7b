//! `callguard replay`: historical call logs through the same window algorithm.
//!
//! Events are sorted stably by event time (ties keep file order) and applied
//! in batches through a [`WindowStore`]: the in-memory store by default, or
//! Redis, which must produce the same records.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use polars::prelude::*;

use crate::calllog::{progress_bar, CallLog, InvalidRow, OrderedLog, CHUNK_ROWS};
use crate::decision::{Decision, Verdict};
use crate::error::{IoError, ReplayError, StoreError};
use crate::event::CallEvent;
use crate::rules::RuleSet;
use crate::store::WindowStore;

/// Events per store call during replay.
pub const REPLAY_BATCH: usize = 512;

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

/// A summary being counted, chunk by chunk.
#[derive(Default)]
struct Tally {
    summary: ReplaySummary,
    rejected_callers: HashSet<String>,
}

impl Tally {
    fn add(&mut self, verdicts: &[Verdict]) {
        let s = &mut self.summary;
        for v in verdicts {
            let r = &v.record;
            s.events += 1;
            s.rejected += u64::from(r.decision == Decision::Reject);
            s.would_reject += u64::from(r.shadow);
            s.duplicates += u64::from(v.duplicate);
            s.late += u64::from(r.late);
            if r.would_reject() && !self.rejected_callers.contains(&r.caller) {
                self.rejected_callers.insert(r.caller.clone());
            }
        }
    }

    fn finish(self, invalid: usize) -> ReplaySummary {
        ReplaySummary {
            rejected_callers: self.rejected_callers.len() as u64,
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

/// Replays an [`OrderedLog`] a chunk at a time through a store; `sink` gets
/// each chunk (time-sorted events; its invalid rows already taken) with its
/// verdicts, in order. Memory holds the raw columns, the store's state and a
/// few chunks.
pub async fn run_ordered<S: WindowStore>(
    log: Arc<OrderedLog>,
    rules: &RuleSet,
    store: &mut S,
    progress: bool,
    mut sink: impl FnMut(CallLog, Vec<Verdict>) -> Result<(), IoError>,
) -> Result<Streamed, ReplayError> {
    let bar = progress_bar(log.rows() as u64, progress, "replaying");
    let mut tally = Tally::default();
    let mut invalid = Vec::new();
    let (tx, mut chunks) = tokio::sync::mpsc::channel(2);
    log.decode_ahead(CHUNK_ROWS, move |c| tx.blocking_send(c).is_ok());
    while let Some(chunk) = chunks.recv().await {
        let mut chunk = chunk?;
        // The chunk is ours: move its events out for the store and back for
        // the sink, rather than cloning each one.
        let (rows, events): (Vec<u64>, Vec<CallEvent>) =
            std::mem::take(&mut chunk.events).into_iter().unzip();
        let verdicts = apply_events(&events, &chunk.once, rules, store).await?;
        chunk.events = rows.into_iter().zip(events).collect();
        tally.add(&verdicts);
        bar.inc((chunk.events.len() + chunk.invalid.len()) as u64);
        invalid.append(&mut chunk.invalid);
        sink(chunk, verdicts)?;
    }
    bar.finish_and_clear();
    invalid.sort_by_key(|r| r.row);
    Ok(Streamed {
        summary: tally.finish(invalid.len()),
        invalid,
    })
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

/// Applies a time-sorted call log through a store, in batches (for logs
/// already decoded whole; files stream through [`run_ordered`]).
pub async fn run<S: WindowStore>(
    log: &CallLog,
    rules: &RuleSet,
    store: &mut S,
) -> Result<Vec<Verdict>, StoreError> {
    let events: Vec<CallEvent> = log.events.iter().map(|(_, e)| e.clone()).collect();
    apply_events(&events, &log.once, rules, store).await
}

/// Applies events through a store in batches of [`REPLAY_BATCH`], passing
/// the once-hints ([`CallLog::once`]) when there is one per event.
async fn apply_events<S: WindowStore>(
    events: &[CallEvent],
    once: &[bool],
    rules: &RuleSet,
    store: &mut S,
) -> Result<Vec<Verdict>, StoreError> {
    let hinted = once.len() == events.len();
    let mut verdicts = Vec::with_capacity(events.len());
    for (i, batch) in events.chunks(REPLAY_BATCH).enumerate() {
        let got = if hinted {
            let hints = &once[i * REPLAY_BATCH..i * REPLAY_BATCH + batch.len()];
            store.apply_batch_once(rules, batch, hints).await?
        } else {
            store.apply_batch(rules, batch).await?
        };
        verdicts.extend(got);
    }
    Ok(verdicts)
}

/// The decision records as a table: `call_id, caller, ts_ms, decision,
/// reason, count_<rule>..., shadow, late, degraded, rules_version`.
pub fn records_frame(verdicts: &[Verdict], rules: &RuleSet) -> Result<DataFrame, IoError> {
    let recs = || verdicts.iter().map(|v| &v.record);
    let mut cols = vec![
        Column::new(
            "call_id".into(),
            recs().map(|r| r.call_id.as_str()).collect::<Vec<_>>(),
        ),
        Column::new(
            "caller".into(),
            recs().map(|r| r.caller.as_str()).collect::<Vec<_>>(),
        ),
        Column::new("ts_ms".into(), recs().map(|r| r.ts_ms).collect::<Vec<_>>()),
        Column::new(
            "decision".into(),
            recs().map(|r| r.decision.as_str()).collect::<Vec<_>>(),
        ),
        Column::new(
            "reason".into(),
            recs().map(|r| r.reason.as_str()).collect::<Vec<_>>(),
        ),
    ];
    cols.extend(count_columns(verdicts, rules));
    cols.push(Column::new(
        "shadow".into(),
        recs().map(|r| r.shadow).collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "late".into(),
        recs().map(|r| r.late).collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "degraded".into(),
        recs().map(|r| r.degraded).collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "rules_version".into(),
        recs().map(|r| r.rules_version.as_str()).collect::<Vec<_>>(),
    ));
    DataFrame::new(verdicts.len(), cols).map_err(|source| IoError::Polars {
        context: "building the decisions table".into(),
        source,
    })
}

/// One `count_<rule>` column per rule, in rule-set order.
pub fn count_columns(verdicts: &[Verdict], rules: &RuleSet) -> Vec<Column> {
    rules
        .rules
        .iter()
        .enumerate()
        .map(|(i, rule)| {
            Column::new(
                format!("count_{}", rule.name).into(),
                verdicts
                    .iter()
                    .map(|v| v.record.counts.get(i).copied().unwrap_or(0))
                    .collect::<Vec<u64>>(),
            )
        })
        .collect()
}

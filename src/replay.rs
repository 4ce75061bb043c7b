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
        let mut s = ReplaySummary {
            invalid: invalid as u64,
            ..Default::default()
        };
        let mut callers = HashSet::new();
        for v in verdicts {
            s.add(v, &mut callers);
        }
        s
    }

    /// Counts one more verdict; `callers` holds the rejected callers so far.
    pub fn add(&mut self, v: &Verdict, callers: &mut HashSet<String>) {
        let r = &v.record;
        self.events += 1;
        self.rejected += u64::from(r.decision == Decision::Reject);
        self.would_reject += u64::from(r.shadow);
        self.duplicates += u64::from(v.duplicate);
        self.late += u64::from(r.late);
        if r.would_reject() && !callers.contains(&r.caller) {
            callers.insert(r.caller.clone());
        }
        self.rejected_callers = callers.len() as u64;
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
    let mut out = Streamed::default();
    let mut callers = HashSet::new();
    let (tx, mut chunks) = tokio::sync::mpsc::channel(2);
    log.decode_ahead(CHUNK_ROWS, move |c| tx.blocking_send(c).is_ok());
    while let Some(chunk) = chunks.recv().await {
        let mut chunk = chunk?;
        let verdicts = run(&chunk, rules, store, false).await?;
        for v in &verdicts {
            out.summary.add(v, &mut callers);
        }
        bar.inc((chunk.events.len() + chunk.invalid.len()) as u64);
        out.invalid.append(&mut chunk.invalid);
        sink(chunk, verdicts)?;
    }
    bar.finish_and_clear();
    out.invalid.sort_by_key(|r| r.row);
    out.summary.invalid = out.invalid.len() as u64;
    Ok(out)
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

/// Applies a time-sorted call log through a store, in batches.
pub async fn run<S: WindowStore>(
    log: &CallLog,
    rules: &RuleSet,
    store: &mut S,
    progress: bool,
) -> Result<Vec<Verdict>, StoreError> {
    let bar = progress_bar(log.events.len() as u64, progress, "replaying");
    let mut verdicts = Vec::with_capacity(log.events.len());
    let mut batch = Vec::with_capacity(REPLAY_BATCH);
    let hinted = log.once.len() == log.events.len();
    for (i, chunk) in log.events.chunks(REPLAY_BATCH).enumerate() {
        batch.clear();
        batch.extend(chunk.iter().map(|(_, e)| e.clone()));
        let got = if hinted {
            let once = &log.once[i * REPLAY_BATCH..i * REPLAY_BATCH + chunk.len()];
            store.apply_batch_once(rules, &batch, once).await?
        } else {
            store.apply_batch(rules, &batch).await?
        };
        verdicts.extend(got);
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
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

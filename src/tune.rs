//! `callguard tune`: choose a rule's limit N from data.
//!
//! For every N in a range, the sweep reports what the rule set would reject
//! with that N (the other rules fixed), under the exact window contract:
//! calls and callers rejected, and, with labels, precision, recall, legit
//! calls and callers wrongly rejected, and fraud callers caught.
//!
//! Under `count = "attempts"` every call is recorded whatever the decision,
//! so counts do not depend on N: one replay gives every call's count, and a
//! call is rejected under N exactly when its count exceeds N. The whole sweep
//! is then histograms and prefix sums. Under `admitted`, decisions feed back
//! into the counts, so each N is replayed too, spread over threads. Input
//! arrives a chunk at a time ([`Sweeper`]): memory holds per-caller tallies
//! and window state, not the log.

use std::collections::HashMap;
use std::sync::Arc;

use crate::calllog::{progress_bar, CallLog, InvalidRow, OrderedLog, CHUNK_ROWS};
use crate::decision::Verdict;
use crate::error::{IoError, RulesError};
use crate::event::CallEvent;
use crate::rules::{CountPolicy, Listed, RuleSet};
use crate::store::memory::MemoryStore;

/// One row of the sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepRow {
    /// The limit.
    pub limit: u64,
    /// Calls rejected (or that shadow mode would reject).
    pub calls_rejected: u64,
    /// Share of all calls rejected.
    pub rejected_share: f64,
    /// Distinct callers with a rejected call.
    pub callers_rejected: u64,
    /// With labels: fraud calls rejected.
    pub fraud_calls_rejected: Option<u64>,
    /// With labels: legit calls rejected (false rejects).
    pub legit_calls_rejected: Option<u64>,
    /// With labels: rejected calls that are fraud.
    pub precision: Option<f64>,
    /// With labels: fraud calls that are rejected.
    pub recall: Option<f64>,
    /// With labels: legit calls rejected / legit calls.
    pub false_reject_rate: Option<f64>,
    /// With labels: legit callers (no fraud call) with a rejected call: the costly error.
    pub legit_callers_rejected: Option<u64>,
    /// With labels: fraud callers (any fraud call) with a rejected call.
    pub fraud_callers_caught: Option<u64>,
}

/// A sweep and its recommendation.
#[derive(Debug, Clone)]
pub struct Sweep {
    /// Name of the swept rule.
    pub rule: String,
    /// One row per N, ascending.
    pub rows: Vec<SweepRow>,
    /// Whether labels were present.
    pub labelled: bool,
    /// Recommended N, if any N qualifies.
    pub recommended: Option<u64>,
    /// One line explaining the recommendation.
    pub explanation: String,
    /// How many replays the sweep needed.
    pub passes: usize,
}

/// How to recommend N.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target {
    /// With labels: the smallest N whose legit false-reject rate is at most this.
    MaxFalseReject(f64),
    /// Without labels: this quantile of per-caller peak counts.
    Quantile(f64),
}

/// What the sweep keeps per caller.
#[derive(Debug, Clone, Copy, Default)]
struct CallerTally {
    /// Any of its calls is labelled fraud.
    fraud: bool,
    /// Largest count of the swept rule among calls N can reject (`attempts`).
    peak_n: u64,
    /// A call is rejected whatever N is (`attempts`).
    always: bool,
    /// Largest count of the swept rule over all its calls (under the rule set as given).
    peak: u64,
}

/// One replay with one limit (the `admitted` path).
struct Replayed {
    rules: RuleSet,
    store: MemoryStore,
    rejected: u64,
    fraud_rejected: u64,
    legit_rejected: u64,
    callers: foldhash::HashSet<String>,
}

impl Replayed {
    fn feed(&mut self, events: &[(u64, CallEvent)], once: &[bool]) {
        for (i, (_, e)) in events.iter().enumerate() {
            let remember = !once.get(i).copied().unwrap_or(false);
            if self
                .store
                .apply_with(&self.rules, e, remember)
                .record
                .would_reject()
            {
                self.rejected += 1;
                self.fraud_rejected += u64::from(e.label == Some(true));
                self.legit_rejected += u64::from(e.label == Some(false));
                if !self.callers.contains(&e.caller) {
                    self.callers.insert(e.caller.clone());
                }
            }
        }
    }
}

/// A sweep fed time-sorted events a chunk at a time: memory holds per-caller
/// tallies and window state, never the log.
///
/// One replay under the rule set as given always runs: under `attempts` it
/// is the whole sweep (histograms of counts, then suffix sums); it also
/// gives the per-caller peaks for [`Target::Quantile`]. Under `admitted`
/// each limit is replayed as well, spread over threads chunk by chunk.
pub struct Sweeper {
    rules: RuleSet,
    index: usize,
    limits: Vec<u64>,
    target: Target,
    base: MemoryStore,
    total: u64,
    labelled: bool,
    fraud_total: u64,
    legit_total: u64,
    callers: foldhash::HashMap<String, CallerTally>,
    /// `attempts`: calls[k] = [legit, fraud] calls of count k (capped) that N can reject.
    calls: Vec<[u64; 2]>,
    /// `attempts`: [legit, fraud] calls rejected whatever N is.
    always: [u64; 2],
    replayed: Vec<Replayed>,
}

impl Sweeper {
    /// A sweep of rule `index` over `limits` (ascending, distinct).
    pub fn new(
        rules: &RuleSet,
        index: usize,
        limits: &[u64],
        target: Target,
    ) -> Result<Self, RulesError> {
        if index >= rules.rules.len() {
            return Err(RulesError::Invalid(format!(
                "no rule #{index} in a set of {}",
                rules.rules.len()
            )));
        }
        let replayed = if rules.count == CountPolicy::Admitted {
            limits
                .iter()
                .map(|&n| {
                    Ok(Replayed {
                        rules: rules.with_limit(index, n)?,
                        store: MemoryStore::new(),
                        rejected: 0,
                        fraud_rejected: 0,
                        legit_rejected: 0,
                        callers: Default::default(),
                    })
                })
                .collect::<Result<Vec<_>, RulesError>>()?
        } else {
            Vec::new()
        };
        let cap = limits.iter().copied().max().unwrap_or(0) as usize + 1;
        Ok(Sweeper {
            rules: rules.clone(),
            index,
            limits: limits.to_vec(),
            target,
            base: MemoryStore::new(),
            total: 0,
            labelled: true,
            fraud_total: 0,
            legit_total: 0,
            callers: Default::default(),
            calls: vec![[0; 2]; cap + 1],
            always: [0; 2],
            replayed,
        })
    }

    /// Feeds the next time-sorted events.
    pub fn feed(&mut self, events: &[(u64, CallEvent)]) {
        self.feed_once(events, &[]);
    }

    /// Feeds the next time-sorted events, with [`CallLog::once`] (may be empty).
    pub fn feed_once(&mut self, events: &[(u64, CallEvent)], once: &[bool]) {
        let attempts = self.rules.count == CountPolicy::Attempts;
        let cap = self.calls.len() - 1;
        for (i, (_, e)) in events.iter().enumerate() {
            self.total += 1;
            self.labelled &= e.label.is_some();
            self.fraud_total += u64::from(e.label == Some(true));
            self.legit_total += u64::from(e.label == Some(false));
            let remember = !once.get(i).copied().unwrap_or(false);
            let v = self.base.apply_with(&self.rules, e, remember);
            let count = v.record.counts.get(self.index).copied().unwrap_or(0);
            let tally = match self.callers.get_mut(&e.caller) {
                Some(t) => t,
                None => self.callers.entry(e.caller.clone()).or_default(),
            };
            tally.fraud |= e.label == Some(true);
            tally.peak = tally.peak.max(count);
            if !attempts {
                continue;
            }
            let fraud = usize::from(e.label == Some(true));
            let listed = self.rules.listed(&e.caller);
            let others = self.rules.rules.iter().enumerate().any(|(i, r)| {
                i != self.index && v.record.counts.get(i).is_some_and(|&c| c > r.limit)
            });
            if listed == Listed::Allow {
                continue;
            }
            if listed == Listed::Deny || others {
                self.always[fraud] += 1;
                tally.always = true;
            } else {
                self.calls[(count as usize).min(cap)][fraud] += 1;
                tally.peak_n = tally.peak_n.max(count);
            }
        }
        if self.replayed.is_empty() {
            return;
        }
        let threads = std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .min(self.replayed.len());
        let group = self.replayed.len().div_ceil(threads.max(1)).max(1);
        std::thread::scope(|s| {
            for part in self.replayed.chunks_mut(group) {
                s.spawn(move || part.iter_mut().for_each(|r| r.feed(events, once)));
            }
        });
    }

    /// Replays the sweep needed: 1 under `attempts`, one per limit plus the
    /// rule set as given under `admitted`.
    pub fn passes(&self) -> usize {
        1 + self.replayed.len()
    }

    /// The sweep table and its recommendation.
    pub fn finish(self) -> Sweep {
        let labelled = self.labelled && self.total > 0;
        let rows = if self.replayed.is_empty() {
            self.rows_from_histograms(labelled)
        } else {
            self.replayed
                .iter()
                .zip(&self.limits)
                .map(|(r, &limit)| {
                    let legit_callers = r
                        .callers
                        .iter()
                        .filter(|c| !self.callers.get(*c).is_some_and(|t| t.fraud))
                        .count() as u64;
                    finish_row(
                        limit,
                        self.total,
                        r.rejected,
                        r.callers.len() as u64,
                        labelled,
                        (
                            r.fraud_rejected,
                            r.legit_rejected,
                            self.fraud_total,
                            self.legit_total,
                            legit_callers,
                            r.callers.len() as u64 - legit_callers,
                        ),
                    )
                })
                .collect()
        };
        let peaks: Vec<u64> = self.callers.values().map(|t| t.peak).collect();
        let (recommended, explanation) =
            recommend(&self.rules, self.index, &rows, labelled, self.target, peaks);
        Sweep {
            rule: self.rules.rules[self.index].name.clone(),
            rows,
            labelled,
            recommended,
            explanation,
            passes: self.passes(),
        }
    }

    /// The one-pass rows: a call is rejected under N exactly when its count
    /// exceeds N, a caller when its peak does.
    fn rows_from_histograms(&self, labelled: bool) -> Vec<SweepRow> {
        let cap = self.calls.len() - 1;
        let mut callers = vec![[0u64; 2]; cap + 1];
        let mut callers_always = [0u64; 2];
        for t in self.callers.values() {
            let fraud = usize::from(t.fraud);
            if t.always {
                callers_always[fraud] += 1;
            } else if t.peak_n > 0 {
                callers[(t.peak_n as usize).min(cap)][fraud] += 1;
            }
        }
        // Suffix sums: above[n] = items with count > n.
        let suffix = |h: &Vec<[u64; 2]>| {
            let mut above = vec![[0u64; 2]; cap + 2];
            for k in (0..=cap).rev() {
                above[k] = [above[k + 1][0] + h[k][0], above[k + 1][1] + h[k][1]];
            }
            above
        };
        let calls_above = suffix(&self.calls);
        let callers_above = suffix(&callers);
        self.limits
            .iter()
            .map(|&n| {
                let k = (n as usize + 1).min(cap + 1);
                let c = calls_above[k];
                let r = callers_above[k];
                let legit_rej = c[0] + self.always[0];
                let fraud_rej = c[1] + self.always[1];
                finish_row(
                    n,
                    self.total,
                    legit_rej + fraud_rej,
                    r[0] + r[1] + callers_always[0] + callers_always[1],
                    labelled,
                    (
                        fraud_rej,
                        legit_rej,
                        self.fraud_total,
                        self.legit_total,
                        r[0] + callers_always[0],
                        r[1] + callers_always[1],
                    ),
                )
            })
            .collect()
    }
}

fn caller_labels(log: &CallLog) -> (bool, HashMap<&str, bool>) {
    let labelled = !log.events.is_empty() && log.events.iter().all(|(_, e)| e.label.is_some());
    let mut fraud_caller: HashMap<&str, bool> = HashMap::new();
    for (_, e) in &log.events {
        let f = fraud_caller.entry(e.caller.as_str()).or_insert(false);
        *f |= e.label == Some(true);
    }
    (labelled, fraud_caller)
}

/// Sweeps rule `index` over `limits` (ascending, distinct) on a decoded,
/// time-sorted log.
pub fn sweep(
    log: &CallLog,
    rules: &RuleSet,
    index: usize,
    limits: &[u64],
    target: Target,
) -> Result<Sweep, RulesError> {
    let mut sweeper = Sweeper::new(rules, index, limits, target)?;
    sweeper.feed(&log.events);
    Ok(sweeper.finish())
}

/// Sweeps an [`OrderedLog`] chunk by chunk; also returns its invalid rows.
pub fn sweep_ordered(
    log: Arc<OrderedLog>,
    rules: &RuleSet,
    index: usize,
    limits: &[u64],
    target: Target,
    progress: bool,
) -> Result<(Sweep, Vec<InvalidRow>), TuneError> {
    let mut sweeper = Sweeper::new(rules, index, limits, target)?;
    let bar = progress_bar(log.rows() as u64, progress, "sweeping");
    let mut invalid = Vec::new();
    let (tx, chunks) = std::sync::mpsc::sync_channel(2);
    log.decode_ahead(CHUNK_ROWS, move |c| tx.send(c).is_ok());
    for chunk in chunks {
        let mut chunk = chunk?;
        sweeper.feed_once(&chunk.events, &chunk.once);
        bar.inc((chunk.events.len() + chunk.invalid.len()) as u64);
        invalid.append(&mut chunk.invalid);
    }
    bar.finish_and_clear();
    invalid.sort_by_key(|r| r.row);
    Ok((sweeper.finish(), invalid))
}

/// Failures of a sweep over a file.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    /// The rule set cannot take a limit.
    #[error(transparent)]
    Rules(#[from] RulesError),
    /// Reading the log failed.
    #[error(transparent)]
    Io(#[from] IoError),
}

fn replay(log: &CallLog, rules: &RuleSet) -> Vec<Verdict> {
    let mut store = MemoryStore::new();
    log.events
        .iter()
        .map(|(_, e)| store.apply(rules, e))
        .collect()
}

fn ratio(a: u64, b: u64) -> Option<f64> {
    (b > 0).then(|| a as f64 / b as f64)
}

fn finish_row(
    limit: u64,
    total: u64,
    rejected: u64,
    callers: u64,
    labelled: bool,
    (fraud_rej, legit_rej, fraud_total, legit_total, legit_callers, fraud_callers): (
        u64,
        u64,
        u64,
        u64,
        u64,
        u64,
    ),
) -> SweepRow {
    let l = |x| labelled.then_some(x);
    SweepRow {
        limit,
        calls_rejected: rejected,
        rejected_share: ratio(rejected, total).unwrap_or(0.0),
        callers_rejected: callers,
        fraud_calls_rejected: l(fraud_rej),
        legit_calls_rejected: l(legit_rej),
        precision: if labelled {
            ratio(fraud_rej, fraud_rej + legit_rej)
        } else {
            None
        },
        recall: if labelled {
            ratio(fraud_rej, fraud_total)
        } else {
            None
        },
        false_reject_rate: if labelled {
            ratio(legit_rej, legit_total)
        } else {
            None
        },
        legit_callers_rejected: l(legit_callers),
        fraud_callers_caught: l(fraud_callers),
    }
}

/// A sweep row from a full replay with that N (see [`row_by_replay`]).
fn row_from_verdicts(
    log: &CallLog,
    verdicts: &[Verdict],
    limit: u64,
    labelled: bool,
    fraud_caller: &HashMap<&str, bool>,
) -> SweepRow {
    let (mut fraud_rej, mut legit_rej, mut fraud_total, mut legit_total) = (0, 0, 0, 0);
    let mut rejected_callers: HashMap<&str, ()> = HashMap::new();
    let mut rejected = 0;
    for ((_, e), v) in log.events.iter().zip(verdicts) {
        fraud_total += u64::from(e.label == Some(true));
        legit_total += u64::from(e.label == Some(false));
        if v.record.would_reject() {
            rejected += 1;
            fraud_rej += u64::from(e.label == Some(true));
            legit_rej += u64::from(e.label == Some(false));
            rejected_callers.insert(e.caller.as_str(), ());
        }
    }
    let legit_callers = rejected_callers
        .keys()
        .filter(|c| !fraud_caller.get(*c).copied().unwrap_or(false))
        .count();
    let fraud_callers = rejected_callers.len() - legit_callers;
    finish_row(
        limit,
        log.events.len() as u64,
        rejected,
        rejected_callers.len() as u64,
        labelled,
        (
            fraud_rej,
            legit_rej,
            fraud_total,
            legit_total,
            legit_callers as u64,
            fraud_callers as u64,
        ),
    )
}

/// Computes a sweep row for one N by replaying (used to check the one-pass path).
pub fn row_by_replay(
    log: &CallLog,
    rules: &RuleSet,
    index: usize,
    limit: u64,
) -> Result<SweepRow, RulesError> {
    let (labelled, fraud_caller) = caller_labels(log);
    let set = rules.with_limit(index, limit)?;
    Ok(row_from_verdicts(
        log,
        &replay(log, &set),
        limit,
        labelled,
        &fraud_caller,
    ))
}

fn recommend(
    rules: &RuleSet,
    index: usize,
    rows: &[SweepRow],
    labelled: bool,
    target: Target,
    mut peaks: Vec<u64>,
) -> (Option<u64>, String) {
    match target {
        Target::MaxFalseReject(max) if labelled => {
            match rows.iter().find(|r| r.false_reject_rate.is_some_and(|f| f <= max)) {
                Some(r) => (
                    Some(r.limit),
                    format!(
                        "N = {}: the smallest limit whose legit false-reject rate ({:.4}%) is within {:.4}%; it catches {:.1}% of fraud calls with {} legit callers hit",
                        r.limit,
                        r.false_reject_rate.unwrap_or(0.0) * 100.0,
                        max * 100.0,
                        r.recall.unwrap_or(0.0) * 100.0,
                        r.legit_callers_rejected.unwrap_or(0)
                    ),
                ),
                None => (None, format!("no limit in the range keeps the false-reject rate within {:.4}%: widen the range or allowlist the legit callers hit", max * 100.0)),
            }
        }
        Target::MaxFalseReject(_) | Target::Quantile(_) => {
            let q = match target {
                Target::Quantile(q) => q,
                Target::MaxFalseReject(_) => 0.999,
            };
            // Per-caller peak count of the swept rule (no labels needed).
            peaks.sort_unstable();
            let sorted = peaks;
            if sorted.is_empty() {
                return (None, "no calls: nothing to recommend".into());
            }
            let pos = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
            let n = sorted[pos];
            let why = if labelled { "" } else { " (no labels)" };
            (
                Some(n),
                format!(
                    "N = {n}: the {:.2}% quantile of per-caller peak counts in the `{}` window{why}, so {:.2}% of callers never exceed it",
                    q * 100.0,
                    rules.rules[index].name,
                    q * 100.0
                ),
            )
        }
    }
}

/// The sweep as a table (one row per N).
pub fn sweep_frame(sweep: &Sweep) -> Result<polars::prelude::DataFrame, crate::error::IoError> {
    use polars::prelude::*;
    let r = &sweep.rows;
    let cols = vec![
        Column::new(
            "limit".into(),
            r.iter().map(|x| x.limit).collect::<Vec<_>>(),
        ),
        Column::new(
            "calls_rejected".into(),
            r.iter().map(|x| x.calls_rejected).collect::<Vec<_>>(),
        ),
        Column::new(
            "rejected_share".into(),
            r.iter().map(|x| x.rejected_share).collect::<Vec<_>>(),
        ),
        Column::new(
            "callers_rejected".into(),
            r.iter().map(|x| x.callers_rejected).collect::<Vec<_>>(),
        ),
        Column::new(
            "fraud_calls_rejected".into(),
            r.iter().map(|x| x.fraud_calls_rejected).collect::<Vec<_>>(),
        ),
        Column::new(
            "legit_calls_rejected".into(),
            r.iter().map(|x| x.legit_calls_rejected).collect::<Vec<_>>(),
        ),
        Column::new(
            "precision".into(),
            r.iter().map(|x| x.precision).collect::<Vec<_>>(),
        ),
        Column::new(
            "recall".into(),
            r.iter().map(|x| x.recall).collect::<Vec<_>>(),
        ),
        Column::new(
            "false_reject_rate".into(),
            r.iter().map(|x| x.false_reject_rate).collect::<Vec<_>>(),
        ),
        Column::new(
            "legit_callers_rejected".into(),
            r.iter()
                .map(|x| x.legit_callers_rejected)
                .collect::<Vec<_>>(),
        ),
        Column::new(
            "fraud_callers_caught".into(),
            r.iter().map(|x| x.fraud_callers_caught).collect::<Vec<_>>(),
        ),
        Column::new(
            "recommended".into(),
            r.iter()
                .map(|x| Some(x.limit) == sweep.recommended)
                .collect::<Vec<_>>(),
        ),
    ];
    DataFrame::new(r.len(), cols).map_err(|source| crate::error::IoError::Polars {
        context: "building the sweep table".into(),
        source,
    })
}

/// A readable terminal table: about `max_rows` rows, always including the
/// recommended N and its neighbours.
pub fn render_table(sweep: &Sweep, max_rows: usize) -> String {
    use std::fmt::Write;
    let n = sweep.rows.len();
    let step = n.div_ceil(max_rows.max(1)).max(1);
    let rec = sweep
        .rows
        .iter()
        .position(|r| Some(r.limit) == sweep.recommended);
    let mut out = String::new();
    let pct = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.3}%", v * 100.0));
    let num = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    let _ = writeln!(
        out,
        "{:>3} {:>7} {:>10} {:>9} {:>8} {:>10} {:>9} {:>9} {:>11} {:>13}",
        "",
        "N",
        "rejected",
        "share",
        "callers",
        "precision",
        "recall",
        "false-rej",
        "legit hit",
        "fraud caught"
    );
    for (i, r) in sweep.rows.iter().enumerate() {
        let near = rec.is_some_and(|k| i + 1 >= k && i <= k + 1);
        if i % step != 0 && !near && i + 1 != n {
            continue;
        }
        let mark = if Some(i) == rec { ">>" } else { "" };
        let _ = writeln!(
            out,
            "{:>3} {:>7} {:>10} {:>9} {:>8} {:>10} {:>9} {:>9} {:>11} {:>13}",
            mark,
            r.limit,
            r.calls_rejected,
            format!("{:.3}%", r.rejected_share * 100.0),
            r.callers_rejected,
            pct(r.precision),
            pct(r.recall),
            pct(r.false_reject_rate),
            num(r.legit_callers_rejected),
            num(r.fraud_callers_caught)
        );
    }
    out
}

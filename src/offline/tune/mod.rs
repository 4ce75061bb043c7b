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
//! into the counts, so each N is replayed too, spread over threads (and so
//! under `attempts` when the retention grows with N: a token bucket's span
//! is its burst times its interval). A rule that sees only some calls
//! (filters) counts only those: its count for the others is empty, never
//! over any N. The
//! replay under the rule set as given is split by caller over the cores
//! ([`crate::store::sharded`]), and skips the distinct-callees feature,
//! which never decides a call. Input arrives a chunk at a time
//! ([`Sweeper`]): memory holds per-caller tallies and window state, not the
//! log.

mod model;
mod report;
mod rows;
mod shards;

use crate::engine::aggregate::{Gate, MemoryLedger};
use crate::engine::pool::Pools;
use std::sync::Arc;

pub use model::{
    default_thresholds, model_sweep_frame, render_model_sweep, sweep_model, ModelSweep,
    ThresholdRow,
};
pub use report::{render_table, sweep_frame};
#[cfg(any(test, feature = "testing"))]
pub use rows::row_by_replay;
use rows::RowCounts;
use shards::{number_callers, split_by_number};

use crate::engine::event::{CallEvent, EventKind};
use crate::engine::rules::{CountPolicy, Judgement, RuleSet};
use crate::error::{RulesError, TuneError};
use crate::offline::order::{OrderedLog, CHUNK_ROWS};
use crate::offline::read::{not_kept, CallLog, InvalidRow};
use crate::offline::replay::Rejections;
use crate::progress::progress_bar;
use crate::store::memory::MemoryStore;
use crate::store::sharded::{run_shards, shards_per_core};

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
    /// Calls the swept rule alone rejects under N: rejected, and no other
    /// rule or list would reject them. The set's columns above include
    /// what the other rules reject whatever N is.
    pub rule_calls_rejected: u64,
    /// With labels: legit calls the swept rule alone rejects.
    pub rule_legit_calls_rejected: Option<u64>,
    /// With labels: fraud calls the swept rule alone rejects / fraud calls.
    pub rule_recall: Option<f64>,
    /// With labels: legit calls the swept rule alone rejects / legit
    /// calls: what its N costs, and what the recommendation bounds.
    pub rule_false_reject_rate: Option<f64>,
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
    /// What the recommendation aimed at.
    pub target: Target,
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
#[derive(Debug, Clone, Default)]
struct CallerTally {
    /// The caller (empty until its first call).
    caller: compact_str::CompactString,
    /// Any of its calls is labelled fraud.
    fraud: bool,
    /// Largest count of the swept rule among calls N can reject (`attempts`).
    peak_n: u64,
    /// A call is rejected whatever N is (`attempts`).
    always: bool,
    /// Largest count of the swept rule over all its calls (under the rule set as given).
    peak: u64,
}

/// One replay with one limit (the `admitted` path, and a swept rule keyed
/// by callee or global: its own counts depend on N, so each N runs its
/// own gate).
struct Replayed {
    rules: RuleSet,
    index: usize,
    store: MemoryStore,
    gate: Gate,
    ledger: MemoryLedger,
    /// Pools, settled after the store (each N its own).
    pools: Pools,
    rejections: Rejections,
    /// The calls the swept rule alone rejects: `[legit or unlabelled, fraud]`.
    alone: [u64; 2],
}

/// Whether a call the sweep counts as rejected is rejected by the swept
/// rule alone: no list, and no other enforcing rule over its limit.
fn rejected_alone(
    rules: &RuleSet,
    index: usize,
    e: &CallEvent,
    v: &crate::engine::record::Verdict,
) -> bool {
    !matches!(
        rules.judge(e.number_for_lists(), &v.record.counts, Some(index)),
        Judgement::Denylisted(_) | Judgement::Exceeded(_)
    )
}

/// Whether a sweep counts a call as rejected: rejected, or over a limit
/// in shadow mode when the whole set is in shadow mode or the shadow rule
/// is the swept one (what enforcing it would reject); other shadow rules
/// stay report-only, as they are.
fn swept_reject(rules: &RuleSet, index: usize, v: &crate::engine::record::Verdict) -> bool {
    let r = &v.record;
    r.decision == crate::engine::record::Decision::Reject
        || (r.shadow && (rules.shadow || r.reason == rules.rules[index].name.as_str()))
}

impl Replayed {
    fn feed(&mut self, events: &[(u64, CallEvent)], unique: &[bool]) {
        let mut gated;
        let events = if self.rules.rules[self.index].key.is_aggregate() {
            gated = events.to_vec();
            self.gate
                .run_rows(&mut self.ledger, &self.rules, &mut gated);
            &gated[..]
        } else {
            events
        };
        for (i, (_, e)) in events.iter().enumerate() {
            let unique = unique.get(i).copied().unwrap_or(false);
            let mut v = self.store.apply_unique(&self.rules, e, unique);
            self.pools.apply_one(&self.rules, e, &mut v);
            // A call's end is applied, never counted.
            if !v.end && swept_reject(&self.rules, self.index, &v) {
                self.rejections.add_rejected(&v, e.label);
                if rejected_alone(&self.rules, self.index, e, &v) {
                    self.alone[usize::from(e.label == Some(true))] += 1;
                }
            }
        }
    }
}

/// Events with their [`CallLog::unique`] flags and callers' numbers.
type Numbered<'a> = (&'a [(u64, CallEvent)], &'a [bool], &'a [u32]);

impl BaseShard {
    /// Events `idx` of `events` (this shard's, in order) through the
    /// replay; a caller's tally sits at its number divided by `shards`.
    fn feed_all(
        &mut self,
        rules: &RuleSet,
        index: usize,
        (events, unique, callers): Numbered<'_>,
        idx: &[usize],
        shards: usize,
    ) {
        for &i in idx {
            let unique = unique.get(i).copied().unwrap_or(false);
            let slot = callers[i] as usize / shards;
            self.feed(rules, index, &events[i].1, unique, slot);
        }
    }

    /// One event through the replay under the rule set as given.
    /// `slot` is the caller's place in this shard's tallies.
    fn feed(&mut self, rules: &RuleSet, index: usize, e: &CallEvent, unique: bool, slot: usize) {
        if e.kind == EventKind::End {
            // Applied (it closes its call), never counted.
            self.store.apply_unique(rules, e, unique);
            return;
        }
        let t = &mut self.totals;
        t.calls += 1;
        t.labelled &= e.label.is_some();
        t.fraud += u64::from(e.label == Some(true));
        t.legit += u64::from(e.label == Some(false));
        let v = self.store.apply_unique(rules, e, unique);
        let count = v.record.counts.get(index).copied().unwrap_or(0);
        if slot >= self.callers.len() {
            self.callers.resize_with(slot + 1, CallerTally::default);
        }
        let tally = &mut self.callers[slot];
        if tally.caller.is_empty() {
            tally.caller = e.caller.clone();
        }
        tally.fraud |= e.label == Some(true);
        tally.peak = tally.peak.max(count);
        if rules.count != CountPolicy::Attempts {
            return;
        }
        let fraud = usize::from(e.label == Some(true));
        let h = &mut self.histogram;
        match rules.judge(e.number_for_lists(), &v.record.counts, Some(index)) {
            Judgement::Allowlisted(_) => {}
            Judgement::Denylisted(_) | Judgement::Exceeded(_) => {
                h.always[fraud] += 1;
                tally.always = true;
            }
            // Another shadow rule over its limit: report-only, so the call
            // is rejected exactly when the swept rule's count exceeds N.
            Judgement::Within | Judgement::ShadowExceeded(_) => {
                let cap = h.calls.len() - 1;
                h.calls[(count as usize).min(cap)][fraud] += 1;
                tally.peak_n = tally.peak_n.max(count);
            }
        }
    }
}

/// Calls seen so far, and how many carried each label.
#[derive(Debug, Clone, Copy)]
struct Totals {
    calls: u64,
    fraud: u64,
    legit: u64,
    /// Every call so far carried a label.
    labelled: bool,
}

/// `attempts`: every call's count of the swept rule, as histograms.
#[derive(Debug, Clone)]
struct Histogram {
    /// calls[k] = [legit, fraud] calls of count k (capped) that N can reject.
    calls: Vec<[u64; 2]>,
    /// [legit, fraud] calls rejected whatever N is (a list or another rule).
    always: [u64; 2],
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
    /// The replay under the rule set as given, split by caller over the
    /// cores (see [`crate::store::sharded`]).
    base: Vec<BaseShard>,
    replayed: Vec<Replayed>,
    /// Caller numbers given to logs fed without them.
    numbers: foldhash::HashMap<compact_str::CompactString, u32>,
}

/// One shard of callers of the replay under the rule set as given: their
/// window state, tallies and histogram (summed over the shards at the end).
struct BaseShard {
    store: MemoryStore,
    totals: Totals,
    /// Its callers' tallies, by caller number (see [`CallLog::callers`])
    /// divided by the number of shards (a shard holds the callers whose
    /// number it is, modulo the shards).
    callers: Vec<CallerTally>,
    histogram: Histogram,
}

impl Totals {
    fn add(&mut self, other: &Totals) {
        self.calls += other.calls;
        self.fraud += other.fraud;
        self.legit += other.legit;
        self.labelled &= other.labelled;
    }
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
        // Distinct callees are a feature and warnings never decide: a
        // sweep skips both (a warn level would also bound the limits).
        let rules = &rules.with_distinct_callees(false).without_warnings()?;
        // Under attempts counts do not depend on N, unless the retention
        // does (a token bucket's span grows with its burst): then every N
        // is replayed, as under admitted.
        let retention_varies = limits
            .iter()
            .map(|&n| rules.with_limit(index, n).map(|r| r.retention_ms()))
            .collect::<Result<Vec<_>, RulesError>>()?
            .into_iter()
            .any(|r| r != rules.retention_ms());
        // A rule keyed by callee or global counts only what it admits, so
        // its counts depend on N: every N is replayed, its gate and all.
        let aggregate = rules.rules[index].key.is_aggregate();
        // A concurrent rule holds open only the calls allowed, so with one
        // in the set every count may depend on N: every N is replayed.
        let concurrent = rules.uses_ends();
        let replayed = if rules.count == CountPolicy::Admitted
            || retention_varies
            || aggregate
            || concurrent
        {
            limits
                .iter()
                .map(|&n| {
                    Ok(Replayed {
                        rules: rules.with_limit(index, n)?,
                        index,
                        store: MemoryStore::new(),
                        gate: Gate::new(),
                        ledger: MemoryLedger::new(),
                        pools: Pools::new(),
                        rejections: Rejections::default(),
                        alone: [0; 2],
                    })
                })
                .collect::<Result<Vec<_>, RulesError>>()?
        } else {
            Vec::new()
        };
        let mut sweeper = Sweeper {
            rules: rules.clone(),
            index,
            limits: limits.to_vec(),
            target,
            base: Vec::new(),
            replayed,
            numbers: Default::default(),
        };
        sweeper.base = sweeper.shards(shards_per_core());
        Ok(sweeper)
    }

    /// The same sweep with the base replay split over `shards` shards of
    /// callers (by default one per core); the rows do not depend on it.
    /// Call before feeding anything.
    pub fn with_shards(mut self, shards: usize) -> Self {
        self.base = self.shards(shards);
        self
    }

    /// Empty base-replay shards (their histograms only when the sweep is
    /// read from them: no N replayed).
    fn shards(&self, shards: usize) -> Vec<BaseShard> {
        let cap = if self.replayed.is_empty() {
            self.limits.iter().copied().max().unwrap_or(0) as usize + 1
        } else {
            0
        };
        (0..shards.max(1))
            .map(|_| BaseShard {
                store: MemoryStore::new(),
                totals: Totals {
                    calls: 0,
                    fraud: 0,
                    legit: 0,
                    labelled: true,
                },
                callers: Default::default(),
                histogram: Histogram {
                    calls: vec![[0; 2]; cap + 1],
                    always: [0; 2],
                },
            })
            .collect()
    }

    /// Feeds the next time-sorted events.
    pub fn feed(&mut self, events: &[(u64, CallEvent)]) {
        self.feed_unique(events, &[]);
    }

    /// Feeds the next time-sorted events, with [`CallLog::unique`] (may be
    /// empty). Callers are numbered here; a sweep is fed either this way or
    /// by [`Sweeper::feed_log`] with its callers' numbers, not both.
    pub fn feed_unique(&mut self, events: &[(u64, CallEvent)], unique: &[bool]) {
        let callers = number_callers(&mut self.numbers, events, &[]).unwrap_or_default();
        self.feed_numbered(events, unique, &callers);
    }

    /// Feeds the next chunk of time-sorted events, using its callers'
    /// numbers when it has them ([`CallLog::callers`]).
    pub fn feed_log(&mut self, log: &CallLog) {
        match number_callers(&mut self.numbers, &log.events, &log.callers) {
            Some(callers) => self.feed_numbered(&log.events, &log.unique, &callers),
            None => self.feed_numbered(&log.events, &log.unique, &log.callers),
        }
    }

    /// Feeds events whose callers are numbered by `callers`.
    fn feed_numbered(&mut self, events: &[(u64, CallEvent)], unique: &[bool], callers: &[u32]) {
        let shards = self.base.len();
        let parts = split_by_number(callers, shards);
        let (rules, index) = (&self.rules, self.index);
        run_shards(&mut self.base, &parts, |shard, idx| {
            shard.feed_all(rules, index, (events, unique, callers), idx, shards);
        });
        if self.replayed.is_empty() {
            return;
        }
        let threads = std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .min(self.replayed.len());
        let group = self.replayed.len().div_ceil(threads.max(1)).max(1);
        std::thread::scope(|s| {
            for part in self.replayed.chunks_mut(group) {
                s.spawn(move || part.iter_mut().for_each(|r| r.feed(events, unique)));
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
        let merged = self.merge_shards();
        let t = merged.totals;
        let labelled = t.labelled && t.calls > 0;
        let rows = if self.replayed.is_empty() {
            self.rows_from_histograms(&merged, labelled)
        } else {
            let fraud_callers: foldhash::HashSet<&str> = merged
                .callers
                .iter()
                .filter(|t| t.fraud)
                .map(|t| t.caller.as_str())
                .collect();
            self.replayed
                .iter()
                .zip(&self.limits)
                .map(|(r, &limit)| {
                    let rej = &r.rejections;
                    let legit_callers = rej
                        .callers
                        .iter()
                        .filter(|c| !fraud_callers.contains(c.as_str()))
                        .count() as u64;
                    RowCounts {
                        limit,
                        calls: t.calls,
                        fraud_calls: t.fraud,
                        legit_calls: t.legit,
                        rejected_calls: rej.calls,
                        rejected_fraud_calls: rej.fraud_calls,
                        rejected_legit_calls: rej.legit_calls,
                        rejected_legit_callers: legit_callers,
                        rejected_fraud_callers: rej.callers.len() as u64 - legit_callers,
                        alone: r.alone,
                    }
                    .row(labelled)
                })
                .collect()
        };
        let peaks: Vec<u64> = merged.callers.iter().map(|t| t.peak).collect();
        let (recommended, explanation) =
            report::recommend(&self.rules, self.index, &rows, labelled, self.target, peaks);
        Sweep {
            rule: self.rules.rules[self.index].name.clone(),
            rows,
            labelled,
            recommended,
            explanation,
            passes: self.passes(),
            target: self.target,
        }
    }

    /// The shards' tallies as one: totals and histograms summed, caller
    /// tallies joined (the shards' callers are disjoint).
    fn merge_shards(&self) -> Merged<'_> {
        let mut totals = Totals {
            calls: 0,
            fraud: 0,
            legit: 0,
            labelled: true,
        };
        let cap = self.base.first().map_or(1, |s| s.histogram.calls.len());
        let mut histogram = Histogram {
            calls: vec![[0; 2]; cap],
            always: [0; 2],
        };
        let mut callers = Vec::new();
        for shard in &self.base {
            totals.add(&shard.totals);
            for (sum, h) in histogram.calls.iter_mut().zip(&shard.histogram.calls) {
                *sum = [sum[0] + h[0], sum[1] + h[1]];
            }
            let a = shard.histogram.always;
            histogram.always = [histogram.always[0] + a[0], histogram.always[1] + a[1]];
            callers.extend(shard.callers.iter().filter(|t| !t.caller.is_empty()));
        }
        Merged {
            totals,
            histogram,
            callers,
        }
    }

    /// The one-pass rows: a call is rejected under N exactly when its count
    /// exceeds N, a caller when its peak does.
    fn rows_from_histograms(&self, merged: &Merged<'_>, labelled: bool) -> Vec<SweepRow> {
        let h = &merged.histogram;
        let cap = h.calls.len() - 1;
        let mut callers = vec![[0u64; 2]; cap + 1];
        let mut callers_always = [0u64; 2];
        for t in &merged.callers {
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
        let calls_above = suffix(&h.calls);
        let callers_above = suffix(&callers);
        self.limits
            .iter()
            .map(|&n| {
                let k = (n as usize + 1).min(cap + 1);
                let c = calls_above[k];
                let r = callers_above[k];
                let legit_rej = c[0] + h.always[0];
                let fraud_rej = c[1] + h.always[1];
                RowCounts {
                    limit: n,
                    calls: merged.totals.calls,
                    fraud_calls: merged.totals.fraud,
                    legit_calls: merged.totals.legit,
                    rejected_calls: legit_rej + fraud_rej,
                    rejected_fraud_calls: fraud_rej,
                    rejected_legit_calls: legit_rej,
                    rejected_legit_callers: r[0] + callers_always[0],
                    rejected_fraud_callers: r[1] + callers_always[1],
                    // Over N, and rejected by nothing else.
                    alone: c,
                }
                .row(labelled)
            })
            .collect()
    }
}

/// Sweeps rule `index` over `limits` (ascending, distinct) on a decoded,
/// time-sorted log: the whole-log form tests compare the chunked
/// [`sweep_ordered`] against (`testing` feature).
#[cfg(any(test, feature = "testing"))]
pub fn sweep(
    log: &CallLog,
    rules: &RuleSet,
    index: usize,
    limits: &[u64],
    target: Target,
) -> Result<Sweep, RulesError> {
    let mut sweeper = Sweeper::new(rules, index, limits, target)?;
    let mut events = log.events.clone();
    Gate::new().run_rows(&mut MemoryLedger::new(), rules, &mut events);
    sweeper.feed(&events);
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
    // The base replay alone, without rules that count before the caller's
    // (the gate's): its shards decode their own events.
    if sweeper.replayed.is_empty() && !rules.has_aggregates() && log.by_shards() {
        let invalid = log.invalid().to_vec();
        bar.inc(not_kept(&invalid) as u64);
        sweeper.feed_by_shards(&log, &|n| bar.inc(n));
        bar.finish_and_clear();
        return Ok((sweeper.finish(), invalid));
    }
    let (tx, chunks) = std::sync::mpsc::sync_channel(2);
    Arc::clone(&log).decode_ahead(SWEEP_CHUNK, move |c| tx.send(c).is_ok());
    let mut invalid = Vec::new();
    // Rules keyed by callee or global count before the caller's rules
    // and whatever they decide: one pass in processing order fills them
    // in, the same for every N swept.
    let (mut gate, mut ledger) = (Gate::new(), MemoryLedger::new());
    let mut chunks = chunks.into_iter().map(|mut chunk: CallLog| {
        bar.inc((chunk.events.len() + not_kept(&chunk.invalid)) as u64);
        invalid.append(&mut chunk.invalid);
        gate.run_rows(&mut ledger, rules, &mut chunk.events);
        chunk
    });
    if sweeper.replayed.is_empty() {
        sweeper.feed_queued(&mut chunks)?;
    } else {
        for chunk in chunks {
            sweeper.feed_log(&chunk);
        }
    }
    bar.finish_and_clear();
    log.check()?;
    invalid.sort_by_key(|r| r.row);
    Ok((sweeper.finish(), invalid))
}

/// The limits to sweep a sum rule over when none are given: quantiles of
/// its callers' (a pool's: its keys') peak sums (50%, 90%, 99%, 99.9% and the largest) and 11
/// steps evenly spaced on a log scale from the 99th percentile to the
/// largest (fraud is in the tail), from one replay with the rule never
/// rejecting; distinct and ascending, at least one.
pub fn observed_limits(
    log: Arc<OrderedLog>,
    rules: &RuleSet,
    index: usize,
    progress: bool,
) -> Result<Vec<u64>, TuneError> {
    let open = rules.with_limit(index, u64::MAX / 4)?;
    let mut peaks = if open.rules[index].is_pooled() {
        let peaks = pool_peaks(Arc::clone(&log), &open, index, progress);
        log.check()?;
        peaks
    } else {
        caller_peaks(log, &open, index, progress)?
    };
    peaks.retain(|&p| p > 0);
    peaks.sort_unstable();
    let quantile = |q: f64| {
        let at = ((peaks.len() as f64 - 1.0) * q).round() as usize;
        peaks.get(at).copied().unwrap_or(1).max(1)
    };
    let mut limits: Vec<u64> = [0.5, 0.9, 0.99, 0.999, 1.0]
        .into_iter()
        .map(quantile)
        .collect();
    // The tail, where fraud is, finer: 12 steps evenly spaced on a log
    // scale from the 99th percentile to the largest.
    let (lo, hi) = (quantile(0.99) as f64, quantile(1.0) as f64);
    limits.extend((1..12).map(|k| (lo * (hi / lo).powf(f64::from(k) / 12.0)).round() as u64));
    limits.sort_unstable();
    limits.dedup();
    if limits.is_empty() {
        limits.push(1);
    }
    Ok(limits)
}

/// Each caller's peak count of rule `index` over the log, the rule never
/// rejecting (`open`).
fn caller_peaks(
    log: Arc<OrderedLog>,
    open: &RuleSet,
    index: usize,
    progress: bool,
) -> Result<Vec<u64>, TuneError> {
    let mut sweeper = Sweeper::new(open, index, &[], Target::Quantile(1.0))?;
    let bar = progress_bar(log.rows() as u64, progress, "observing sums");
    let (tx, chunks) = std::sync::mpsc::sync_channel(2);
    Arc::clone(&log).decode_ahead(SWEEP_CHUNK, move |c| tx.send(c).is_ok());
    let (mut gate, mut ledger) = (Gate::new(), MemoryLedger::new());
    for mut chunk in chunks {
        bar.inc((chunk.events.len() + not_kept(&chunk.invalid)) as u64);
        gate.run_rows(&mut ledger, open, &mut chunk.events);
        sweeper.feed_log(&chunk);
    }
    bar.finish_and_clear();
    log.check()?;
    let merged = sweeper.merge_shards();
    Ok(merged.callers.iter().map(|t| t.peak).collect())
}

/// Each pool's peak count of pool rule `index` (keyed by account, callee
/// or global: the pool's sum is the key's, not a caller's) over the log,
/// the rule never rejecting (`open`): one replay in processing order, the
/// pools after the caller's rules.
fn pool_peaks(log: Arc<OrderedLog>, open: &RuleSet, index: usize, progress: bool) -> Vec<u64> {
    let bar = progress_bar(log.rows() as u64, progress, "observing sums");
    let (tx, chunks) = std::sync::mpsc::sync_channel(2);
    Arc::clone(&log).decode_ahead(SWEEP_CHUNK, move |c| tx.send(c).is_ok());
    let (mut gate, mut ledger) = (Gate::new(), MemoryLedger::new());
    let (mut store, mut pools) = (MemoryStore::new(), Pools::new());
    let mut peaks: foldhash::HashMap<String, u64> = Default::default();
    for mut chunk in chunks {
        bar.inc((chunk.events.len() + not_kept(&chunk.invalid)) as u64);
        gate.run_rows(&mut ledger, open, &mut chunk.events);
        for (_, e) in &chunk.events {
            let mut v = store.apply_unique(open, e, false);
            pools.apply_one(open, e, &mut v);
            if let Some(pool) = crate::engine::pool::pool_of(open, index, e) {
                let peak = peaks.entry(pool).or_default();
                *peak = (*peak).max(v.record.counts[index]);
            }
        }
    }
    bar.finish_and_clear();
    peaks.into_values().collect()
}

/// Events a [`sweep_ordered`] hands on at once: larger than a replay's
/// chunk, as the sweep keeps no records (a chunk is a few MiB of events).
const SWEEP_CHUNK: usize = 4 * CHUNK_ROWS;

/// The shards of a [`Sweeper`]'s base replay, summed.
struct Merged<'a> {
    totals: Totals,
    histogram: Histogram,
    /// Every caller's tally (the shards' callers are disjoint).
    callers: Vec<&'a CallerTally>,
}

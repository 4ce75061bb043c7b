//! `tune --model`: the threshold of a rule set's model swept on a
//! labelled log, from one replay.
//!
//! The replay scores every attempt with the model in shadow: the rules'
//! decisions stand as they would without the model (an enforcing model's
//! rejects change no state: see [`crate::engine::model`]), and each
//! attempt has its score. A threshold T then rejects the calls the rules
//! reject and, of those they allow (listed callers aside), the ones scored
//! T or more: every T is read off the same replay.

use std::sync::Arc;

use crate::engine::record::Decision;
use crate::engine::rules::{RuleSet, REASON_ALLOWLIST, REASON_BAD_CALLER};
use crate::error::{IoError, RulesError, TuneError};
use crate::offline::order::OrderedLog;
use crate::offline::read::InvalidRow;
use crate::offline::replay::{run_ordered, ReplayStore};
use crate::store::memory::MemoryStore;
use crate::store::sharded::ShardedStore;

/// One labelled attempt, as the sweep needs it.
#[derive(Debug, Clone, Copy)]
struct Scored {
    fraud: bool,
    /// The rules reject it.
    by_rules: bool,
    /// The model may reject it: the rules allow it and no list decides.
    open: bool,
    score: f32,
}

/// What one threshold does (or the rules alone: `threshold` `None`).
#[derive(Debug, Clone, PartialEq)]
pub struct ThresholdRow {
    /// The threshold; `None` for the rules alone.
    pub threshold: Option<f32>,
    /// Calls rejected (by the rules or the model).
    pub rejected: u64,
    /// Of which by the model.
    pub by_model: u64,
    /// Fraud calls rejected.
    pub fraud_rejected: u64,
    /// Legit calls rejected.
    pub legit_rejected: u64,
    /// Fraud calls rejected / fraud calls.
    pub recall: f64,
    /// Fraud calls rejected / calls rejected (`None` when none is).
    pub precision: Option<f64>,
    /// Legit calls rejected / legit calls.
    pub false_reject_rate: f64,
    /// Legit calls the model rejected (the rules allowed them) / legit
    /// calls: what the threshold costs, and what is recommended on (the
    /// rules' own share is the same for every threshold).
    pub model_false_reject_rate: f64,
}

/// The sweep: a row per threshold, the rules alone, and the recommendation.
#[derive(Debug, Clone)]
pub struct ModelSweep {
    /// One row per threshold, ascending.
    pub rows: Vec<ThresholdRow>,
    /// The rules without the model.
    pub rules_alone: ThresholdRow,
    /// The recommended row (an index into `rows`), if a threshold meets
    /// the bound.
    pub recommended: Option<usize>,
    /// The bound on the legit false-reject rate.
    pub max_false_reject: f64,
    /// Labelled attempts: fraud, legit.
    pub calls: (u64, u64),
}

/// The thresholds swept unless given: 0.05 to 0.95 by 0.05, then 0.97, 0.99
/// and 0.995.
pub fn default_thresholds() -> Vec<f32> {
    let mut t: Vec<f32> = (1..=19).map(|i| i as f32 * 0.05).collect();
    t.extend([0.97, 0.99, 0.995]);
    t
}

/// Replays `log` with `rules`' model in shadow and sweeps `thresholds`:
/// recommends the highest-recall threshold (the lowest) whose model's own
/// legit false-reject rate (legit calls it rejects that the rules allow) is
/// at most `max_false_reject`, as the limit sweep bounds the swept rule's.
pub async fn sweep_model(
    log: Arc<OrderedLog>,
    rules: &RuleSet,
    thresholds: &[f32],
    max_false_reject: f64,
    progress: bool,
) -> Result<(ModelSweep, Vec<InvalidRow>), TuneError> {
    let scoring = in_shadow(rules)?;
    let mut scored = Vec::with_capacity(log.rows());
    let mut unlabelled = 0u64;
    let streamed = run_ordered(
        log,
        &scoring,
        &mut ReplayStore::<MemoryStore>::Sharded(ShardedStore::per_core()),
        progress,
        |chunk| {
            for row in chunk.rows() {
                let (e, v) = (row.event, row.verdict);
                let (Some(fraud), Some(score)) = (e.label, v.score) else {
                    unlabelled += 1;
                    continue;
                };
                let r = &v.record;
                let listed = r.reason == REASON_ALLOWLIST || r.reason == REASON_BAD_CALLER;
                scored.push(Scored {
                    fraud,
                    by_rules: r.decision == Decision::Reject,
                    open: r.decision == Decision::Allow && !listed,
                    score,
                });
            }
            Ok(())
        },
    )
    .await?;
    if scored.is_empty() {
        return Err(TuneError::NoLabels(unlabelled));
    }
    let mut thresholds = thresholds.to_vec();
    thresholds.sort_by(f32::total_cmp);
    thresholds.dedup();
    let rows: Vec<ThresholdRow> = thresholds
        .iter()
        .map(|&t| row_at(&scored, Some(t)))
        .collect();
    let recommended = rows
        .iter()
        .position(|r| r.model_false_reject_rate <= max_false_reject);
    let fraud = scored.iter().filter(|s| s.fraud).count() as u64;
    Ok((
        ModelSweep {
            rules_alone: row_at(&scored, None),
            rows,
            recommended,
            max_false_reject,
            calls: (fraud, scored.len() as u64 - fraud),
        },
        streamed.invalid,
    ))
}

/// `rules` with its model in shadow (an error without a model).
fn in_shadow(rules: &RuleSet) -> Result<RuleSet, RulesError> {
    let mut spec = rules.spec();
    let model = spec.model.as_mut().ok_or_else(|| {
        RulesError::Invalid("--model: the rule set has no [model] to tune".into())
    })?;
    std::sync::Arc::make_mut(model).shadow = true;
    RuleSet::build(spec)
}

/// The counts at threshold `t` (`None`: the rules alone).
fn row_at(scored: &[Scored], t: Option<f32>) -> ThresholdRow {
    let (mut rejected, mut by_model, mut fraud_rejected, mut legit_rejected) = (0, 0, 0, 0);
    let mut legit_by_model = 0;
    let (mut fraud, mut legit) = (0u64, 0u64);
    for s in scored {
        let model = s.open && t.is_some_and(|t| s.score >= t);
        let reject = s.by_rules || model;
        fraud += u64::from(s.fraud);
        legit += u64::from(!s.fraud);
        rejected += u64::from(reject);
        by_model += u64::from(model);
        fraud_rejected += u64::from(reject && s.fraud);
        legit_rejected += u64::from(reject && !s.fraud);
        legit_by_model += u64::from(model && !s.fraud);
    }
    let share = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    ThresholdRow {
        threshold: t,
        rejected,
        by_model,
        fraud_rejected,
        legit_rejected,
        recall: share(fraud_rejected, fraud),
        precision: (rejected > 0).then(|| share(fraud_rejected, rejected)),
        false_reject_rate: share(legit_rejected, legit),
        model_false_reject_rate: share(legit_by_model, legit),
    }
}

/// The sweep as a text table, the rules alone against the rules and the
/// model at the recommended threshold, and the recommendation.
pub fn render_model_sweep(s: &ModelSweep) -> String {
    let pct = |v: f64| format!("{:.2}%", v * 100.0);
    let line = |name: String, r: &ThresholdRow| {
        format!(
            "{name:>12} {:>9} {:>9} {:>9} {:>10} {:>11} {:>11}\n",
            r.rejected,
            r.by_model,
            pct(r.recall),
            r.precision.map_or("-".into(), pct),
            pct(r.false_reject_rate),
            pct(r.model_false_reject_rate),
        )
    };
    let mut out = format!(
        "{} fraud and {} legit labelled attempts (false rej.: legit calls rejected, by anything and by the model)\n{:>12} {:>9} {:>9} {:>9} {:>10} {:>11} {:>11}\n",
        s.calls.0, s.calls.1, "threshold", "rejected", "by model", "recall", "precision", "false rej.", "by model"
    );
    for r in &s.rows {
        out.push_str(&line(format!("{:.3}", r.threshold.unwrap_or(f32::NAN)), r));
    }
    out.push_str("\nrules alone against rules + model:\n");
    out.push_str(&line("rules alone".into(), &s.rules_alone));
    match s.recommended {
        Some(i) => {
            let r = &s.rows[i];
            out.push_str(&line("+ model".into(), r));
            out.push_str(&format!(
                "recommendation: threshold = {:.3}, the highest recall ({}) with the model's own legit false-reject rate ({}) at most {}; the model adds {} rejects, recall {} -> {}\n",
                r.threshold.unwrap_or(f32::NAN),
                pct(r.recall),
                pct(r.model_false_reject_rate),
                pct(s.max_false_reject),
                r.by_model,
                pct(s.rules_alone.recall),
                pct(r.recall),
            ));
        }
        None => out.push_str(&format!(
            "recommendation: none: at every threshold the model rejects more than {} of legit calls (raise --max-false-reject, or sweep higher --thresholds)\n",
            pct(s.max_false_reject),
        )),
    }
    out
}

/// The sweep as a table (`--output`): a row per threshold, then the rules
/// alone (threshold null).
pub fn model_sweep_frame(s: &ModelSweep) -> Result<polars::prelude::DataFrame, IoError> {
    use polars::prelude::{Column, DataFrame};
    let rows: Vec<&ThresholdRow> = s.rows.iter().chain([&s.rules_alone]).collect();
    let recommended: Vec<bool> = (0..rows.len()).map(|i| Some(i) == s.recommended).collect();
    let columns = vec![
        Column::new(
            "threshold".into(),
            rows.iter().map(|r| r.threshold).collect::<Vec<_>>(),
        ),
        Column::new(
            "rejected".into(),
            rows.iter().map(|r| r.rejected).collect::<Vec<_>>(),
        ),
        Column::new(
            "by_model".into(),
            rows.iter().map(|r| r.by_model).collect::<Vec<_>>(),
        ),
        Column::new(
            "fraud_rejected".into(),
            rows.iter().map(|r| r.fraud_rejected).collect::<Vec<_>>(),
        ),
        Column::new(
            "legit_rejected".into(),
            rows.iter().map(|r| r.legit_rejected).collect::<Vec<_>>(),
        ),
        Column::new(
            "recall".into(),
            rows.iter().map(|r| r.recall).collect::<Vec<_>>(),
        ),
        Column::new(
            "precision".into(),
            rows.iter().map(|r| r.precision).collect::<Vec<_>>(),
        ),
        Column::new(
            "model_false_reject_rate".into(),
            rows.iter()
                .map(|r| r.model_false_reject_rate)
                .collect::<Vec<_>>(),
        ),
        Column::new(
            "false_reject_rate".into(),
            rows.iter().map(|r| r.false_reject_rate).collect::<Vec<_>>(),
        ),
        Column::new("recommended".into(), recommended),
    ];
    DataFrame::new(rows.len(), columns)
        .map_err(crate::offline::read::polars_err("building the sweep table"))
}

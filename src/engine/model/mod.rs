//! A rule set's model: every attempt scored from its point-in-time
//! features, after the rules (and the pools) have decided it.
//!
//! The contract:
//! - An attempt's inputs are exactly the values the `features` table holds
//!   for it (the same [`Field::value`]), as `f32`; a null (a caller's first
//!   call has no `since_prev_ms`; a count of 0 is written as null) is NaN,
//!   as a model trained on that table through pandas receives it.
//! - Only features known at the attempt may be inputs: the counts, the time
//!   since the caller's previous call, the distinct callees and the local
//!   time. Anything known after it (duration, label, decision) is refused.
//! - Every attempt gets a `score`. A call the rules reject stays rejected; a
//!   call they allow (a listed caller aside) with a score at or above
//!   `threshold` is rejected for reason `model`, with the set's
//!   `model_retry_after` and no block key; a shadow model (or a shadow set)
//!   only flags it (`shadow`, reason `model`, unless a shadow rule flagged it
//!   first). An allowed call whose score reaches `warn` is warned `model`
//!   unless a rule warned it.
//! - A redelivery (a duplicate) decided under the same rule set is scored
//!   again from its recorded features, and so gets the same answer; one
//!   decided under another set keeps its record as the store kept it.
//! - An enforcing model needs a set whose state does not depend on the final
//!   decision: it is refused with `count = "admitted"`, pools, or a caller's
//!   concurrent or sum rule (they decide before it; see
//!   [`crate::engine::pool`]).

mod onnx;

use std::path::PathBuf;
use std::sync::Arc;

use compact_str::CompactString;

use crate::engine::record::{Decision, Field, Row, Schema, Value, Verdict};
use crate::engine::rules::{RuleSet, REASON_ALLOWLIST, REASON_BAD_CALLER, REASON_DENYLIST};
pub use onnx::Scorer;

/// The reason of a call the model rejects (or flags, in shadow).
pub const REASON_MODEL: &str = "model";

/// The Retry-After of a model reject unless the set says
/// (`model_retry_after`).
pub const DEFAULT_MODEL_RETRY_AFTER_MS: i64 = 60_000;

/// A rule set's `[model]`: the loaded model and how its score decides.
#[derive(Clone)]
pub struct Model {
    /// The model file, as the rules name it, resolved from their folder.
    pub path: PathBuf,
    /// The feature columns fed to the model, in its input order.
    pub input_names: Vec<String>,
    /// The same, as fields (resolved against the rule set by
    /// [`Model::resolve`]).
    inputs: Vec<Field>,
    /// Reject (or flag) at or above this score.
    pub threshold: f32,
    /// Report only: never reject.
    pub shadow: bool,
    /// Warn an allowed call at or above this score.
    pub warn: Option<f32>,
    /// Retry-After of a model reject, milliseconds.
    pub retry_after_ms: i64,
    /// A model reject sets the caller's block key (`block = true`), where
    /// the store writes block keys (`--block-keys`), as a rule's does.
    pub block: bool,
    /// SHA-256 of the model file (hex): part of the rule set's version.
    pub hash: String,
    scorer: Arc<Scorer>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("path", &self.path)
            .field("inputs", &self.input_names)
            .field("threshold", &self.threshold)
            .field("shadow", &self.shadow)
            .field("warn", &self.warn)
            .field("hash", &self.hash)
            .finish_non_exhaustive()
    }
}

impl PartialEq for Model {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash
            && self.input_names == other.input_names
            && self.threshold.to_bits() == other.threshold.to_bits()
            && self.shadow == other.shadow
            && self.warn.map(f32::to_bits) == other.warn.map(f32::to_bits)
            && self.retry_after_ms == other.retry_after_ms
            && self.block == other.block
    }
}

impl Eq for Model {}

/// Feature columns known only after the attempt: a model fed them would
/// learn from the future.
const AFTER_THE_ATTEMPT: [&str; 11] = [
    "duration_ms",
    "label",
    "decision",
    "reason",
    "retry_after_ms",
    "warn",
    "late",
    "degraded",
    "shadow",
    "score",
    "rules_version",
];

impl Model {
    /// A model of `bytes` (the file at `path`) fed `inputs`.
    pub fn load(
        path: PathBuf,
        bytes: &[u8],
        inputs: Vec<String>,
        threshold: f32,
        shadow: bool,
        warn: Option<f32>,
        retry_after_ms: i64,
    ) -> Result<Self, String> {
        if inputs.is_empty() {
            return Err("inputs: name the feature columns the model takes, in its order".into());
        }
        if !threshold.is_finite() {
            return Err("threshold: a number".into());
        }
        if warn.is_some_and(|w| !w.is_finite() || w > threshold) {
            return Err("warn: a number no higher than threshold".into());
        }
        if retry_after_ms < 0 {
            return Err("model_retry_after: not negative".into());
        }
        let scorer = Scorer::load(bytes, inputs.len())?;
        let hash = {
            use sha2::{Digest, Sha256};
            Sha256::digest(bytes)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        };
        Ok(Model {
            path,
            input_names: inputs,
            inputs: Vec::new(),
            threshold,
            shadow,
            warn,
            retry_after_ms,
            block: false,
            hash,
            scorer: Arc::new(scorer),
        })
    }

    /// Resolves the input names against `rules` (their `features`
    /// columns): each must be a feature known at the attempt.
    pub fn resolve(&mut self, rules: &RuleSet) -> Result<(), String> {
        let schema = Schema::features(rules);
        let known = || {
            schema
                .columns()
                .iter()
                .filter(|c| is_input(c.field))
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut fields = Vec::with_capacity(self.input_names.len());
        for name in &self.input_names {
            if AFTER_THE_ATTEMPT.contains(&name.as_str()) {
                return Err(format!(
                    "inputs: `{name}` is known only after the attempt (a model fed it learns from the future); inputs known at the attempt: {}",
                    known()
                ));
            }
            let field = schema
                .columns()
                .iter()
                .find(|c| &c.name == name)
                .map(|c| c.field);
            match field {
                Some(f) if is_input(f) => fields.push(f),
                Some(_) => {
                    return Err(format!(
                        "inputs: `{name}` names the call, it is no feature; inputs known at the attempt: {}",
                        known()
                    ))
                }
                None => {
                    return Err(format!(
                        "inputs: no feature column `{name}`; inputs known at the attempt: {}",
                        known()
                    ))
                }
            }
        }
        self.inputs = fields;
        Ok(())
    }

    /// The fields fed to the model, in order.
    pub fn inputs(&self) -> &[Field] {
        &self.inputs
    }

    /// Whether `field` is one of the model's inputs.
    pub fn uses(&self, field: Field) -> bool {
        self.inputs.contains(&field)
    }

    /// Appends the model's inputs for one decided attempt.
    pub fn features(&self, verdict: &Verdict, out: &mut Vec<f32>) {
        let row = Row::of_verdict(verdict);
        out.extend(self.inputs.iter().map(|f| as_input(f.value(row))));
    }

    /// The scores of `rows` (row after row, one value per input).
    pub fn score(&self, rows: &[f32]) -> Result<Vec<f32>, String> {
        self.scorer.score(rows)
    }
}

/// Whether a feature column may feed a model: known at the attempt.
fn is_input(field: Field) -> bool {
    matches!(
        field,
        Field::Count(_)
            | Field::SincePrevMs
            | Field::DistinctCallees
            | Field::LocalHour(_)
            | Field::LocalWeekday(_)
    )
}

/// A feature value as the model takes it: through `f64`, as a pandas frame
/// holds it, to `f32`; null as NaN.
fn as_input(value: Value<'_>) -> f32 {
    match value {
        Value::Int(Some(v)) => v as f64 as f32,
        Value::UInt(Some(v)) => v as f64 as f32,
        _ => f32::NAN,
    }
}

/// Whether the model scores this verdict (see the module).
fn scored(rules: &RuleSet, v: &Verdict) -> bool {
    !v.end && !v.record.degraded && (!v.duplicate || v.record.rules_version == rules.version())
}

/// Scores every attempt among `verdicts` in one batch and decides them as
/// the module says. A scoring failure (a model that loaded and ran on a
/// probe row cannot fail on others; if it does) leaves the rules' decisions
/// and no score, and is returned for the caller to report.
pub fn decide<'a>(
    rules: &RuleSet,
    verdicts: impl IntoIterator<Item = &'a mut Verdict>,
) -> Result<(), String> {
    let Some(model) = rules.model() else {
        return Ok(());
    };
    let mut picked: Vec<&mut Verdict> = verdicts.into_iter().filter(|v| scored(rules, v)).collect();
    if picked.is_empty() {
        return Ok(());
    }
    let mut rows = Vec::with_capacity(picked.len() * model.inputs.len());
    for v in &picked {
        model.features(v, &mut rows);
    }
    let scores = model.score(&rows)?;
    for (v, s) in picked.iter_mut().zip(scores) {
        settle(rules, model, v, s);
    }
    Ok(())
}

/// One attempt's decision given its score (see the module).
pub fn settle(rules: &RuleSet, model: &Model, v: &mut Verdict, score: f32) {
    v.score = Some(score);
    let r = &mut v.record;
    let listed =
        [REASON_ALLOWLIST, REASON_DENYLIST, REASON_BAD_CALLER].contains(&r.reason.as_str());
    if r.decision != Decision::Allow || listed {
        return;
    }
    if score >= model.threshold {
        if model.shadow || rules.shadow {
            if !r.shadow {
                r.shadow = true;
                r.reason = CompactString::const_new(REASON_MODEL);
            }
        } else {
            r.decision = Decision::Reject;
            r.reason = CompactString::const_new(REASON_MODEL);
            r.shadow = false;
            r.warn = None;
            r.retry_after_ms = Some(model.retry_after_ms);
            return;
        }
    }
    if r.warn.is_none() && model.warn.is_some_and(|w| score >= w) {
        r.warn = Some(CompactString::const_new(REASON_MODEL));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::event::CallEvent;

    const INPUTS: [&str; 6] = [
        "count_burst",
        "count_minute",
        "count_hour",
        "since_prev_ms",
        "distinct_callees",
        "local_hour",
    ];

    fn rules(shadow: bool, warn: Option<f32>) -> RuleSet {
        let text = std::fs::read_to_string("data/rules.toml").unwrap();
        let mut spec = RuleSet::from_toml(&text.replace("allow = []", "allow = [\"+3491\"]"))
            .unwrap()
            .spec();
        let bytes = std::fs::read("data/model.onnx").unwrap();
        spec.model = Some(Arc::new(
            Model::load(
                "data/model.onnx".into(),
                &bytes,
                INPUTS.iter().map(|s| s.to_string()).collect(),
                0.5,
                shadow,
                warn,
                30_000,
            )
            .unwrap(),
        ));
        RuleSet::build(spec).unwrap()
    }

    fn verdict(rules: &RuleSet, caller: &str) -> Verdict {
        let mut v = Verdict::of_end(&CallEvent::new("c1", caller, 1_764_547_200_000), rules);
        v.end = false;
        v.record.reason = CompactString::const_new("ok");
        v
    }

    #[test]
    fn the_decision_order_of_a_score() {
        let enforcing = rules(false, Some(0.3));
        let model = enforcing.model().unwrap();
        // Over the threshold: rejected, the model's Retry-After, no warning.
        let mut v = verdict(&enforcing, "+34600000001");
        settle(&enforcing, model, &mut v, 0.5);
        let r = &v.record;
        assert_eq!((r.decision, r.reason.as_str()), (Decision::Reject, "model"));
        assert_eq!(
            (r.retry_after_ms, r.warn.as_deref(), v.score),
            (Some(30_000), None, Some(0.5))
        );
        // Under it, over `warn`: allowed and warned.
        let mut v = verdict(&enforcing, "+34600000001");
        settle(&enforcing, model, &mut v, 0.4);
        assert_eq!(v.record.decision, Decision::Allow);
        assert_eq!(v.record.warn.as_deref(), Some("model"));
        // A rule's warning comes first.
        let mut v = verdict(&enforcing, "+34600000001");
        v.record.warn = Some("minute".into());
        settle(&enforcing, model, &mut v, 0.4);
        assert_eq!(v.record.warn.as_deref(), Some("minute"));
        // A rule's reject stands, and keeps its reason and Retry-After.
        let mut v = verdict(&enforcing, "+34600000001");
        v.record.decision = Decision::Reject;
        v.record.reason = "burst".into();
        v.record.retry_after_ms = Some(900);
        settle(&enforcing, model, &mut v, 0.99);
        assert_eq!(
            (v.record.reason.as_str(), v.record.retry_after_ms),
            ("burst", Some(900))
        );
        // A listed caller is scored, not rejected.
        let mut v = verdict(&enforcing, "+34911000001");
        v.record.reason = REASON_ALLOWLIST.into();
        settle(&enforcing, model, &mut v, 0.99);
        assert_eq!((v.record.decision, v.score), (Decision::Allow, Some(0.99)));
        // In shadow: flagged, not rejected; a shadow rule's flag comes first.
        let shadow = rules(true, None);
        let model = shadow.model().unwrap();
        let mut v = verdict(&shadow, "+34600000001");
        settle(&shadow, model, &mut v, 0.7);
        assert_eq!(
            (v.record.decision, v.record.shadow),
            (Decision::Allow, true)
        );
        assert_eq!(v.record.reason, "model");
        let mut v = verdict(&shadow, "+34600000001");
        v.record.shadow = true;
        v.record.reason = "hour".into();
        settle(&shadow, model, &mut v, 0.7);
        assert_eq!(v.record.reason, "hour");
    }

    #[test]
    fn ends_degraded_calls_and_other_sets_redeliveries_are_not_scored() {
        let set = rules(false, None);
        let mut end = verdict(&set, "+34600000001");
        end.end = true;
        let mut degraded = verdict(&set, "+34600000001");
        degraded.record.degraded = true;
        let mut other = verdict(&set, "+34600000001");
        other.duplicate = true;
        other.record.rules_version = "0123456789ab".into();
        let mut same = verdict(&set, "+34600000001");
        same.duplicate = true;
        decide(&set, [&mut end, &mut degraded, &mut other, &mut same]).unwrap();
        assert_eq!((end.score, degraded.score, other.score), (None, None, None));
        assert!(same.score.is_some());
    }

    #[test]
    fn a_null_feature_reaches_the_model_as_nan() {
        let set = rules(false, None);
        let v = verdict(&set, "+34600000001");
        let mut row = Vec::new();
        set.model().unwrap().features(&v, &mut row);
        // No counts (0 is written as null), no previous call, no callees.
        assert_eq!(row.len(), 6);
        assert!(row[..5].iter().all(|x| x.is_nan()), "{row:?}");
        assert_eq!(row[5], 0.0, "midnight UTC");
    }
}

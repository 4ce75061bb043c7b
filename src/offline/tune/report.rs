//! Presenting a sweep: the recommendation, the table and the terminal view.

use crate::engine::rules::RuleSet;
use crate::error::IoError;
use crate::offline::read::polars_err;
use crate::offline::tune::{Sweep, SweepRow, Target};

/// The recommended N and one line saying why.
pub(super) fn recommend(
    rules: &RuleSet,
    index: usize,
    rows: &[SweepRow],
    labelled: bool,
    target: Target,
    mut peaks: Vec<u64>,
) -> (Option<u64>, String) {
    match target {
        Target::MaxFalseReject(max) if labelled => {
            // The swept rule's own false rejects: what the other rules
            // reject is the same for every N, and no N can lower it.
            match rows.iter().find(|r| r.rule_false_reject_rate.is_some_and(|f| f <= max)) {
                Some(r) => (
                    Some(r.limit),
                    format!(
                        "N = {}: the smallest limit whose own legit false-reject rate ({:.4}%: legit calls `{}` alone rejects) is within {:.4}%; alone it catches {:.1}% of fraud calls; the whole set with it: {:.1}% of fraud calls, false-reject rate {:.4}%, {} legit callers hit",
                        r.limit,
                        r.rule_false_reject_rate.unwrap_or(0.0) * 100.0,
                        rules.rules[index].name,
                        max * 100.0,
                        r.rule_recall.unwrap_or(0.0) * 100.0,
                        r.recall.unwrap_or(0.0) * 100.0,
                        r.false_reject_rate.unwrap_or(0.0) * 100.0,
                        r.legit_callers_rejected.unwrap_or(0)
                    ),
                ),
                None => (None, format!("no limit in --limits ({}) keeps `{}`'s own false-reject rate within {:.4}%: widen the range or allowlist the legit callers hit", range(rows), rules.rules[index].name, max * 100.0)),
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
            let (first, last) = (rows.first().map(|r| r.limit), rows.last().map(|r| r.limit));
            let outside = if first.is_some_and(|f| n < f) || last.is_some_and(|l| n > l) {
                format!(
                    "; outside --limits ({}): the table and plot do not show it, widen the range",
                    range(rows)
                )
            } else {
                String::new()
            };
            (
                Some(n),
                format!(
                    "N = {n}: the {:.2}% quantile of per-caller peak counts in the `{}` window{why}, so {:.2}% of callers never exceed it{outside}",
                    q * 100.0,
                    rules.rules[index].name,
                    q * 100.0
                ),
            )
        }
    }
}

/// The swept range as `--limits` spells it.
fn range(rows: &[SweepRow]) -> String {
    match (rows.first(), rows.last()) {
        (Some(a), Some(b)) => format!("{}..{}", a.limit, b.limit),
        _ => "empty".into(),
    }
}

/// The sweep as a table (one row per N).
pub fn sweep_frame(sweep: &Sweep) -> Result<polars::prelude::DataFrame, IoError> {
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
            "rule_calls_rejected".into(),
            r.iter().map(|x| x.rule_calls_rejected).collect::<Vec<_>>(),
        ),
        Column::new(
            "rule_legit_calls_rejected".into(),
            r.iter()
                .map(|x| x.rule_legit_calls_rejected)
                .collect::<Vec<_>>(),
        ),
        Column::new(
            "rule_recall".into(),
            r.iter().map(|x| x.rule_recall).collect::<Vec<_>>(),
        ),
        Column::new(
            "rule_false_reject_rate".into(),
            r.iter()
                .map(|x| x.rule_false_reject_rate)
                .collect::<Vec<_>>(),
        ),
        Column::new(
            "recommended".into(),
            r.iter()
                .map(|x| Some(x.limit) == sweep.recommended)
                .collect::<Vec<_>>(),
        ),
    ];
    DataFrame::new(r.len(), cols).map_err(polars_err("building the sweep table"))
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
        "{:>3} {:>7} {:>10} {:>9} {:>8} {:>10} {:>9} {:>9} {:>11} {:>13} {:>10} {:>13}",
        "",
        "N",
        "rejected",
        "share",
        "callers",
        "precision",
        "recall",
        "false-rej",
        "legit hit",
        "fraud caught",
        "rule alone",
        "its false-rej"
    );
    for (i, r) in sweep.rows.iter().enumerate() {
        let near = rec.is_some_and(|k| i + 1 >= k && i <= k + 1);
        if i % step != 0 && !near && i + 1 != n {
            continue;
        }
        let mark = if Some(i) == rec { ">>" } else { "" };
        let _ = writeln!(
            out,
            "{:>3} {:>7} {:>10} {:>9} {:>8} {:>10} {:>9} {:>9} {:>11} {:>13} {:>10} {:>13}",
            mark,
            r.limit,
            r.calls_rejected,
            format!("{:.3}%", r.rejected_share * 100.0),
            r.callers_rejected,
            pct(r.precision),
            pct(r.recall),
            pct(r.false_reject_rate),
            num(r.legit_callers_rejected),
            num(r.fraud_callers_caught),
            r.rule_calls_rejected,
            pct(r.rule_false_reject_rate)
        );
    }
    out
}

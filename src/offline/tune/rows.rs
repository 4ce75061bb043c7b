//! A sweep row's counts, and the replay that computes one row the slow
//! way (the one-pass sweep's test oracle).

use super::SweepRow;
#[cfg(any(test, feature = "testing"))]
use super::{rejected_alone, swept_reject};
#[cfg(any(test, feature = "testing"))]
use crate::engine::aggregate::{Gate, MemoryLedger};
#[cfg(any(test, feature = "testing"))]
use crate::engine::rules::RuleSet;
#[cfg(any(test, feature = "testing"))]
use crate::error::RulesError;
#[cfg(any(test, feature = "testing"))]
use crate::offline::read::CallLog;
#[cfg(any(test, feature = "testing"))]
use crate::offline::replay::Rejections;
#[cfg(any(test, feature = "testing"))]
use crate::store::memory::MemoryStore;

/// The counts behind one row of the sweep.
#[derive(Debug, Clone, Copy)]
pub(super) struct RowCounts {
    pub(super) limit: u64,
    pub(super) calls: u64,
    pub(super) fraud_calls: u64,
    pub(super) legit_calls: u64,
    pub(super) rejected_calls: u64,
    pub(super) rejected_fraud_calls: u64,
    pub(super) rejected_legit_calls: u64,
    pub(super) rejected_legit_callers: u64,
    pub(super) rejected_fraud_callers: u64,
    /// Calls the swept rule alone rejects: `[legit or unlabelled, fraud]`.
    pub(super) alone: [u64; 2],
}

impl RowCounts {
    pub(super) fn row(self, labelled: bool) -> SweepRow {
        let ratio = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
        let l = |x: u64| labelled.then_some(x);
        let lr = |x: Option<f64>| x.filter(|_| labelled);
        let (fraud, legit) = (self.rejected_fraud_calls, self.rejected_legit_calls);
        SweepRow {
            limit: self.limit,
            calls_rejected: self.rejected_calls,
            rejected_share: ratio(self.rejected_calls, self.calls).unwrap_or(0.0),
            callers_rejected: self.rejected_legit_callers + self.rejected_fraud_callers,
            fraud_calls_rejected: l(fraud),
            legit_calls_rejected: l(legit),
            precision: lr(ratio(fraud, fraud + legit)),
            recall: lr(ratio(fraud, self.fraud_calls)),
            false_reject_rate: lr(ratio(legit, self.legit_calls)),
            legit_callers_rejected: l(self.rejected_legit_callers),
            fraud_callers_caught: l(self.rejected_fraud_callers),
            rule_calls_rejected: self.alone[0] + self.alone[1],
            rule_legit_calls_rejected: l(self.alone[0]),
            rule_recall: lr(ratio(self.alone[1], self.fraud_calls)),
            rule_false_reject_rate: lr(ratio(self.alone[0], self.legit_calls)),
        }
    }
}

/// Computes a sweep row for one N by replaying the whole log with that N
/// (a test oracle of the one-pass path; `testing` feature).
#[cfg(any(test, feature = "testing"))]
pub fn row_by_replay(
    log: &CallLog,
    rules: &RuleSet,
    index: usize,
    limit: u64,
) -> Result<SweepRow, RulesError> {
    let set = rules.without_warnings()?.with_limit(index, limit)?;
    let is_end =
        |e: &crate::engine::event::CallEvent| e.kind == crate::engine::event::EventKind::End;
    let labelled = !log.events.is_empty()
        && log
            .events
            .iter()
            .all(|(_, e)| is_end(e) || e.label.is_some());
    let mut fraud_callers = foldhash::HashSet::default();
    let (mut fraud_calls, mut legit_calls) = (0, 0);
    let mut store = MemoryStore::new();
    let mut pools = crate::engine::pool::Pools::new();
    let mut rejections = Rejections::default();
    let mut alone = [0u64; 2];
    let mut events = log.events.clone();
    Gate::new().run_rows(&mut MemoryLedger::new(), &set, &mut events);
    for (_, e) in &events {
        if is_end(e) {
            let mut v = store.apply(&set, e);
            pools.apply_one(&set, e, &mut v);
            continue;
        }
        fraud_calls += u64::from(e.label == Some(true));
        legit_calls += u64::from(e.label == Some(false));
        if e.label == Some(true) {
            fraud_callers.insert(e.caller.as_str());
        }
        let mut v = store.apply(&set, e);
        pools.apply_one(&set, e, &mut v);
        if swept_reject(&set, index, &v) {
            rejections.add_rejected(&v, e.label);
            if rejected_alone(&set, index, e, &v) {
                alone[usize::from(e.label == Some(true))] += 1;
            }
        }
    }
    let legit_callers = rejections
        .callers
        .iter()
        .filter(|c| !fraud_callers.contains(c.as_str()))
        .count() as u64;
    Ok(RowCounts {
        limit,
        calls: log.events.iter().filter(|(_, e)| !is_end(e)).count() as u64,
        fraud_calls,
        legit_calls,
        rejected_calls: rejections.calls,
        rejected_fraud_calls: rejections.fraud_calls,
        rejected_legit_calls: rejections.legit_calls,
        rejected_legit_callers: legit_callers,
        rejected_fraud_callers: rejections.callers.len() as u64 - legit_callers,
        alone,
    }
    .row(labelled))
}

//! Decision records: the one output record, online and offline.

use serde_json::{json, Map, Value};

use crate::rules::RuleSet;

/// The verdict on one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Let the call through.
    Allow,
    /// Reject the call.
    Reject,
}

impl Decision {
    /// `allow` or `reject`.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Allow => "allow",
            Decision::Reject => "reject",
        }
    }
}

/// Reason of an allowed call that no rule or list singled out.
pub const REASON_OK: &str = "ok";
/// Reason when the caller is on the allowlist.
pub const REASON_ALLOWLIST: &str = "allowlist";
/// Reason when the caller is on the denylist.
pub const REASON_DENYLIST: &str = "denylist";

/// One decision per call event.
///
/// `reason` is `ok`, `allowlist`, `denylist`, or the name of the first rule
/// whose count exceeded its limit. Under shadow mode a call that would have
/// been rejected is emitted as `allow` with `shadow = true` and the reason it
/// would have been rejected for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionRecord {
    /// The call attempt.
    pub call_id: String,
    /// Normalised calling number.
    pub caller: String,
    /// Event time, epoch milliseconds.
    pub ts_ms: i64,
    /// What to do with the call.
    pub decision: Decision,
    /// Why (see the type docs).
    pub reason: String,
    /// The window count per rule, in rule-set order (the current call included).
    pub counts: Vec<u64>,
    /// Shadow mode turned a reject into an allow.
    pub shadow: bool,
    /// The event was older than the caller's latest event minus grace.
    pub late: bool,
    /// The window store failed and a fallback policy decided (online only).
    pub degraded: bool,
    /// Version of the rule set that decided.
    pub rules_version: String,
}

impl DecisionRecord {
    /// Whether the call was rejected or would have been (shadow).
    pub fn would_reject(&self) -> bool {
        self.decision == Decision::Reject || self.shadow
    }

    /// The record as a flat JSON object with one `count_<rule>` field per rule.
    pub fn to_json(&self, rules: &RuleSet) -> Value {
        let mut m = Map::new();
        m.insert("call_id".into(), json!(self.call_id));
        m.insert("caller".into(), json!(self.caller));
        m.insert("ts_ms".into(), json!(self.ts_ms));
        m.insert("decision".into(), json!(self.decision.as_str()));
        m.insert("reason".into(), json!(self.reason));
        for (i, r) in rules.rules.iter().enumerate() {
            m.insert(
                format!("count_{}", r.name),
                json!(self.counts.get(i).copied().unwrap_or(0)),
            );
        }
        m.insert("shadow".into(), json!(self.shadow));
        m.insert("late".into(), json!(self.late));
        m.insert("degraded".into(), json!(self.degraded));
        m.insert("rules_version".into(), json!(self.rules_version));
        Value::Object(m)
    }
}

/// What a window store returns for one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The decision record.
    pub record: DecisionRecord,
    /// The caller's latest event time before this event, if within retention
    /// (longest window + grace); the "time since previous call" feature.
    pub prev_ts_ms: Option<i64>,
    /// Distinct callees of the caller over the longest window, this call's
    /// included (`None` when the rule set does not keep the feature); see
    /// the window contract in [`crate::window`].
    pub distinct_callees: Option<u64>,
    /// This call_id was seen before: the record is the one it got then.
    pub duplicate: bool,
}

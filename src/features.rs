//! Point-in-time features: what the model sees for each call.
//!
//! The consumer emits one feature record per call to the features topic;
//! `callguard features` writes the same values for a call log. Every value is
//! computed only from calls at or before the call in processing order.

use chrono::{DateTime, SecondsFormat};
use serde_json::{json, Map, Value};

use crate::decision::Verdict;
use crate::event::CallEvent;
use crate::rules::RuleSet;

/// Milliseconds since the caller's previous call (the latest event time seen
/// before this call, within the retention); negative for a call that arrived
/// out of order; `None` when there is none.
pub fn since_prev_ms(v: &Verdict) -> Option<i64> {
    v.prev_ts_ms.map(|p| v.record.ts_ms - p)
}

/// The feature record as JSON (the features topic's payload).
pub fn feature_json(v: &Verdict, event: &CallEvent, rules: &RuleSet) -> Value {
    let r = &v.record;
    let mut m = Map::new();
    m.insert("call_id".into(), json!(r.call_id));
    m.insert("caller".into(), json!(r.caller));
    m.insert("ts_ms".into(), json!(r.ts_ms));
    m.insert(
        "event_time".into(),
        json!(DateTime::from_timestamp_millis(r.ts_ms)
            .map(|d| d.to_rfc3339_opts(SecondsFormat::Millis, true))),
    );
    for (i, rule) in rules.rules.iter().enumerate() {
        m.insert(
            format!("count_{}", rule.name),
            json!(r.counts.get(i).copied().unwrap_or(0)),
        );
    }
    m.insert("since_prev_ms".into(), json!(since_prev_ms(v)));
    m.insert("callee".into(), json!(event.callee));
    m.insert("duration_ms".into(), json!(event.duration_ms));
    m.insert("decision".into(), json!(r.decision.as_str()));
    m.insert("reason".into(), json!(r.reason));
    m.insert("late".into(), json!(r.late));
    m.insert("degraded".into(), json!(r.degraded));
    m.insert("rules_version".into(), json!(r.rules_version));
    Value::Object(m)
}

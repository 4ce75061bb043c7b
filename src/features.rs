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
    m.insert("distinct_callees".into(), json!(v.distinct_callees));
    m.insert("callee".into(), json!(event.callee));
    m.insert("duration_ms".into(), json!(event.duration_ms));
    m.insert("decision".into(), json!(r.decision.as_str()));
    m.insert("reason".into(), json!(r.reason));
    m.insert("late".into(), json!(r.late));
    m.insert("degraded".into(), json!(r.degraded));
    m.insert("rules_version".into(), json!(r.rules_version));
    Value::Object(m)
}

/// The feature table of a decided call log: `call_id`, `caller`,
/// `event_time` (timestamp, ms, UTC), `ts_ms`, `count_<rule>`...,
/// `since_prev_ms`, `distinct_callees`, `callee`, `duration_ms`, `decision`, `reason`, `late`,
/// `label`, `rules_version`. Same values as the features topic.
pub fn features_frame(
    events: &[(u64, CallEvent)],
    verdicts: &[Verdict],
    rules: &RuleSet,
) -> Result<polars::prelude::DataFrame, crate::error::IoError> {
    use polars::prelude::*;
    let err = |source| crate::error::IoError::Polars {
        context: "building the features table".into(),
        source,
    };
    let recs = || verdicts.iter().map(|v| &v.record);
    let ts: Vec<i64> = recs().map(|r| r.ts_ms).collect();
    let event_time = Column::new("event_time".into(), ts.clone())
        .cast(&DataType::Datetime(TimeUnit::Milliseconds, None))
        .map_err(err)?;
    let mut cols = vec![
        Column::new(
            "call_id".into(),
            recs().map(|r| r.call_id.as_str()).collect::<Vec<_>>(),
        ),
        Column::new(
            "caller".into(),
            recs().map(|r| r.caller.as_str()).collect::<Vec<_>>(),
        ),
        event_time,
        Column::new("ts_ms".into(), ts),
    ];
    cols.extend(crate::replay::count_columns(verdicts, rules));
    cols.push(Column::new(
        "since_prev_ms".into(),
        verdicts.iter().map(since_prev_ms).collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "distinct_callees".into(),
        verdicts
            .iter()
            .map(|v| v.distinct_callees)
            .collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "callee".into(),
        events
            .iter()
            .map(|(_, e)| e.callee.clone())
            .collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "duration_ms".into(),
        events
            .iter()
            .map(|(_, e)| e.duration_ms)
            .collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "decision".into(),
        recs().map(|r| r.decision.as_str()).collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "reason".into(),
        recs().map(|r| r.reason.as_str()).collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "late".into(),
        recs().map(|r| r.late).collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "label".into(),
        events.iter().map(|(_, e)| e.label).collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "rules_version".into(),
        recs().map(|r| r.rules_version.as_str()).collect::<Vec<_>>(),
    ));
    polars::prelude::DataFrame::new(verdicts.len(), cols).map_err(err)
}

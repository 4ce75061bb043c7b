//! Records: the decision on one call, and the one column list that every
//! output of callguard is built from.
//!
//! A [`Verdict`] is what a window store returns for one event. The outputs
//! (the `call-decisions` and `call-features` topics, the `replay` and
//! `features` tables) are all built from a [`Schema`]: a list of
//! [`Column`]s, each naming a [`Field`] that knows its value for one decided
//! call ([`Row`]) and its [`Kind`]. JSON encoding lives here; the table
//! builder (`offline::table`) reads the same columns. Adding a column is
//! adding a [`Field`] and putting it in [`Schema::decisions`] or
//! [`Schema::features`].
//!
//! The feature topic and the feature file carry the same columns, in the
//! same order. `event_time` is in UTC everywhere: RFC 3339 text with
//! milliseconds and `Z` in JSON and CSV (the same text), a UTC-aware
//! millisecond timestamp (`timestamp[ms, tz=UTC]`) in Parquet.

use chrono::{DateTime, SecondsFormat};
use chrono_tz::Tz;
use compact_str::CompactString;
use serde_json::{json, Map};

use crate::engine::event::CallEvent;
use crate::engine::local_time::local_parts;
use crate::engine::rules::RuleSet;
use crate::error::UnknownColumn;

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
/// The lists' reasons belong to the rule set that judges them.
pub use crate::engine::rules::{REASON_ALLOWLIST, REASON_BAD_CALLER, REASON_DENYLIST};
/// Reason of a decision made by a fallback policy while the store failed.
pub const REASON_STORE_ERROR: &str = "store_error";
/// The reason in the record of a call's end ([`Verdict::of_end`]), which
/// no output writes.
pub const REASON_END: &str = "end";

/// Window counts, one per rule: kept inline for up to four rules (no
/// allocation per record for the usual rule sets).
pub type Counts = smallvec::SmallVec<[u64; 4]>;

/// One decision per call event.
///
/// `reason` is `ok`, `allowlist`, `denylist`, or the name of the first rule
/// whose count exceeded its limit. Under shadow mode a call that would have
/// been rejected is emitted as `allow` with `shadow = true` and the reason it
/// would have been rejected for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionRecord {
    /// The call attempt.
    pub call_id: CompactString,
    /// Normalised calling number.
    pub caller: CompactString,
    /// Event time, epoch milliseconds.
    pub ts_ms: i64,
    /// What to do with the call.
    pub decision: Decision,
    /// Why (see the type docs).
    pub reason: CompactString,
    /// The window count per rule, in rule-set order (the current call
    /// included); 0 for a rule that does not see the call (its filters),
    /// written as an empty value.
    pub counts: Counts,
    /// Shadow mode turned a reject into an allow.
    pub shadow: bool,
    /// The event was older than the caller's latest event minus grace.
    pub late: bool,
    /// The window store failed and a fallback policy decided (online only).
    pub degraded: bool,
    /// Version of the rule set that decided.
    pub rules_version: CompactString,
    /// On a reject by a rule: milliseconds until a call from this caller
    /// would be allowed again if it placed no further call (the window
    /// contract's Retry-After, in [`crate::engine::window`]). `None` for
    /// allowed calls (shadow ones included) and denylist rejects.
    pub retry_after_ms: Option<i64>,
    /// The first rule, in order, whose count exceeds its `warn` level, on
    /// a call that is allowed and on no list.
    pub warn: Option<CompactString>,
}

impl DecisionRecord {
    /// Whether the call was rejected or would have been (shadow).
    pub fn would_reject(&self) -> bool {
        self.decision == Decision::Reject || self.shadow
    }
}

/// What a window store returns for one event.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// The decision record.
    pub record: DecisionRecord,
    /// The caller's latest event time before this event, if within retention
    /// (longest window + grace); the "time since previous call" feature.
    pub prev_ts_ms: Option<i64>,
    /// Distinct callees of the caller over the longest window, this call's
    /// included (`None` when the rule set does not keep the feature); see
    /// the window contract in [`crate::engine::window`].
    pub distinct_callees: Option<u64>,
    /// This call_id was seen before: the record is the one it got then.
    pub duplicate: bool,
    /// The event was a call's end ([`EventKind::End`]), not an attempt: it
    /// was applied, not decided, and no output writes its record (which
    /// holds only the call's identity and the end's time).
    pub end: bool,
    /// The rule set's model's score of the attempt (`None` without a model,
    /// and for ends and degraded decisions): see [`crate::engine::model`].
    pub score: Option<f32>,
}

impl Verdict {
    /// Milliseconds since the caller's previous call (the latest event time
    /// seen before this call, within the retention); negative for a call
    /// that arrived out of order; `None` when there is none.
    pub fn since_prev_ms(&self) -> Option<i64> {
        self.prev_ts_ms.map(|p| self.record.ts_ms - p)
    }

    /// The verdict a fallback policy gives while the store fails: no counts,
    /// reason [`REASON_STORE_ERROR`], flagged `degraded`.
    pub fn degraded(event: &CallEvent, rules: &RuleSet, decision: Decision) -> Self {
        Verdict {
            record: DecisionRecord {
                call_id: event.call_id.clone(),
                caller: event.caller.clone(),
                ts_ms: event.ts_ms,
                decision,
                reason: CompactString::const_new(REASON_STORE_ERROR),
                counts: smallvec::smallvec![0; rules.rules.len()],
                shadow: false,
                late: false,
                degraded: true,
                rules_version: rules.version().into(),
                retry_after_ms: None,
                warn: None,
            },
            prev_ts_ms: None,
            distinct_callees: None,
            duplicate: false,
            end: false,
            score: None,
        }
    }

    /// What applying a call's end returns: allowed, no counts, reason
    /// [`REASON_END`], flagged `end` (see [`Verdict::end`]).
    pub fn of_end(event: &CallEvent, rules: &RuleSet) -> Self {
        let mut v = Verdict::degraded(event, rules, Decision::Allow);
        v.record.degraded = false;
        v.record.reason = CompactString::const_new(REASON_END);
        v.record.counts = smallvec::smallvec![0; rules.rules.len()];
        v.end = true;
        v
    }
}

/// One decided call, as the outputs see it: the event and its verdict.
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    /// The event as decoded.
    pub event: &'a CallEvent,
    /// What the store decided.
    pub verdict: &'a Verdict,
}

/// The event of a row known by its verdict alone.
static NO_EVENT: CallEvent = CallEvent {
    call_id: CompactString::const_new(""),
    caller: CompactString::const_new(""),
    ts_ms: 0,
    callee: None,
    kind: crate::engine::event::EventKind::Attempt,
    duration_ms: None,
    talk_ms: None,
    account: None,
    label: None,
    list_number: None,
    filter_callee: None,
    aggregate: None,
    dropped: None,
};

impl<'a> Row<'a> {
    /// A row rendered from its verdict alone (a check's answer): every
    /// column of the record is there; the columns only the event has
    /// (callee, duration, label) are empty.
    pub fn of_verdict(verdict: &'a Verdict) -> Self {
        Row {
            event: &NO_EVENT,
            verdict,
        }
    }
}

/// A field of the output records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// `call_id`.
    CallId,
    /// `caller`, normalised.
    Caller,
    /// `ts_ms`: event time, epoch milliseconds.
    TsMs,
    /// `event_time`: the event time as a timestamp (ms, UTC).
    EventTime,
    /// `count_<rule>`: the window count of the rule with this index.
    Count(usize),
    /// `since_prev_ms`: see [`Verdict::since_prev_ms`].
    SincePrevMs,
    /// `distinct_callees`: see [`Verdict::distinct_callees`].
    DistinctCallees,
    /// `local_hour`: the hour of the event time (0-23) in the rule set's
    /// time zone (UTC without one).
    LocalHour(Tz),
    /// `local_weekday`: the day of the week of the event time in the rule
    /// set's time zone, ISO 8601 (1 Monday to 7 Sunday).
    LocalWeekday(Tz),
    /// `callee` as given.
    Callee,
    /// `duration_ms`.
    DurationMs,
    /// `decision`: `allow` or `reject`.
    Decision,
    /// `reason`.
    Reason,
    /// `retry_after_ms`: see [`DecisionRecord::retry_after_ms`].
    RetryAfterMs,
    /// `shadow`.
    Shadow,
    /// `late`.
    Late,
    /// `degraded`.
    Degraded,
    /// `label`: ground truth, if the event carried one.
    Label,
    /// `rules_version`.
    RulesVersion,
    /// `warn`: see [`DecisionRecord::warn`] (only in a rule set with a
    /// `warn` level).
    Warn,
    /// `score`: see [`Verdict::score`] (only in a rule set with a model).
    Score,
}

/// The type of a column, as tables store it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Text (possibly null).
    Text,
    /// Signed integer (possibly null).
    Int,
    /// Unsigned integer (possibly null).
    UInt,
    /// Boolean (possibly null).
    Bool,
    /// Timestamp, milliseconds, UTC.
    Time,
    /// 32-bit float (possibly null).
    Float,
}

/// The value of one field of one row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    /// [`Kind::Text`].
    Text(Option<&'a str>),
    /// [`Kind::Int`].
    Int(Option<i64>),
    /// [`Kind::UInt`].
    UInt(Option<u64>),
    /// [`Kind::Bool`].
    Bool(Option<bool>),
    /// [`Kind::Time`]: epoch milliseconds.
    Time(i64),
    /// [`Kind::Float`].
    Float(Option<f32>),
}

impl Field {
    /// The column type.
    pub fn kind(self) -> Kind {
        match self {
            Field::CallId
            | Field::Caller
            | Field::Callee
            | Field::Decision
            | Field::Reason
            | Field::RulesVersion
            | Field::Warn => Kind::Text,
            Field::TsMs | Field::SincePrevMs | Field::DurationMs | Field::RetryAfterMs => Kind::Int,
            Field::Count(_)
            | Field::DistinctCallees
            | Field::LocalHour(_)
            | Field::LocalWeekday(_) => Kind::UInt,
            Field::Shadow | Field::Late | Field::Degraded | Field::Label => Kind::Bool,
            Field::EventTime => Kind::Time,
            Field::Score => Kind::Float,
        }
    }

    /// The value for one row.
    pub fn value<'a>(self, row: Row<'a>) -> Value<'a> {
        let v = row.verdict;
        let r = &v.record;
        match self {
            Field::CallId => Value::Text(Some(&r.call_id)),
            Field::Caller => Value::Text(Some(&r.caller)),
            Field::TsMs => Value::Int(Some(r.ts_ms)),
            Field::EventTime => Value::Time(r.ts_ms),
            Field::Count(i) => Value::UInt(r.counts.get(i).copied().filter(|&c| c > 0)),
            Field::SincePrevMs => Value::Int(v.since_prev_ms()),
            Field::DistinctCallees => Value::UInt(v.distinct_callees),
            Field::LocalHour(tz) => {
                Value::UInt(local_parts(r.ts_ms, tz).map(|l| u64::from(l.hour)))
            }
            Field::LocalWeekday(tz) => {
                Value::UInt(local_parts(r.ts_ms, tz).map(|l| u64::from(l.weekday)))
            }
            Field::Callee => Value::Text(row.event.callee.as_deref()),
            Field::DurationMs => Value::Int(row.event.duration_ms),
            Field::Decision => Value::Text(Some(r.decision.as_str())),
            Field::Reason => Value::Text(Some(&r.reason)),
            Field::RetryAfterMs => Value::Int(r.retry_after_ms),
            Field::Shadow => Value::Bool(Some(r.shadow)),
            Field::Late => Value::Bool(Some(r.late)),
            Field::Degraded => Value::Bool(Some(r.degraded)),
            Field::Label => Value::Bool(row.event.label),
            Field::RulesVersion => Value::Text(Some(&r.rules_version)),
            Field::Warn => Value::Text(r.warn.as_deref()),
            Field::Score => Value::Float(v.score),
        }
    }
}

impl Value<'_> {
    /// The JSON form (`event_time` as RFC 3339 with milliseconds).
    pub fn to_json(self) -> serde_json::Value {
        match self {
            Value::Text(s) => json!(s),
            Value::Int(i) => json!(i),
            Value::UInt(u) => json!(u),
            Value::Bool(b) => json!(b),
            Value::Float(f) => json!(f.filter(|f| f.is_finite()).map(f64::from)),
            Value::Time(ms) => json!(DateTime::from_timestamp_millis(ms)
                .map(|d| d.to_rfc3339_opts(SecondsFormat::Millis, true))),
        }
    }
}

/// One named column of an output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Column (and JSON field) name.
    pub name: String,
    /// What it holds.
    pub field: Field,
}

/// The columns of one output, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schema {
    columns: Vec<Column>,
    /// Column indices by name: the key order of [`Schema::to_json`]'s
    /// objects, which [`Schema::write_json`] writes directly.
    by_name: Vec<usize>,
    /// Per entry of `by_name`, the JSON text before its value: `"name":`.
    keys: Vec<Vec<u8>>,
}

impl Schema {
    fn build(rules: &RuleSet, fields: &[Field]) -> Self {
        let mut columns = Vec::new();
        for &field in fields {
            let name = match field {
                Field::Count(_) => {
                    // A placeholder: expands to one column per rule.
                    for (i, rule) in rules.rules.iter().enumerate() {
                        columns.push(Column {
                            name: format!("count_{}", rule.name),
                            field: Field::Count(i),
                        });
                    }
                    continue;
                }
                Field::CallId => "call_id",
                Field::Caller => "caller",
                Field::TsMs => "ts_ms",
                Field::EventTime => "event_time",
                Field::SincePrevMs => "since_prev_ms",
                Field::DistinctCallees => "distinct_callees",
                Field::LocalHour(_) => "local_hour",
                Field::LocalWeekday(_) => "local_weekday",
                Field::Callee => "callee",
                Field::DurationMs => "duration_ms",
                Field::Decision => "decision",
                Field::Reason => "reason",
                Field::RetryAfterMs => "retry_after_ms",
                Field::Shadow => "shadow",
                Field::Late => "late",
                Field::Degraded => "degraded",
                Field::Label => "label",
                Field::RulesVersion => "rules_version",
                Field::Warn => {
                    let model_warns = rules.model().is_some_and(|m| m.warn.is_some());
                    if !rules.rules.iter().any(|r| r.warn.is_some()) && !model_warns {
                        continue;
                    }
                    "warn"
                }
                Field::Score => {
                    if rules.model().is_none() {
                        continue;
                    }
                    "score"
                }
            };
            columns.push(Column {
                name: name.to_string(),
                field,
            });
        }
        Self::from_columns(columns)
    }

    /// The schema of these columns, in this order.
    fn from_columns(columns: Vec<Column>) -> Self {
        let mut by_name: Vec<usize> = (0..columns.len()).collect();
        by_name.sort_by(|&a, &b| columns[a].name.cmp(&columns[b].name));
        let keys = by_name
            .iter()
            .map(|&i| {
                let mut key = Vec::new();
                json_text(&mut key, &columns[i].name);
                key.push(b':');
                key
            })
            .collect();
        Schema {
            columns,
            by_name,
            keys,
        }
    }

    /// Decision records (`call-decisions`, `replay`): `call_id, caller,
    /// ts_ms, decision, reason, retry_after_ms, count_<rule>..., shadow, late, degraded,
    /// rules_version`.
    pub fn decisions(rules: &RuleSet) -> Self {
        Self::build(
            rules,
            &[
                Field::CallId,
                Field::Caller,
                Field::TsMs,
                Field::Decision,
                Field::Reason,
                Field::RetryAfterMs,
                Field::Warn,
                Field::Score,
                Field::Count(0),
                Field::Shadow,
                Field::Late,
                Field::Degraded,
                Field::RulesVersion,
            ],
        )
    }

    /// Point-in-time features (`call-features`, `features`): `call_id,
    /// caller, event_time, ts_ms, count_<rule>..., since_prev_ms,
    /// distinct_callees, local_hour, local_weekday, callee, duration_ms,
    /// decision, reason, retry_after_ms, late, degraded, label,
    /// rules_version`.
    pub fn features(rules: &RuleSet) -> Self {
        let tz = rules.timezone.unwrap_or(Tz::UTC);
        Self::build(
            rules,
            &[
                Field::CallId,
                Field::Caller,
                Field::EventTime,
                Field::TsMs,
                Field::Count(0),
                Field::SincePrevMs,
                Field::DistinctCallees,
                Field::LocalHour(tz),
                Field::LocalWeekday(tz),
                Field::Callee,
                Field::DurationMs,
                Field::Decision,
                Field::Reason,
                Field::RetryAfterMs,
                Field::Warn,
                Field::Score,
                Field::Late,
                Field::Degraded,
                Field::Label,
                Field::RulesVersion,
            ],
        )
    }

    /// The columns, in order.
    pub fn columns(&self) -> &[Column] {
        &self.columns
    }

    /// Only the columns named in `names`, in that order (a name given
    /// twice is kept once); the values are this schema's. An empty list
    /// keeps every column. A name not in the schema is an error naming the
    /// columns there are.
    pub fn select(&self, names: &[String]) -> Result<Self, UnknownColumn> {
        if names.is_empty() {
            return Ok(self.clone());
        }
        let mut columns: Vec<Column> = Vec::with_capacity(names.len());
        for name in names {
            let name = name.trim();
            let Some(c) = self.columns.iter().find(|c| c.name == name) else {
                return Err(UnknownColumn {
                    name: name.to_string(),
                    columns: self.column_names(),
                });
            };
            if !columns.iter().any(|k| k.name == c.name) {
                columns.push(c.clone());
            }
        }
        Ok(Self::from_columns(columns))
    }

    /// The first `at` columns and the rest, as two schemas (for building
    /// a table's columns in two places).
    pub fn split_at(&self, at: usize) -> (Self, Self) {
        let at = at.min(self.columns.len());
        (
            Self::from_columns(self.columns[..at].to_vec()),
            Self::from_columns(self.columns[at..].to_vec()),
        )
    }

    /// Whether a column holds `field`.
    pub fn has(&self, field: Field) -> bool {
        self.columns.iter().any(|c| c.field == field)
    }

    /// The column names, comma-separated.
    pub fn column_names(&self) -> String {
        let names: Vec<&str> = self.columns.iter().map(|c| c.name.as_str()).collect();
        names.join(", ")
    }

    /// One row as a flat JSON object (a topic's payload).
    pub fn to_json(&self, row: Row<'_>) -> serde_json::Value {
        let mut m = Map::new();
        for c in &self.columns {
            m.insert(c.name.clone(), c.field.value(row).to_json());
        }
        serde_json::Value::Object(m)
    }

    /// [`Schema::to_json`]'s text for one row, as a payload (see
    /// [`Schema::write_json`]).
    pub fn json_bytes(&self, row: Row<'_>) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 * self.columns.len());
        self.write_json(row, &mut out);
        out
    }

    /// Appends [`Schema::to_json`]'s text for one row to `out`, written
    /// directly (no intermediate map: a topic's payloads are written once
    /// per call on the hot path). Byte for byte the same text.
    pub fn write_json(&self, row: Row<'_>, out: &mut Vec<u8>) {
        self.write_json_with(row, &[], out);
    }

    /// [`Schema::write_json`] with `extra` members merged in, as the map
    /// of [`Schema::to_json`] with them inserted would be written: keys in
    /// order, an extra member replacing a column of its name. `extra` is
    /// sorted by key, each value already JSON text (a check's answer adds
    /// `duplicate` and `ratelimit` to the decision record).
    pub fn write_json_with(&self, row: Row<'_>, extra: &[(&str, &[u8])], out: &mut Vec<u8>) {
        out.push(b'{');
        let mut digits = itoa::Buffer::new();
        let mut extra = extra.iter().peekable();
        for (key, &i) in self.keys.iter().zip(&self.by_name) {
            let name = self.columns[i].name.as_str();
            let mut replaced = false;
            while let Some((k, v)) = extra.next_if(|(k, _)| *k <= name) {
                replaced |= *k == name;
                json_member(out, k, v);
            }
            if !replaced {
                json_separator(out);
                out.extend_from_slice(key);
                write_value(self.columns[i].field.value(row), &mut digits, out);
            }
        }
        for (k, v) in extra {
            json_member(out, k, v);
        }
        out.push(b'}');
    }
}

/// Appends a comma unless `out` has just opened an object.
fn json_separator(out: &mut Vec<u8>) {
    if out.last() != Some(&b'{') {
        out.push(b',');
    }
}

/// Appends the member `"key":value`, `value` being JSON text.
fn json_member(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    json_separator(out);
    json_text(out, key);
    out.push(b':');
    out.extend_from_slice(value);
}

/// Appends one column's value as `serde_json` writes it.
fn write_value(value: Value<'_>, digits: &mut itoa::Buffer, out: &mut Vec<u8>) {
    match value {
        Value::Text(Some(s)) => json_text(out, s),
        Value::Int(Some(v)) => out.extend_from_slice(digits.format(v).as_bytes()),
        Value::UInt(Some(v)) => out.extend_from_slice(digits.format(v).as_bytes()),
        Value::Bool(Some(b)) => out.extend_from_slice(if b { b"true" } else { b"false" }),
        Value::Time(ms) => json_time(out, ms),
        Value::Float(Some(f)) if f.is_finite() => {
            out.extend_from_slice(ryu::Buffer::new().format_finite(f64::from(f)).as_bytes())
        }
        Value::Text(None)
        | Value::Int(None)
        | Value::UInt(None)
        | Value::Bool(None)
        | Value::Float(_) => out.extend_from_slice(b"null"),
    }
}

/// Appends `s` as a JSON string, as `serde_json` writes it.
fn json_text(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        // Nothing to escape (the common case: numbers, ids, reasons).
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Writing a str into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
    }
}

/// Appends an event time as `serde_json` writes its RFC 3339 text with
/// milliseconds (`"2025-12-01T00:00:45.561Z"`), or `null` out of range.
fn json_time(out: &mut Vec<u8>, ms: i64) {
    use chrono::{Datelike, Timelike};
    let Some(d) = DateTime::from_timestamp_millis(ms) else {
        out.extend_from_slice(b"null");
        return;
    };
    let year = d.year();
    if !(0..=9999).contains(&year) {
        // Years chrono writes with a sign: its own text.
        json_text(out, &d.to_rfc3339_opts(SecondsFormat::Millis, true));
        return;
    }
    let two = |out: &mut Vec<u8>, v: u32| {
        out.push(b'0' + (v / 10) as u8);
        out.push(b'0' + (v % 10) as u8);
    };
    let y = year as u32;
    out.push(b'"');
    two(out, y / 100);
    two(out, y % 100);
    out.push(b'-');
    two(out, d.month());
    out.push(b'-');
    two(out, d.day());
    out.push(b'T');
    two(out, d.hour());
    out.push(b':');
    two(out, d.minute());
    out.push(b':');
    two(out, d.second());
    out.push(b'.');
    let milli = d.timestamp_subsec_millis();
    out.push(b'0' + (milli / 100) as u8);
    two(out, milli % 100);
    out.extend_from_slice(b"Z\"");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A schema split in two holds its columns in order, once; selecting
    /// keeps the order asked for and refuses an unknown name.
    #[test]
    fn split_and_select_keep_the_columns() {
        let rules = RuleSet::from_args(None, &["m:sliding:60s:5".into()]).unwrap();
        let all = Schema::features(&rules);
        let names =
            |s: &Schema| -> Vec<String> { s.columns().iter().map(|c| c.name.clone()).collect() };
        for at in [0, 1, 8, all.columns().len(), 99] {
            let (a, b) = all.split_at(at);
            assert_eq!(a.columns().len(), at.min(all.columns().len()));
            assert_eq!(
                [names(&a), names(&b)].concat(),
                names(&all),
                "split at {at}"
            );
        }
        let picked = all
            .select(&["reason".into(), "call_id".into(), "reason".into()])
            .unwrap();
        assert_eq!(names(&picked), ["reason", "call_id"]);
        assert_eq!(names(&all.select(&[]).unwrap()), names(&all));
        let e = all.select(&["count_x".into()]).unwrap_err();
        assert_eq!(e.name, "count_x");
        assert!(e.columns.contains("count_m"), "{e}");
    }

    /// The direct writer gives exactly the map's text, for every field
    /// kind with and without a value, and names that need escaping.
    #[test]
    fn written_json_equals_the_map_s_text() {
        let rules =
            RuleSet::from_args(None, &["ab_1:sliding:60s:5".into(), "zz:fixed:1s:2".into()])
                .unwrap();
        let full = CallEvent {
            call_id: "c\u{e9}\"1".into(),
            caller: "+34911000001".into(),
            ts_ms: 1_764_547_200_123,
            callee: Some("+34600000000".into()),
            duration_ms: Some(-3),
            label: Some(true),
            ..Default::default()
        };
        let bare = CallEvent {
            callee: None,
            duration_ms: None,
            label: None,
            ..full.clone()
        };
        let mut v = Verdict::degraded(&full, &rules, Decision::Reject);
        v.record.counts = smallvec::smallvec![7, u64::MAX];
        v.record.retry_after_ms = Some(1_500);
        v.prev_ts_ms = Some(1_764_547_100_000);
        v.distinct_callees = Some(3);
        let bare_v = Verdict::degraded(&bare, &rules, Decision::Allow);
        for schema in [Schema::decisions(&rules), Schema::features(&rules)] {
            for row in [
                Row {
                    event: &full,
                    verdict: &v,
                },
                Row {
                    event: &bare,
                    verdict: &bare_v,
                },
            ] {
                let mut out = Vec::new();
                schema.write_json(row, &mut out);
                assert_eq!(
                    String::from_utf8(out).unwrap(),
                    schema.to_json(row).to_string()
                );
                // Members merged in: before, between and after the
                // columns, one replacing a column.
                let extra: [(&str, &[u8]); 4] = [
                    ("a", b"1"),
                    ("caller", b"\"x\""),
                    ("duplicate", b"true"),
                    ("zz_last", b"[1,{}]"),
                ];
                let mut out = Vec::new();
                schema.write_json_with(row, &extra, &mut out);
                let mut map = schema.to_json(row);
                for (k, v) in extra {
                    map[k] = serde_json::from_slice(v).unwrap();
                }
                assert_eq!(String::from_utf8(out).unwrap(), map.to_string());
            }
        }
    }

    /// `local_hour` and `local_weekday` are the event time's hour and ISO
    /// weekday in the set's time zone (UTC without one), across midnight
    /// and a summer-time change.
    #[test]
    fn local_time_features_follow_the_set_s_time_zone() {
        let utc = RuleSet::from_args(None, &["m:sliding:60s:5".into()]).unwrap();
        let madrid =
            RuleSet::from_toml("timezone = \"Europe/Madrid\"\n[[rule]]\nname = \"m\"\nkind = \"sliding\"\nwindow = \"60s\"\nlimit = 5\n")
                .unwrap();
        assert_ne!(utc.version(), madrid.version(), "the zone changes features");
        let at = |rules: &RuleSet, ts: &str| -> (u64, u64) {
            let ts_ms = DateTime::parse_from_rfc3339(ts).unwrap().timestamp_millis();
            let ev = CallEvent::new("c1", "+34911000001", ts_ms);
            let v = Verdict::degraded(&ev, rules, Decision::Allow);
            let row = Row {
                event: &ev,
                verdict: &v,
            };
            let json = Schema::features(rules).to_json(row);
            (
                json["local_hour"].as_u64().unwrap(),
                json["local_weekday"].as_u64().unwrap(),
            )
        };
        // Monday 1 December 2025, 23:30 UTC: 00:30 on Tuesday in Madrid.
        assert_eq!(at(&utc, "2025-12-01T23:30:00Z"), (23, 1));
        assert_eq!(at(&madrid, "2025-12-01T23:30:00Z"), (0, 2));
        // Sunday 30 March 2025, 01:30 UTC: 03:30 in Madrid, on summer time
        // from 01:00 UTC (02:30 before it would be, on winter time).
        assert_eq!(at(&madrid, "2025-03-30T01:30:00Z"), (3, 7));
        assert_eq!(at(&madrid, "2025-03-30T00:30:00Z"), (1, 7));
    }

    /// Times and strings are written as `serde_json` writes chrono's text
    /// and strings: over the whole time range (years with a sign, the
    /// epoch, millisecond edges, out of range) and every byte that needs
    /// escaping.
    #[test]
    fn times_and_strings_are_written_as_serde_json_does() {
        let mut times = vec![
            0,
            -1,
            1,
            999,
            1_000,
            1_764_547_200_123,
            253_402_300_799_999, // 9999-12-31T23:59:59.999Z
            253_402_300_800_000, // year 10000
            -62_167_219_200_000, // year 0
            -62_167_219_200_001, // year -1
            i64::MAX,
            i64::MIN,
        ];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..2_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            times.push((x % 600_000_000_000_000) as i64 - 300_000_000_000_000);
        }
        for ms in times {
            let mut out = Vec::new();
            json_time(&mut out, ms);
            let expected = Value::Time(ms).to_json().to_string();
            assert_eq!(String::from_utf8(out).unwrap(), expected, "{ms}");
        }
        let mut texts: Vec<String> = (0u8..=0x7f).map(|b| format!("a{}b", b as char)).collect();
        texts.extend(["", "+34911000001", "ok", "\u{e9}\u{1F600}", "\u{2028}"].map(String::from));
        for t in texts {
            let mut out = Vec::new();
            json_text(&mut out, &t);
            assert_eq!(
                String::from_utf8(out).unwrap(),
                serde_json::to_string(&t).unwrap()
            );
        }
    }

    #[test]
    fn features_and_decisions_share_their_common_columns_in_one_spelling() {
        let rules = RuleSet::from_args(None, &["m:sliding:60s:2".into()]).unwrap();
        let d = Schema::decisions(&rules);
        let f = Schema::features(&rules);
        for c in d.columns() {
            if c.field != Field::Shadow {
                assert!(f.columns().contains(c), "{} missing from features", c.name);
            }
        }
        let names: Vec<&str> = d.columns().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "call_id",
                "caller",
                "ts_ms",
                "decision",
                "reason",
                "retry_after_ms",
                "count_m",
                "shadow",
                "late",
                "degraded",
                "rules_version"
            ]
        );
    }
}

//! The stores' record form: a call's verdict as the window script writes
//! it and as both Redis stores keep it for idempotency (one line of
//! [`REPLY_FIELDS`]), and read back. The engine's verdicts know nothing of
//! it.

use crate::engine::event::CallEvent;
use crate::engine::record::{Counts, Decision, DecisionRecord, Verdict};

/// The fields of the Redis script's reply record, in order, `|`-separated
/// (`counts` is comma-separated). `lua/window.lua` documents the same list;
/// a test holds the two together.
pub const REPLY_FIELDS: [&str; 11] = [
    "ts_ms",
    "decision",
    "reason",
    "shadow",
    "late",
    "rules_version",
    "prev_ts_ms",
    "distinct_callees",
    "counts",
    "retry_after_ms",
    "warn",
];

impl Verdict {
    /// Rebuilds a verdict from a store's encoded reply record (see
    /// [`REPLY_FIELDS`]); `None` if it is malformed.
    pub fn from_reply(encoded: &str, event: &CallEvent, duplicate: bool) -> Option<Self> {
        Self::from_stored(encoded, &event.call_id, &event.caller, duplicate)
    }

    /// The record as a store keeps it, in the script's reply form (the
    /// fields of [`REPLY_FIELDS`] joined by `|`): what
    /// [`Verdict::from_stored`] reads back.
    pub fn to_reply(&self) -> String {
        // Written piece by piece (numbers with itoa): the cached store
        // writes one per call, and `format!` machinery was a tenth of its
        // task's time.
        let mut num = itoa::Buffer::new();
        let flag = |b: bool| if b { '1' } else { '0' };
        let r = &self.record;
        let mut out = String::with_capacity(64);
        out.push_str(num.format(r.ts_ms));
        out.push('|');
        out.push(flag(r.decision == Decision::Reject));
        out.push('|');
        out.push_str(&r.reason);
        out.push('|');
        out.push(flag(r.shadow));
        out.push('|');
        out.push(flag(r.late));
        out.push('|');
        out.push_str(&r.rules_version);
        out.push('|');
        if let Some(p) = self.prev_ts_ms {
            out.push_str(num.format(p));
        }
        out.push('|');
        if let Some(d) = self.distinct_callees {
            out.push_str(num.format(d));
        }
        out.push('|');
        for (i, c) in r.counts.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(num.format(*c));
        }
        out.push('|');
        if let Some(ms) = r.retry_after_ms {
            out.push_str(num.format(ms));
        }
        out.push('|');
        if let Some(w) = &r.warn {
            out.push_str(w);
        }
        out
    }

    /// [`Verdict::from_reply`] for a record of call `call_id` from `caller`.
    pub fn from_stored(
        encoded: &str,
        call_id: &str,
        caller: &str,
        duplicate: bool,
    ) -> Option<Self> {
        let mut parts: Vec<&str> = encoded.split('|').collect();
        // Kept by a version before retry_after_ms or warn (a redelivery
        // across an upgrade).
        while parts.len() >= REPLY_FIELDS.len() - 2 && parts.len() < REPLY_FIELDS.len() {
            parts.push("");
        }
        let [ts, decision, reason, shadow, late, version, prev, distinct, counts, retry, warn] =
            parts[..]
        else {
            return None;
        };
        let optional = |s: &str| -> Option<Option<i64>> {
            if s.is_empty() {
                Some(None)
            } else {
                s.parse().ok().map(Some)
            }
        };
        Some(Verdict {
            record: DecisionRecord {
                call_id: call_id.into(),
                caller: caller.into(),
                ts_ms: ts.parse().ok()?,
                decision: match decision {
                    "0" => Decision::Allow,
                    "1" => Decision::Reject,
                    _ => return None,
                },
                reason: reason.into(),
                counts: counts
                    .split(',')
                    .filter(|c| !c.is_empty())
                    .map(|c| c.parse().ok())
                    .collect::<Option<Counts>>()?,
                shadow: shadow == "1",
                late: late == "1",
                degraded: false,
                rules_version: version.into(),
                retry_after_ms: optional(retry)?,
                warn: (!warn.is_empty()).then(|| warn.into()),
            },
            prev_ts_ms: optional(prev)?,
            distinct_callees: optional(distinct)?.map(|d| d as u64),
            duplicate,
            end: false,
            score: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::rules::RuleSet;

    /// What a store keeps of a verdict reads back to the same verdict,
    /// every optional field with and without a value.
    #[test]
    fn stored_records_read_back() {
        let rules =
            RuleSet::from_args(None, &["a:sliding:60s:5".into(), "b:fixed:1s:2".into()]).unwrap();
        let event = CallEvent::new("c1", "+34911000001", 1_764_547_200_123);
        let bare = Verdict {
            record: DecisionRecord {
                degraded: false,
                ..Verdict::degraded(&event, &rules, Decision::Allow).record
            },
            ..Verdict::degraded(&event, &rules, Decision::Allow)
        };
        let mut full = bare.clone();
        full.record.decision = Decision::Reject;
        full.record.reason = "a".into();
        full.record.counts = smallvec::smallvec![6, 2];
        full.record.shadow = true;
        full.record.late = true;
        full.record.retry_after_ms = Some(9_000);
        full.record.warn = Some("b".into());
        full.prev_ts_ms = Some(1_764_547_100_000);
        full.distinct_callees = Some(4);
        for v in [bare, full] {
            let back = Verdict::from_stored(&v.to_reply(), "c1", "+34911000001", false);
            assert_eq!(back.as_ref(), Some(&v), "{}", v.to_reply());
        }
        // The same text as the window script writes for a record.
        for lua in ["5|1|m|0|1|abc|-3||4,2|900|", "5|0|ok|1|0|abc||7|1||burst"] {
            let v = Verdict::from_stored(lua, "c", "+34911234567", false).unwrap();
            assert_eq!(v.to_reply(), lua);
        }
    }

    #[test]
    fn lua_header_lists_the_reply_fields_in_order() {
        let lua = include_str!("../../lua/window.lua");
        let line = lua
            .lines()
            .find(|l| l.contains("record fields:"))
            .expect("the script header names its record fields");
        let listed: Vec<&str> = line
            .split("record fields:")
            .nth(1)
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        assert_eq!(listed, REPLY_FIELDS);
    }

    #[test]
    fn reply_round_trips() {
        let ev = CallEvent::new("c", "+34911234567", 5);
        let v = Verdict::from_reply("5|1|m|0|1|abc|-3||4,2", &ev, true).unwrap();
        assert_eq!(v.record.decision, Decision::Reject);
        assert_eq!(v.record.counts.as_slice(), [4, 2]);
        assert_eq!(v.prev_ts_ms, Some(-3));
        assert_eq!(v.distinct_callees, None);
        assert!(v.record.late && !v.record.shadow && v.duplicate);
        assert!(Verdict::from_reply("5|2|m|0|1|abc|||4", &ev, false).is_none());
        assert!(Verdict::from_reply("5|1|m|0|1|abc||", &ev, false).is_none());
    }
}

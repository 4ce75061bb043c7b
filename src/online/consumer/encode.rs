//! Messages in, records out: decoding call events from Kafka messages and
//! encoding decisions, features and dead letters as records to produce.

use std::sync::Arc;
use std::time::Instant;

use rdkafka::message::{Header, Headers, Message, OwnedHeaders};

use crate::engine::event::CallEvent;
use crate::engine::record::{Row, Schema, Verdict};
use crate::engine::rules::RuleSet;
use crate::error::EventError;
use crate::online::consumer::delivery::{OutKey, OutRecord};
use crate::online::consumer::ConsumeConfig;
use crate::online::policy::check_future_skew;

/// A message read: where it came from, and its event, or its dead letter
/// if it is not one (built as it is read, so the message's bytes are not
/// kept).
pub(super) struct Item {
    pub(super) topic: Arc<str>,
    pub(super) partition: i32,
    pub(super) offset: i64,
    /// When it was read.
    pub(super) read_at: Instant,
    /// The event, or the error's kind and the dead letter.
    pub(super) event: Result<CallEvent, (&'static str, Box<OutRecord>)>,
}

/// Decodes a message; the key must be present (producers key by caller).
pub fn decode_message(m: &impl Message, config: &ConsumeConfig) -> Result<CallEvent, EventError> {
    let payload = m.payload().unwrap_or_default();
    if payload.len() > config.max_payload_bytes {
        return Err(EventError::Oversized {
            size: payload.len(),
            limit: config.max_payload_bytes,
        });
    }
    if m.key().is_none_or(|k| k.is_empty()) {
        return Err(EventError::Missing(
            "message key (producers must key call events by caller)",
        ));
    }
    if payload.is_empty() {
        return Err(EventError::Json("empty payload".into()));
    }
    let event = config.decoder.decode_json(payload)?;
    check_future_skew(event, config.max_future_skew)
}

/// Longest key a dead letter keeps, bytes.
const MAX_DEAD_KEY: usize = 1024;
/// Most bytes of original headers a dead letter keeps.
const MAX_DEAD_HEADERS: usize = 16 * 1024;

/// The dead letter of a message: its original key and bytes, the error and
/// where it came from in headers. It is always small enough to produce: a
/// payload over `max_payload` bytes is cut to that many (header
/// `callguard.truncated_from` gives the original size; the source topic,
/// partition and offset still point at the whole message), a key over 1 KiB
/// likewise, and original headers beyond 16 KiB are left out.
pub(super) fn dead_letter(
    m: &impl Message,
    err: &EventError,
    topic: &Arc<str>,
    max_payload: usize,
) -> OutRecord {
    let payload = m.payload().unwrap_or_default();
    let key = m.key().unwrap_or_default();
    let mut headers = OwnedHeaders::new()
        .insert(Header {
            key: "callguard.error",
            value: Some(err.to_string().as_str()),
        })
        .insert(Header {
            key: "callguard.error_kind",
            value: Some(err.kind()),
        })
        .insert(Header {
            key: "callguard.source_topic",
            value: Some(m.topic()),
        })
        .insert(Header {
            key: "callguard.partition",
            value: Some(m.partition().to_string().as_str()),
        })
        .insert(Header {
            key: "callguard.offset",
            value: Some(m.offset().to_string().as_str()),
        });
    if payload.len() > max_payload {
        headers = headers.insert(Header {
            key: "callguard.truncated_from",
            value: Some(payload.len().to_string().as_str()),
        });
    }
    if key.len() > MAX_DEAD_KEY {
        headers = headers.insert(Header {
            key: "callguard.key_truncated_from",
            value: Some(key.len().to_string().as_str()),
        });
    }
    if let Some(h) = m.headers() {
        let mut kept = 0;
        for i in 0..h.count() {
            let hdr = h.get(i);
            kept += hdr.key.len() + hdr.value.map_or(0, <[u8]>::len);
            if kept > MAX_DEAD_HEADERS {
                headers = headers.insert(Header {
                    key: "callguard.headers_dropped",
                    value: Some((h.count() - i).to_string().as_str()),
                });
                break;
            }
            headers = headers.insert(Header {
                key: hdr.key,
                value: hdr.value,
            });
        }
    }
    OutRecord {
        topic: topic.clone(),
        key: OutKey::Bytes(key[..key.len().min(MAX_DEAD_KEY)].to_vec()),
        payload: payload[..payload.len().min(max_payload)].to_vec(),
        headers: Some(headers),
    }
}

/// How many rule sets' schemas the encoder remembers.
const SCHEMAS_KEPT: usize = 16;

/// The decision and feature schemas of one rule set.
struct Schemas {
    version: String,
    decisions: Schema,
    features: Schema,
}

impl Schemas {
    fn of(rules: &RuleSet) -> Self {
        Schemas {
            version: rules.version().to_string(),
            decisions: Schema::decisions(rules),
            features: Schema::features(rules),
        }
    }
}

/// Encodes decided calls as decision and feature records. Each record is
/// encoded with the schema of the rule set that decided it: a call
/// redelivered after a reload gets its first record back, whose counts are
/// those of the old rules, under the old rules' names. The schemas of the
/// last 16 rule sets are kept; a record of a set older than that (or from
/// before a restart with other rules) is encoded with the current names.
pub(super) struct Encoder {
    /// Most recent first; the current rule set's at the front.
    schemas: std::collections::VecDeque<Schemas>,
    /// Topic of decision records.
    decisions_topic: Arc<str>,
    /// Topic of feature records.
    features_topic: Arc<str>,
}

impl Encoder {
    /// An encoder for `rules`, writing to the configured output topics.
    pub fn new(rules: &RuleSet, config: &ConsumeConfig) -> Self {
        Encoder {
            schemas: std::iter::once(Schemas::of(rules)).collect(),
            decisions_topic: config.decisions_topic.as_str().into(),
            features_topic: config.features_topic.as_str().into(),
        }
    }

    /// Follows a rule reload.
    pub fn follow(&mut self, rules: &RuleSet) {
        if self
            .schemas
            .front()
            .is_some_and(|s| s.version == rules.version())
        {
            return;
        }
        self.schemas.retain(|s| s.version != rules.version());
        self.schemas.push_front(Schemas::of(rules));
        self.schemas.truncate(SCHEMAS_KEPT);
    }

    /// The schemas for a record decided under `version`.
    fn for_version(&self, version: &str) -> Option<&Schemas> {
        self.schemas
            .iter()
            .find(|s| s.version == version)
            .or(self.schemas.front())
    }

    /// One decision record and one feature record per call, keyed by
    /// caller; none for a call's end (applied, not decided).
    pub fn encode(&self, events: &[CallEvent], verdicts: &[Verdict], out: &mut Vec<OutRecord>) {
        for (event, verdict) in events.iter().zip(verdicts) {
            if verdict.end {
                continue;
            }
            let Some(schemas) = self.for_version(&verdict.record.rules_version) else {
                continue;
            };
            let row = Row { event, verdict };
            out.push(OutRecord {
                topic: self.decisions_topic.clone(),
                key: OutKey::Caller(event.caller.clone()),
                payload: schemas.decisions.json_bytes(row),
                headers: None,
            });
            out.push(OutRecord {
                topic: self.features_topic.clone(),
                key: OutKey::Caller(event.caller.clone()),
                payload: schemas.features.json_bytes(row),
                headers: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::record::{Decision, DecisionRecord};

    fn verdict(rules: &RuleSet, counts: Vec<u64>) -> Verdict {
        Verdict {
            record: DecisionRecord {
                call_id: "c1".into(),
                caller: "+34911000001".into(),
                ts_ms: 1_764_547_200_000,
                decision: Decision::Allow,
                reason: "ok".into(),
                counts: counts.into(),
                shadow: false,
                late: false,
                degraded: false,
                rules_version: rules.version().into(),
                retry_after_ms: None,
                warn: None,
            },
            prev_ts_ms: None,
            distinct_callees: None,
            duplicate: true,
            end: false,
            score: None,
        }
    }

    /// A record decided before a reload keeps its rules' column names.
    #[test]
    fn records_are_encoded_with_the_rules_that_decided_them() {
        let before = RuleSet::from_args(None, &["minute:sliding:60s:5".into()]).unwrap();
        let after = RuleSet::from_args(None, &["hour:sliding:1h:50".into()]).unwrap();
        let config = ConsumeConfig::new("b", "g", "calls", "d", "f", "dlq");
        let mut encoder = Encoder::new(&before, &config);
        encoder.follow(&after);
        let event = CallEvent::new("c1", "+34911000001", 1_764_547_200_000);
        let mut out = Vec::new();
        let events = [event.clone(), event];
        encoder.encode(
            &events,
            &[verdict(&before, vec![4]), verdict(&after, vec![7])],
            &mut out,
        );
        let decision =
            |i: usize| -> serde_json::Value { serde_json::from_slice(&out[i].payload).unwrap() };
        assert_eq!(decision(0)["count_minute"], 4);
        assert!(decision(0).get("count_hour").is_none());
        assert_eq!(decision(2)["count_hour"], 7);
        assert!(decision(2).get("count_minute").is_none());
    }

    /// A call's end is applied, not decided: it produces no record.
    #[test]
    fn a_call_end_produces_no_record() {
        let rules = RuleSet::from_args(None, &["minute:sliding:60s:5".into()]).unwrap();
        let config = ConsumeConfig::new("b", "g", "calls", "d", "f", "dlq");
        let encoder = Encoder::new(&rules, &config);
        let attempt = CallEvent::new("c1", "+34911000001", 1_764_547_200_000);
        let end = CallEvent {
            kind: crate::engine::event::EventKind::End,
            ..attempt.clone()
        };
        let mut out = Vec::new();
        encoder.encode(
            &[attempt, end.clone()],
            &[verdict(&rules, vec![1]), Verdict::of_end(&end, &rules)],
            &mut out,
        );
        assert_eq!(
            out.len(),
            2,
            "one decision and one feature record: the attempt's"
        );
    }
}

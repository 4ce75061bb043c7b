//! Messages in, records out: decoding call events from Kafka messages and
//! encoding decisions, features and dead letters as records to produce.

use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};

use crate::engine::event::CallEvent;
use crate::engine::record::{Row, Schema, Verdict};
use crate::engine::rules::RuleSet;
use crate::error::EventError;
use crate::online::consumer::delivery::OutRecord;
use crate::online::consumer::ConsumeConfig;

/// Decodes a message; the key must be present (producers key by caller).
pub fn decode_message(m: &OwnedMessage, config: &ConsumeConfig) -> Result<CallEvent, EventError> {
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
    if let Some(skew) = config.max_future_skew {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let limit = now_ms.saturating_add(skew.as_millis() as i64);
        if event.ts_ms > limit {
            return Err(EventError::TsOutOfRange {
                ts: event.ts_ms,
                why: format!(
                    "more than {} s ahead of the wall clock ({now_ms} ms)",
                    skew.as_secs()
                ),
            });
        }
    }
    Ok(event)
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
    m: &OwnedMessage,
    err: &EventError,
    topic: &str,
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
        topic: topic.to_string(),
        key: key[..key.len().min(MAX_DEAD_KEY)].to_vec(),
        payload: payload[..payload.len().min(max_payload)].to_vec(),
        headers: Some(headers),
        dead_letter: true,
    }
}

/// Encodes decided calls as decision and feature records, with the schemas
/// of the rule set in force (rebuilt only when its version changes).
pub(super) struct Encoder {
    version: String,
    decisions: Schema,
    features: Schema,
}

impl Encoder {
    pub fn new(rules: &RuleSet) -> Self {
        Encoder {
            version: rules.version().to_string(),
            decisions: Schema::decisions(rules),
            features: Schema::features(rules),
        }
    }

    /// Follows a rule reload.
    pub fn follow(&mut self, rules: &RuleSet) {
        if rules.version() != self.version {
            *self = Encoder::new(rules);
        }
    }

    /// One decision record and one feature record per call, keyed by caller.
    pub fn encode(
        &self,
        events: &[CallEvent],
        verdicts: &[Verdict],
        config: &ConsumeConfig,
        out: &mut Vec<OutRecord>,
    ) {
        for (event, verdict) in events.iter().zip(verdicts) {
            let row = Row { event, verdict };
            let key = event.caller.as_bytes();
            out.push(OutRecord {
                topic: config.decisions_topic.clone(),
                key: key.to_vec(),
                payload: self.decisions.to_json(row).to_string().into_bytes(),
                headers: None,
                dead_letter: false,
            });
            out.push(OutRecord {
                topic: config.features_topic.clone(),
                key: key.to_vec(),
                payload: self.features.to_json(row).to_string().into_bytes(),
                headers: None,
                dead_letter: false,
            });
        }
    }
}

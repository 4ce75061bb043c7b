//! Call events: the one input record every part of callguard consumes.
//!
//! A call event is decoded from a Kafka JSON payload or a call-log row by the
//! same [`Decoder`], so online and offline see exactly the same values. The
//! calling number is normalised to E.164 (`+` and 6 to 15 digits) before it
//! becomes part of any key; anything that cannot be normalised is an
//! [`EventError`], never a malformed key.

mod json;

use std::collections::HashMap;

use chrono::DateTime;
use compact_str::CompactString;

use crate::error::EventError;

/// The caller key of every call whose caller is unusable: missing, or not
/// a telephone number (garbage or spoofed CLI, a national number without a
/// default country code). Not a number itself, so no real caller shares
/// it; the rule set's `bad_caller` policy decides such calls.
pub const BAD_CALLER: &str = "bad_caller";

/// Most names of unread fields noted per event (see
/// [`Decoder::decode_json_noting`]).
pub const MAX_NOTED_FIELDS: usize = json::MAX_NOTED;

/// Longest accepted `call_id`, in bytes.
pub const MAX_CALL_ID_LEN: usize = 256;

/// Longest callee text considered for normalisation, bytes; longer ones
/// are dropped (an E.164 number with separators fits easily).
pub const MAX_CALLEE_INPUT_LEN: usize = 64;

/// Earliest accepted event time: 2000-01-01T00:00:00Z, epoch ms.
pub const MIN_TS_MS: i64 = 946_684_800_000;
/// First rejected event time: 2100-01-01T00:00:00Z, epoch ms. Times in
/// microseconds or nanoseconds, or other far-future values, land beyond it.
pub const MAX_TS_MS: i64 = 4_102_444_800_000;

/// Checks that an event time lies in `[MIN_TS_MS, MAX_TS_MS)`.
pub fn check_ts_range(ts: i64) -> Result<i64, EventError> {
    if ts < MIN_TS_MS {
        Err(EventError::TsOutOfRange {
            ts,
            why: "before 2000-01-01 (seconds instead of milliseconds?)".into(),
        })
    } else if ts >= MAX_TS_MS {
        Err(EventError::TsOutOfRange {
            ts,
            why: "2100-01-01 or later (microseconds instead of milliseconds?)".into(),
        })
    } else {
        Ok(ts)
    }
}

/// Pseudonymises telephone numbers (numbers are personal data): the
/// HMAC-SHA256 of the normalised number under a secret key, as `h` and 32
/// hex digits (128 bits). The same key gives the same pseudonym online and
/// offline; without the key a pseudonym cannot be turned back into a number.
#[derive(Clone)]
pub struct NumberHasher {
    key: std::sync::Arc<[u8]>,
}

/// Shortest accepted pseudonymisation key, bytes.
pub const MIN_HASH_KEY_LEN: usize = 16;

impl NumberHasher {
    /// A hasher with `key` (at least [`MIN_HASH_KEY_LEN`] bytes).
    pub fn new(key: &[u8]) -> Result<Self, EventError> {
        if key.len() < MIN_HASH_KEY_LEN {
            return Err(EventError::BadHashKey(key.len()));
        }
        Ok(NumberHasher { key: key.into() })
    }

    /// The pseudonym of a normalised number.
    pub fn hash(&self, number: &str) -> String {
        use hmac::Mac;
        // HMAC takes keys of any length: this cannot fail.
        let mut mac = match hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.key) {
            Ok(m) => m,
            Err(_) => return String::new(),
        };
        mac.update(number.as_bytes());
        let digest = mac.finalize().into_bytes();
        let mut out = String::with_capacity(33);
        out.push('h');
        for b in &digest[..16] {
            out.push_str(&format!("{b:02x}"));
        }
        out
    }
}

impl std::fmt::Debug for NumberHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NumberHasher(key: ***)")
    }
}

/// What an event says of its call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// The call is attempted: it is decided (today's events).
    #[default]
    Attempt,
    /// The call ended (hung up, or failed): `ts` is the hang-up time. It is
    /// not decided; it closes the call for the concurrent rules and brings
    /// its talk time to the sums.
    End,
}

impl EventKind {
    /// `attempt` or `end`, as inputs write it.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Attempt => "attempt",
            EventKind::End => "end",
        }
    }
}

/// One call event (an attempt, or the end of a call), decoded and normalised.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallEvent {
    /// Unique id of the call attempt (the idempotency key); inline up to 24
    /// bytes (an Asterisk `uniqueid`, a short id), allocated beyond.
    pub call_id: CompactString,
    /// The calling number, normalised to E.164 (`+` followed by 6 to 15
    /// digits; kept inline, never allocated).
    pub caller: CompactString,
    /// Event time, epoch milliseconds.
    pub ts_ms: i64,
    /// The called number, normalised to E.164 like the caller; `None` when
    /// absent or not a valid number (the call itself stays valid).
    pub callee: Option<CompactString>,
    /// Attempt or end ([`EventKind`]); an attempt unless the input says
    /// `event = "end"`.
    pub kind: EventKind,
    /// Call duration in milliseconds (attempt to hang-up), if present: in a
    /// call log, the call also ends at `ts + duration_ms`.
    pub duration_ms: Option<i64>,
    /// Talk (answered) time in milliseconds, if present; absent or 0 means
    /// unanswered.
    pub talk_ms: Option<i64>,
    /// The customer, tenant or SIP trunk the call is billed to (a PBX calls
    /// from hundreds of numbers): up to 64 of `A-Z a-z 0-9 . _ - : @ +`;
    /// rules keyed by `account` count its calls together.
    pub account: Option<CompactString>,
    /// Ground truth for tuning: `true` for fraud, if present.
    pub label: Option<bool>,
    /// With pseudonymised numbers: the caller's real normalised number, for
    /// allow- and denylist matching only (it is never stored or emitted).
    pub list_number: Option<String>,
    /// With pseudonymised numbers: the callee's real normalised number, for
    /// rules' callee prefixes and rate tables only (it is never stored or
    /// emitted).
    pub filter_callee: Option<CompactString>,
    /// What the rules keyed by callee or global found for this call, one
    /// entry per rule of the set (others zero), filled in by
    /// [`crate::engine::aggregate::Gate`] before the caller's rules decide;
    /// `None` when the set has no such rule.
    pub aggregate: Option<std::sync::Arc<[Aggregated]>>,
    /// Fields of the input whose values could not be read, as online and
    /// offline alike: optional ones (a label `unknown`, a duration `1.5`),
    /// which the call is kept without, or the caller, which the call then
    /// stands under [`BAD_CALLER`] for. Whoever read it reports them.
    pub dropped: Option<Box<[EventError]>>,
}

/// One rule keyed by callee or global, for one call: its count and, when
/// its window (as this instance sees it) would reject a call to the same
/// key later, the last time it would.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Aggregated {
    /// The count, this call included; 0 when the rule does not see it.
    pub count: u64,
    /// The last time at which a call to the same key would still exceed
    /// the limit, given the window after this call (the retry-after's
    /// part of the rule).
    pub until: Option<i64>,
}

impl CallEvent {
    /// A call attempt with only its identity and time: no callee,
    /// duration or label (set those fields, or build with
    /// `..Default::default()`, for more).
    pub fn new(
        call_id: impl Into<CompactString>,
        caller: impl Into<CompactString>,
        ts_ms: i64,
    ) -> Self {
        CallEvent {
            call_id: call_id.into(),
            caller: caller.into(),
            ts_ms,
            ..CallEvent::default()
        }
    }

    /// The number the allow- and denylists are matched against: the real
    /// caller, also when `caller` is a pseudonym.
    pub fn number_for_lists(&self) -> &str {
        self.list_number.as_deref().unwrap_or(&self.caller)
    }

    /// The callee rules' callee prefixes and rate tables are matched
    /// against: the real one, also when `callee` is a pseudonym.
    pub fn callee_for_filters(&self) -> Option<&str> {
        self.filter_callee.as_deref().or(self.callee.as_deref())
    }

    /// What rule `i` (keyed by callee or global) found for this call.
    pub fn aggregated(&self, i: usize) -> Aggregated {
        self.aggregate
            .as_ref()
            .and_then(|a| a.get(i).copied())
            .unwrap_or_default()
    }
}

/// A field value as found in the input, before decoding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RawValue<'a> {
    /// Missing or null.
    Null,
    /// A string (CSV cells are always strings).
    Str(&'a str),
    /// An integer (JSON number without fraction, Parquet integer).
    Int(i64),
    /// A floating point number (JSON number with a fraction or exponent).
    Float(f64),
    /// A boolean.
    Bool(bool),
}

/// As a person reads it in an error: JSON's spelling (`null`, `-5`,
/// `1.5`, `true`, and text in quotes, made printable).
impl std::fmt::Display for RawValue<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RawValue::Null => f.write_str("null"),
            RawValue::Str(s) => write!(f, "\"{}\"", printable(s)),
            RawValue::Int(i) => write!(f, "{i}"),
            RawValue::Float(x) => write!(f, "{x}"),
            RawValue::Bool(b) => write!(f, "{b}"),
        }
    }
}

impl<'a> RawValue<'a> {
    /// Borrows a JSON value as a raw value; arrays and objects become `None`.
    pub fn from_json(v: &'a serde_json::Value) -> Option<Self> {
        Some(match v {
            serde_json::Value::Null => RawValue::Null,
            serde_json::Value::Bool(b) => RawValue::Bool(*b),
            serde_json::Value::Number(n) => match n.as_i64() {
                Some(i) => RawValue::Int(i),
                None => RawValue::Float(n.as_f64().unwrap_or(f64::NAN)),
            },
            serde_json::Value::String(s) => RawValue::Str(s),
            _ => return None,
        })
    }

    fn is_null(&self) -> bool {
        match self {
            RawValue::Null => true,
            RawValue::Str(s) => s.trim().is_empty(),
            _ => false,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            RawValue::Null => "null",
            RawValue::Str(_) => "string",
            RawValue::Int(_) => "integer",
            RawValue::Float(_) => "float",
            RawValue::Bool(_) => "boolean",
        }
    }
}

/// The canonical field names of a call event.
pub const FIELDS: [&str; 9] = [
    "call_id",
    "caller",
    "ts",
    "callee",
    "duration_ms",
    "label",
    "event",
    "talk_ms",
    "account",
];

/// Places in [`FIELDS`].
const CALL_ID: usize = 0;
const CALLER: usize = 1;
/// The place of `ts` in [`FIELDS`].
pub const TS: usize = 2;
const CALLEE: usize = 3;
const DURATION_MS: usize = 4;
const LABEL: usize = 5;
const EVENT: usize = 6;
const TALK_MS: usize = 7;
const ACCOUNT: usize = 8;

/// The unit of a time or duration field of an input (`--map
/// duration_ms=billsec:s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Milliseconds (a time may also be RFC 3339 text).
    Millis,
    /// Seconds, maybe with a fraction (`12`, `1764547200.25`).
    Seconds,
}

/// Maps canonical field names to the names used by an input (`--map
/// caller=src`), and the units of `ts` and `duration_ms` when given
/// (`ts=start:s`, `duration_ms=billsec:s`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldMap {
    names: HashMap<String, String>,
    /// The units of `ts` and `duration_ms`, when given (read per event:
    /// fields, not a map).
    ts_unit: Option<Unit>,
    duration_unit: Option<Unit>,
    talk_unit: Option<Unit>,
}

impl FieldMap {
    /// Parses `caller=src,ts=start_time` (entries may also be given one by
    /// one); `ts` and `duration_ms` may name their unit, `:ms` or `:s`
    /// (`duration_ms=billsec:s`).
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, EventError> {
        let mut names = HashMap::new();
        let (mut ts_unit, mut duration_unit, mut talk_unit) = (None, None, None);
        for entry in entries {
            for pair in entry.as_ref().split(',').filter(|p| !p.trim().is_empty()) {
                let (canon, source) = pair
                    .split_once('=')
                    .ok_or_else(|| EventError::BadMapping(pair.to_string()))?;
                let canon = canon.trim();
                if !FIELDS.contains(&canon) {
                    return Err(EventError::BadMapping(format!(
                        "{pair}: unknown field `{canon}` (known: {})",
                        FIELDS.join(", ")
                    )));
                }
                let (source, unit) = match source.trim().rsplit_once(':') {
                    Some((col, "s")) => (col, Some(Unit::Seconds)),
                    Some((col, "ms")) => (col, Some(Unit::Millis)),
                    _ => (source.trim(), None),
                };
                match (canon, unit) {
                    (_, None) => {}
                    ("ts", unit) => ts_unit = unit,
                    ("duration_ms", unit) => duration_unit = unit,
                    ("talk_ms", unit) => talk_unit = unit,
                    _ => {
                        return Err(EventError::BadMapping(format!(
                            "{pair}: only ts, duration_ms and talk_ms take a unit (:s or :ms)"
                        )))
                    }
                }
                names.insert(canon.to_string(), source.to_string());
            }
        }
        Ok(FieldMap {
            names,
            ts_unit,
            duration_unit,
            talk_unit,
        })
    }

    /// The unit given for `ts`, if any.
    pub fn ts_unit(&self) -> Option<Unit> {
        self.ts_unit
    }

    /// The unit given for `duration_ms`, if any.
    pub fn duration_unit(&self) -> Option<Unit> {
        self.duration_unit
    }

    /// The unit given for `talk_ms`, if any.
    pub fn talk_unit(&self) -> Option<Unit> {
        self.talk_unit
    }

    /// The unit given for `canonical` (`ts`, `duration_ms` or `talk_ms`), if any.
    fn unit(&self, canonical: &str) -> Option<Unit> {
        match canonical {
            "ts" => self.ts_unit,
            "duration_ms" => self.duration_unit,
            "talk_ms" => self.talk_unit,
            _ => None,
        }
    }

    /// The mapping's entry for `canonical` as `--map` takes it
    /// (`duration_ms=billsec:s`), or `None` when it keeps the field's own
    /// name and gives no unit.
    pub fn entry(&self, canonical: &str) -> Option<String> {
        let source = self.source(canonical);
        let unit = match self.unit(canonical) {
            Some(Unit::Seconds) => ":s",
            Some(Unit::Millis) => ":ms",
            None => "",
        };
        (source != canonical || !unit.is_empty()).then(|| format!("{canonical}={source}{unit}"))
    }

    /// Whether the mapping names an input column for `canonical` itself
    /// (an entry of `--map`), rather than leaving it at its own name.
    pub fn is_named(&self, canonical: &str) -> bool {
        self.names.contains_key(canonical)
    }

    /// The input's name for a canonical field.
    pub fn source<'a>(&'a self, canonical: &'a str) -> &'a str {
        self.names
            .get(canonical)
            .map(String::as_str)
            .unwrap_or(canonical)
    }
}

/// Decodes raw fields into [`CallEvent`]s; shared by the Kafka and call-log paths.
#[derive(Debug, Clone, Default)]
pub struct Decoder {
    /// Input field names.
    pub map: FieldMap,
    /// Country code (digits, no `+`) for national numbers, e.g. `34`.
    pub default_country_code: Option<String>,
    /// Pseudonymise callers and callees (`--hash-numbers`).
    pub hasher: Option<NumberHasher>,
}

impl Decoder {
    /// A decoder with a field mapping and an optional default country code.
    pub fn new(map: FieldMap, default_country_code: Option<String>) -> Result<Self, EventError> {
        if let Some(cc) = &default_country_code {
            let cc = cc.trim_start_matches('+');
            if cc.is_empty() || cc.len() > 3 || !cc.bytes().all(|b| b.is_ascii_digit()) {
                return Err(EventError::BadCountryCode(cc.to_string()));
            }
        }
        Ok(Decoder {
            map,
            default_country_code: default_country_code
                .map(|c| c.trim_start_matches('+').to_string()),
            hasher: None,
        })
    }

    /// Decodes one event from a field lookup (`get(name)` returns the raw value of an input field).
    pub fn decode<'a, F>(&self, get: F) -> Result<CallEvent, EventError>
    where
        F: Fn(&str) -> RawValue<'a>,
    {
        self.decode_indexed(|i| get(self.map.source(FIELDS[i])))
    }

    /// Decodes one event from its fields by place: `get(i)` returns the raw
    /// value of the input field mapped to `FIELDS[i]` (for callers that
    /// resolved the mapping once, not once per event and field).
    pub fn decode_indexed<'a, F>(&self, get: F) -> Result<CallEvent, EventError>
    where
        F: Fn(usize) -> RawValue<'a>,
    {
        let call_id = decode_call_id(get(CALL_ID))?;
        // An unusable caller is a caller too: [`BAD_CALLER`], which the
        // rule set's `bad_caller` policy decides (never a refused event:
        // garbage CLI is what fraud sends).
        let mut dropped = Vec::new();
        let caller = self.caller(get(CALLER)).map_err(|e| dropped.push(e)).ok();
        let ts_ms = match self.map.ts_unit() {
            Some(Unit::Seconds) => seconds_value(get(TS)).ok_or_else(|| {
                EventError::BadTimestamp(format!("{} (mapped as epoch seconds)", get(TS)))
            })?,
            _ => parse_ts(get(TS))?,
        };
        let ts_ms = check_ts_range(ts_ms)?;
        let callee = match get(CALLEE) {
            v if v.is_null() => None,
            RawValue::Str(s) => self.callee(s),
            RawValue::Int(i) => self.callee(&i.to_string()),
            v => {
                return Err(EventError::WrongType {
                    field: "callee",
                    found: v.kind(),
                })
            }
        };
        // A bad optional field drops that field, not the call: the call
        // still counts in its caller's windows, so other calls' counts
        // do not depend on it.
        let kind = parse_event_kind(get(EVENT))?;
        let duration = parse_duration(get(DURATION_MS), self.map.duration_unit(), "duration_ms");
        let duration_ms = duration.unwrap_or_else(|e| {
            dropped.push(e);
            None
        });
        let talk = parse_duration(get(TALK_MS), self.map.talk_unit(), "talk_ms");
        let talk_ms = talk.unwrap_or_else(|e| {
            dropped.push(e);
            None
        });
        let account = parse_account(get(ACCOUNT)).unwrap_or_else(|e| {
            dropped.push(e);
            None
        });
        let label = parse_label(get(LABEL)).unwrap_or_else(|e| {
            dropped.push(e);
            None
        });
        // A pseudonym stays as it is (an event `serve --hash-numbers`
        // published, read back by `consume --hash-numbers`): hashed again it
        // would be another caller. Lists and callee ranges, matched on real
        // numbers, cannot see behind it.
        let (caller, callee, list_number, filter_callee) = match (&self.hasher, caller) {
            (Some(h), Some(caller)) if is_pseudonym(&caller) => {
                let callee = callee.map(|c| {
                    if is_pseudonym(&c) {
                        c
                    } else {
                        h.hash(&c).into()
                    }
                });
                (caller, callee, None, None)
            }
            // After normalisation, so a number has one pseudonym however it
            // was written; the real numbers stay only for list and callee
            // prefix matching. The unusable caller's key is no number.
            (Some(h), Some(caller)) => (
                h.hash(&caller).into(),
                callee.as_deref().map(|c| h.hash(c).into()),
                Some(caller.into()),
                callee,
            ),
            (Some(h), None) => (
                CompactString::const_new(BAD_CALLER),
                callee.as_deref().map(|c| h.hash(c).into()),
                None,
                callee,
            ),
            (None, caller) => (
                caller.unwrap_or(CompactString::const_new(BAD_CALLER)),
                callee,
                None,
                None,
            ),
        };
        Ok(CallEvent {
            call_id,
            caller,
            ts_ms,
            callee,
            kind,
            duration_ms,
            talk_ms,
            account,
            label,
            list_number,
            filter_callee,
            aggregate: None,
            dropped: (!dropped.is_empty()).then(|| dropped.into_boxed_slice()),
        })
    }

    /// The caller normalised to E.164; an error when missing or not a
    /// number.
    fn caller(&self, raw: RawValue<'_>) -> Result<CompactString, EventError> {
        match raw {
            RawValue::Str(s) if is_pseudonym(s) => Ok(s.into()),
            RawValue::Str(s) if !s.trim().is_empty() => {
                normalize_number(s, self.default_country_code.as_deref())
            }
            RawValue::Int(i) => {
                normalize_number(&i.to_string(), self.default_country_code.as_deref())
            }
            v if v.is_null() => Err(EventError::Missing("caller")),
            v => Err(EventError::WrongType {
                field: "caller",
                found: v.kind(),
            }),
        }
    }

    /// The callee normalised like a caller; `None` when it cannot be (an
    /// internal extension without a country code, `s`, garbage) or is
    /// longer than [`MAX_CALLEE_INPUT_LEN`]: the call stays valid, the
    /// distinct-callees feature skips it.
    fn callee(&self, raw: &str) -> Option<CompactString> {
        if is_pseudonym(raw) {
            return Some(raw.into());
        }
        if raw.len() > MAX_CALLEE_INPUT_LEN {
            return None;
        }
        normalize_number(raw, self.default_country_code.as_deref()).ok()
    }

    /// Decodes a JSON payload (a Kafka message value).
    pub fn decode_json(&self, payload: &[u8]) -> Result<CallEvent, EventError> {
        self.decode_json_at(payload, None)
    }

    /// [`Decoder::decode_json`], where a payload without a time (the field
    /// missing or null) takes `default_ts_ms` if given.
    pub fn decode_json_at(
        &self,
        payload: &[u8],
        default_ts_ms: Option<i64>,
    ) -> Result<CallEvent, EventError> {
        self.decode_json_noting(payload, default_ts_ms, None)
    }

    /// [`Decoder::decode_json_at`] that also notes, in `others`, the keys of
    /// the payload's fields it does not read (the first
    /// [`MAX_NOTED_FIELDS`]): a misspelled `calee`, or a switch's own.
    pub fn decode_json_noting(
        &self,
        payload: &[u8],
        default_ts_ms: Option<i64>,
        others: Option<&mut Vec<String>>,
    ) -> Result<CallEvent, EventError> {
        let text = std::str::from_utf8(payload)
            .map_err(|e| EventError::Json(format!("invalid UTF-8: {e}")))?;
        let names = FIELDS.map(|canon| self.map.source(canon));
        let found = json::read_fields(text, names, others)
            .map_err(|e| EventError::Json(e.to_string()))?
            .ok_or_else(|| EventError::Json("payload is not a JSON object".into()))?;
        for (canon, v) in FIELDS.iter().zip(&found) {
            if matches!(v, Some(json::Scalar::Nested)) {
                return Err(EventError::WrongType {
                    field: canon,
                    found: "array or object",
                });
            }
        }
        self.decode_indexed(|i| {
            let v = found[i]
                .as_ref()
                .and_then(json::Scalar::raw)
                .unwrap_or(RawValue::Null);
            match default_ts_ms {
                Some(now) if i == TS && v == RawValue::Null => RawValue::Int(now),
                _ => v,
            }
        })
    }

    /// The names of `fields` that are not the input names of any field
    /// (the first [`MAX_NOTED_FIELDS`], sorted).
    pub fn other_fields<'a>(&self, fields: impl Iterator<Item = &'a str>) -> Vec<String> {
        let known = FIELDS.map(|canon| self.map.source(canon));
        let mut others: Vec<String> = fields
            .filter(|f| !known.contains(f))
            .take(MAX_NOTED_FIELDS)
            .map(str::to_string)
            .collect();
        others.sort_unstable();
        others
    }

    /// The input names of the fields a decoder reads, in [`FIELDS`] order.
    pub fn known_fields(&self) -> Vec<&str> {
        FIELDS.iter().map(|canon| self.map.source(canon)).collect()
    }

    /// Decodes an event from text fields (a query string's parameters);
    /// without a time, `default_ts_ms` if given.
    pub fn decode_fields(
        &self,
        fields: &HashMap<String, String>,
        default_ts_ms: Option<i64>,
    ) -> Result<CallEvent, EventError> {
        let ts_name = self.map.source("ts");
        self.decode(|name| match (fields.get(name), default_ts_ms) {
            (Some(v), _) => RawValue::Str(v),
            (None, Some(now)) if name == ts_name => RawValue::Int(now),
            (None, _) => RawValue::Null,
        })
    }
}

fn decode_call_id(v: RawValue<'_>) -> Result<CompactString, EventError> {
    let id: CompactString = match v {
        RawValue::Str(s) => s.trim().into(),
        RawValue::Int(i) => i.to_string().into(),
        v if v.is_null() => return Err(EventError::Missing("call_id")),
        v => {
            return Err(EventError::WrongType {
                field: "call_id",
                found: v.kind(),
            })
        }
    };
    if id.is_empty() {
        return Err(EventError::Missing("call_id"));
    }
    if id.len() > MAX_CALL_ID_LEN || id.chars().any(char::is_control) {
        return Err(EventError::BadCallId(id.chars().take(40).collect()));
    }
    Ok(id)
}

/// Whether `s` is a pseudonym ([`NumberHasher::hash`]'s form: `h` and 32
/// lowercase hex digits), which no telephone number is.
pub fn is_pseudonym(s: &str) -> bool {
    s.len() == 33
        && s.starts_with('h')
        && s.bytes()
            .skip(1)
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Normalises a telephone number to E.164.
///
/// Spaces, dashes, dots and parentheses are stripped and a leading `00`
/// becomes `+`. With a default country code, national numbers (leading `0`,
/// or no prefix at all) get it prepended. The result must be `+` followed by
/// 6 to 15 digits.
pub fn normalize_number(
    raw: &str,
    default_country_code: Option<&str>,
) -> Result<CompactString, EventError> {
    // Fast path: already E.164 (most call records), kept inline.
    if let Some(digits) = raw.strip_prefix('+') {
        if (6..=15).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()) {
            return Ok(raw.into());
        }
    }
    let bad = |why: &str| EventError::BadNumber {
        field: "caller",
        value: format!("{} ({why})", printable(raw)),
    };
    let stripped: String = raw
        .chars()
        .filter(|c| !matches!(c, ' ' | '-' | '.' | '(' | ')' | '\t'))
        .collect();
    let e164 = if let Some(rest) = stripped.strip_prefix('+') {
        format!("+{rest}")
    } else if let Some(rest) = stripped.strip_prefix("00") {
        format!("+{rest}")
    } else if let Some(cc) = default_country_code {
        let national = stripped.strip_prefix('0').unwrap_or(&stripped);
        format!("+{cc}{national}")
    } else if stripped.bytes().all(|b| b.is_ascii_digit()) && !stripped.is_empty() {
        return Err(bad("national number: pass --default-country-code"));
    } else {
        format!("+{stripped}")
    };
    let digits = &e164[1..];
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad(
            "only digits, +, spaces, dashes, dots and parentheses are allowed",
        ));
    }
    if !(6..=15).contains(&digits.len()) {
        return Err(bad("E.164 numbers have 6 to 15 digits"));
    }
    Ok(e164.as_str().into())
}

fn printable(s: &str) -> String {
    let mut out: String = s.chars().take(40).flat_map(char::escape_default).collect();
    if s.chars().count() > 40 {
        out.push('…');
    }
    out
}

/// Parses an event time: integer epoch milliseconds or an RFC 3339 string.
pub fn parse_ts(v: RawValue<'_>) -> Result<i64, EventError> {
    match v {
        RawValue::Int(i) => Ok(i),
        RawValue::Str(s) => {
            let s = s.trim();
            if s.is_empty() {
                return Err(EventError::Missing("ts"));
            }
            if let Ok(i) = s.parse::<i64>() {
                return Ok(i);
            }
            if let Some(ms) = utc_rfc3339_ms(s) {
                return Ok(ms);
            }
            DateTime::parse_from_rfc3339(s)
                .map(|d| d.timestamp_millis())
                .map_err(|_| EventError::BadTimestamp(printable(s)))
        }
        RawValue::Null => Err(EventError::Missing("ts")),
        other => Err(EventError::BadTimestamp(other.to_string())),
    }
}

/// The common shape of an event time, parsed without a general parser:
/// `YYYY-MM-DDTHH:MM:SSZ` or `YYYY-MM-DDTHH:MM:SS.sssZ` (UTC, what most
/// exporters write), as epoch milliseconds. `None` for any other text
/// (which [`parse_ts`] hands to the full RFC 3339 parser), including
/// impossible dates and leap seconds.
fn utc_rfc3339_ms(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    let millis = match b.len() {
        20 => 0,
        24 if b[19] == b'.' => digits(&b[20..23])?,
        _ => return None,
    };
    if b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    if b[b.len() - 1] != b'Z' {
        return None;
    }
    let (year, month, day) = (digits(&b[0..4])?, digits(&b[5..7])?, digits(&b[8..10])?);
    let (hour, minute, second) = (
        digits(&b[11..13])?,
        digits(&b[14..16])?,
        digits(&b[17..19])?,
    );
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let month_days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return None,
    };
    if day == 0 || day > month_days || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    // Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
    // days_from_civil, years counted from March).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    Some(((days * 24 + hour) * 60 + minute) * 60_000 + second * 1_000 + millis)
}

/// ASCII decimal digits as a number; `None` if any byte is not a digit.
fn digits(b: &[u8]) -> Option<i64> {
    b.iter().try_fold(0i64, |n, &d| {
        d.is_ascii_digit().then(|| n * 10 + i64::from(d - b'0'))
    })
}

/// Seconds as written by a switch (`12`, or `1764547200.25` for
/// sub-second times) in milliseconds; `None` for anything else.
pub fn seconds_to_ms(s: &str) -> Option<i64> {
    let s = s.trim();
    let integer = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    if !integer(whole) || !(frac.is_empty() || integer(frac)) {
        return None;
    }
    let whole: i64 = whole.parse().ok()?;
    let mut ms = 0i64;
    for (i, d) in frac.bytes().take(3).enumerate() {
        ms += i64::from(d - b'0') * [100, 10, 1][i];
    }
    whole.checked_mul(1000)?.checked_add(ms)
}

/// A value in seconds (text or a JSON number) in milliseconds.
fn seconds_value(v: RawValue<'_>) -> Option<i64> {
    match v {
        RawValue::Int(i) if i >= 0 => i.checked_mul(1000),
        RawValue::Float(x) if x.is_finite() && x >= 0.0 => Some((x * 1000.0).round() as i64),
        RawValue::Str(s) => seconds_to_ms(s),
        _ => None,
    }
}

/// Parses a duration field (`duration_ms`, `talk_ms`) as milliseconds: a
/// non-negative integer, or with `Unit::Seconds` non-negative seconds
/// (fractions allowed); empty means unknown.
fn parse_duration(
    v: RawValue<'_>,
    unit: Option<Unit>,
    field: &'static str,
) -> Result<Option<i64>, EventError> {
    match v {
        v if v.is_null() => Ok(None),
        v if unit == Some(Unit::Seconds) => {
            seconds_value(v)
                .map(Some)
                .ok_or_else(|| EventError::BadNumber {
                    field,
                    value: format!("{v} (seconds, as mapped with :s)"),
                })
        }
        RawValue::Int(i) if i >= 0 => Ok(Some(i)),
        RawValue::Str(s) => match s.trim().parse::<i64>() {
            Ok(i) if i >= 0 => Ok(Some(i)),
            _ => Err(EventError::BadNumber {
                field,
                value: printable(s),
            }),
        },
        v => Err(EventError::BadNumber {
            field,
            value: v.to_string(),
        }),
    }
}

/// Longest account id, bytes.
pub const MAX_ACCOUNT_LEN: usize = 64;

/// Parses `account`: 1 to [`MAX_ACCOUNT_LEN`] of `A-Z a-z 0-9 . _ - : @
/// +` (a number is taken as its digits); empty means none.
fn parse_account(v: RawValue<'_>) -> Result<Option<CompactString>, EventError> {
    let text = match v {
        v if v.is_null() => return Ok(None),
        RawValue::Str(s) => CompactString::from(s.trim()),
        RawValue::Int(i) => CompactString::from(i.to_string()),
        v => {
            return Err(EventError::WrongType {
                field: "account",
                found: v.kind(),
            })
        }
    };
    let fine = |b: u8| b.is_ascii_alphanumeric() || b".-_:@+".contains(&b);
    if text.len() > MAX_ACCOUNT_LEN || !text.bytes().all(fine) {
        return Err(EventError::BadAccount(printable(&text)));
    }
    Ok(Some(text))
}

/// Parses `event`: `attempt` (also when absent or empty) or `end`. Any
/// other value refuses the event: read as an attempt, an end would count
/// a call that never was.
fn parse_event_kind(v: RawValue<'_>) -> Result<EventKind, EventError> {
    match v {
        v if v.is_null() => Ok(EventKind::Attempt),
        RawValue::Str(s) if s.trim().eq_ignore_ascii_case("attempt") => Ok(EventKind::Attempt),
        RawValue::Str(s) if s.trim().eq_ignore_ascii_case("end") => Ok(EventKind::End),
        RawValue::Str(s) => Err(EventError::BadEventKind(printable(s))),
        v => Err(EventError::WrongType {
            field: "event",
            found: v.kind(),
        }),
    }
}

/// Parses a label: `1`/`0`, `true`/`false`, `fraud`/`legit`; empty means unknown.
pub fn parse_label(v: RawValue<'_>) -> Result<Option<bool>, EventError> {
    match v {
        v if v.is_null() => Ok(None),
        RawValue::Bool(b) => Ok(Some(b)),
        RawValue::Int(1) => Ok(Some(true)),
        RawValue::Int(0) => Ok(Some(false)),
        RawValue::Str(s) => {
            // Compared without case and without allocating: a log has a
            // label on every row.
            let t = s.trim();
            let is = |words: [&str; 3]| words.iter().any(|w| t.eq_ignore_ascii_case(w));
            if is(["1", "true", "fraud"]) {
                Ok(Some(true))
            } else if is(["0", "false", "legit"]) {
                Ok(Some(false))
            } else {
                Err(EventError::BadLabel(printable(s)))
            }
        }
        other => Err(EventError::BadLabel(other.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shortcut for the common UTC shape gives the full parser's time,
    /// and leaves every other text (impossible dates, leap seconds, offsets,
    /// other shapes) to it.
    #[test]
    fn utc_times_parse_as_the_rfc3339_parser_does() {
        use chrono::SecondsFormat;
        let full = |s: &str| {
            DateTime::parse_from_rfc3339(s)
                .ok()
                .map(|d| d.timestamp_millis())
        };
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut shortcut = 0;
        for k in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // 0000-01-01 to 9999-12-31, and the range callguard accepts.
            let span = if k % 2 == 0 {
                315_537_897_600_000
            } else {
                4_102_444_800_000
            };
            let ms = (state % span) as i64 - 62_167_219_200_000 * i64::from(k % 2 == 0);
            let t = DateTime::from_timestamp_millis(ms).unwrap();
            for form in [SecondsFormat::Millis, SecondsFormat::Secs] {
                let text = t.to_rfc3339_opts(form, true);
                assert_eq!(utc_rfc3339_ms(&text), full(&text), "{text}");
                assert_eq!(parse_ts(RawValue::Str(&text)).ok(), full(&text), "{text}");
                shortcut += usize::from(utc_rfc3339_ms(&text).is_some());
            }
        }
        assert!(shortcut > 39_000, "{shortcut}");
        for text in [
            "2024-02-29T23:59:59.999Z",
            "2025-02-29T00:00:00Z",
            "2100-02-29T00:00:00Z",
            "2000-02-29T12:00:00.5Z",
            "2025-04-31T00:00:00Z",
            "2025-13-01T00:00:00Z",
            "2025-00-10T00:00:00Z",
            "2025-01-00T00:00:00Z",
            "2025-01-01T24:00:00Z",
            "2025-01-01T23:60:00Z",
            "2016-12-31T23:59:60Z",
            "2016-12-31T23:59:60.500Z",
            "2025-01-01t10:00:00z",
            "2025-01-01 10:00:00Z",
            "2025-01-01T10:00:00+01:00",
            "2025-01-01T10:00:00.123+00:00",
            "2025-01-01T10:00:00.12Z",
            "2025-01-01T10:00:00,123Z",
            "2025-1-01T10:00:00.123Z",
            "+025-01-01T10:00:00.123Z",
            "2025-01-01T10:0a:00.123Z",
        ] {
            assert_eq!(parse_ts(RawValue::Str(text)).ok(), full(text), "{text}");
            if let Some(ms) = utc_rfc3339_ms(text) {
                assert_eq!(Some(ms), full(text), "{text}");
            }
        }
        assert_eq!(utc_rfc3339_ms("2016-12-31T23:59:60Z"), None);
        assert_eq!(utc_rfc3339_ms("2025-02-29T00:00:00Z"), None);
    }

    #[test]
    fn pseudonyms_are_keyed_stable_and_never_show_the_key() {
        assert!(NumberHasher::new(b"short").is_err());
        let a = NumberHasher::new(b"0123456789abcdef").unwrap();
        let b = NumberHasher::new(b"0123456789abcdeF").unwrap();
        let h = a.hash("+34911234567");
        assert_eq!(h, a.hash("+34911234567"));
        assert_ne!(h, b.hash("+34911234567"));
        assert_ne!(h, a.hash("+34911234568"));
        assert!(h.starts_with('h') && h.len() == 33, "{h}");
        assert!(!format!("{a:?}").contains("0123"));
        // Written differently, one number has one pseudonym; lists see the real one.
        let d = Decoder {
            hasher: Some(a.clone()),
            ..Decoder::default()
        };
        let e = d
            .decode_json(br#"{"call_id":"x","caller":"0034 911 234 567","ts":1764547200000,"callee":"+34600000001"}"#)
            .unwrap();
        assert_eq!(e.caller, h);
        assert_eq!(e.callee.as_deref(), Some(a.hash("+34600000001").as_str()));
        assert_eq!(e.number_for_lists(), "+34911234567");
    }

    /// An event published with its numbers pseudonymised (`serve
    /// --hash-numbers`) keeps them when read by a decoder that hashes: the
    /// same caller key, not a hash of the hash nor an unusable caller.
    #[test]
    fn pseudonyms_are_not_hashed_again() {
        let h = NumberHasher::new(b"0123456789abcdef").unwrap();
        let d = Decoder {
            hasher: Some(h.clone()),
            ..Decoder::default()
        };
        let first = d
            .decode_json(br#"{"call_id":"x","caller":"+34911234567","ts":1764547200000,"callee":"+34600000001"}"#)
            .unwrap();
        assert!(is_pseudonym(&first.caller), "{}", first.caller);
        // As `serve` publishes it (src/online/produce.rs, event_json).
        let published = format!(
            r#"{{"call_id":"x","caller":"{}","ts":1764547200000,"callee":"{}"}}"#,
            first.caller,
            first.callee.as_deref().unwrap()
        );
        let again = d.decode_json(published.as_bytes()).unwrap();
        assert_eq!(again.caller, first.caller);
        assert_eq!(again.callee, first.callee);
        assert_eq!(again.dropped, None);
        // A decoder without the key reads the pseudonyms as they are too.
        let plain = Decoder::default()
            .decode_json(published.as_bytes())
            .unwrap();
        assert_eq!((plain.caller, plain.callee), (first.caller, first.callee));
        assert!(!is_pseudonym("+34911234567") && !is_pseudonym("hABC"));
    }

    #[test]
    fn normalises_numbers() {
        assert_eq!(
            normalize_number("+34 911-23.45(67)", None).unwrap(),
            "+34911234567"
        );
        assert_eq!(
            normalize_number("0034911234567", None).unwrap(),
            "+34911234567"
        );
        assert_eq!(
            normalize_number("0911234567", Some("34")).unwrap(),
            "+34911234567"
        );
        assert_eq!(
            normalize_number("911234567", Some("34")).unwrap(),
            "+34911234567"
        );
        for bad in [
            "",
            "+",
            "abc",
            "+34{91}",
            "+34\n911",
            "+12345",
            "+1234567890123456",
            "911234567",
        ] {
            assert!(
                normalize_number(bad, None).is_err(),
                "{bad:?} must be rejected"
            );
        }
    }

    #[test]
    fn parses_timestamps() {
        assert_eq!(
            parse_ts(RawValue::Int(1_700_000_000_000)).unwrap(),
            1_700_000_000_000
        );
        assert_eq!(
            parse_ts(RawValue::Str("1700000000000")).unwrap(),
            1_700_000_000_000
        );
        assert_eq!(
            parse_ts(RawValue::Str("2025-12-01T00:00:00.250Z")).unwrap(),
            1_764_547_200_250
        );
        assert_eq!(
            parse_ts(RawValue::Str("2025-12-01T01:00:00.250+01:00")).unwrap(),
            1_764_547_200_250
        );
        assert!(parse_ts(RawValue::Str("yesterday")).is_err());
        assert!(parse_ts(RawValue::Float(1.5)).is_err());
        assert!(parse_ts(RawValue::Null).is_err());
    }

    #[test]
    fn decodes_json_with_mapping() {
        let d = Decoder::new(FieldMap::parse(&["caller=src,ts=start"]).unwrap(), None).unwrap();
        let e = d
            .decode_json(br#"{"call_id":"a1","src":"+34911234567","start":"2025-12-01T00:00:00Z","label":"fraud"}"#)
            .unwrap();
        assert_eq!(e.caller, "+34911234567");
        assert_eq!(e.ts_ms, 1_764_547_200_000);
        assert_eq!(e.label, Some(true));
        assert!(d
            .decode_json(br#"{"call_id":"a1","src":"+34911234567"}"#)
            .is_err());
        assert!(d.decode_json(b"{\"call_id\":").is_err());
        assert!(d.decode_json(b"\xff\xfe").is_err());
        assert!(d
            .decode_json(br#"{"call_id":["x"],"src":"+34911234567","start":1}"#)
            .is_err());
    }

    /// A bad label or duration drops that field, not the call; the call's
    /// other fields are decoded as ever, and the errors say what was dropped.
    #[test]
    fn bad_optional_fields_are_dropped_and_the_call_kept() {
        let d = Decoder::default();
        let base = r#""call_id":"x","caller":"+34911000003","ts":1764547200000"#;
        let e = d
            .decode_json(format!(r#"{{{base},"label":"unknown","duration_ms":"1.5"}}"#).as_bytes())
            .unwrap();
        assert_eq!((e.label, e.duration_ms), (None, None));
        assert_eq!(e.caller, "+34911000003");
        let dropped: Vec<&str> = e.dropped.iter().flatten().map(EventError::kind).collect();
        assert_eq!(dropped, ["bad_number", "bad_label"]);
        let e = d
            .decode_json(format!(r#"{{{base},"label":"fraud","duration_ms":1500}}"#).as_bytes())
            .unwrap();
        assert_eq!(
            (e.label, e.duration_ms, e.dropped),
            (Some(true), Some(1500), None)
        );
    }

    #[test]
    fn decodes_call_ends_and_talk_time() {
        let d = Decoder::default();
        let base = r#""call_id":"x","caller":"+34911000003","ts":1764547200000"#;
        let e = d.decode_json(format!("{{{base}}}").as_bytes()).unwrap();
        assert_eq!((e.kind, e.talk_ms), (EventKind::Attempt, None));
        let e = d
            .decode_json(format!(r#"{{{base},"event":"end","talk_ms":61000}}"#).as_bytes())
            .unwrap();
        assert_eq!((e.kind, e.talk_ms), (EventKind::End, Some(61_000)));
        let e = d
            .decode_json(format!(r#"{{{base},"event":"attempt"}}"#).as_bytes())
            .unwrap();
        assert_eq!(e.kind, EventKind::Attempt);
        // An unknown kind refuses the event; a bad talk time is dropped.
        let bad = d.decode_json(format!(r#"{{{base},"event":"hangup"}}"#).as_bytes());
        assert!(
            matches!(&bad, Err(EventError::BadEventKind(v)) if v.contains("hangup")),
            "{bad:?}"
        );
        assert_eq!(bad.unwrap_err().kind(), "bad_event");
        let e = d
            .decode_json(format!(r#"{{{base},"event":"end","talk_ms":-3}}"#).as_bytes())
            .unwrap();
        assert_eq!((e.kind, e.talk_ms), (EventKind::End, None));
        assert_eq!(e.dropped.as_deref().map(<[_]>::len), Some(1));
        // billsec in seconds, as CDRs write it.
        let map = FieldMap::parse(&["talk_ms=billsec:s"]).unwrap();
        let d = Decoder::new(map, None).unwrap();
        let e = d
            .decode_json(format!(r#"{{{base},"event":"end","billsec":"12.5"}}"#).as_bytes())
            .unwrap();
        assert_eq!(e.talk_ms, Some(12_500));
    }

    #[test]
    fn decodes_accounts() {
        let d = Decoder::default();
        let base = r#""call_id":"x","caller":"+34911000003","ts":1764547200000"#;
        let account = |json: &str| {
            let e = d
                .decode_json(format!("{{{base},{json}}}").as_bytes())
                .unwrap();
            (
                e.account.map(|a| a.to_string()),
                e.dropped.map_or(0, |d| d.len()),
            )
        };
        assert_eq!(
            account(r#""account":"trunk:acme-7""#),
            (Some("trunk:acme-7".into()), 0)
        );
        assert_eq!(account(r#""account":4410"#), (Some("4410".into()), 0));
        assert_eq!(account(r#""account":"  ""#), (None, 0));
        // A bad account is dropped (the call kept, the field reported).
        assert_eq!(account(r#""account":"a b""#), (None, 1));
        assert_eq!(
            account(&format!(r#""account":"{}""#, "x".repeat(65))),
            (None, 1)
        );
        assert_eq!(account(&format!(r#""account":"{}""#, "x".repeat(64))).1, 0);
    }

    #[test]
    fn rejects_bad_mapping_and_labels() {
        assert!(FieldMap::parse(&["nope=src"]).is_err());
        assert!(FieldMap::parse(&["caller"]).is_err());
        assert!(parse_label(RawValue::Str("maybe")).is_err());
        assert!(parse_label(RawValue::Str("fraudulent")).is_err());
        assert_eq!(parse_label(RawValue::Str(" ")).unwrap(), None);
        for (text, label) in [
            ("1", true),
            (" True", true),
            ("FRAUD ", true),
            ("0", false),
            ("false", false),
            ("Legit", false),
        ] {
            assert_eq!(
                parse_label(RawValue::Str(text)).unwrap(),
                Some(label),
                "{text}"
            );
        }
    }

    #[test]
    fn errors_show_values_as_json_spells_them() {
        let d = Decoder::default();
        // A bad optional field is dropped, the call kept: its error is
        // what the reader reports.
        let err = |json: &str| match d.decode_json(json.as_bytes()) {
            Err(e) => e.to_string(),
            Ok(e) => e.dropped.expect("a dropped field")[0].to_string(),
        };
        let base = r#""call_id":"x","caller":"+34911000003""#;
        let cases = [
            (format!(r#"{{{base},"ts":true}}"#), "true"),
            (
                format!(r#"{{{base},"ts":1764547200000,"duration_ms":-5.5}}"#),
                "-5.5",
            ),
            (format!(r#"{{{base},"ts":1764547200000,"label":7}}"#), "7"),
        ];
        for (json, shown) in cases {
            let e = err(&json);
            assert!(e.contains(shown), "{json}: {e}");
            for debug in ["Bool(", "Float(", "Int(", "Str("] {
                assert!(!e.contains(debug), "{json}: {e}");
            }
        }
    }
}

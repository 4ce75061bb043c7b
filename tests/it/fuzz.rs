//! Fuzzing the input boundaries (reliability issue): the JSON decoder, the
//! call-log reader and the rules parser get arbitrary bytes and must answer
//! with a typed error or a value, never a panic. Bounded case counts keep
//! this inside the test command's budget.

use callguard::engine::event::{normalize_number, Decoder, FieldMap};
use callguard::engine::rules::{parse_duration_ms, Rule, RuleSet};
use callguard::offline::read::{read_call_log, ReadOptions};
use proptest::prelude::*;
use serde_json::{json, Value};

/// Any JSON value, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::from),
        "[+0-9 ()-]{0,20}".prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::hash_map(".{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A call-event-shaped object whose fields take any JSON value.
fn event_object() -> impl Strategy<Value = Value> {
    (
        json_value(),
        json_value(),
        json_value(),
        json_value(),
        json_value(),
        json_value(),
    )
        .prop_map(|(id, caller, ts, callee, dur, label)| {
            json!({"call_id": id, "caller": caller, "ts": ts, "callee": callee, "duration_ms": dur, "label": label})
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3_000, ..ProptestConfig::default() })]

    #[test]
    fn json_decoder_never_panics_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let d = Decoder::new(FieldMap::default(), Some("34".into())).unwrap();
        if let Err(e) = d.decode_json(&bytes) {
            prop_assert!(!e.kind().is_empty());
        }
    }

    #[test]
    fn json_decoder_never_panics_on_event_shapes(v in event_object()) {
        let d = Decoder::default();
        match d.decode_json(v.to_string().as_bytes()) {
            Ok(e) => {
                prop_assert!(e.caller.starts_with('+'));
                prop_assert!((callguard::engine::event::MIN_TS_MS..callguard::engine::event::MAX_TS_MS).contains(&e.ts_ms));
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn rules_parsers_never_panic(text in ".{0,300}", short in "[a-z_:0-9smhd-]{0,30}") {
        let _ = RuleSet::from_toml(&text);
        let _ = Rule::parse_shorthand(&short);
        let _ = parse_duration_ms(&short);
        let _ = normalize_number(&text, Some("34"));
    }

    #[test]
    fn rules_files_of_rule_shaped_text_never_panic(
        name in "[a-z_]{0,40}",
        kind in "(fixed|sliding|sliding-approx|[a-z]{0,6})",
        window in "[0-9]{0,25}(ms|s|m|h|d|w|)",
        limit in any::<i64>(),
        grace in "[0-9]{0,25}(ms|s|m|h|)",
    ) {
        let text = format!(
            "grace = \"{grace}\"\n[[rule]]\nname = \"{name}\"\nkind = \"{kind}\"\nwindow = \"{window}\"\nlimit = {limit}\n"
        );
        if let Ok(set) = RuleSet::from_toml(&text) {
            prop_assert!(set.rules[0].window_ms >= 1 && set.rules[0].limit >= 1);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    /// Arbitrary bytes after a valid header: the reader yields events and
    /// invalid rows, or one error for the file, never a panic.
    #[test]
    fn call_log_reader_never_panics(body in prop::collection::vec(
        prop_oneof![
            4 => any::<u8>(),
            2 => Just(b','),
            2 => Just(b'\n'),
            1 => Just(b'"'),
            1 => Just(b';'),
        ],
        0..400,
    )) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("calls.csv");
        let mut bytes = b"call_id,caller,ts\n".to_vec();
        bytes.extend_from_slice(&body);
        std::fs::write(&path, &bytes).unwrap();
        match read_call_log(&path, &ReadOptions::default()) {
            Ok(log) => {
                for (row, e) in &log.events {
                    prop_assert!(*row >= 1);
                    prop_assert!(e.caller.starts_with('+'));
                }
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    /// Arbitrary header lines: a wrong delimiter, missing or odd columns
    /// (no wanted column at all once made polars panic).
    #[test]
    fn call_log_headers_never_panic(
        header in prop::collection::vec(prop_oneof![
            3 => "[a-z_]{1,8}".prop_map(String::into_bytes),
            1 => Just(b"call_id".to_vec()),
            1 => Just(b"caller".to_vec()),
            1 => Just(b"ts".to_vec()),
            1 => prop::collection::vec(any::<u8>(), 0..4),
        ], 0..5),
        sep in prop_oneof![Just(b','), Just(b';'), Just(b'\t'), Just(b'|')],
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("calls.csv");
        let mut bytes = header.join(&sep);
        bytes.extend_from_slice(b"\na,+34911000001,1764547200000\n");
        std::fs::write(&path, &bytes).unwrap();
        if let Err(e) = callguard::offline::order::OrderedLog::open(&path, &ReadOptions::default()) {
            prop_assert!(!e.to_string().is_empty());
        }
    }
}

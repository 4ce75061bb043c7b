//! Hand-written window scenarios with their expected records. The semantics
//! suite checks the in-memory store against the expectations; the
//! conformance suite runs the same scenarios against Redis.
#![allow(dead_code)]

use callguard::engine::rules::{CountPolicy, Rule, RuleSet};

/// Start of 2025-12-01 UTC: a multiple of every window used here.
pub const T0: i64 = 1_764_547_200_000;

/// One scenario: a rule set and events with what each must yield.
pub struct Scenario {
    /// Name, for failure messages.
    pub name: &'static str,
    /// The rule set.
    pub rules: RuleSet,
    /// (caller, call id, ms after T0, expected) where expected is
    /// `"<decision> <reason> <counts,...>[ late][ shadow][ dup]"`.
    pub events: Vec<(&'static str, &'static str, i64, &'static str)>,
}

fn set(
    rules: &[&str],
    count: CountPolicy,
    grace_ms: i64,
    allow: &[&str],
    deny: &[&str],
    shadow: bool,
) -> RuleSet {
    RuleSet::new(
        rules
            .iter()
            .map(|r| Rule::parse_shorthand(r).unwrap())
            .collect(),
        count,
        grace_ms,
        allow.iter().map(|s| s.to_string()).collect(),
        deny.iter().map(|s| s.to_string()).collect(),
        shadow,
    )
    .unwrap()
}

const A: &str = "+34911000001";
const B: &str = "+34911000002";

/// All scenarios.
pub fn all() -> Vec<Scenario> {
    use CountPolicy::*;
    vec![
        Scenario {
            name: "sliding window edges: t-W excluded, t included",
            rules: set(&["s:sliding:1s:2"], Attempts, 5_000, &[], &[], false),
            events: vec![
                (A, "1", 0, "allow ok 1"),
                (A, "2", 999, "allow ok 2"),
                (A, "3", 1_000, "allow ok 2"),
                (A, "4", 1_000, "reject s 3"),
                (B, "5", 1_000, "allow ok 1"),
            ],
        },
        Scenario {
            name: "fixed bucket boundaries",
            rules: set(&["f:fixed:1s:2"], Attempts, 5_000, &[], &[], false),
            events: vec![
                (A, "1", 998, "allow ok 1"),
                (A, "2", 999, "allow ok 2"),
                (A, "3", 1_000, "allow ok 1"),
                (A, "4", 1_000, "allow ok 2"),
                (A, "5", 1_001, "reject f 3"),
            ],
        },
        Scenario {
            name: "same-millisecond ties count in processing order",
            rules: set(
                &["s:sliding:1m:3", "f:fixed:1m:3"],
                Attempts,
                5_000,
                &[],
                &[],
                false,
            ),
            events: vec![
                (A, "1", 7, "allow ok 1,1"),
                (A, "2", 7, "allow ok 2,2"),
                (A, "3", 7, "allow ok 3,3"),
                (A, "4", 7, "reject s 4,4"),
            ],
        },
        Scenario {
            name: "attempts: a caller who keeps calling stays blocked",
            rules: set(&["s:sliding:10s:2"], Attempts, 5_000, &[], &[], false),
            events: vec![
                (A, "1", 0, "allow ok 1"),
                (A, "2", 1, "allow ok 2"),
                (A, "3", 2, "reject s 3"),
                (A, "4", 3, "reject s 4"),
                (A, "5", 10_001, "reject s 3"),
            ],
        },
        Scenario {
            name: "admitted: only allowed calls count",
            rules: set(&["s:sliding:10s:2"], Admitted, 5_000, &[], &[], false),
            events: vec![
                (A, "1", 0, "allow ok 1"),
                (A, "2", 1, "allow ok 2"),
                (A, "3", 2, "reject s 3"),
                (A, "4", 3, "reject s 3"),
                (A, "5", 10_001, "allow ok 1"),
            ],
        },
        Scenario {
            name: "late events are flagged, events within grace are exact",
            rules: set(&["s:sliding:10s:100"], Attempts, 2_000, &[], &[], false),
            events: vec![
                (A, "1", 10_000, "allow ok 1"),
                (A, "2", 8_500, "allow ok 1"),
                (A, "3", 9_000, "allow ok 2"),
                (A, "4", 7_000, "allow ok 1 late"),
                (A, "5", 10_000, "allow ok 5"),
            ],
        },
        Scenario {
            name: "fixed: out of order within grace, and a late event in a dead bucket",
            rules: set(&["f:fixed:1s:5"], Attempts, 1_000, &[], &[], false),
            events: vec![
                (A, "1", 5_000, "allow ok 1"),
                (A, "2", 3_500, "allow ok 1 late"),
                (A, "3", 4_200, "allow ok 1"),
                (A, "4", 4_300, "allow ok 2"),
                (A, "5", 3_600, "allow ok 1 late"),
                (A, "6", 5_001, "allow ok 2"),
            ],
        },
        Scenario {
            name: "allow and deny lists take precedence; deny wins",
            rules: set(
                &["s:sliding:1m:1"],
                Attempts,
                5_000,
                &["+3491100", "+4477"],
                &["+447700"],
                false,
            ),
            events: vec![
                ("+447700900123", "1", 0, "reject denylist 1"),
                ("+447700900123", "2", 1, "reject denylist 2"),
                (A, "3", 2, "allow allowlist 1"),
                (A, "4", 3, "allow allowlist 2"),
                ("+447712345678", "5", 4, "allow allowlist 1"),
                ("+34600000001", "6", 5, "allow ok 1"),
                ("+34600000001", "7", 6, "reject s 2"),
            ],
        },
        Scenario {
            name: "shadow mode reports but allows; admitted shadow records what enforcement would",
            rules: set(&["s:sliding:1m:1"], Admitted, 5_000, &[], &[], true),
            events: vec![
                (A, "1", 0, "allow ok 1"),
                (A, "2", 1, "allow s 2 shadow"),
                (A, "3", 2, "allow s 2 shadow"),
            ],
        },
        Scenario {
            name: "a redelivered call id gets its first record back and counts once",
            rules: set(
                &["s:sliding:1m:2", "f:fixed:1m:5"],
                Attempts,
                5_000,
                &[],
                &[],
                false,
            ),
            events: vec![
                (A, "1", 0, "allow ok 1,1"),
                (A, "2", 1, "allow ok 2,2"),
                (A, "1", 0, "allow ok 1,1 dup"),
                (A, "1", 50, "allow ok 1,1 dup"),
                (A, "3", 2, "reject s 3,3"),
                (A, "3", 2, "reject s 3,3 dup"),
                (B, "1", 3, "allow ok 1,1"),
            ],
        },
        Scenario {
            name: "sliding-approx: weighted previous bucket, integer arithmetic",
            rules: set(
                &["a:sliding-approx:10s:100"],
                Attempts,
                10_000,
                &[],
                &[],
                false,
            ),
            events: vec![
                (A, "1", 1_000, "allow ok 1"),
                (A, "2", 2_000, "allow ok 2"),
                (A, "3", 3_000, "allow ok 3"),
                (A, "4", 4_000, "allow ok 4"),
                (A, "5", 5_000, "allow ok 5"),
                (A, "6", 12_500, "allow ok 4"),
                (A, "7", 17_500, "allow ok 3"),
                (A, "8", 9_000, "allow ok 6"),
                (A, "9", 18_000, "allow ok 4"),
                (A, "10", 35_000, "allow ok 1"),
            ],
        },
        Scenario {
            name: "sliding-approx: a late call at or below the horizon counts 1, however often redelivered",
            rules: set(&["a:sliding-approx:10s:3"], Attempts, 1_000, &[], &[], false)
                .with_dedup(11_000)
                .unwrap(),
            events: vec![
                (A, "1", 0, "allow ok 1"),
                (A, "2", 100, "allow ok 2"),
                (A, "3", 9_000, "allow ok 3"),
                // Bucket 1: floor(3 * 7499 / 10000) + 0 + 1. L' - R = 1500 from here.
                (A, "4", 12_500, "allow ok 3"),
                // In bucket 0 but past the horizon: its record is dropped at once
                // (L' - D = 1500), so it must not raise the counter.
                (A, "5", 1_000, "allow ok 1 late"),
                (A, "5", 1_000, "allow ok 1 late"),
                // In bucket 0 above the horizon: prev + 1, and recorded.
                (A, "6", 2_000, "reject a 4 late"),
                (A, "7", 12_600, "reject a 4"),
            ],
        },
        Scenario {
            name: "state idle longer than window + grace counts as none",
            rules: set(
                &["s:sliding:1m:5", "a:sliding-approx:1m:5", "f:fixed:1m:5"],
                Attempts,
                5_000,
                &[],
                &[],
                false,
            ),
            events: vec![
                (A, "1", 100, "allow ok 1,1,1"),
                (A, "2", 200, "allow ok 2,2,2"),
                (A, "3", 65_300, "allow ok 1,1,1"),
                (A, "4", 65_301, "allow ok 2,2,2"),
            ],
        },
    ]
}

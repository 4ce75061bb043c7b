//! The shipped Prometheus alert rules (`deploy/prometheus/`): valid, and
//! firing on the synthetic series of their unit tests (`promtool`, Debian's
//! `prometheus` package), and naming only metrics callguard exports.

mod common;

use std::process::Command;

fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus"))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "`promtool` could not be run ({e}): these tests need it (Debian: apt-get install \
                 prometheus). The README's test command installs it."
            )
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

#[test]
fn alert_rules_are_valid_and_fire_on_their_test_series() {
    let checked = promtool(&["check", "rules", "callguard-alerts.yml"]);
    assert!(checked.contains("SUCCESS: 8 rules found"), "{checked}");
    let tested = promtool(&["test", "rules", "callguard-alerts.test.yml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    // The Prometheus config docker-compose.yml mounts, rules included.
    let config = promtool(&["check", "config", "prometheus.yml"]);
    assert!(config.contains("SUCCESS: 8 rules found"), "{config}");
}

/// Every `callguard_*` metric an alert names is one callguard exports: a
/// renamed metric would leave its alert silent for ever.
#[test]
fn alert_rules_name_only_exported_metrics() {
    let rules = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/prometheus/callguard-alerts.yml"
    ))
    .unwrap();
    let metrics = callguard::online::metrics::Metrics::new();
    // Touch every family the alerts use, so the encoding lists them.
    for family in [&metrics.store_errors, &metrics.dlq, &metrics.rule_reloads] {
        callguard::online::metrics::Metrics::inc(family, "x");
    }
    metrics
        .lag
        .get_or_create(&callguard::online::metrics::PartitionLabels {
            topic: "t".into(),
            partition: "0".into(),
        })
        .set(1);
    metrics
        .events
        .get_or_create(&callguard::online::metrics::DecisionLabels {
            decision: "allow".into(),
            reason: "ok".into(),
        })
        .inc();
    let exported = metrics.encode();
    let mut named: Vec<&str> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("callguard_"))
        .collect();
    named.sort();
    named.dedup();
    assert!(named.len() >= 8, "{named:?}");
    for name in named {
        assert!(
            exported.lines().any(|l| l.starts_with(name)),
            "the alerts use {name}, which callguard does not export:\n{exported}"
        );
    }
}

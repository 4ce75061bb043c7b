//! The shipped Prometheus alert rules (`deploy/prometheus/`): valid, and
//! firing on the synthetic series of their unit tests (`promtool`, Debian's
//! `prometheus` package), and naming only metrics callguard exports.

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
    assert!(checked.contains("SUCCESS: 10 rules found"), "{checked}");
    let tested = promtool(&["test", "rules", "callguard-alerts.test.yml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    // The Prometheus config docker-compose.yml mounts, rules included.
    let config = promtool(&["check", "config", "prometheus.yml"]);
    assert!(config.contains("SUCCESS: 10 rules found"), "{config}");
}

/// What callguard's `/metrics` shows once every labelled family has a
/// series (an untouched family lists nothing).
fn exported() -> String {
    use callguard::online::metrics::{DecisionLabels, Metrics, PartitionLabels};
    let metrics = Metrics::new();
    let families = [
        &metrics.store_errors,
        &metrics.dlq,
        &metrics.rule_reloads,
        &metrics.invalid_checks,
        &metrics.connections_shed,
    ];
    for family in families {
        Metrics::inc(family, "x");
    }
    metrics
        .lag
        .get_or_create(&PartitionLabels {
            topic: "t".into(),
            partition: "0".into(),
        })
        .set(1);
    metrics
        .events
        .get_or_create(&DecisionLabels {
            decision: "allow".into(),
            reason: "ok".into(),
        })
        .inc();
    metrics.encode()
}

/// The `callguard_*` names in a text, once each.
fn names(text: &str) -> Vec<&str> {
    let mut named: Vec<&str> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("callguard_"))
        .collect();
    named.sort();
    named.dedup();
    named
}

fn assert_exported(what: &str, named: &[&str]) {
    let exported = exported();
    for name in named {
        assert!(
            exported.lines().any(|l| l.starts_with(name)),
            "{what} uses {name}, which callguard does not export:\n{exported}"
        );
    }
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
    let named = names(&rules);
    assert!(named.len() >= 8, "{named:?}");
    assert_exported("the alerts", &named);
}

/// The Grafana dashboard: every panel's queries are valid PromQL (checked
/// by `promtool` as recording rules, the `$instance` variable set to all)
/// on metrics callguard exports, and every panel uses the provisioned data
/// source.
#[test]
fn grafana_dashboard_queries_are_valid_on_exported_metrics() {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = std::fs::read_to_string(format!("{root}/deploy/grafana/dashboards/callguard.json"))
        .unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels.len() >= 8);
    let mut exprs = Vec::new();
    for p in panels {
        assert_eq!(p["datasource"]["uid"], "prometheus", "{}", p["title"]);
        for t in p["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().replace("$instance", ".*"));
        }
    }
    let all = exprs.join("\n");
    assert_exported("the dashboard", &names(&all));
    // Each query as a recording rule, for promtool to parse.
    let dir = tempfile::tempdir().unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in exprs.iter().enumerate() {
        rules.push_str(&format!(
            "      - record: dashboard:query{i}\n        expr: {}\n",
            serde_json::to_string(e).unwrap()
        ));
    }
    let file = dir.path().join("dashboard-queries.yml");
    std::fs::write(&file, rules).unwrap();
    let checked = promtool(&["check", "rules", file.to_str().unwrap()]);
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", exprs.len())),
        "{checked}"
    );
}

/// The docs cannot rot silently: every relative link in the README,
/// `docs/`, ARCHITECTURE.md and CONTRIBUTING.md points at a file that
/// exists, and so does every path of the project they name in code
/// (`src/engine/record.rs`, `scripts/test-all.sh`, ...).
#[test]
fn every_link_and_path_in_the_docs_exists() {
    use std::path::Path;
    let mut pages = vec![
        "README.md".to_string(),
        "ARCHITECTURE.md".to_string(),
        "CONTRIBUTING.md".to_string(),
    ];
    for entry in std::fs::read_dir("docs").unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path.to_string_lossy().into_owned());
        }
    }
    assert!(pages.len() >= 9, "{pages:?}");
    let roots = [
        "src/",
        "lua/",
        "scripts/",
        "tests/",
        "data/",
        "deploy/",
        "integrations/",
        "examples/",
        "notebooks/",
        "docs/",
    ];
    let mut missing = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        let dir = Path::new(page).parent().unwrap_or(Path::new(""));
        // Markdown links: ](target), relative ones only.
        for part in text.split("](").skip(1) {
            let target = part.split(')').next().unwrap_or("");
            let target = target.split('#').next().unwrap_or("");
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            if !dir.join(target).exists() {
                missing.push(format!("{page}: link {target}"));
            }
        }
        // Project paths named in code spans.
        for span in text.split('`').skip(1).step_by(2) {
            for word in span.split_whitespace() {
                let word = word.trim_end_matches([',', '.', ';', ':', ')']);
                let named = roots.iter().any(|r| word.starts_with(r));
                if !named || word.contains(['*', '{', '<', '$']) {
                    continue;
                }
                if !Path::new(word).exists() {
                    missing.push(format!("{page}: path {word}"));
                }
            }
        }
    }
    assert!(missing.is_empty(), "missing:\n{}", missing.join("\n"));
}

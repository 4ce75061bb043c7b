//! `notebooks/threshold_tuning.ipynb` runs top to bottom, headless, against
//! the binary built for these tests, so it cannot rot. Its own last cell
//! checks that the N it chooses is the one `callguard tune` recommends.

use crate::common;

use std::process::Command;

/// Runs `notebooks/<name>` headless from a clean state (the committed
/// outputs dropped first) against the binary built for these tests, its
/// files in `out`; the executed notebook's text.
fn execute(name: &str, out: &std::path::Path) -> String {
    let found = Command::new("jupyter")
        .args(["nbconvert", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "`jupyter nbconvert` not found: pip install -r notebooks/requirements.txt (scripts/test-all.sh does)"
    );
    let executed = out.join("executed.ipynb");
    let o = Command::new("jupyter")
        .current_dir("notebooks")
        .env("CALLGUARD_BIN", common::bin())
        .env("CALLGUARD_NOTEBOOK_OUT", out)
        .env("MPLBACKEND", "Agg")
        .args([
            "nbconvert",
            "--to",
            "notebook",
            "--execute",
            // From a clean state: the committed outputs are dropped first.
            "--ClearOutputPreprocessor.enabled=True",
            "--ExecutePreprocessor.timeout=600",
            name,
            "--output",
        ])
        .arg(&executed)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{name} failed (its packages: pip install -r notebooks/requirements.txt; scripts/test-all.sh does):\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::read_to_string(&executed).unwrap()
}

#[test]
fn threshold_tuning_notebook_runs_top_to_bottom() {
    let dir = tempfile::tempdir().unwrap();
    let text = execute("threshold_tuning.ipynb", dir.path());
    // The last cell prints "chosen N = <n>: ..." (the source has the words too).
    let chosen = text
        .split("chosen N = ")
        .skip(1)
        .find_map(|rest| rest.split(':').next()?.trim().parse::<u64>().ok());
    assert!(
        chosen.is_some_and(|n| (1..=60).contains(&n)),
        "no chosen N in the output"
    );
    for plot in ["sweep.png", "tradeoff.png"] {
        let len = std::fs::metadata(dir.path().join(plot)).map_or(0, |m| m.len());
        assert!(len > 10_000, "{plot}: {len} bytes");
    }
}

/// The committed notebook carries its outputs, so its tables and plots show
/// when the repository is browsed; and they hold no path of the machine
/// that ran it (`CALLGUARD_NOTEBOOK_OUT` and the binary stay out of them).
#[test]
fn the_committed_notebook_shows_its_outputs() {
    let text = std::fs::read_to_string("notebooks/threshold_tuning.ipynb").unwrap();
    let nb: serde_json::Value = serde_json::from_str(&text).unwrap();
    let outputs: Vec<&serde_json::Value> = nb["cells"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["cell_type"] == "code")
        .flat_map(|c| c["outputs"].as_array().into_iter().flatten())
        .collect();
    let plots = outputs
        .iter()
        .filter(|o| o["data"]["image/png"].is_string())
        .count();
    assert!(
        plots >= 2,
        "{plots} plots in the committed notebook: run it with outputs (see notebooks/)"
    );
    assert!(
        text.contains("chosen N = "),
        "the chosen N is not in the outputs"
    );
    for path in ["/root/", "/home/", "/tmp/", "/work/"] {
        let leaked = outputs.iter().any(|o| o.to_string().contains(path));
        assert!(!leaked, "an output names a machine path ({path})");
    }
}

/// `notebooks/fraud_model.ipynb` runs top to bottom headless against the
/// binary built for these tests (it generates two days, trains on the
/// first, checks callguard's scores against onnxruntime's and sweeps the
/// threshold on the second; its cells assert the scores agree and the model
/// adds recall on the held-out day); its committed outputs show the plots
/// and the result, and no machine path.
#[test]
fn fraud_model_notebook_runs_top_to_bottom() {
    let dir = tempfile::tempdir().unwrap();
    let text = execute("fraud_model.ipynb", dir.path());
    assert!(
        text.contains("over_1e-05 0 "),
        "no score check in the output"
    );
    assert!(
        text.contains("(rules + model)"),
        "no comparison in the output"
    );
    for plot in ["model.png", "model-sweep.png"] {
        let len = std::fs::metadata(dir.path().join(plot)).map_or(0, |m| m.len());
        assert!(len > 10_000, "{plot}: {len} bytes");
    }
    let committed = std::fs::read_to_string("notebooks/fraud_model.ipynb").unwrap();
    let nb: serde_json::Value = serde_json::from_str(&committed).unwrap();
    let outputs: Vec<String> = nb["cells"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| c["outputs"].as_array().into_iter().flatten())
        .map(|o| o.to_string())
        .collect();
    assert!(outputs.iter().filter(|o| o.contains("image/png")).count() >= 2);
    assert!(outputs.iter().any(|o| o.contains("(rules + model)")));
    for path in ["/root/", "/home/", "/tmp/", "/work/"] {
        assert!(
            !outputs.iter().any(|o| o.contains(path)),
            "an output names {path}"
        );
    }
}

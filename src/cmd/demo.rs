//! `callguard demo`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;

use callguard::demo::{self, DemoConfig};
use callguard::engine::rules::RuleSet;
use callguard::offline::read::ReadOptions;

/// The whole pipeline in one process with no servers: embedded Kafka
/// (librdkafka mock cluster), in-memory windows, the sample call log,
/// a live summary, and a parity check against `replay`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Call log to play (default: the sample log built into the binary,
    /// the project's `data/calls.csv`, so `demo` runs from any directory).
    #[arg(long, short)]
    pub input: Option<PathBuf>,
    /// Rule set file (default: the built-in `data/rules.toml`).
    #[arg(long)]
    pub rules: Option<PathBuf>,
    /// Partitions of the calls topic.
    #[arg(long, default_value_t = 4)]
    pub partitions: i32,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
}

/// The sample call log, built in.
const SAMPLE_CALLS: &[u8] = include_bytes!("../../data/calls.csv");

/// The sample rule set, built in.
const SAMPLE_RULES: &str = include_str!("../../data/rules.toml");

/// Runs `callguard demo`.
pub async fn run(args: DemoArgs) -> Result<()> {
    // The built-in sample is written to a temporary file for the run.
    let sample = tempfile::tempdir()?;
    let input = match args.input {
        Some(path) => path,
        None => {
            let path = sample.path().join("calls.csv");
            std::fs::write(&path, SAMPLE_CALLS)?;
            path
        }
    };
    let rules = match &args.rules {
        Some(path) => RuleSet::from_file(path)?,
        None => RuleSet::from_toml(SAMPLE_RULES)?,
    };
    let report = demo::run(DemoConfig {
        input,
        read: ReadOptions::default(),
        rules,
        partitions: args.partitions,
        timeout: Duration::from_secs(args.timeout_s),
    })
    .await?;
    println!();
    println!(
        "decided          {} of {} events ({:.0} events/s from the first decision, \
         which came {:.1} s after the start: joining the consumer group)",
        report.decided, report.produced, report.events_per_sec, report.first_decision_s
    );
    println!("rejected         {}", report.rejected);
    println!("dead letters     {}", report.dead_letters);
    let top: Vec<String> = report
        .top_rejected
        .iter()
        .map(|(c, n)| format!("{c} ({n})"))
        .collect();
    println!("top rejected     {}", top.join(", "));
    if report.mismatches == 0 && report.decided == report.produced {
        println!("parity           every decision equals `callguard replay` on the same file");
        Ok(())
    } else {
        anyhow::bail!(
            "{} decisions differ from the replay ({} of {} decided)",
            report.mismatches,
            report.decided,
            report.produced
        )
    }
}

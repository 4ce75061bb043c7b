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
    /// Call log to play.
    #[arg(long, short, default_value = "data/calls.csv")]
    pub input: PathBuf,
    /// Rule set file.
    #[arg(long, default_value = "data/rules.toml")]
    pub rules: PathBuf,
    /// Partitions of the calls topic.
    #[arg(long, default_value_t = 4)]
    pub partitions: i32,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
}

/// Runs `callguard demo`.
pub async fn run(args: DemoArgs) -> Result<()> {
    let report = demo::run(DemoConfig {
        input: args.input,
        read: ReadOptions::default(),
        rules: RuleSet::from_file(&args.rules)?,
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

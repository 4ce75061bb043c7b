//! `callguard features`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use crate::cmd::args::LogArgs;
use crate::cmd::{progress_wanted, report_invalid};

/// Export point-in-time features of every call of a call log (Parquet
/// or CSV): window counts, time since the caller's previous call,
/// distinct callees in the longest window, decision and label; the same
/// columns and values the consumer emits online. Large logs stream in chunks.
#[derive(Debug, Clone, Args)]
pub struct FeaturesArgs {
    /// The call log, the rules, pseudonyms.
    #[command(flatten)]
    pub log: LogArgs,
    /// Feature table: `.parquet` (recommended: typed timestamps) or `.csv`.
    #[arg(long, short)]
    pub output: PathBuf,
    /// Write only these columns, in this order, e.g.
    /// `call_id,count_minute,since_prev_ms` (default: all). Values are the
    /// full table's; work for features not asked for is skipped (distinct
    /// callees are not tracked unless `distinct_callees` or `rules_version`
    /// is asked for, nor callees read without `callee` either). An unknown
    /// name is an error listing the columns.
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub columns: Vec<String>,
}

/// Runs `callguard features`.
pub async fn run(args: FeaturesArgs) -> Result<()> {
    let rules = args.log.rule_set()?;
    let read = args.log.read_options(progress_wanted())?;
    let report = callguard::offline::features::export(
        &args.log.input.input,
        &read,
        &rules,
        &args.columns,
        &args.output,
    )
    .await?;
    println!(
        "features         {} rows to {}",
        report.rows,
        args.output.display()
    );
    if let Some(path) = &report.invalid_file {
        report_invalid(path, &report.streamed.invalid);
    }
    Ok(())
}

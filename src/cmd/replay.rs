//! `callguard replay`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use callguard::engine::record::Schema;
use callguard::offline::replay::to_table;

use crate::cmd::args::{LogArgs, StoreArgs};
use crate::cmd::{describe_rules, progress_wanted, report_invalid};

/// Decide every call of a historical call log, offline, with the same
/// window semantics as the online consumer.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// The call log, the rules, pseudonyms.
    #[command(flatten)]
    pub log: LogArgs,
    /// Store options.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Decision records: `.csv` or `.parquet`. Invalid rows go to
    /// `<name>.invalid.csv` beside it.
    #[arg(long, short)]
    pub output: PathBuf,
}

/// Runs `callguard replay`.
pub async fn run(args: ReplayArgs) -> Result<()> {
    let rules = args.log.rule_set()?;
    let read = args.log.read_options(progress_wanted())?;
    let mut store = args.store.open_replay().await?;
    let schema = Schema::decisions(&rules);
    let report = to_table(
        &args.log.input.input,
        &read,
        &rules,
        &mut store,
        schema,
        &args.output,
    )
    .await?;
    println!("rules            {}", describe_rules(&rules));
    println!("{}", report.streamed.summary);
    println!("decisions        {}", args.output.display());
    if let Some(path) = &report.invalid_file {
        report_invalid(path, &report.streamed.invalid);
    }
    Ok(())
}

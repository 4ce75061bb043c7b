//! `callguard generate`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use callguard::offline::generate;

/// Write a synthetic, labelled call log (subscribers, PBX trunks, call
/// centres, robocallers, wangiri bursts) for trying and testing callguard.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// Number of calls.
    #[arg(long, default_value_t = 20_000)]
    pub rows: usize,
    /// Random seed (the same seed gives the same log).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output CSV.
    #[arg(long, short)]
    pub output: PathBuf,
}

/// Runs `callguard generate`.
pub fn run(args: GenerateArgs) -> Result<()> {
    let calls = generate::generate(args.rows, args.seed);
    generate::write_csv(&args.output, &calls)?;
    let fraud = calls.iter().filter(|c| c.fraud).count();
    println!(
        "wrote {} calls ({} labelled fraud) to {}",
        calls.len(),
        fraud,
        args.output.display()
    );
    Ok(())
}

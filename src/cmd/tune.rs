//! `callguard tune`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;

use callguard::offline::order::OrderedLog;
use callguard::offline::table::write_frame;
use callguard::offline::tune::{render_table, sweep_frame, sweep_ordered, Target};

use crate::cmd::args::LogArgs;
use crate::cmd::progress_wanted;

/// Sweep a rule's limit N over a range on a call log and recommend one:
/// calls and callers rejected, and with labels precision, recall and
/// legit callers wrongly rejected, for every N. A `--rule` may leave out
/// its limit (`NAME:KIND:WINDOW`): the limit is what the sweep varies.
#[derive(Debug, Clone, Args)]
pub struct TuneArgs {
    /// The call log, the rules, pseudonyms.
    #[command(flatten)]
    pub log: LogArgs,
    /// Which rule to sweep (default: the first).
    #[arg(long)]
    pub sweep: Option<String>,
    /// Range of N, inclusive: `A..B`.
    #[arg(long, default_value = "1..200")]
    pub limits: String,
    /// Column holding the ground truth (1/0, true/false, fraud/legit).
    #[arg(long)]
    pub label_column: Option<String>,
    /// With labels: recommend the smallest N whose legit false-reject rate is at most this.
    #[arg(long, default_value_t = 0.002, conflicts_with = "quantile")]
    pub max_false_reject: f64,
    /// Without labels (or to override): recommend this quantile of per-caller peak counts.
    #[arg(long)]
    pub quantile: Option<f64>,
    /// Full sweep table: `.csv` or `.parquet`.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Plot: `.png` or `.svg`.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// Parses `A..B` (inclusive) into the limits A, A+1, ..., B.
pub fn parse_limits(s: &str) -> Result<Vec<u64>> {
    let bad = || anyhow::anyhow!("limits `{s}`: expected A..B with 1 <= A <= B <= 1000000");
    let (a, b) = s.split_once("..").ok_or_else(bad)?;
    let a: u64 = a.trim().parse().map_err(|_| bad())?;
    let b: u64 = b
        .trim()
        .trim_start_matches('=')
        .parse()
        .map_err(|_| bad())?;
    if a == 0 || a > b || b > 1_000_000 {
        return Err(bad());
    }
    Ok((a..=b).collect())
}

/// Runs `callguard tune`.
pub fn run(args: TuneArgs) -> Result<()> {
    let limits = parse_limits(&args.limits)?;
    let max_n = limits.last().copied().unwrap_or(1);
    // NAME:KIND:WINDOW without a limit: the sweep varies it.
    let mut rule_args = args.log.rules.clone();
    for r in &mut rule_args.rule {
        if r.split(':').count() == 3 {
            *r = format!("{r}:{max_n}");
        }
    }
    let rules = rule_args.rule_set()?;
    let index = match &args.sweep {
        Some(name) => rules
            .rule_index(name)
            .with_context(|| format!("no rule named `{name}` in the rule set"))?,
        None => 0,
    };
    let target = match args.quantile {
        Some(q) if (0.0..=1.0).contains(&q) => Target::Quantile(q),
        Some(q) => anyhow::bail!("--quantile {q}: expected 0 to 1"),
        None => Target::MaxFalseReject(args.max_false_reject),
    };
    let mut log_args = args.log.clone();
    if let Some(col) = &args.label_column {
        log_args.input.decoder.map.push(format!("label={col}"));
    }
    let progress = progress_wanted();
    let mut read = log_args.read_options(progress)?;
    // Callees matter to a sweep only where a rule decides by them.
    read.callees = rules.decides_by_callee();
    let log = Arc::new(OrderedLog::open(&log_args.input.input, &read)?);
    let rows = log.rows();
    let started = std::time::Instant::now();
    let (result, invalid) = sweep_ordered(log, &rules, index, &limits, target, progress)?;
    tracing::info!(
        passes = result.passes,
        seconds = started.elapsed().as_secs_f64(),
        "sweep done"
    );
    print!("{}", render_table(&result, 20));
    if let Some(out) = &args.output {
        write_frame(out, &mut sweep_frame(&result)?)?;
        println!("sweep table      {}", out.display());
    }
    if let Some(plot) = &args.plot {
        callguard::offline::plot::draw(&result, plot)?;
        println!("plot             {}", plot.display());
    }
    println!(
        "{} events, {} invalid rows, {} replay pass(es)",
        rows - invalid.len(),
        invalid.len(),
        result.passes
    );
    println!("recommendation: {}", result.explanation);
    Ok(())
}

//! `callguard tune`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;

use callguard::error::IoError;
use callguard::offline::order::OrderedLog;
use callguard::offline::read::not_kept;
use callguard::offline::table::{write_frame, write_invalid, TableFormat};
use callguard::offline::tune::{
    default_thresholds, model_sweep_frame, observed_limits, render_model_sweep, render_table,
    sweep_frame, sweep_model, sweep_ordered, Target,
};

use crate::cmd::args::LogArgs;
use crate::cmd::{progress_wanted, report_invalid};

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
    /// The limits N to sweep: `A..B` (every whole number from A to B), or
    /// values `V1,V2,...`. For a sum rule they are in its unit (`5m,90m`
    /// of talk, `20.00,50` of spend), and without this option the sweep
    /// takes quantiles of its callers' observed sums (50% to 99.9%, the
    /// largest, and a log-spaced tail). Default for other rules: 1..200.
    #[arg(long)]
    pub limits: Option<String>,
    /// Column holding the ground truth (1/0, true/false, fraud/legit).
    #[arg(long)]
    pub label_column: Option<String>,
    /// With labels: recommend the smallest N whose legit false-reject rate is at most this
    /// (with `--model`: the lowest threshold whose model's own rate is).
    #[arg(long, default_value_t = 0.002, conflicts_with = "quantile")]
    pub max_false_reject: f64,
    /// Without labels (or to override): recommend this quantile of per-caller peak counts.
    #[arg(long)]
    pub quantile: Option<f64>,
    /// Full sweep table: `.csv` or `.parquet`. Rows that are not valid
    /// calls, and fields dropped from calls kept (a label `unknown`), are
    /// listed in `<name>.invalid.csv` beside it; without `--output`, in
    /// `<log's name>.invalid.csv` in the current directory (columns no rule
    /// of the set reads, such as `talk_ms` without a sum rule, are not
    /// read, so not listed). A log with no valid call is an error.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Plot: `.png` or `.svg`.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Sweep the threshold of the rule set's `[model]` instead of a rule's
    /// limit: on a labelled log, the calls rejected, recall, precision and
    /// legit false-reject rate per threshold (from one replay that scores
    /// every call), the rules alone beside the rules and the model, and the
    /// highest-recall threshold whose model's own legit false-reject rate
    /// (legit calls it rejects that the rules allow) is at most
    /// `--max-false-reject`. See docs/model.md.
    #[arg(long, conflicts_with_all = ["sweep", "limits", "quantile"])]
    pub model: bool,
    /// With `--model`: the thresholds to sweep, `T1,T2,...` (0 to 1).
    /// Default: 0.05 to 0.95 by 0.05, 0.97, 0.99, 0.995.
    #[arg(long, requires = "model", value_delimiter = ',')]
    pub thresholds: Option<Vec<f32>>,
}

/// Where `tune` without `--output` lists a log's invalid rows:
/// `<log's stem>.invalid.csv` in the current directory.
fn invalid_home(input: &Path) -> PathBuf {
    let stem = input
        .file_stem()
        .map_or_else(|| "tune".into(), |s| s.to_string_lossy().into_owned());
    PathBuf::from(format!("{stem}.csv"))
}

/// Parses `A..B` (inclusive) into the limits A, A+1, ..., B, or a list
/// `V1,V2,...` of whole numbers; ascending and distinct.
pub fn parse_limits(s: &str) -> Result<Vec<u64>> {
    if !s.contains("..") {
        return parse_values(s, |v| {
            v.parse::<u64>()
                .ok()
                .filter(|&n| n >= 1)
                .ok_or_else(|| format!("`{v}`: a whole number from 1"))
        });
    }
    let bad =
        || anyhow::anyhow!("limits `{s}`: expected A..B with 1 <= A <= B <= 1000000, or V1,V2,...");
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

/// Parses a list `V1,V2,...` by `one`: ascending and distinct.
fn parse_values(s: &str, one: impl Fn(&str) -> Result<u64, String>) -> Result<Vec<u64>> {
    let mut values = s
        .split(',')
        .map(|v| one(v.trim()))
        .collect::<Result<Vec<u64>, String>>()
        .map_err(|e| anyhow::anyhow!("limits `{s}`: {e}"))?;
    values.sort_unstable();
    values.dedup();
    anyhow::ensure!(!values.is_empty(), "limits `{s}`: no value");
    Ok(values)
}

/// Runs `callguard tune`.
pub async fn run(args: TuneArgs) -> Result<()> {
    if args.model {
        return run_model(args).await;
    }
    // A window rule's limits; a sum rule's are read in its unit below.
    let limits = parse_limits(args.limits.as_deref().unwrap_or("1..200"));
    // Output names are checked before the sweep, not after it.
    if let Some(out) = &args.output {
        TableFormat::from_path(out)?;
    }
    if let Some(plot) = &args.plot {
        callguard::offline::plot::check_path(plot)?;
    }
    let max_n = limits
        .as_ref()
        .ok()
        .and_then(|l| l.last().copied())
        .unwrap_or(200);
    // NAME:KIND:WINDOW without a limit: the sweep varies it.
    let mut rule_args = args.log.rules.clone();
    for r in &mut rule_args.rule {
        if r.split(':').count() == 3 {
            *r = format!("{r}:{max_n}");
        }
    }
    let rules = rule_args.rule_set()?;
    if rules.model().is_some() {
        println!("the rule set's [model] is left out of the limit sweep: sweep its threshold with --model");
    }
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
    // So do durations where calls' ends count, talk where it is added up,
    // and accounts where a rule is keyed by them.
    read.durations = rules.uses_ends();
    read.talk = rules.adds_talk();
    read.accounts = rules.keys_by_account();
    let mut log = OrderedLog::open(&log_args.input.input, &read)?;
    if rules.uses_ends() {
        // Calls end: a concurrent or sum rule's count needs their ends.
        log = log.with_ends();
    }
    let log = Arc::new(log);
    let limits = match (&rules.rules[index].sum, &args.limits) {
        (Some(sum), Some(given)) => parse_values(given, |v| sum.of.parse_level(v))?,
        (Some(sum), None) => {
            let observed = observed_limits(log.clone(), &rules, index, progress)?;
            let rule = &rules.rules[index];
            // (A sum keyed by account, callee or global is the key's.)
            let whose = match rule.key.is_aggregate() {
                true => rule.key.as_str(),
                false => "caller",
            };
            println!(
                "limits of {} ({}), from each {whose}'s peak sum: {}",
                rule.name,
                sum.unit(),
                observed
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            observed
        }
        (None, _) => limits?,
    };
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
    let not_decided = not_kept(&invalid);
    let invalid_file = match &args.output {
        Some(out) => write_invalid(out, &invalid)?,
        // Without an output, beside where the command runs, named after the log.
        None => write_invalid(&invalid_home(&args.log.input.input), &invalid)?,
    };
    if let Some(path) = &invalid_file {
        report_invalid(path, &invalid);
    }
    if rows == not_decided {
        let first = invalid
            .iter()
            .find(|r| !r.kept)
            .map(|r| format!(" (the first, row {}: {})", r.row, r.error))
            .unwrap_or_default();
        return Err(IoError::BadShape {
            path: args.log.input.input.clone(),
            problem: format!(
                "no valid call to tune on: all {rows} rows are invalid{first}{}",
                invalid_file
                    .map(|p| format!("; listed in {}", p.display()))
                    .unwrap_or_default()
            ),
        }
        .into());
    }
    println!(
        "{} events, {} invalid rows, {} replay pass(es)",
        rows - not_decided,
        not_decided,
        result.passes
    );
    println!("recommendation: {}", result.explanation);
    Ok(())
}

/// `tune --model`: the model's threshold swept (see [`TuneArgs::model`]).
async fn run_model(args: TuneArgs) -> Result<()> {
    if let Some(out) = &args.output {
        TableFormat::from_path(out)?;
    }
    if let Some(plot) = &args.plot {
        callguard::offline::plot::check_path(plot)?;
    }
    let rules = args.log.rules.rule_set()?;
    anyhow::ensure!(
        rules.model().is_some(),
        "--model: the rule set has no [model] to tune (see docs/model.md)"
    );
    let thresholds = args.thresholds.clone().unwrap_or_else(default_thresholds);
    if let Some(bad) = thresholds.iter().find(|t| !(0.0..=1.0).contains(*t)) {
        anyhow::bail!("--thresholds: {bad} is not between 0 and 1");
    }
    let mut log_args = args.log.clone();
    if let Some(col) = &args.label_column {
        log_args.input.decoder.map.push(format!("label={col}"));
    }
    let progress = progress_wanted();
    let read = log_args.read_options(progress)?;
    let mut log = OrderedLog::open(&log_args.input.input, &read)?;
    if rules.uses_ends() {
        log = log.with_ends();
    }
    let rows = log.rows();
    let (sweep, invalid) = sweep_model(
        Arc::new(log),
        &rules,
        &thresholds,
        args.max_false_reject,
        progress,
    )
    .await?;
    print!("{}", render_model_sweep(&sweep));
    if let Some(out) = &args.output {
        write_frame(out, &mut model_sweep_frame(&sweep)?)?;
        println!("sweep table      {}", out.display());
    }
    if let Some(plot) = &args.plot {
        callguard::offline::plot::draw_model(&sweep, plot)?;
        println!("plot             {}", plot.display());
    }
    let invalid_file = match &args.output {
        Some(out) => write_invalid(out, &invalid)?,
        None => write_invalid(&invalid_home(&args.log.input.input), &invalid)?,
    };
    if let Some(path) = &invalid_file {
        report_invalid(path, &invalid);
    }
    println!(
        "{} events, {} invalid rows",
        rows - not_kept(&invalid),
        not_kept(&invalid)
    );
    Ok(())
}

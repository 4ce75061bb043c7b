//! `callguard generate`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use callguard::offline::cdr::InputFormat;
use callguard::offline::generate;

/// Write a synthetic, labelled call log (subscribers, PBX trunks, call
/// centres, robocallers, wangiri bursts) for trying and testing callguard.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// Number of calls (a day, with --days; default 20,000). With
    /// --subscribers: the calls of the day to write, every caller's calls
    /// thinned alike (default: the whole day, about 4 calls a subscriber).
    #[arg(long)]
    pub rows: Option<usize>,
    /// Write a day of a carrier's whole population instead: this many
    /// subscribers, each with a daily call rate of its own from a
    /// heavy-tailed mix (most 1 to 5 calls a day, one in 200 a PBX trunk
    /// with 50 to 500, one in 100,000 a flood of thousands within hours;
    /// populations `subscriber`, `pbx`, `flood`). Written a minute at a time:
    /// memory holds 8 bytes a subscriber. For measuring cost at a carrier's
    /// shape (scripts/bench-population.sh).
    #[arg(long, conflicts_with_all = ["days", "tdos", "low_and_slow"],
          value_parser = clap::value_parser!(u64).range(1..=generate::population::MAX_SUBSCRIBERS))]
    pub subscribers: Option<u64>,
    /// Days of traffic, from 2025-12-01, each of --rows calls: the same
    /// subscribers, PBXs and call centres every day (their calls differ),
    /// fraud from new numbers every day. Written a day at a time, so
    /// memory holds one day whatever the number of days.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=3660))]
    pub days: u64,
    /// Random seed (the same seed gives the same log).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output file.
    #[arg(long, short)]
    pub output: PathBuf,
    /// Write it as callguard's CSV (`csv`, with labels and populations) or
    /// as a switch's call records: `asterisk` (Master.csv), `freeswitch`
    /// (mod_cdr_csv) or `kamailio-acc` (with a BYE row per answered call),
    /// to try the readers' presets.
    #[arg(long, value_enum, default_value_t = CdrFormat::Csv)]
    pub format: CdrFormat,
    /// The switch's time zone for CDR output, e.g. Europe/Madrid.
    #[arg(long, default_value = "UTC")]
    pub timezone: chrono_tz::Tz,
    /// Add a telephony denial-of-service attack of this many calls: ~40
    /// calls/s from 11:00 UTC on the first day to one victim number from
    /// many spoofed callers (population `tdos`; stopped by a rule keyed by
    /// callee).
    #[arg(long, default_value_t = 0)]
    pub tdos: usize,
    /// Add this many low-and-slow dialers a day (population
    /// `low_and_slow`, new numbers every day): at night, a call every 20 to
    /// 40 s to a new number for one to two hours, under every limit of
    /// data/rules.toml. The rules alone miss them; their features (calls in
    /// the hour, distinct callees, the regular gap, the hour) carry them, for
    /// training a model (docs/model.md).
    #[arg(long, default_value_t = 0)]
    pub low_and_slow: usize,
}

/// Calls a day without --rows.
const DEFAULT_ROWS: usize = 20_000;

/// What `generate` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CdrFormat {
    /// callguard's CSV.
    Csv,
    /// Asterisk Master.csv.
    Asterisk,
    /// FreeSWITCH mod_cdr_csv, default template.
    Freeswitch,
    /// Kamailio acc with src_user, dst_user, src_ip.
    KamailioAcc,
}

/// Runs `callguard generate`.
pub fn run(args: GenerateArgs) -> Result<()> {
    let cdr = match args.format {
        CdrFormat::Csv => None,
        CdrFormat::Asterisk => Some(InputFormat::Asterisk),
        CdrFormat::Freeswitch => Some(InputFormat::FreeSwitch),
        CdrFormat::KamailioAcc => Some(InputFormat::KamailioAcc),
    };
    if let Some(n) = args.subscribers {
        return population(&args, n, cdr);
    }
    let written = generate::write_days(
        &args.output,
        args.rows.unwrap_or(DEFAULT_ROWS),
        args.seed,
        args.days,
        generate::Extra {
            tdos: args.tdos,
            low_and_slow: args.low_and_slow,
        },
        cdr,
        args.timezone,
    )?;
    println!(
        "wrote {} calls ({} labelled fraud) to {}",
        written.calls,
        written.fraud,
        args.output.display()
    );
    Ok(())
}

/// `generate --subscribers N`.
fn population(args: &GenerateArgs, subscribers: u64, cdr: Option<InputFormat>) -> Result<()> {
    let w = generate::population::write_population(
        &args.output,
        subscribers,
        args.rows.map(|r| r as u64),
        args.seed,
        cdr,
        args.timezone,
    )?;
    println!(
        "wrote {} calls ({} labelled fraud) of {} subscribers ({} PBX trunks, {} floods; a whole day is about {} calls) to {}",
        w.written.calls,
        w.written.fraud,
        subscribers,
        w.pbxs,
        w.floods,
        w.day_calls,
        args.output.display()
    );
    Ok(())
}

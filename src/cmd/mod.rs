//! The command layer: clap arguments, one file per subcommand, each mapping
//! its arguments onto the library's configurations and printing the result.
//! Only this layer knows about clap.

pub mod args;
pub mod consume;
pub mod demo;
pub mod features;
pub mod generate;
pub mod produce;
pub mod replay;
pub mod serve;
pub mod tune;

use std::io::IsTerminal;
use std::path::Path;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};

use callguard::engine::rules::RuleSet;
use callguard::error::EventError;
use callguard::offline::read::{not_kept, InvalidRow};

/// callguard: per-number call-rate windows that reject fraud bursts
/// (robocalls, wangiri, SIP floods), online from Kafka with Redis and offline
/// from call logs, with identical decisions.
#[derive(Debug, Parser)]
#[command(name = "callguard", version, about, long_about = None)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "CALLGUARD_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Decide every call of a historical call log, offline, with the same
    /// window semantics as the online consumer.
    Replay(Box<replay::ReplayArgs>),
    /// Run the stream processor: consume call events from Kafka, decide
    /// them against per-caller windows, and produce decisions, features and
    /// dead letters.
    Consume(Box<consume::ConsumeArgs>),
    /// Answer a switch's check per call in the same request: an HTTP API
    /// (POST or GET /v1/check) on the same rules and window store as
    /// `consume`, for Kamailio, OpenSIPS, FreeSWITCH or Asterisk.
    Serve(Box<serve::ServeArgs>),
    /// Load a call log into a Kafka topic, keyed by caller, in the replay's
    /// processing order (stable by event time).
    Produce(Box<produce::ProduceArgs>),
    /// The whole pipeline in one process with no servers: embedded Kafka
    /// (librdkafka mock cluster), in-memory windows, the sample call log,
    /// a live summary, and a parity check against `replay`.
    Demo(Box<demo::DemoArgs>),
    /// Sweep a rule's limit N over a range on a call log and recommend one:
    /// calls and callers rejected, and with labels precision, recall and
    /// legit callers wrongly rejected, for every N.
    Tune(Box<tune::TuneArgs>),
    /// Export point-in-time features of every call of a call log (Parquet
    /// or CSV): window counts, time since the caller's previous call,
    /// distinct callees in the longest window, decision and label; the same
    /// values the consumer emits online. Large logs stream in chunks.
    Features(Box<features::FeaturesArgs>),
    /// Write a synthetic, labelled call log (subscribers, PBX trunks, call
    /// centres, robocallers, wangiri bursts) for trying and testing callguard.
    Generate(generate::GenerateArgs),
}

/// Parses the command line (exits with clap's message on bad arguments).
pub fn parse() -> Cli {
    Cli::parse()
}

/// Runs a subcommand.
pub async fn run(command: Command) -> Result<()> {
    match command {
        Command::Replay(args) => replay::run(*args).await,
        Command::Consume(args) => consume::run(*args).await,
        Command::Serve(args) => serve::run(*args).await,
        Command::Produce(args) => produce::run(*args).await,
        Command::Demo(args) => demo::run(*args).await,
        Command::Tune(args) => tune::run(*args).await,
        Command::Features(args) => features::run(*args).await,
        Command::Generate(args) => generate::run(args),
    }
}

/// The exit status for an error: 2 when the input cannot be used (a file
/// that cannot be read, rules that do not load, a bad field mapping), as for
/// bad arguments; 1 for anything else (a store or broker failure).
pub fn exit_code(e: &anyhow::Error) -> u8 {
    use callguard::error::{DemoError, EventError, IoError, ReplayError, RulesError, TuneError};
    let bad_input = e.chain().any(|c| {
        c.is::<IoError>()
            || c.is::<RulesError>()
            || c.is::<EventError>()
            || c.is::<TuneError>()
            || matches!(c.downcast_ref::<ReplayError>(), Some(ReplayError::Io(_)))
            || matches!(c.downcast_ref::<DemoError>(), Some(DemoError::Io(_)))
    });
    if bad_input {
        2
    } else {
        1
    }
}

/// Log lines are coloured only when stderr is a terminal and `NO_COLOR`
/// is unset or empty (<https://no-color.org>): a log file or a pipe gets
/// plain text.
pub fn colour_wanted() -> bool {
    colour_for(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    )
}

/// [`colour_wanted`] for a given terminal test and `NO_COLOR` value.
fn colour_for(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Progress bars are drawn only when stderr is a terminal.
pub fn progress_wanted() -> bool {
    std::io::stderr().is_terminal()
}

/// What the cached store's callers in memory did, for a summary line
/// (`None` for a store without them).
pub fn describe_cache(c: &callguard::store::CacheStats) -> Option<String> {
    if c.lookups == 0 {
        return None;
    }
    Some(format!(
        "{} callers looked up, {} in memory ({:.1}%); {} read back from Redis, {} dropped from memory; {} held at the end (about {} MiB)",
        c.lookups,
        c.hits,
        100.0 * c.hits as f64 / c.lookups as f64,
        c.rereads,
        c.evictions,
        c.callers,
        c.bytes >> 20
    ))
}

/// The rules of a set and its version, for a summary line.
pub fn describe_rules(rules: &RuleSet) -> String {
    let list: Vec<String> = rules.rules.iter().map(ToString::to_string).collect();
    format!("{} (version {})", list.join(", "), rules.version())
}

/// Says where the invalid rows went, logs the first few that are really
/// bad, and counts apart the rows a switch logs for other than call
/// attempts (Kamailio's BYE transactions), which are expected.
pub fn report_invalid(path: &Path, invalid: &[InvalidRow]) {
    let other = |r: &&InvalidRow| matches!(r.error, EventError::NotACallAttempt { .. });
    for bad in invalid.iter().filter(|r| !other(r) && !r.kept).take(5) {
        tracing::warn!(row = bad.row, error = %bad.error, "invalid row");
    }
    for kept in invalid.iter().filter(|r| r.kept).take(5) {
        if kept.error.field() == Some("caller") {
            tracing::warn!(row = kept.row, error = %kept.error, "unusable caller, decided as bad_caller");
        } else {
            tracing::warn!(row = kept.row, error = %kept.error, "field dropped, call kept");
        }
    }
    let not_calls = invalid.iter().filter(other).count();
    let count = not_kept(invalid);
    let dropped = invalid.len() - count;
    let mut line = format!("invalid rows at  {} ({count}", path.display());
    if not_calls > 0 {
        line.push_str(&format!(", of which {not_calls} not call attempts"));
    }
    if dropped > 0 {
        let fields = if dropped == 1 { "field" } else { "fields" };
        line.push_str(&format!("; and {dropped} {fields} dropped from calls kept"));
    }
    println!("{line})");
}

/// Resolves when SIGINT or SIGTERM arrives.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term => {},
    }
    tracing::info!("shutdown requested");
}

#[cfg(test)]
mod tests {
    use super::colour_for;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour_for(true, None));
        assert!(colour_for(true, Some(OsStr::new(""))));
        assert!(!colour_for(true, Some(OsStr::new("1"))));
        assert!(!colour_for(false, None));
        assert!(!colour_for(false, Some(OsStr::new(""))));
    }
}

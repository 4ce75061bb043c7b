//! `callguard produce`.

use anyhow::Result;
use clap::Args;

use callguard::offline::order::{OrderedLog, CHUNK_ROWS};
use callguard::offline::read::not_kept;
use callguard::online::consumer::DEFAULT_INPUT_TOPIC;
use callguard::online::produce::{KeyBy, Loader};

use crate::cmd::args::{InputArgs, KafkaArgs};
use crate::cmd::progress_wanted;

/// Load a call log into a Kafka topic, keyed by caller (or account), in
/// the replay's processing order (stable by event time).
#[derive(Debug, Clone, Args)]
pub struct ProduceArgs {
    /// Input options.
    #[command(flatten)]
    pub input: InputArgs,
    /// Kafka options.
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Topic to write.
    #[arg(long, env = "CALLGUARD_INPUT_TOPIC", default_value = DEFAULT_INPUT_TOPIC)]
    pub topic: String,
    /// Also write each call's end (`"event": "end"`) at `ts + duration_ms`,
    /// in the same processing order `replay` uses for rule sets with a
    /// concurrent rule (an end before an attempt of the same millisecond):
    /// a `consume` of the topic then decides as `replay` of the log.
    #[arg(long)]
    pub ends: bool,
    /// Each event's Kafka key (so its partition): `caller`, or `account`
    /// (the account when the call has one, else the caller). Key by
    /// account when a rule is keyed by account: a trunk's calls from all
    /// its numbers then stay in one partition, in order, and a concurrent
    /// rule per account decides online as `replay` does.
    #[arg(long, value_enum, default_value_t = KeyArg::Caller)]
    pub key_by: KeyArg,
}

/// `--key-by`: see [`KeyBy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KeyArg {
    /// The caller.
    Caller,
    /// The account when the call has one, else the caller.
    Account,
}

impl From<KeyArg> for KeyBy {
    fn from(k: KeyArg) -> Self {
        match k {
            KeyArg::Caller => KeyBy::Caller,
            KeyArg::Account => KeyBy::Account,
        }
    }
}

/// Runs `callguard produce`.
pub async fn run(args: ProduceArgs) -> Result<()> {
    let progress = progress_wanted();
    let mut log = OrderedLog::open(&args.input.input, &args.input.read_options(progress)?)?;
    if args.ends {
        log = log.with_ends();
    }
    let settings = args.kafka.settings.parse()?;
    let mut loader = Loader::new(
        &args.kafka.brokers,
        &settings,
        &args.topic,
        log.rows() as u64,
        progress,
    )?
    .keyed_by(args.key_by.into());
    let mut invalid = Vec::new();
    for mut chunk in log.chunks(CHUNK_ROWS) {
        for (_, e) in &chunk.events {
            loader.send(e).await?;
        }
        invalid.append(&mut chunk.invalid);
    }
    log.check()?;
    let n = loader.finish().await?;
    invalid.sort_by_key(|r| r.row);
    let skipped = not_kept(&invalid);
    let dropped = match invalid.len() - skipped {
        0 => String::new(),
        n => format!(", {n} fields dropped from calls kept"),
    };
    println!(
        "produced {n} events to {} ({skipped} invalid rows skipped{dropped})",
        args.topic,
    );
    for bad in invalid.iter().take(10) {
        println!("  row {}: {}", bad.row, bad.error);
    }
    Ok(())
}

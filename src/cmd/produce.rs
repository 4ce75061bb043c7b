//! `callguard produce`.

use anyhow::Result;
use clap::Args;

use callguard::offline::order::{OrderedLog, CHUNK_ROWS};
use callguard::offline::read::not_kept;
use callguard::online::consumer::DEFAULT_INPUT_TOPIC;
use callguard::online::produce::Loader;

use crate::cmd::args::{InputArgs, KafkaArgs};
use crate::cmd::progress_wanted;

/// Load a call log into a Kafka topic, keyed by caller, in the replay's
/// processing order (stable by event time).
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
    )?;
    let mut invalid = Vec::new();
    for mut chunk in log.chunks(CHUNK_ROWS) {
        for (_, e) in &chunk.events {
            loader.send(e).await?;
        }
        invalid.append(&mut chunk.invalid);
    }
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

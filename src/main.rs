//! The `callguard` command: parses arguments and runs a subcommand.

use std::io::IsTerminal;

use anyhow::{Context, Result};
use clap::Parser;
use tracing_subscriber::EnvFilter;

use callguard::calllog::{read_call_log, write_frame, write_invalid};
use callguard::cli::{Cli, Command, LogFormat, ReplayArgs, StoreKind};
use callguard::replay::{self, ReplaySummary};
use callguard::store::memory::MemoryStore;
use callguard::store::redis::RedisStore;
use callguard::store::AnyStore;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter =
        EnvFilter::try_from_env("CALLGUARD_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

async fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Replay(args) => replay_cmd(*args).await,
        Command::Generate(args) => {
            let calls = callguard::generate::generate(args.rows, args.seed);
            callguard::generate::write_csv(&args.output, &calls)?;
            let fraud = calls.iter().filter(|c| c.fraud).count();
            println!(
                "wrote {} calls ({} labelled fraud) to {}",
                calls.len(),
                fraud,
                args.output.display()
            );
            Ok(())
        }
    }
}

async fn open_store(args: &callguard::cli::StoreArgs) -> Result<AnyStore> {
    Ok(match args.store {
        StoreKind::Memory => AnyStore::Memory(MemoryStore::new()),
        StoreKind::Redis => {
            let config = args.redis_config();
            let store = RedisStore::connect(config.clone())
                .await
                .with_context(|| format!("connecting to Redis at {}", config.urls.join(",")))?;
            AnyStore::Redis(Box::new(store))
        }
    })
}

async fn replay_cmd(args: ReplayArgs) -> Result<()> {
    let progress = std::io::stderr().is_terminal();
    let rules = args.rules.rule_set()?;
    let read = args.input.read_options(progress)?;
    let mut log = read_call_log(&args.input.input, &read)?;
    log.sort_by_time();
    let mut store = open_store(&args.store).await?;
    let verdicts = replay::run(&log, &rules, &mut store, progress).await?;
    let mut df = replay::records_frame(&verdicts, &rules)?;
    if let Some(dir) = args.output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    write_frame(&args.output, &mut df)?;
    let summary = ReplaySummary::new(&verdicts, log.invalid.len());
    println!(
        "rules            {} (version {})",
        rules
            .rules
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        rules.version()
    );
    println!("{summary}");
    println!("decisions        {}", args.output.display());
    if let Some(path) = write_invalid(&args.output, &log.invalid)? {
        for bad in log.invalid.iter().take(5) {
            tracing::warn!(row = bad.row, error = %bad.error, "invalid row");
        }
        println!("invalid rows at  {}", path.display());
    }
    Ok(())
}

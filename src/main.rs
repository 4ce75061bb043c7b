//! The `callguard` command: parses arguments and runs a subcommand.

use std::io::IsTerminal;

use anyhow::{Context, Result};

/// mimalloc: the window state and records are many small allocations, where
/// it is markedly faster than the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use clap::Parser;
use tracing_subscriber::EnvFilter;

use callguard::calllog::{write_frame, write_invalid, BackgroundWriter, CallLog, OrderedLog};
use callguard::cli::{
    Cli, Command, ConsumeArgs, DemoArgs, FeaturesArgs, LogFormat, ProduceArgs, ReplayArgs,
    StoreKind, TuneArgs,
};
use callguard::replay;
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
        Command::Consume(args) => consume_cmd(*args).await,
        Command::Produce(args) => produce_cmd(*args).await,
        Command::Demo(args) => demo_cmd(*args).await,
        Command::Tune(args) => tune_cmd(*args),
        Command::Features(args) => features_cmd(*args).await,
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

async fn open_store(args: &callguard::cli::StoreArgs, streaming: bool) -> Result<AnyStore> {
    Ok(match args.store {
        StoreKind::Memory if streaming => AnyStore::Memory(MemoryStore::keeping_all()),
        StoreKind::Memory => AnyStore::Memory(MemoryStore::new()),
        StoreKind::Redis => {
            let config = args.redis_config();
            let store = RedisStore::connect(config.clone()).await.with_context(|| {
                let urls: Vec<String> = config
                    .urls
                    .iter()
                    .map(|u| callguard::store::redis::redact(u))
                    .collect();
                format!("connecting to Redis at {}", urls.join(","))
            })?;
            AnyStore::Redis(Box::new(store))
        }
    })
}

async fn replay_cmd(args: ReplayArgs) -> Result<()> {
    let progress = std::io::stderr().is_terminal();
    let rules = args.rules.rule_set()?;
    let read = args.input.read_options(progress)?;
    let log = std::sync::Arc::new(OrderedLog::open(&args.input.input, &read)?);
    let mut store = open_store(&args.store, false).await?;
    create_parent(&args.output)?;
    let schema = replay::records_frame(&[], &rules)?
        .schema()
        .as_ref()
        .clone();
    let table_rules = rules.clone();
    let mut out = BackgroundWriter::spawn(&args.output, &schema, move |verdicts: Vec<_>| {
        replay::records_frame(&verdicts, &table_rules)
    })?;
    let done = replay::run_ordered(log, &rules, &mut store, progress, |_, verdicts| {
        out.send(verdicts)
    })
    .await?;
    out.finish()?;
    let summary = &done.summary;
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
    if let Some(path) = write_invalid(&args.output, &done.invalid)? {
        for bad in done.invalid.iter().take(5) {
            tracing::warn!(row = bad.row, error = %bad.error, "invalid row");
        }
        println!("invalid rows at  {}", path.display());
    }
    Ok(())
}

/// Creates the parent directory of an output file.
fn create_parent(output: &std::path::Path) -> Result<()> {
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    Ok(())
}

/// Resolves when SIGINT or SIGTERM arrives.
async fn shutdown_signal() {
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

async fn consume_cmd(args: ConsumeArgs) -> Result<()> {
    use callguard::consumer::{self, ConsumeConfig};
    use callguard::event::{Decoder, FieldMap};
    use callguard::metrics::{self, Health, Metrics};
    use std::sync::Arc;

    let rules = args.rules.rule_set()?;
    let settings = callguard::kafka::parse_settings(&args.kafka.settings)?;
    let mut _embedded = None;
    let brokers = if args.kafka.brokers == "mock" {
        let k = callguard::kafka::EmbeddedKafka::start()?;
        for t in [
            &args.input_topic,
            &args.decisions_topic,
            &args.features_topic,
        ] {
            k.create_topic(t, 4)?;
        }
        k.create_topic(&args.dlq_topic, 1)?;
        let b = k.bootstrap();
        println!("embedded Kafka (librdkafka mock cluster) at {b}");
        _embedded = Some(k);
        b
    } else {
        args.kafka.brokers.clone()
    };
    let mut config = ConsumeConfig::new(
        &brokers,
        &args.group,
        &args.input_topic,
        &args.decisions_topic,
        &args.features_topic,
        &args.dlq_topic,
    );
    config.kafka_settings = settings;
    config.batch_size = args.batch_size.max(1);
    config.max_in_flight = args.max_in_flight.max(1);
    config.on_store_error = args.on_store_error;
    config.max_payload_bytes = args.max_payload_bytes;
    config.decoder = Decoder::new(
        FieldMap::parse(&args.map)?,
        args.default_country_code.clone(),
    )?;
    config.drain_timeout = std::time::Duration::from_secs(args.drain_timeout_s);

    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let server_stop = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let bound = metrics::serve(
        args.metrics_addr,
        metrics.clone(),
        health.clone(),
        server_stop,
    )
    .await
    .with_context(|| format!("serving metrics on {}", args.metrics_addr))?;
    tracing::info!(addr = %bound, "metrics on /metrics, health on /healthz and /readyz");
    let (rules_tx, rules_rx) = tokio::sync::watch::channel(rules);
    callguard::reload::spawn(args.rules.clone(), rules_tx, metrics.clone())?;
    let store = open_store(&args.store, true).await?;
    let stats = consumer::run(config, store, rules_rx, metrics, health, shutdown_signal()).await;
    let _ = stop_tx.send(true);
    let stats = stats?;
    tracing::info!(
        decided = stats.decided,
        rejected = stats.rejected,
        dead_letters = stats.dead_letters,
        "stopped"
    );
    Ok(())
}

async fn produce_cmd(args: ProduceArgs) -> Result<()> {
    let progress = std::io::stderr().is_terminal();
    let read = args.input.read_options(progress)?;
    let log = OrderedLog::open(&args.input.input, &read)?;
    let settings = callguard::kafka::parse_settings(&args.kafka.settings)?;
    let mut loader = callguard::produce::Loader::new(
        &args.kafka.brokers,
        &settings,
        &args.topic,
        log.rows() as u64,
        progress,
    )?;
    let mut invalid = Vec::new();
    for chunk in log.chunks(callguard::calllog::CHUNK_ROWS) {
        let mut chunk = chunk?;
        for (_, e) in &chunk.events {
            loader.send(e).await?;
        }
        invalid.append(&mut chunk.invalid);
    }
    let n = loader.finish().await?;
    invalid.sort_by_key(|r| r.row);
    println!(
        "produced {n} events to {} ({} invalid rows skipped)",
        args.topic,
        invalid.len()
    );
    for bad in invalid.iter().take(10) {
        println!("  row {}: {}", bad.row, bad.error);
    }
    Ok(())
}

async fn demo_cmd(args: DemoArgs) -> Result<()> {
    let rules = callguard::rules::RuleSet::from_file(&args.rules)?;
    let config = callguard::demo::DemoConfig {
        input: args.input,
        read: callguard::calllog::ReadOptions::default(),
        rules,
        partitions: args.partitions,
        timeout: std::time::Duration::from_secs(args.timeout_s),
    };
    let report = callguard::demo::run(config)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    println!();
    println!(
        "decided          {} of {} events ({:.0} events/s)",
        report.decided, report.produced, report.events_per_sec
    );
    println!("rejected         {}", report.rejected);
    println!("dead letters     {}", report.dead_letters);
    println!(
        "top rejected     {}",
        report
            .top_rejected
            .iter()
            .map(|(c, n)| format!("{c} ({n})"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if report.mismatches == 0 && report.decided == report.produced {
        println!("parity           every decision equals `callguard replay` on the same file");
        Ok(())
    } else {
        anyhow::bail!(
            "{} decisions differ from the replay ({} of {} decided)",
            report.mismatches,
            report.decided,
            report.produced
        )
    }
}

fn tune_cmd(args: TuneArgs) -> Result<()> {
    use callguard::cli::{parse_limits, CountArg};
    use callguard::rules::{CountPolicy, RuleSet};
    use callguard::tune::Target;

    let limits = parse_limits(&args.limits)?;
    let max_n = limits.last().copied().unwrap_or(1);
    // NAME:KIND:WINDOW without a limit: the limit is what the sweep varies.
    let shorthands: Vec<String> = args
        .rule
        .iter()
        .map(|r| {
            if r.split(':').count() == 3 {
                format!("{r}:{max_n}")
            } else {
                r.clone()
            }
        })
        .collect();
    let mut rules = RuleSet::from_args(args.rules.as_deref(), &shorthands)?;
    if let Some(c) = args.count {
        let count = if c == CountArg::Admitted {
            CountPolicy::Admitted
        } else {
            CountPolicy::Attempts
        };
        rules = rules.with_options(count, rules.grace_ms, rules.shadow)?;
    }
    let index = match &args.sweep {
        Some(name) => rules
            .rule_index(name)
            .with_context(|| format!("no rule named `{name}` in the rule set"))?,
        None => 0,
    };
    let progress = std::io::stderr().is_terminal();
    let mut input = args.input.clone();
    if let Some(col) = &args.label_column {
        input.map.push(format!("label={col}"));
    }
    let log = std::sync::Arc::new(OrderedLog::open(
        &input.input,
        &input.read_options(progress)?,
    )?);
    let rows = log.rows();
    let target = match args.quantile {
        Some(q) if (0.0..=1.0).contains(&q) => Target::Quantile(q),
        Some(q) => anyhow::bail!("--quantile {q}: expected 0 to 1"),
        None => Target::MaxFalseReject(args.max_false_reject),
    };
    let started = std::time::Instant::now();
    let (result, invalid) =
        callguard::tune::sweep_ordered(log, &rules, index, &limits, target, progress)?;
    tracing::info!(
        passes = result.passes,
        seconds = started.elapsed().as_secs_f64(),
        "sweep done"
    );
    print!("{}", callguard::tune::render_table(&result, 20));
    if let Some(out) = &args.output {
        let mut df = callguard::tune::sweep_frame(&result)?;
        write_frame(out, &mut df)?;
        println!("sweep table      {}", out.display());
    }
    if let Some(plot) = &args.plot {
        callguard::plot::draw(&result, plot)?;
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

async fn features_cmd(args: FeaturesArgs) -> Result<()> {
    let progress = std::io::stderr().is_terminal();
    let rules = args.rules.rule_set()?;
    let log = std::sync::Arc::new(OrderedLog::open(
        &args.input.input,
        &args.input.read_options(progress)?,
    )?);
    create_parent(&args.output)?;
    let schema = callguard::features::features_frame(&[], &[], &rules)?
        .schema()
        .as_ref()
        .clone();
    let table_rules = rules.clone();
    let mut out = BackgroundWriter::spawn(
        &args.output,
        &schema,
        move |(chunk, verdicts): (CallLog, Vec<_>)| {
            callguard::features::features_frame(&chunk.events, &verdicts, &table_rules)
        },
    )?;
    let mut store = MemoryStore::new();
    let done = replay::run_ordered(log, &rules, &mut store, progress, |chunk, verdicts| {
        out.send((chunk, verdicts))
    })
    .await?;
    let rows = out.finish()?;
    println!("features         {rows} rows to {}", args.output.display());
    if let Some(path) = write_invalid(&args.output, &done.invalid)? {
        println!(
            "invalid rows at  {} ({})",
            path.display(),
            done.invalid.len()
        );
    }
    Ok(())
}

//! The `callguard` command: parses arguments, sets up logging and the async
//! runtime, and runs a subcommand (`cmd/`).

mod cmd;

use tracing_subscriber::EnvFilter;

use cmd::LogFormat;

/// mimalloc: the window state and records are many small allocations, where
/// it is markedly faster than the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    callguard::process::prefer_small_pages();
    let cli = cmd::parse();
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
    match runtime.block_on(cmd::run(cli.command)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(cmd::exit_code(&e))
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter =
        EnvFilter::try_from_env("CALLGUARD_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(cmd::colour_wanted())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

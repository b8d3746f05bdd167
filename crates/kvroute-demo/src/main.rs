//! The `kvroute-demo` binary (the README's first command): an embedded simulated fleet, a router
//! per policy, a multi-turn chat workload; prints cache hit rate, time to first token and
//! throughput per routing policy. A binary of its own so the router's deployment build never
//! links the simulated engine or this driver.

use clap::Parser;
use kvroute_demo::DemoArgs;

/// The same allocator as the router binary, so the in-process routers behave as deployed.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "kvroute-demo",
    version,
    about = "Run an embedded simulated fleet and compare kvroute's routing policies on a chat workload"
)]
struct Cli {
    #[command(flatten)]
    demo: DemoArgs,
    #[arg(long, env = "KVROUTE_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: kvroute::cli::LogFormat,
}

/// The demo prints a table (or JSON) on stdout; router logs would drown it, so only warnings
/// are shown by default, on stderr, coloured only on a terminal.
fn init_logging_quiet(format: kvroute::cli::LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        kvroute::cli::LogFormat::Text => builder.init(),
        kvroute::cli::LogFormat::Json => builder.json().init(),
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging_quiet(cli.log_format);
    match kvroute_demo::run(cli.demo).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo failed: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

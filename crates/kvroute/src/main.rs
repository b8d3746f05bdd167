//! The `kvroute` binary: parse flags, set up logging, run the router until SIGTERM or ctrl-c.
//! All logic lives in the library. The demo is a binary of its own (`kvroute-demo`), so a
//! deployment build of the router links no simulated engine.

use clap::Parser;
use kvroute::cli::{Cli, LogFormat};

/// mimalloc instead of glibc malloc: the proxy path allocates and frees many small buffers per
/// request (headers, body chunks, futures), and glibc's free-list consolidation showed up in
/// profiles of the router (docs/BENCHMARKS.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour codes only on a terminal: a log file or a pipe to a collector gets plain text, and
    // NO_COLOR (no-color.org) turns them off on a terminal too.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let config = match cli.serve.into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let handle = match kvroute::serve(config).await {
        Ok(h) => h,
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            return std::process::ExitCode::FAILURE;
        }
    };
    shutdown_signal().await;
    tracing::info!("shutting down");
    handle.shutdown().await;
    std::process::ExitCode::SUCCESS
}

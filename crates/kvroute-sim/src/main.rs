//! `kvroute-sim` binary: parses [`SimConfig`] from flags, starts the fleet, prints where each
//! engine listens (one line per engine, for scripts), and on SIGTERM / ctrl-c drains in-flight
//! requests before exiting.

use clap::Parser;
use kvroute_sim::{SimConfig, start_fleet};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cfg = SimConfig::parse();
    let fleet = match start_fleet(cfg).await {
        Ok(f) => f,
        Err(e) => {
            eprintln!("kvroute-sim: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    for e in &fleet.engines {
        let kv: Vec<String> = (0..e.dp_size()).map(|r| e.kv_endpoint(r)).collect();
        let replay: Vec<String> = (0..e.dp_size()).map(|r| e.replay_endpoint(r)).collect();
        println!(
            "engine {} http={} kv={} replay={}{}",
            e.engine().index,
            e.http_url(),
            kv.join(","),
            replay.join(","),
            e.load_endpoint(0)
                .map(|_| {
                    let l: Vec<String> = (0..e.dp_size())
                        .filter_map(|r| e.load_endpoint(r))
                        .collect();
                    format!(" load={}", l.join(","))
                })
                .unwrap_or_default()
        );
    }
    tracing::info!(engines = fleet.engines.len(), "kvroute-sim serving");
    wait_for_signal().await;
    tracing::info!("draining in-flight requests");
    fleet.shutdown().await;
    std::process::ExitCode::SUCCESS
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

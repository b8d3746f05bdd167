//! `kvroute-soak`: the soak of `kvroute_fleet::soak` as a command (`scripts/soak.sh` runs it).
//! Prints the report as one JSON document and exits 1 when a check failed.

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    about = "One router, 16 simulated engine ranks, an open-loop client and a chaos driver, for a fixed time"
)]
struct Args {
    /// Length of the run under load, in seconds.
    #[arg(long, default_value_t = 600.0)]
    duration_s: f64,
    /// Client requests per second (open loop).
    #[arg(long, default_value_t = 500.0)]
    rate: f64,
    /// Time between two chaos episodes.
    #[arg(long, default_value_t = 5_000)]
    chaos_period_ms: u64,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let report = kvroute_fleet::soak::run(kvroute_fleet::soak::SoakConfig {
        duration_s: args.duration_s,
        rate_per_s: args.rate,
        chaos_period_ms: args.chaos_period_ms,
    })
    .await;
    println!(
        "{}",
        serde_json::to_string_pretty(&report.json).unwrap_or_default()
    );
    if report.failed_checks.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        for f in &report.failed_checks {
            eprintln!("soak check failed: {f}");
        }
        std::process::ExitCode::FAILURE
    }
}

//! Where the processes of a scenario write their logs, and reading their tails into failure
//! messages: a failed scenario's panic carries the evidence (the router's own account of each
//! rank's outcome), not just the assertion.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// Lines of a log quoted in a failure message.
pub const LOG_TAIL_LINES_MAX: usize = 40;

/// This test process's log directory (`$TMPDIR/kvroute-fleet-<pid>`), created on first use.
pub fn run_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("kvroute-fleet-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("the log directory can be created");
        d
    })
}

/// A fresh log file path named after `what` (numbered, so restarts never overwrite).
pub fn log_file(what: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    run_dir().join(format!("{n:03}-{what}.log"))
}

/// The last [`LOG_TAIL_LINES_MAX`] lines of `path`, or why it cannot be read.
pub fn tail(path: &Path) -> String {
    match std::fs::read_to_string(path) {
        Ok(s) => {
            let lines: Vec<&str> = s.lines().collect();
            let from = lines.len().saturating_sub(LOG_TAIL_LINES_MAX);
            lines[from..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

//! The one way a scenario waits: poll a condition until a named deadline, and on timeout panic
//! with what was awaited and what was last seen. Polling instead of sleeping is what keeps the
//! scenarios both fast (they go on as soon as the state is reached) and honest (a slow machine
//! delays them, it does not make them assert on a state that was never reached).

use std::future::Future;
use std::time::{Duration, Instant};

/// Time between two probes of a condition.
pub const POLL_INTERVAL_MS: u64 = 25;

/// Polls `probe` until it returns `Ok`, or panics after `limit_ms` naming `what` and the last
/// `Err` seen.
pub async fn wait_until<T, F, Fut>(what: &str, limit_ms: u64, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    match try_wait_until(limit_ms, &mut probe).await {
        Ok(v) => v,
        Err(last) => panic!("timed out after {limit_ms} ms waiting for {what}; last seen: {last}"),
    }
}

/// Like [`wait_until`] but returns the last `Err` instead of panicking, for callers that add
/// context (logs) to the failure.
pub async fn try_wait_until<T, F, Fut>(limit_ms: u64, probe: &mut F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    loop {
        let last = match probe().await {
            Ok(v) => return Ok(v),
            Err(seen) => seen,
        };
        if start.elapsed() >= Duration::from_millis(limit_ms) {
            return Err(last);
        }
        tokio::time::sleep(Duration::from_millis(POLL_INTERVAL_MS)).await;
    }
}

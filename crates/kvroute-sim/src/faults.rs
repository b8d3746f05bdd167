//! Injected HTTP faults (test-only, behind `--enable-control`): the next N generation requests
//! of an engine stall, either before the response head (what a router sees from an engine that
//! accepted the request and then hangs: it must time out with a 504 and free the request's
//! load) or in the middle of a streamed answer (it must neither cut the stream nor hold up
//! other requests meanwhile).
//!
//! Faults are armed by count, not by time, so a chaos driver knows exactly how many requests
//! it hit: each armed stall is consumed by one request and counted in `applied` when it fires,
//! and `/served_stats` reports the counts. A stall is bounded (`STALL_MS_MAX`): the sim never
//! holds a request forever on its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Longest stall a control request may arm.
pub const STALL_MS_MAX: u64 = 600_000;

/// Where an armed stall hits a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StallAt {
    /// Before the response head: the request was accepted and read, nothing is answered.
    Head,
    /// After the first chunk of a streamed answer (only streamed answers take it: a
    /// non-streamed answer has no middle).
    Body,
}

/// One engine's armed and fired stalls.
#[derive(Debug, Default)]
pub struct Faults {
    head_armed: AtomicU64,
    body_armed: AtomicU64,
    /// Milliseconds each stall lasts (the latest arming wins).
    stall_ms: AtomicU64,
    head_applied: AtomicU64,
    body_applied: AtomicU64,
}

/// Counts for `/served_stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct FaultCounts {
    pub head_stalls_armed: u64,
    pub body_stalls_armed: u64,
    pub head_stalls_applied: u64,
    pub body_stalls_applied: u64,
}

/// Takes one unit from `armed` if any is left (never below zero under concurrent takers).
fn take(armed: &AtomicU64) -> bool {
    armed
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
        .is_ok()
}

impl Faults {
    /// Arms `requests` more stalls of `stall_ms` at `at` (clamped to [`STALL_MS_MAX`]).
    pub fn arm(&self, at: StallAt, requests: u64, stall_ms: u64) {
        self.stall_ms
            .store(stall_ms.min(STALL_MS_MAX), Ordering::Release);
        let armed = match at {
            StallAt::Head => &self.head_armed,
            StallAt::Body => &self.body_armed,
        };
        armed.fetch_add(requests, Ordering::AcqRel);
    }

    /// For a request about to be answered: the stall it must take before its head, if one is
    /// armed.
    pub fn take_head(&self) -> Option<Duration> {
        take(&self.head_armed).then(|| {
            self.head_applied.fetch_add(1, Ordering::AcqRel);
            self.stall()
        })
    }

    /// For a streamed request: the stall it must take after its first chunk, if one is armed.
    pub fn take_body(&self) -> Option<Duration> {
        take(&self.body_armed).then(|| {
            self.body_applied.fetch_add(1, Ordering::AcqRel);
            self.stall()
        })
    }

    fn stall(&self) -> Duration {
        Duration::from_millis(self.stall_ms.load(Ordering::Acquire))
    }

    pub fn counts(&self) -> FaultCounts {
        FaultCounts {
            head_stalls_armed: self.head_armed.load(Ordering::Acquire),
            body_stalls_armed: self.body_armed.load(Ordering::Acquire),
            head_stalls_applied: self.head_applied.load(Ordering::Acquire),
            body_stalls_applied: self.body_applied.load(Ordering::Acquire),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_armed_stall_fires_once_and_is_counted() {
        let f = Faults::default();
        assert_eq!(f.take_head(), None);
        f.arm(StallAt::Head, 2, 50);
        f.arm(StallAt::Body, 1, 70);
        // The latest arming sets the length of every stall.
        assert_eq!(f.take_head(), Some(Duration::from_millis(70)));
        assert_eq!(f.take_head(), Some(Duration::from_millis(70)));
        assert_eq!(
            f.take_head(),
            None,
            "head stalls exhausted; a body stall is never taken before a head"
        );
        assert_eq!(f.take_body(), Some(Duration::from_millis(70)));
        assert_eq!(f.take_body(), None);
        let c = f.counts();
        assert_eq!((c.head_stalls_applied, c.body_stalls_applied), (2, 1));
        assert_eq!((c.head_stalls_armed, c.body_stalls_armed), (0, 0));
    }

    #[test]
    fn a_stall_is_clamped_to_its_bound() {
        let f = Faults::default();
        f.arm(StallAt::Head, 1, u64::MAX);
        assert_eq!(f.take_head(), Some(Duration::from_millis(STALL_MS_MAX)));
    }

    #[test]
    fn concurrent_takers_never_take_more_than_was_armed() {
        let f = std::sync::Arc::new(Faults::default());
        f.arm(StallAt::Head, 100, 1);
        let taken: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    let f = f.clone();
                    s.spawn(move || (0..100).filter(|_| f.take_head().is_some()).count() as u64)
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("taker")).sum()
        });
        assert_eq!(taken, 100);
        assert_eq!(f.counts().head_stalls_applied, 100);
    }
}

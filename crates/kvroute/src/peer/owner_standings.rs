//! Which siblings a replica still asks to place its cold prompts (`crate::peer::cold_owner`):
//! a sibling whose placement asks keep failing is set aside for a while, and the prompts it
//! owned go to the next owner in rendezvous order.
//!
//! Why: the owner of a cold prompt is named by a hash over the sibling list, and that list can
//! name a replica that is gone (a static `--kv-peers` entry for a host that died, an endpoint
//! not yet dropped by discovery) or one that cannot answer (an older version without the
//! placement endpoint, mid rolling update). Without a memory of failures every cold prompt
//! that replica owns would wait for the connect error or the whole `--cold-owner-timeout-ms`
//! before being placed where it arrived, for as long as the list names it. Every replica
//! watching the same sibling fail sets it aside on its own, so they move to the same next
//! owner and agree again without a message.
//!
//! Shape: one [`OwnerStanding`] per sibling that has failed lately (a sibling absent from the
//! table is trusted with no failure), written by the requests that asked and read by the
//! planner of every cold prompt. A circuit breaker with a doubling pause:
//! * `Trusted { failures }` is asked; [`COLD_OWNER_FAILURES_MAX`] failures in a row set it
//!   aside for [`COLD_OWNER_SET_ASIDE_MIN_MS`] (one slow answer on a busy machine does not move
//!   ownership; a dead host costs three asks);
//! * `SetAside { until_us, set_aside_ms }` is not asked before `until_us`; from then on it is
//!   asked again on probation: an answer trusts it again, a failure sets it aside for twice as
//!   long, up to [`COLD_OWNER_SET_ASIDE_MAX_MS`]. A failure of an ask sent before it was set
//!   aside changes nothing.
//!
//! The table is bounded ([`COLD_OWNER_STANDINGS_MAX`] siblings); a sibling that fails while it
//! is full stays trusted, which costs time, never a request. Pure state: the caller passes the
//! clock, so every transition is tested without waiting.

use std::collections::HashMap;

use kvroute_discovery::PeerUrl;

/// Failed asks in a row that set a sibling aside.
pub const COLD_OWNER_FAILURES_MAX: u32 = 3;
/// First pause of a sibling set aside.
pub const COLD_OWNER_SET_ASIDE_MIN_MS: u64 = 1_000;
/// Longest pause (a sibling that keeps failing its probation ask).
pub const COLD_OWNER_SET_ASIDE_MAX_MS: u64 = 30_000;
/// Most siblings with a failure on record.
pub const COLD_OWNER_STANDINGS_MAX: usize = 1_024;

/// How an ask to a sibling ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AskOutcome {
    /// The sibling answered with a placement.
    Answered,
    /// No placement: timeout, connection error, an error status or an unreadable answer.
    Failed,
}

/// One sibling's standing as an owner of cold prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerStanding {
    /// Asked; `failures` asks in a row failed (fewer than [`COLD_OWNER_FAILURES_MAX`]).
    Trusted { failures: u32 },
    /// Not asked before `until_us`; asked again on probation from then on.
    SetAside { until_us: u64, set_aside_ms: u64 },
}

impl OwnerStanding {
    /// A sibling with no failure on record.
    pub const TRUSTED: OwnerStanding = OwnerStanding::Trusted { failures: 0 };

    /// Whether a cold prompt may be sent to this sibling at `now_us`.
    pub fn askable(&self, now_us: u64) -> bool {
        match *self {
            OwnerStanding::Trusted { .. } => true,
            OwnerStanding::SetAside { until_us, .. } => now_us >= until_us,
        }
    }

    /// The standing after an ask that ended with `outcome` at `now_us`.
    pub fn after(self, outcome: AskOutcome, now_us: u64) -> OwnerStanding {
        let set_aside = |ms: u64| OwnerStanding::SetAside {
            until_us: now_us.saturating_add(ms.saturating_mul(1_000)),
            set_aside_ms: ms,
        };
        match (self, outcome) {
            (_, AskOutcome::Answered) => OwnerStanding::TRUSTED,
            (OwnerStanding::Trusted { failures }, AskOutcome::Failed) => {
                let failures = failures.saturating_add(1);
                if failures >= COLD_OWNER_FAILURES_MAX {
                    set_aside(COLD_OWNER_SET_ASIDE_MIN_MS)
                } else {
                    OwnerStanding::Trusted { failures }
                }
            }
            (
                OwnerStanding::SetAside {
                    until_us,
                    set_aside_ms,
                },
                AskOutcome::Failed,
            ) => {
                if now_us >= until_us {
                    set_aside(
                        set_aside_ms
                            .saturating_mul(2)
                            .min(COLD_OWNER_SET_ASIDE_MAX_MS),
                    )
                } else {
                    // An ask sent before the sibling was set aside, ending late: the pause
                    // already counts it.
                    self
                }
            }
        }
    }
}

/// The siblings with a failure on record (see the module doc).
#[derive(Debug, Default)]
pub struct OwnerStandings {
    by_sibling: HashMap<PeerUrl, OwnerStanding>,
}

/// One sibling's standing as `/workers` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OwnerStandingView {
    pub sibling: String,
    /// Failed asks in a row (while trusted).
    pub failures: u32,
    /// How long it is still set aside (0 when it may be asked).
    pub set_aside_for_ms: u64,
}

impl OwnerStandings {
    pub fn standing(&self, sibling: &PeerUrl) -> OwnerStanding {
        self.by_sibling
            .get(sibling)
            .copied()
            .unwrap_or(OwnerStanding::TRUSTED)
    }

    /// Whether a cold prompt may be sent to `sibling` at `now_us`.
    pub fn askable(&self, sibling: &PeerUrl, now_us: u64) -> bool {
        self.standing(sibling).askable(now_us)
    }

    /// Records how an ask to `sibling` ended.
    pub fn record(&mut self, sibling: &PeerUrl, outcome: AskOutcome, now_us: u64) {
        let next = self.standing(sibling).after(outcome, now_us);
        if next == OwnerStanding::TRUSTED {
            self.by_sibling.remove(sibling);
        } else if self.by_sibling.len() < COLD_OWNER_STANDINGS_MAX
            || self.by_sibling.contains_key(sibling)
        {
            self.by_sibling.insert(sibling.clone(), next);
        }
    }

    /// Every sibling with a failure on record, by URL.
    pub fn view(&self, now_us: u64) -> Vec<OwnerStandingView> {
        let mut out: Vec<OwnerStandingView> = self
            .by_sibling
            .iter()
            .map(|(sibling, standing)| {
                let (failures, set_aside_for_ms) = match *standing {
                    OwnerStanding::Trusted { failures } => (failures, 0),
                    OwnerStanding::SetAside { until_us, .. } => {
                        (0, until_us.saturating_sub(now_us) / 1_000)
                    }
                };
                OwnerStandingView {
                    sibling: sibling.to_string(),
                    failures,
                    set_aside_for_ms,
                }
            })
            .collect();
        out.sort_by(|a, b| a.sibling.cmp(&b.sibling));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000;

    fn url(s: &str) -> PeerUrl {
        PeerUrl::parse(s).unwrap()
    }

    #[test]
    fn a_trusted_sibling_is_set_aside_only_after_failures_max_in_a_row() {
        let mut s = OwnerStanding::TRUSTED;
        for n in 1..COLD_OWNER_FAILURES_MAX {
            s = s.after(AskOutcome::Failed, 0);
            assert_eq!(s, OwnerStanding::Trusted { failures: n });
            assert!(s.askable(0), "still asked after {n} failures");
        }
        s = s.after(AskOutcome::Failed, 5 * MS);
        assert_eq!(
            s,
            OwnerStanding::SetAside {
                until_us: 5 * MS + COLD_OWNER_SET_ASIDE_MIN_MS * MS,
                set_aside_ms: COLD_OWNER_SET_ASIDE_MIN_MS,
            }
        );
    }

    #[test]
    fn an_answer_between_failures_starts_the_count_again() {
        let s = OwnerStanding::TRUSTED
            .after(AskOutcome::Failed, 0)
            .after(AskOutcome::Failed, 0)
            .after(AskOutcome::Answered, 0);
        assert_eq!(s, OwnerStanding::TRUSTED);
        assert_eq!(
            s.after(AskOutcome::Failed, 0),
            OwnerStanding::Trusted { failures: 1 }
        );
    }

    #[test]
    fn a_set_aside_sibling_is_not_asked_until_its_pause_ends() {
        let s = OwnerStanding::SetAside {
            until_us: 100 * MS,
            set_aside_ms: 50,
        };
        assert!(!s.askable(99 * MS));
        assert!(
            s.askable(100 * MS),
            "asked on probation once the pause ends"
        );
    }

    #[test]
    fn a_failed_probation_doubles_the_pause_up_to_the_cap() {
        let mut s = OwnerStanding::SetAside {
            until_us: 0,
            set_aside_ms: COLD_OWNER_SET_ASIDE_MIN_MS,
        };
        let mut pauses = Vec::new();
        let mut now = 0;
        for _ in 0..8 {
            s = s.after(AskOutcome::Failed, now);
            let OwnerStanding::SetAside {
                until_us,
                set_aside_ms,
            } = s
            else {
                panic!("a failed probation left {s:?}");
            };
            assert_eq!(until_us, now + set_aside_ms * MS);
            pauses.push(set_aside_ms);
            now = until_us;
        }
        assert_eq!(
            pauses,
            [2_000, 4_000, 8_000, 16_000, 30_000, 30_000, 30_000, 30_000]
        );
    }

    #[test]
    fn an_answered_probation_trusts_the_sibling_again() {
        let s = OwnerStanding::SetAside {
            until_us: 10 * MS,
            set_aside_ms: 8_000,
        };
        assert_eq!(
            s.after(AskOutcome::Answered, 10 * MS),
            OwnerStanding::TRUSTED
        );
    }

    #[test]
    fn a_late_failure_of_an_ask_sent_before_the_pause_changes_nothing() {
        let s = OwnerStanding::SetAside {
            until_us: 10 * MS,
            set_aside_ms: 1_000,
        };
        assert_eq!(s.after(AskOutcome::Failed, 9 * MS), s);
    }

    #[test]
    fn the_table_keeps_only_siblings_with_a_failure_and_stays_bounded() {
        let mut t = OwnerStandings::default();
        let a = url("http://10.0.0.1:8081");
        t.record(&a, AskOutcome::Failed, 0);
        assert_eq!(t.standing(&a), OwnerStanding::Trusted { failures: 1 });
        t.record(&a, AskOutcome::Answered, 0);
        assert!(t.by_sibling.is_empty(), "an answer forgets the sibling");
        for i in 0..COLD_OWNER_STANDINGS_MAX + 10 {
            let s = url(&format!("http://10.{}.{}.1:8081", i / 256, i % 256));
            t.record(&s, AskOutcome::Failed, 0);
        }
        assert_eq!(t.by_sibling.len(), COLD_OWNER_STANDINGS_MAX);
        let past_cap = url(&format!(
            "http://10.{}.{}.1:8081",
            (COLD_OWNER_STANDINGS_MAX + 5) / 256,
            (COLD_OWNER_STANDINGS_MAX + 5) % 256
        ));
        assert!(
            t.askable(&past_cap, 0),
            "a sibling past the cap stays trusted"
        );
    }

    #[test]
    fn the_view_shows_failures_and_the_pause_left() {
        let mut t = OwnerStandings::default();
        let (a, b) = (url("http://10.0.0.1:8081"), url("http://10.0.0.2:8081"));
        t.record(&b, AskOutcome::Failed, 0);
        for _ in 0..COLD_OWNER_FAILURES_MAX {
            t.record(&a, AskOutcome::Failed, 0);
        }
        let v = t.view(400 * MS);
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].sibling, a.to_string());
        assert_eq!(
            (v[0].failures, v[0].set_aside_for_ms),
            (0, COLD_OWNER_SET_ASIDE_MIN_MS - 400)
        );
        assert_eq!((v[1].failures, v[1].set_aside_for_ms), (1, 0));
    }
}

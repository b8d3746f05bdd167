//! How a rank's bootstrap ended ([`Outcome`], the project's one outcome type: `kvroute-kv`
//! re-exports it for its rank machines, the service labels its metrics and logs with it) and
//! which registration of a rank a verdict is about ([`Incarnation`]).
//!
//! The transitions that lead to an outcome live in one place, `kvroute-kv`'s rank machine (the
//! pump owns it, so every transition is ordered with the batches it depends on); this module
//! only names the ends, so the pure sweep and the service speak of them with one vocabulary.

/// Names one registration of a rank (the KV plane mints them from a counter that never repeats),
/// so a verdict about an older registration can only miss, never alias the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Incarnation(pub u64);

/// What became of a rank's bootstrap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Recovered: grafted, and the splice between the snapshot's cursor and the live stream
    /// was proven by sequence numbers.
    Warm,
    /// Recovered: grafted, but no batch, replay or sibling could witness the splice within the
    /// bounded number of probes; the graft is kept.
    WarmUnwitnessed,
    /// Recovered, as far as the fleet can: grafted and the splice proven like `warm`, but the
    /// sibling's own view of the rank did not reach back to the publisher's origin (it joined the
    /// stream mid-way or lost batches; its snapshot lists the rank in `partial_ranks`). This
    /// replica now sees what its sibling sees, not everything the engine holds, and will not
    /// name the rank complete to others either.
    WarmPartial,
    /// Failed: the live stream did not join the snapshot's cursor and neither the engine's replay
    /// nor the one fresher snapshot healed it; the graft was discarded.
    Gap,
    /// Failed: no snapshot had a cursor for the rank (the delivered one did not speak for it, or
    /// every sibling that answered knows nothing of it), and its engine could not rebuild it.
    Uncovered,
    /// Failed: the search ended (timed out, no peers, fleet cold) without a snapshot.
    Abandoned,
    /// Failed: the held batches passed their count or byte bound; they were applied cold.
    Overflow,
    /// Failed: the publisher restarted (not at seq 0) while the rank was being bootstrapped.
    PublisherReset,
    /// Failed: the graft itself was refused by the index.
    Rejected,
    /// Recovered: the rank's stream began at seq 0 while we watched, so nothing was missed.
    FromOrigin,
    /// Recovered: the rank holds nothing (a fresh engine): every sibling that holds its whole
    /// history says so, or the engine's replay from seq 0 returned nothing.
    Empty,
    /// Recovered: rebuilt exactly from the engine's replay buffer, which reached back to seq 0.
    FromEngineReplay,
}

impl Outcome {
    pub const ALL: [Outcome; 12] = [
        Outcome::Warm,
        Outcome::WarmUnwitnessed,
        Outcome::WarmPartial,
        Outcome::Gap,
        Outcome::Uncovered,
        Outcome::Abandoned,
        Outcome::Overflow,
        Outcome::PublisherReset,
        Outcome::Rejected,
        Outcome::FromOrigin,
        Outcome::Empty,
        Outcome::FromEngineReplay,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Warm => "warm",
            Outcome::WarmUnwitnessed => "warm_unwitnessed",
            Outcome::WarmPartial => "warm_partial",
            Outcome::Gap => "gap",
            Outcome::Uncovered => "uncovered",
            Outcome::Abandoned => "abandoned",
            Outcome::Overflow => "overflow",
            Outcome::PublisherReset => "publisher_reset",
            Outcome::Rejected => "rejected",
            Outcome::FromOrigin => "from_origin",
            Outcome::Empty => "empty",
            Outcome::FromEngineReplay => "from_engine_replay",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_is_listed_once_with_a_distinct_label() {
        let labels: std::collections::HashSet<&str> =
            Outcome::ALL.iter().map(|o| o.label()).collect();
        assert_eq!(labels.len(), Outcome::ALL.len(), "labels are distinct");
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i, "ALL is in declaration order: {o:?}");
        }
    }
}

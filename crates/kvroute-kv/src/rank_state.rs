//! The per-rank sequencing state machine of the pump: which batches of one engine rank get applied
//! to the index, in which order, and when a gap must be repaired through the engine's replay socket.
//!
//! It is pure and synchronous (no sockets, no clock, no index): it consumes live batches, replay
//! answers and reconnect notices, and emits [`Action`]s that the pump executes. That keeps every
//! ordering rule testable in isolation, and keeps the one subtle invariant in one place:
//! **a batch is applied at most once and in increasing sequence order within one publisher
//! incarnation** (`cursor` = last applied seq). Applying out of order could re-store a block after
//! its removal and leave a phantom carrier in the index.
//!
//! Restart detection relies on ZMQ's per-connection ordering: one SUB connection delivers a
//! publisher's batches in order, so the *live* stream going backwards (or returning to seq 0 once a
//! cursor is past it) can only mean a new publisher, whose sequence restarted. A live seq at or
//! below the cursor that is not a regression of the live stream itself is a re-delivery of a batch
//! already obtained through replay, hence a duplicate.
//!
//! A publisher restart can also hide behind a reconnect: if the new publisher has already counted
//! past our cursor when the SUB reconnects, its seqs look like a continuation. Replays therefore
//! start AT the cursor when its batch's `ts` is known, and compare: the engine's batch at that seq
//! must be the one we applied (same `ts`), or the publisher is not the one the cursor speaks of.
//!
//! **Peer bootstrap.** A rank registered while bootstrap is on starts in a holding phase: its
//! live batches are held (bounded by count and bytes) until a sibling's snapshot is grafted under
//! them or the rank is released. The snapshot's cursor `c` for the rank (seq and `ts`) is the
//! watermark: held batches at or below it are already in the snapshot; the first one above it
//! must be `c + 1` for the splice to be proven. A gap is healed from the engine's replay socket
//! when the rank has one, else (or when replay cannot cover it) the rank asks once for a fresher
//! snapshot, and a second failure discards the graft and runs the rank cold. With nothing held at
//! graft time the proof is deferred: the first live batch decides, and the engine's replay from
//! `c` (or, without a replay socket, the siblings' cursors) is asked meanwhile, because a quiet
//! rank may publish nothing for a long time. Every bootstrap ends in exactly one
//! [`BootstrapOutcome`], reported as [`Action::BootstrapFinished`] on the transition to `Live`.
//!
//! Ordering contract with the pump for a graft: [`Action::Graft`] is emitted before the `Apply`
//! of every held batch above the watermark, and the pump completes the graft of that rank before
//! executing any later action of the rank. That is what keeps a removal that arrived while the
//! rank was held from being resurrected by the snapshot: the removal is applied after the graft.
//! The pump validates and prepares the graft BEFORE delivering it ([`RankMachine::on_graft`]), so
//! a snapshot the index refuses is a release (`rejected`), never a half-taken graft.
//!
//! The machine is generic over the batch payload (anything with a [`Stamped::ts`] and a
//! [`HeldCost`]) so tests can use plain markers.

use std::collections::VecDeque;

use kvroute_wire::EventBatch;

/// A batch's publish timestamp, which (with its seq) identifies it across publisher restarts.
pub trait Stamped {
    fn ts(&self) -> f64;
}

impl Stamped for EventBatch {
    fn ts(&self) -> f64 {
        self.ts
    }
}

/// The memory a held batch costs, for the bootstrap hold's byte bound.
///
/// The payload reports its own cost rather than the caller passing the wire size: batches reach
/// the hold from two paths (the live stream and replay answers), and what the hold keeps in
/// memory is the decoded batch, whose size differs from its msgpack bytes.
pub trait HeldCost {
    fn held_bytes(&self) -> u64;
}

impl HeldCost for EventBatch {
    /// An estimate from the decoded shape: the structs plus their vectors' elements. It ignores
    /// allocator slack, which is why the bound it feeds is set with headroom.
    fn held_bytes(&self) -> u64 {
        use kvroute_wire::KvEvent;
        let mut bytes = std::mem::size_of::<(i64, EventBatch)>()
            + self.events.len() * std::mem::size_of::<KvEvent>();
        for ev in &self.events {
            bytes += match ev {
                KvEvent::BlockStored(s) => {
                    s.block_hashes.len() * 8
                        + s.token_ids.len() * 4
                        + s.extra_keys.len() * std::mem::size_of::<Option<u64>>()
                        + s.lora_name.as_ref().map_or(0, String::len)
                }
                KvEvent::BlockRemoved(r) => r.block_hashes.len() * 8,
                KvEvent::AllBlocksCleared => 0,
            };
        }
        bytes as u64
    }
}

/// Live batches held while a replay is in flight. Past this the replay is abandoned: the held
/// batches are applied and the gap counted lost, because holding without bound would let one slow
/// replay socket grow the router's memory and stall the rank indefinitely.
pub const HELD_BATCHES_MAX: usize = 4096;

/// Live batches one bootstrapping rank may hold. The hold lasts the whole sibling search (fetch,
/// vet, graft: seconds, up to the bootstrap deadline); past this the rank is released and runs
/// cold (`overflow`) rather than grow without bound.
pub const BOOTSTRAP_HELD_BATCHES_MAX: usize = 8192;

/// Bytes (as [`HeldCost`] estimates them) one bootstrapping rank may hold. Counted as well as
/// batches because a batch ranges from a few hundred bytes to megabytes (token ids of every
/// stored block); this bounds a 1,024-rank fleet's holds to a few GiB in the worst case.
pub const BOOTSTRAP_HELD_BYTES_MAX: u64 = 4 * 1024 * 1024;
/// Bytes of live batches one model's bootstrapping ranks may hold ALL TOGETHER. A fleet of a
/// thousand ranks each within [`BOOTSTRAP_HELD_BYTES_MAX`] could hold gigabytes; past this
/// total the rank holding the most is released cold (`overflow`), one at a time, until the total
/// is back under it.
pub const BOOTSTRAP_HELD_BYTES_TOTAL_MAX: u64 = 256 * 1024 * 1024;

/// A rank registered without bootstrap whose FIRST live batch has a seq in `1..=` this asks the
/// engine's replay from seq 0 before applying it. A stream seen first so close to its origin was
/// joined around the publisher's start, and the batches before it were lost to the subscription's
/// slow join or withheld; the engine's replay buffer still holds them, and without them the rank's
/// first blocks would be invisible for as long as the engine keeps them. Farther from the origin
/// the router simply joined mid-stream (that is the bootstrap's job), and replaying a long buffer
/// per rank at every start would cost more than it recovers.
pub const ORIGIN_REPLAY_FIRST_SEQ_MAX: i64 = 16;

/// Unanswered sibling-cursor probes of a deferred splice proof before the graft is kept as
/// `warm_unwitnessed`; bounded so a replica alone in its fleet settles instead of probing forever.
pub const SPLICE_PROBE_ROUNDS_MAX: u32 = 3;

/// How a rank's bootstrap ended: the one outcome type of the project (defined in the pure
/// `kvroute-bootstrap` crate). Some are decided by this machine (the splice proofs, overflow,
/// restarts); the others are the caller's reason for a release without a graft.
pub use kvroute_bootstrap::outcome::Outcome as BootstrapOutcome;

/// Batches held by a bootstrapping rank, ascending by seq, with their [`HeldCost`] total.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldBatches<B> {
    batches: VecDeque<(i64, B)>,
    bytes: u64,
}

impl<B> Default for HeldBatches<B> {
    fn default() -> Self {
        Self {
            batches: VecDeque::new(),
            bytes: 0,
        }
    }
}

impl<B: HeldCost> HeldBatches<B> {
    /// Held batches from `batches`, which must be ascending and distinct by seq.
    fn from_sorted(batches: Vec<(i64, B)>) -> Self {
        let bytes = batches.iter().map(|(_, b)| b.held_bytes()).sum();
        Self {
            batches: batches.into(),
            bytes,
        }
    }

    pub fn len(&self) -> usize {
        self.batches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn first_seq(&self) -> Option<i64> {
        self.batches.front().map(|(s, _)| *s)
    }

    fn last_seq(&self) -> Option<i64> {
        self.batches.back().map(|(s, _)| *s)
    }

    fn push(&mut self, seq: i64, batch: B) {
        self.bytes += batch.held_bytes();
        self.batches.push_back((seq, batch));
    }

    fn over_limits(&self) -> bool {
        self.batches.len() > BOOTSTRAP_HELD_BATCHES_MAX || self.bytes > BOOTSTRAP_HELD_BYTES_MAX
    }

    /// Drops batches at or below `seq`; returns how many.
    fn drop_through(&mut self, seq: i64) -> u64 {
        let mut dropped = 0;
        while let Some((s, b)) = self.batches.front() {
            if *s > seq {
                break;
            }
            self.bytes -= b.held_bytes();
            self.batches.pop_front();
            dropped += 1;
        }
        dropped
    }
}

/// What became of one replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayOutcome {
    /// Every missing batch was obtained.
    Repaired,
    /// The engine answered, but some batches were no longer in its buffer (or the answer was cut
    /// short); the missing ones were counted lost.
    Incomplete,
    /// No usable answer (timeout, socket error, or abandoned because too much was held).
    Failed,
}

impl ReplayOutcome {
    pub fn label(self) -> &'static str {
        match self {
            ReplayOutcome::Repaired => "repaired",
            ReplayOutcome::Incomplete => "incomplete",
            ReplayOutcome::Failed => "failed",
        }
    }
}

/// An engine's answer to one replay request, already decoded by the replay task.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayAnswer<B> {
    /// Batches in the order received (may be empty, partial or overlapping what is already applied).
    Batches(Vec<(i64, B)>),
    Failed,
}

/// What the pump must do, in this order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action<B> {
    /// Apply the batch to the index and set the rank's cursor to `seq`.
    Apply {
        seq: i64,
        batch: B,
    },
    /// The engine restarted: drop everything the rank carries, before any later `Apply`.
    ClearRank,
    /// Ask the rank's replay socket for batches `from_seq..`; answers with another generation are
    /// stale. Batches at or after `stop_before` are already held and need not be fetched.
    StartReplay {
        generation: u64,
        from_seq: i64,
        stop_before: Option<i64>,
    },
    Duplicate {
        seq: i64,
    },
    Lost {
        batches: u64,
    },
    PublisherRestarted,
    ReplayFinished {
        outcome: ReplayOutcome,
    },
    /// Graft the prepared snapshot's carriers for this rank (whose cursor is `watermark`), to
    /// completion, before executing any later action of this rank.
    Graft {
        watermark: Witness,
    },
    /// The graft cannot be proven: drop every carrier of the rank and its index cursor (the rank
    /// carried nothing but the graft), before any later `Apply`. If the rank's graft job is still
    /// running, abandon the rank in it.
    DiscardGraft,
    /// Ask the siblings' cursor tables for this rank and answer with
    /// [`RankMachine::on_probe_answer`] under `generation` (the pump paces the rounds).
    ProbeSiblings {
        generation: u64,
        watermark: Witness,
    },
    /// The one retry of this incarnation: find a snapshot again, newer than the gap. Its cursor
    /// for the rank must reach at least `min_cursor` (deliveries below it are ignored); the
    /// coordinator stamps the freshness floor (now) when it executes this.
    RequestFreshSnapshot {
        min_cursor: i64,
    },
    /// The rank's bootstrap ended; exactly one per bootstrapping incarnation.
    BootstrapFinished {
        outcome: BootstrapOutcome,
    },
}

/// `(seq, ts)` of an applied batch that a replay answer must reproduce.
pub type Witness = (i64, f64);

/// Where the rank is in its sequencing.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase<B> {
    /// Batches are applied as they arrive.
    Live,
    /// A replay is in flight; live batches wait in `held` (ascending seq) until it answers.
    Replaying {
        generation: u64,
        from_seq: i64,
        /// `(cursor, ts)` of the applied batch the answer must reproduce, when it is known.
        verify: Option<Witness>,
        held: VecDeque<(i64, B)>,
    },
    /// Bootstrap: no snapshot yet; live batches are held until a graft or a release.
    Holding {
        held: HeldBatches<B>,
        /// After a gap, the one retry demands a snapshot whose cursor reaches this seq.
        min_cursor: Option<i64>,
    },
    /// The engine's replay from seq 0 is asked; live batches held. Either there is no snapshot
    /// (`over_graft` is `None`), or a partial graft's splice was just proven and the engine may
    /// still hold the rank's whole stream, which beats the producer's partial view.
    Rebuilding {
        generation: u64,
        held: HeldBatches<B>,
        /// The outcome of the release if the replay does not reach back to seq 0.
        fallback: BootstrapOutcome,
        /// The proven partial graft in place, by its watermark's seq: a replay that reaches seq 0
        /// replaces it, any other answer leaves it (and `fallback` is `warm_partial`).
        over_graft: Option<i64>,
    },
    /// Grafted at `watermark`, and a gap separates it from the first held batch: the engine's
    /// replay is asked for the missing batches.
    Healing {
        generation: u64,
        watermark: Witness,
        held: HeldBatches<B>,
    },
    /// Grafted at `watermark` with nothing held: the proof is deferred to the first live batch,
    /// the engine's replay from the watermark (`replay`), or the siblings' cursors (`probe`).
    Proving {
        watermark: Witness,
        replay: Option<u64>,
        probe: Option<u64>,
        unanswered_probes: u32,
    },
}

/// Counters kept per rank for status reporting (the pump mirrors them into metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankCounters {
    pub applied_batches: u64,
    pub duplicate_batches: u64,
    pub lost_batches: u64,
    pub publisher_restarts: u64,
    pub replays_started: u64,
    /// Held batches found already reflected in a grafted snapshot (seq at or below its cursor).
    pub reflected_batches: u64,
}

#[derive(Debug, Clone)]
pub struct RankMachine<B> {
    cursor: Option<i64>,
    /// `ts` of the batch at `cursor`.
    cursor_ts: Option<f64>,
    /// Last seq received on the live stream (not replay): the restart detector.
    last_live_seq: Option<i64>,
    phase: Phase<B>,
    next_generation: u64,
    has_replay: bool,
    counters: RankCounters,
    /// The one gap retry of a bootstrap is still available.
    retry_available: bool,
    outcome: Option<BootstrapOutcome>,
    /// The index holds every effect of the current publisher's stream since its seq 0: the
    /// stream was applied from batch 0 with no batch lost, or a bootstrap proved a graft or a
    /// rebuild that reaches back to it. Only then may "this rank carries nothing" be told to a
    /// sibling as "the engine holds nothing" (a snapshot's `empty_ranks`).
    history_complete: bool,
    /// What the graft in place says about the rank's history: a graft of a rank its producer
    /// lists as partial proves, even once spliced, only the producer's view, so its proof
    /// settles `warm_partial` and leaves `history_complete` false. Set by each graft taken.
    graft_history: GraftHistory,
}

/// How far back a snapshot's view of a rank reaches (the producer's `partial_ranks`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GraftHistory {
    /// The producer held the rank's whole history since its publisher's seq 0.
    #[default]
    Complete,
    /// The producer joined the rank's stream mid-way, lost batches, or grafted such a view.
    Partial,
}

impl<B: Stamped + HeldCost> RankMachine<B> {
    /// A rank that has applied nothing yet. `has_replay`: the rank has a replay endpoint.
    pub fn new(has_replay: bool) -> Self {
        Self {
            cursor: None,
            cursor_ts: None,
            last_live_seq: None,
            phase: Phase::Live,
            next_generation: 0,
            has_replay,
            counters: RankCounters::default(),
            retry_available: false,
            outcome: None,
            history_complete: false,
            graft_history: GraftHistory::Complete,
        }
    }

    /// A rank registered while peer bootstrap is on: it holds its live batches until a graft
    /// ([`Self::on_graft`]) or a release ([`Self::on_release`]).
    pub fn new_bootstrapping(has_replay: bool) -> Self {
        Self {
            phase: Phase::Holding {
                held: HeldBatches::default(),
                min_cursor: None,
            },
            retry_available: true,
            ..Self::new(has_replay)
        }
    }

    /// How the rank's bootstrap ended; `None` while it runs (or if it never bootstrapped).
    pub fn outcome(&self) -> Option<BootstrapOutcome> {
        self.outcome
    }

    /// Whether the rank is in a bootstrap phase (holding, rebuilding, or proving a graft).
    pub fn is_bootstrapping(&self) -> bool {
        matches!(
            self.phase,
            Phase::Holding { .. }
                | Phase::Rebuilding { .. }
                | Phase::Healing { .. }
                | Phase::Proving { .. }
        )
    }

    /// Bytes held by a bootstrap phase (0 otherwise).
    pub fn held_bytes(&self) -> u64 {
        match &self.phase {
            Phase::Holding { held, .. }
            | Phase::Rebuilding { held, .. }
            | Phase::Healing { held, .. } => held.bytes(),
            _ => 0,
        }
    }

    /// Last applied seq; `None` before the first batch. After a restart detected mid-stream it is
    /// -1 ("before the new publisher's origin") until the new stream's first batch is applied.
    pub fn cursor(&self) -> Option<i64> {
        self.cursor
    }

    pub fn phase(&self) -> &Phase<B> {
        &self.phase
    }

    /// Whether the index's count of the rank's blocks may be taken for the engine's whole cache
    /// (the routing path prices displacement by it, `engine_loads`): the history is complete,
    /// or the publisher has sent nothing since the rank was registered and no bootstrap spoke
    /// for it. The second is an assumption, and the one a router must make to fill a fresh
    /// engine: a rank that does hold blocks from before announces its next insertion with a
    /// seq past 0, which either replays back to its origin or leaves the history incomplete,
    /// and the count is withheld from then on.
    pub fn counts_whole_cache(&self) -> bool {
        self.history_complete()
            || (self.cursor.is_none()
                && matches!(self.phase, Phase::Live)
                && self.outcome.is_none())
    }

    /// Whether the index holds the publisher's whole stream since its seq 0 (see the field). False
    /// while bootstrapping, after a lost batch, and after a restart until the new batch 0 applies.
    pub fn history_complete(&self) -> bool {
        self.history_complete && !self.is_bootstrapping()
    }

    pub fn counters(&self) -> RankCounters {
        self.counters
    }

    pub fn held_len(&self) -> usize {
        match &self.phase {
            Phase::Live | Phase::Proving { .. } => 0,
            Phase::Replaying { held, .. } => held.len(),
            Phase::Holding { held, .. }
            | Phase::Rebuilding { held, .. }
            | Phase::Healing { held, .. } => held.len(),
        }
    }

    /// A batch from the rank's SUB socket.
    pub fn on_live_batch(&mut self, seq: i64, batch: B, out: &mut Vec<Action<B>>) {
        if self.is_bootstrapping() {
            return self.on_live_batch_bootstrapping(seq, batch, out);
        }
        if self.is_restart(seq, &batch) {
            self.restart(out);
        }
        self.last_live_seq = Some(seq);
        let held = match &mut self.phase {
            Phase::Replaying { held, .. } => held,
            _ => return self.on_live_batch_while_live(seq, batch, out),
        };
        if self.cursor.is_some_and(|c| seq <= c) || held.back().is_some_and(|(s, _)| seq <= *s) {
            self.counters.duplicate_batches += 1;
            out.push(Action::Duplicate { seq });
            return;
        }
        if held.len() < HELD_BATCHES_MAX {
            held.push_back((seq, batch));
            return;
        }
        // Overflow: give up on the replay rather than hold without bound.
        let (held, _) = self.leave_replaying();
        out.push(Action::ReplayFinished {
            outcome: ReplayOutcome::Failed,
        });
        for (s, b) in held {
            self.apply_in_order(s, b, out);
        }
        self.apply_in_order(seq, batch, out);
    }

    /// The SUB socket (re)connected: batches published while it was away (slow joiner, reconnect)
    /// are invisible to it, so ask replay for everything after the cursor.
    pub fn on_reconnect(&mut self, out: &mut Vec<Action<B>>) {
        if let (Phase::Live, Some(_), true) = (&self.phase, self.cursor, self.has_replay) {
            self.start_replay(None, VecDeque::new(), out);
        }
    }

    /// The answer to the replay of `generation`. Stale answers (the rank restarted or abandoned
    /// that replay meanwhile) are ignored.
    pub fn on_replay_answer(
        &mut self,
        generation: u64,
        answer: ReplayAnswer<B>,
        out: &mut Vec<Action<B>>,
    ) {
        match &self.phase {
            Phase::Replaying { generation: g, .. } if *g == generation => {}
            Phase::Healing { generation: g, .. } if *g == generation => {
                return self.on_heal_answer(answer, out);
            }
            Phase::Proving {
                replay: Some(g), ..
            } if *g == generation => return self.on_proof_answer(answer, out),
            Phase::Rebuilding { generation: g, .. } if *g == generation => {
                return self.on_rebuild_answer(answer, out);
            }
            _ => return,
        }
        let (held, verify) = self.leave_replaying();
        let mut answer = answer;
        if let (Some((at, ts)), ReplayAnswer::Batches(batches)) = (verify, &mut answer)
            && let Some(pos) = batches.iter().position(|(s, _)| *s == at)
        {
            if batches[pos].1.ts() != ts {
                // Another publisher counted past our cursor: everything applied is stale.
                self.restart(out);
                let stop_before = held.front().map(|(s, _)| *s);
                self.start_replay(stop_before, held, out);
                return;
            }
            // The witness is the batch already applied; it is neither new nor a duplicate.
            batches.remove(pos);
        }
        let lost_before = self.counters.lost_batches;
        let first_held = held.front().map(|(s, _)| *s);
        let failed = matches!(answer, ReplayAnswer::Failed);
        if let ReplayAnswer::Batches(mut batches) = answer {
            // The engine sends in order; sorting is cheap insurance for the apply-once invariant.
            batches.sort_by_key(|(s, _)| *s);
            for (s, b) in batches {
                if first_held.is_some_and(|f| s >= f) {
                    break;
                }
                self.apply_in_order(s, b, out);
            }
        }
        for (s, b) in held {
            self.apply_in_order(s, b, out);
        }
        let outcome = if failed {
            ReplayOutcome::Failed
        } else if self.counters.lost_batches == lost_before {
            ReplayOutcome::Repaired
        } else {
            ReplayOutcome::Incomplete
        };
        out.push(Action::ReplayFinished { outcome });
    }

    fn is_restart(&self, seq: i64, batch: &B) -> bool {
        let live_went_back = self.last_live_seq.is_some_and(|last| seq < last);
        let back_to_origin = seq == 0 && self.cursor.is_some_and(|c| c > 0);
        // Same seq as the applied batch but another payload: only a new publisher does that
        // (this catches a restart when the cursor was still 0).
        let other_batch_at_cursor =
            self.cursor == Some(seq) && self.cursor_ts.is_some_and(|ts| ts != batch.ts());
        live_went_back || back_to_origin || other_batch_at_cursor
    }

    fn restart(&mut self, out: &mut Vec<Action<B>>) {
        if matches!(self.phase, Phase::Replaying { .. }) {
            // The held batches belong to the dead publisher; ClearRank wipes what they would add.
            let _ = self.leave_replaying();
            out.push(Action::ReplayFinished {
                outcome: ReplayOutcome::Failed,
            });
        }
        self.counters.publisher_restarts += 1;
        out.push(Action::PublisherRestarted);
        out.push(Action::ClearRank);
        self.history_complete = false;
        // -1, not None: the new publisher counts from 0, so a first live seq > 0 is a gap that
        // replay can fill from the new publisher's buffer.
        self.cursor = Some(-1);
        self.cursor_ts = None;
    }

    fn on_live_batch_while_live(&mut self, seq: i64, batch: B, out: &mut Vec<Action<B>>) {
        match self.cursor {
            Some(c) if seq > c + 1 && self.has_replay => {
                self.start_replay(Some(seq), VecDeque::from([(seq, batch)]), out);
            }
            // A young stream joined just after its origin: fetch the batches before it from the
            // engine (a replay from 0, since there is no cursor to verify).
            None if self.has_replay && (1..=ORIGIN_REPLAY_FIRST_SEQ_MAX).contains(&seq) => {
                self.start_replay(Some(seq), VecDeque::from([(seq, batch)]), out);
            }
            _ => self.apply_in_order(seq, batch, out),
        }
    }

    /// Replays from the cursor (to verify it) when its batch's ts is known, else from the cursor
    /// plus one. Only called with a cursor.
    fn start_replay(
        &mut self,
        stop_before: Option<i64>,
        held: VecDeque<(i64, B)>,
        out: &mut Vec<Action<B>>,
    ) {
        let cursor = self.cursor.unwrap_or(-1);
        let verify = match self.cursor_ts {
            Some(ts) if cursor >= 0 => Some((cursor, ts)),
            _ => None,
        };
        let from_seq = if verify.is_some() { cursor } else { cursor + 1 };
        let generation = self.next_generation;
        self.next_generation += 1;
        self.counters.replays_started += 1;
        self.phase = Phase::Replaying {
            generation,
            from_seq,
            verify,
            held,
        };
        out.push(Action::StartReplay {
            generation,
            from_seq,
            stop_before,
        });
    }

    fn leave_replaying(&mut self) -> (VecDeque<(i64, B)>, Option<Witness>) {
        match std::mem::replace(&mut self.phase, Phase::Live) {
            Phase::Replaying { held, verify, .. } => (held, verify),
            _ => (VecDeque::new(), None),
        }
    }

    /// The cursor filter every applied batch passes through.
    fn apply_in_order(&mut self, seq: i64, batch: B, out: &mut Vec<Action<B>>) {
        if let Some(c) = self.cursor {
            if seq <= c {
                self.counters.duplicate_batches += 1;
                out.push(Action::Duplicate { seq });
                return;
            }
            if seq > c + 1 {
                let missing = (seq - c - 1) as u64;
                self.counters.lost_batches += missing;
                out.push(Action::Lost { batches: missing });
                self.history_complete = false;
            }
        }
        if seq == 0 && matches!(self.cursor, None | Some(-1)) {
            // The publisher's first batch, applied before any other of its stream.
            self.history_complete = true;
        }
        self.cursor = Some(seq);
        self.cursor_ts = Some(batch.ts());
        self.counters.applied_batches += 1;
        out.push(Action::Apply { seq, batch });
    }
}

/// Bootstrap inputs and transitions.
impl<B: Stamped + HeldCost> RankMachine<B> {
    /// A graft for this rank is ready, with the snapshot's cursor as `watermark`. Returns whether
    /// it was taken: only a holding rank takes one, and after a gap only one whose cursor reaches
    /// the retry's demand (an older one would gap again by construction). The pump grafts only
    /// ranks that took it, then executes the actions.
    pub fn on_graft(
        &mut self,
        watermark: Witness,
        history: GraftHistory,
        out: &mut Vec<Action<B>>,
    ) -> bool {
        let Phase::Holding { min_cursor, .. } = &self.phase else {
            return false;
        };
        if min_cursor.is_some_and(|m| watermark.0 < m) {
            return false;
        }
        let Phase::Holding { mut held, .. } = std::mem::replace(&mut self.phase, Phase::Live)
        else {
            return false;
        };
        out.push(Action::Graft { watermark });
        self.graft_history = history;
        let (c, ts) = watermark;
        self.counters.reflected_batches += held.drop_through(c);
        self.cursor = Some(c);
        self.cursor_ts = Some(ts);
        match held.first_seq() {
            None => self.start_proof(watermark, 0, out),
            Some(first) if Some(first) == c.checked_add(1) => {
                self.finish(BootstrapOutcome::Warm, held, out);
            }
            Some(_) => self.on_gap(watermark, held, None, out),
        }
        true
    }

    /// Ends a holding (or rebuilding) rank's bootstrap without a graft: the held batches apply in
    /// order and the rank runs from its live stream. Returns false (and does nothing) in any other
    /// phase: a graft in place is judged by its own proof, not by the caller.
    pub fn on_release(&mut self, outcome: BootstrapOutcome, out: &mut Vec<Action<B>>) -> bool {
        if !matches!(self.phase, Phase::Holding { .. } | Phase::Rebuilding { .. }) {
            return false;
        }
        // A rebuild over a proven graft is past the siblings' say: the graft stands as proven.
        let outcome = match self.phase {
            Phase::Rebuilding {
                fallback,
                over_graft: Some(_),
                ..
            } => fallback,
            _ => outcome,
        };
        let held = self.take_held();
        self.finish(outcome, held, out);
        true
    }

    /// No snapshot will come: rebuild the rank from the engine's replay buffer if it still reaches
    /// back to seq 0 (a young engine), else release it with `fallback`. Returns false (and does
    /// nothing) unless the rank is holding and has a replay socket.
    pub fn on_engine_rebuild(
        &mut self,
        fallback: BootstrapOutcome,
        out: &mut Vec<Action<B>>,
    ) -> bool {
        if !self.has_replay || !matches!(self.phase, Phase::Holding { .. }) {
            return false;
        }
        let held = self.take_held();
        self.start_rebuild(held, fallback, None, out);
        true
    }

    /// Asks the engine's replay from seq 0 and holds live batches until it answers: for a rank no
    /// snapshot will cover (`over_graft` is `None`), or over a partial graft whose splice was
    /// just proven at watermark `over_graft`, since a young engine still holds the rank's whole
    /// stream, where the graft is only its producer's view (the producer joined mid-way).
    fn start_rebuild(
        &mut self,
        held: HeldBatches<B>,
        fallback: BootstrapOutcome,
        over_graft: Option<i64>,
        out: &mut Vec<Action<B>>,
    ) {
        let generation = self.mint_generation();
        self.counters.replays_started += 1;
        out.push(Action::StartReplay {
            generation,
            from_seq: 0,
            stop_before: held.first_seq(),
        });
        self.phase = Phase::Rebuilding {
            generation,
            held,
            fallback,
            over_graft,
        };
    }

    /// The siblings' answer to probe `generation`: the highest cursor any of them reports for this
    /// rank, `None` when none names it. Above the watermark proves a missed batch; at it proves the
    /// splice; below it or silence proves nothing. Answers to a probe the rank has moved past
    /// (a later batch decided, or a restarted engine replaced the graft) are ignored.
    pub fn on_probe_answer(
        &mut self,
        generation: u64,
        highest: Option<i64>,
        out: &mut Vec<Action<B>>,
    ) {
        let Phase::Proving {
            watermark,
            probe: Some(g),
            unanswered_probes,
            ..
        } = self.phase
        else {
            return;
        };
        if g != generation {
            return;
        }
        match highest {
            Some(seq) if seq > watermark.0 => self.fall_back(HeldBatches::default(), seq, out),
            Some(seq) if seq == watermark.0 => {
                self.finish(BootstrapOutcome::Warm, HeldBatches::default(), out);
            }
            _ if unanswered_probes + 1 >= SPLICE_PROBE_ROUNDS_MAX => {
                self.finish(
                    BootstrapOutcome::WarmUnwitnessed,
                    HeldBatches::default(),
                    out,
                );
            }
            _ => self.start_proof_probe(watermark, unanswered_probes + 1, out),
        }
    }

    fn on_live_batch_bootstrapping(&mut self, seq: i64, batch: B, out: &mut Vec<Action<B>>) {
        let grafted = matches!(
            self.phase,
            Phase::Healing { .. }
                | Phase::Proving { .. }
                | Phase::Rebuilding {
                    over_graft: Some(_),
                    ..
                }
        );
        let went_back = self.last_live_seq.is_some_and(|last| seq < last);
        // With a graft in place the cursor is the snapshot's: a batch 0 past it, or another batch
        // at it, comes from a publisher the snapshot does not describe.
        let origin_again = grafted && seq == 0 && self.cursor.is_some_and(|c| c > 0);
        let other_at_cursor = grafted
            && self.cursor == Some(seq)
            && self.cursor_ts.is_some_and(|ts| ts != batch.ts());
        self.last_live_seq = Some(seq);
        if went_back || origin_again || other_at_cursor {
            return self.restart_while_bootstrapping(seq, batch, out);
        }
        match &mut self.phase {
            Phase::Holding { held, .. } if held.is_empty() && seq == 0 => {
                self.finish(BootstrapOutcome::FromOrigin, HeldBatches::default(), out);
                self.apply_in_order(seq, batch, out);
            }
            Phase::Holding { held, .. }
            | Phase::Rebuilding { held, .. }
            | Phase::Healing { held, .. } => {
                if held.last_seq().is_some_and(|last| seq <= last) {
                    self.counters.duplicate_batches += 1;
                    out.push(Action::Duplicate { seq });
                    return;
                }
                held.push(seq, batch);
                if held.over_limits() {
                    self.overflow(out);
                }
            }
            Phase::Proving {
                watermark, replay, ..
            } => {
                let (watermark, replay) = (*watermark, *replay);
                if seq <= watermark.0 {
                    self.counters.duplicate_batches += 1;
                    out.push(Action::Duplicate { seq });
                } else if Some(seq) == watermark.0.checked_add(1) {
                    self.finish(BootstrapOutcome::Warm, HeldBatches::default(), out);
                    self.apply_in_order(seq, batch, out);
                } else {
                    let held = HeldBatches::from_sorted(vec![(seq, batch)]);
                    self.on_gap(watermark, held, replay, out);
                }
            }
            Phase::Live | Phase::Replaying { .. } => {}
        }
    }

    /// A new publisher while bootstrapping: whatever is held or grafted belongs to the old one.
    fn restart_while_bootstrapping(&mut self, seq: i64, batch: B, out: &mut Vec<Action<B>>) {
        self.phase = Phase::Live;
        self.counters.publisher_restarts += 1;
        out.push(Action::PublisherRestarted);
        out.push(Action::ClearRank);
        let outcome = if seq == 0 {
            BootstrapOutcome::FromOrigin
        } else {
            BootstrapOutcome::PublisherReset
        };
        self.history_complete = false;
        self.record_outcome(outcome, out);
        // As after a live restart: the new publisher counts from 0, so a first seq past it is a
        // gap the replay socket may still fill.
        self.cursor = Some(-1);
        self.cursor_ts = None;
        self.on_live_batch_while_live(seq, batch, out);
    }

    /// The engine's answer while healing the gap between the watermark and the first held batch.
    fn on_heal_answer(&mut self, answer: ReplayAnswer<B>, out: &mut Vec<Action<B>>) {
        let Phase::Healing {
            watermark, held, ..
        } = std::mem::replace(&mut self.phase, Phase::Live)
        else {
            return;
        };
        let (c, ts) = watermark;
        // Healing always holds the batch that revealed the gap.
        let first = held.first_seq().unwrap_or(c);
        let ReplayAnswer::Batches(batches) = answer else {
            return self.fall_back(held, first.saturating_sub(1), out);
        };
        let batches = sorted_distinct(batches);
        if batches.iter().any(|(s, b)| *s == c && b.ts() != ts) {
            return self.reset_after_graft(held, out);
        }
        let fill: Vec<(i64, B)> = batches
            .into_iter()
            .filter(|(s, _)| *s > c && *s < first)
            .collect();
        let missing = i128::from(first) - i128::from(c) - 1;
        let complete = fill.len() as i128 == missing
            && fill.iter().zip(c + 1..).all(|((s, _), want)| *s == want);
        if !complete {
            return self.fall_back(held, first.saturating_sub(1), out);
        }
        let held = HeldBatches {
            bytes: 0,
            batches: fill.into_iter().chain(held.batches).collect(),
        };
        self.finish(BootstrapOutcome::Warm, held, out);
    }

    /// The engine's answer to the replay from the watermark of a deferred proof.
    fn on_proof_answer(&mut self, answer: ReplayAnswer<B>, out: &mut Vec<Action<B>>) {
        let Phase::Proving {
            watermark,
            unanswered_probes,
            ..
        } = self.phase
        else {
            return;
        };
        let (c, ts) = watermark;
        let ReplayAnswer::Batches(batches) = answer else {
            // The engine could not speak; the siblings may.
            self.phase = Phase::Live;
            return self.start_proof_probe(watermark, unanswered_probes, out);
        };
        let batches = sorted_distinct(batches);
        let witness = batches.iter().find(|(s, _)| *s == c).map(|(_, b)| b.ts());
        let later: Vec<(i64, B)> = batches.into_iter().filter(|(s, _)| *s > c).collect();
        self.phase = Phase::Live;
        match witness {
            // Another batch at the watermark: the snapshot's cursor speaks of another publisher.
            Some(w) if w != ts => self.reset_after_graft(HeldBatches::default(), out),
            Some(_) => {
                let later = HeldBatches::from_sorted(later);
                match later.first_seq() {
                    Some(first) if first > c.saturating_add(1) => {
                        self.fall_back(later, first - 1, out);
                    }
                    _ => self.finish(BootstrapOutcome::Warm, later, out),
                }
            }
            // Nothing at or after the watermark in the engine's buffer: this publisher never
            // reached the snapshot's cursor, so the cursor describes an earlier incarnation.
            None if later.is_empty() => self.reset_after_graft(HeldBatches::default(), out),
            // The watermark's batch is gone from the buffer while later ones remain: whether any
            // was missed cannot be shown. The retry must reach the newest batch seen, so that its
            // own proof asks the engine about a batch still in the buffer.
            None => {
                let later = HeldBatches::from_sorted(later);
                let min_cursor = later.last_seq().unwrap_or(c);
                self.fall_back(later, min_cursor, out);
            }
        }
    }

    /// The engine's answer to the rebuild replay from seq 0.
    fn on_rebuild_answer(&mut self, answer: ReplayAnswer<B>, out: &mut Vec<Action<B>>) {
        let Phase::Rebuilding {
            held,
            fallback,
            over_graft,
            ..
        } = std::mem::replace(&mut self.phase, Phase::Live)
        else {
            return;
        };
        let ReplayAnswer::Batches(batches) = answer else {
            return self.finish(fallback, held, out);
        };
        let first_held = held.first_seq();
        let prefix: Vec<(i64, B)> = sorted_distinct(batches)
            .into_iter()
            .filter(|(s, _)| *s >= 0 && first_held.is_none_or(|f| *s < f))
            .collect();
        // From 0 with no hole, up to the first held batch: exactly the stream we missed. With
        // nothing held, an empty answer is an engine that has published nothing yet.
        let contiguous = prefix.iter().zip(0..).all(|((s, _), want)| *s == want);
        let reaches_held = first_held.is_none_or(|f| prefix.len() as i64 == f);
        if let Some(watermark_seq) = over_graft {
            // The replay replaces the graft only if it is the whole stream through everything
            // applied on the graft so far (its watermark, and the live batch that proved the
            // splice when one did); anything less leaves the proven graft, which is at least the
            // producer's view.
            let applied_through = self.cursor.unwrap_or(watermark_seq).max(watermark_seq);
            let reaches_applied = prefix.len() as i64 > applied_through;
            if !(contiguous && reaches_held && reaches_applied) {
                return self.finish(fallback, held, out);
            }
            out.push(Action::ClearRank);
            self.cursor = Some(-1);
            self.cursor_ts = None;
            self.graft_history = GraftHistory::Complete;
            let held = HeldBatches {
                bytes: 0,
                batches: prefix.into_iter().chain(held.batches).collect(),
            };
            return self.finish(BootstrapOutcome::FromEngineReplay, held, out);
        }
        // The engine is the witness: a replay from seq 0 holding nothing, with nothing held
        // live, is a publisher that has published nothing, so the rank holds nothing (`empty`,
        // whatever the siblings said). When the siblings named it empty, batches it cannot
        // rebuild from prove the rank is NOT empty, only unrecoverable, which is `abandoned`.
        let siblings_said_empty = fallback == BootstrapOutcome::Empty;
        let outcome = if prefix.is_empty() && first_held.is_none() {
            BootstrapOutcome::Empty
        } else if contiguous && reaches_held {
            BootstrapOutcome::FromEngineReplay
        } else if siblings_said_empty && !prefix.is_empty() {
            BootstrapOutcome::Abandoned
        } else {
            fallback
        };
        let held = HeldBatches {
            bytes: 0,
            batches: prefix.into_iter().chain(held.batches).collect(),
        };
        self.finish(outcome, held, out);
    }

    /// A gap between the watermark and the first held batch: heal it from the engine's replay (the
    /// proof's replay already in flight covers it), else fall back.
    fn on_gap(
        &mut self,
        watermark: Witness,
        held: HeldBatches<B>,
        replay_in_flight: Option<u64>,
        out: &mut Vec<Action<B>>,
    ) {
        if let Some(generation) = replay_in_flight {
            self.phase = Phase::Healing {
                generation,
                watermark,
                held,
            };
            return;
        }
        if !self.has_replay {
            let first = held.first_seq().unwrap_or(watermark.0);
            return self.fall_back(held, first.saturating_sub(1), out);
        }
        let generation = self.mint_generation();
        self.counters.replays_started += 1;
        // From the watermark itself, not the seq after it: the engine's batch there must carry the
        // cursor's ts, which proves the snapshot and the held batches speak of one publisher.
        out.push(Action::StartReplay {
            generation,
            from_seq: watermark.0,
            stop_before: held.first_seq(),
        });
        self.phase = Phase::Healing {
            generation,
            watermark,
            held,
        };
    }

    /// The graft cannot be proven: discard it, then either ask once for a fresher snapshot
    /// (holding on, batches kept, no cursor) or run cold (`gap`).
    fn fall_back(&mut self, held: HeldBatches<B>, min_cursor: i64, out: &mut Vec<Action<B>>) {
        out.push(Action::DiscardGraft);
        self.history_complete = false;
        self.cursor = None;
        self.cursor_ts = None;
        if self.retry_available {
            self.retry_available = false;
            out.push(Action::RequestFreshSnapshot { min_cursor });
            self.phase = Phase::Holding {
                held,
                min_cursor: Some(min_cursor),
            };
        } else {
            self.finish(BootstrapOutcome::Gap, held, out);
        }
    }

    /// The engine denied the snapshot's cursor: clear the rank, then recover the new publisher's
    /// stream as after a live restart (replay from its origin, held batches kept).
    fn reset_after_graft(&mut self, held: HeldBatches<B>, out: &mut Vec<Action<B>>) {
        self.phase = Phase::Live;
        self.counters.publisher_restarts += 1;
        out.push(Action::PublisherRestarted);
        out.push(Action::ClearRank);
        self.history_complete = false;
        self.record_outcome(BootstrapOutcome::PublisherReset, out);
        self.cursor = Some(-1);
        self.cursor_ts = None;
        let stop_before = held.first_seq();
        if self.has_replay {
            self.start_replay(stop_before, held.batches, out);
        } else {
            for (s, b) in held.batches {
                self.apply_in_order(s, b, out);
            }
        }
    }

    /// Releases a holding rank cold (`overflow`) because the model's ranks together hold too
    /// much (see [`BOOTSTRAP_HELD_BYTES_TOTAL_MAX`]). False, and nothing happens, when the rank
    /// holds nothing in a phase that holds.
    pub fn overflow_for_total(&mut self, out: &mut Vec<Action<B>>) -> bool {
        let holding = matches!(
            self.phase,
            Phase::Holding { .. } | Phase::Rebuilding { .. } | Phase::Healing { .. }
        );
        if !holding || self.held_bytes() == 0 {
            return false;
        }
        self.overflow(out);
        true
    }

    fn overflow(&mut self, out: &mut Vec<Action<B>>) {
        // Over a proven graft, the held batches follow its watermark: they apply on it as is.
        if let Phase::Rebuilding {
            fallback,
            over_graft: Some(_),
            ..
        } = self.phase
        {
            let held = self.take_held();
            return self.finish(fallback, held, out);
        }
        if matches!(self.phase, Phase::Healing { .. }) {
            out.push(Action::DiscardGraft);
            self.history_complete = false;
            self.cursor = None;
            self.cursor_ts = None;
        }
        let held = self.take_held();
        self.finish(BootstrapOutcome::Overflow, held, out);
    }

    /// Defers the proof of a graft with nothing held: the engine's replay from the watermark when
    /// there is a replay socket, else the siblings' cursors.
    fn start_proof(&mut self, watermark: Witness, unanswered: u32, out: &mut Vec<Action<B>>) {
        if !self.has_replay {
            return self.start_proof_probe(watermark, unanswered, out);
        }
        let generation = self.mint_generation();
        self.counters.replays_started += 1;
        out.push(Action::StartReplay {
            generation,
            from_seq: watermark.0,
            stop_before: None,
        });
        self.phase = Phase::Proving {
            watermark,
            replay: Some(generation),
            probe: None,
            unanswered_probes: unanswered,
        };
    }

    fn start_proof_probe(&mut self, watermark: Witness, unanswered: u32, out: &mut Vec<Action<B>>) {
        let generation = self.mint_generation();
        out.push(Action::ProbeSiblings {
            generation,
            watermark,
        });
        self.phase = Phase::Proving {
            watermark,
            replay: None,
            probe: Some(generation),
            unanswered_probes: unanswered,
        };
    }

    /// Ends the bootstrap: reports `outcome`, goes live and applies `held` through the cursor
    /// filter (cold when the cursor was reset, spliced when it is the watermark).
    fn finish(
        &mut self,
        outcome: BootstrapOutcome,
        held: HeldBatches<B>,
        out: &mut Vec<Action<B>>,
    ) {
        self.phase = Phase::Live;
        // A proven splice proves only what the grafted snapshot knew; the engine may know more.
        let partial_splice =
            outcome == BootstrapOutcome::Warm && self.graft_history == GraftHistory::Partial;
        if partial_splice
            && self.has_replay
            && let Some(watermark_seq) = self.cursor
        {
            return self.start_rebuild(
                held,
                BootstrapOutcome::WarmPartial,
                Some(watermark_seq),
                out,
            );
        }
        let outcome = if partial_splice {
            BootstrapOutcome::WarmPartial
        } else {
            outcome
        };
        self.record_outcome(outcome, out);
        // Outcomes that prove the index reaches back to the publisher's origin; a batch lost
        // while the held ones apply below takes that back. `warm_unwitnessed` and `warm_partial`
        // prove nothing of the kind.
        if matches!(
            outcome,
            BootstrapOutcome::Warm
                | BootstrapOutcome::FromOrigin
                | BootstrapOutcome::FromEngineReplay
                | BootstrapOutcome::Empty
        ) {
            self.history_complete = true;
        }
        for (s, b) in held.batches {
            self.apply_in_order(s, b, out);
        }
    }

    fn record_outcome(&mut self, outcome: BootstrapOutcome, out: &mut Vec<Action<B>>) {
        self.outcome = Some(outcome);
        out.push(Action::BootstrapFinished { outcome });
    }

    fn take_held(&mut self) -> HeldBatches<B> {
        match std::mem::replace(&mut self.phase, Phase::Live) {
            Phase::Holding { held, .. }
            | Phase::Rebuilding { held, .. }
            | Phase::Healing { held, .. } => held,
            _ => HeldBatches::default(),
        }
    }

    fn mint_generation(&mut self) -> u64 {
        let generation = self.next_generation;
        self.next_generation += 1;
        generation
    }
}

/// A replay answer sorted by seq with repeats dropped (engines send in order; this is cheap
/// insurance for the apply-once invariant).
fn sorted_distinct<B>(mut batches: Vec<(i64, B)>) -> Vec<(i64, B)> {
    batches.sort_by_key(|(s, _)| *s);
    batches.dedup_by_key(|(s, _)| *s);
    batches
}

#[cfg(test)]
mod bootstrap_tests;

#[cfg(test)]
mod tests {
    use super::*;

    type M = RankMachine<&'static str>;

    /// Test batches are named; the name stands in for the publish time, so two batches with the
    /// same seq but different names come from different publishers.
    impl Stamped for &'static str {
        fn ts(&self) -> f64 {
            self.bytes().fold(0u64, |h, b| h * 31 + u64::from(b)) as f64
        }
    }

    fn live(m: &mut M, seq: i64, b: &'static str) -> Vec<Action<&'static str>> {
        let mut out = Vec::new();
        m.on_live_batch(seq, b, &mut out);
        out
    }

    fn apply(seq: i64, batch: &'static str) -> Action<&'static str> {
        Action::Apply { seq, batch }
    }

    /// A machine that joined its stream at `seq`, past the origin, with that batch applied at
    /// once: what a first live batch beyond [`ORIGIN_REPLAY_FIRST_SEQ_MAX`] does. The tables use
    /// small seqs for readability, so they start here instead of through `on_live_batch`.
    fn joined_mid_stream(has_replay: bool, seq: i64, b: &'static str) -> M {
        let mut m = M::new(has_replay);
        let mut out = Vec::new();
        m.last_live_seq = Some(seq);
        m.apply_in_order(seq, b, &mut out);
        assert_eq!(out, vec![apply(seq, b)]);
        m
    }

    fn replaying_generation(m: &M) -> u64 {
        match m.phase() {
            Phase::Replaying { generation, .. } => *generation,
            other => panic!("expected Replaying, machine is {other:?}"),
        }
    }

    #[test]
    fn first_batch_ever_is_applied_whatever_its_seq() {
        let mut m = M::new(true);
        assert_eq!(live(&mut m, 41, "a"), vec![apply(41, "a")]);
        assert_eq!(m.cursor(), Some(41));
    }

    #[test]
    fn first_batch_near_the_origin_replays_from_seq_zero_before_applying_it() {
        let mut m = M::new(true);
        assert_eq!(
            live(&mut m, 3, "d"),
            vec![Action::StartReplay {
                generation: 0,
                from_seq: 0,
                stop_before: Some(3)
            }]
        );
        assert_eq!(m.cursor(), None, "nothing applied while the replay runs");
        let mut out = Vec::new();
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(0, "a"), (1, "b"), (2, "c")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                apply(0, "a"),
                apply(1, "b"),
                apply(2, "c"),
                apply(3, "d"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Repaired
                }
            ]
        );
        assert!(m.history_complete());
    }

    #[test]
    fn first_batch_one_past_the_origin_window_applies_at_once_with_unknown_history() {
        let mut m = M::new(true);
        let seq = ORIGIN_REPLAY_FIRST_SEQ_MAX + 1;
        assert_eq!(live(&mut m, seq, "a"), vec![apply(seq, "a")]);
        assert!(!m.history_complete());
        let mut m = M::new(true);
        let seq = ORIGIN_REPLAY_FIRST_SEQ_MAX;
        assert!(matches!(
            live(&mut m, seq, "a")[..],
            [Action::StartReplay { .. }]
        ));
    }

    #[test]
    fn first_batch_near_the_origin_without_a_replay_socket_applies_at_once() {
        let mut m = M::new(false);
        assert_eq!(live(&mut m, 3, "d"), vec![apply(3, "d")]);
        assert!(!m.history_complete());
    }

    #[test]
    fn failed_origin_replay_applies_the_first_batch_with_unknown_history() {
        let mut m = M::new(true);
        live(&mut m, 2, "c");
        let mut out = Vec::new();
        m.on_replay_answer(0, ReplayAnswer::Failed, &mut out);
        assert_eq!(
            out,
            vec![
                apply(2, "c"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Failed
                }
            ]
        );
        assert!(!m.history_complete());
    }

    #[test]
    fn a_rank_counts_the_whole_cache_until_its_stream_shows_a_history_it_missed() {
        let mut m = M::new(false);
        assert!(
            m.counts_whole_cache(),
            "nothing published since registration"
        );
        live(&mut m, 0, "a");
        assert!(m.counts_whole_cache(), "applied from seq 0");
        live(&mut m, 2, "c");
        assert!(!m.counts_whole_cache(), "batch 1 lost");
        let mut m = M::new(false);
        live(&mut m, 4, "e");
        assert!(!m.counts_whole_cache(), "first heard at seq 4");
        let mut m = M::new(true);
        live(&mut m, 2, "c");
        assert!(
            !m.counts_whole_cache(),
            "replaying back to the origin: not yet"
        );
        let m = M::new_bootstrapping(true);
        assert!(
            !m.counts_whole_cache(),
            "a bootstrapping rank waits for its graft's proof"
        );
    }

    #[test]
    fn a_stream_applied_from_seq_zero_is_complete_until_a_batch_is_lost() {
        let mut m = M::new(false);
        live(&mut m, 0, "a");
        live(&mut m, 1, "b");
        assert!(m.history_complete());
        live(&mut m, 3, "d");
        assert_eq!(m.counters().lost_batches, 1);
        assert!(!m.history_complete());
    }

    #[test]
    fn a_restart_is_complete_again_once_the_new_batch_zero_applies() {
        let mut m = M::new(false);
        live(&mut m, 0, "a");
        live(&mut m, 1, "b");
        live(&mut m, 0, "x");
        assert_eq!(m.counters().publisher_restarts, 1);
        assert!(
            m.history_complete(),
            "the new publisher was seen from its origin"
        );
        // A restart caught past the new origin, without replay, misses the first batches.
        let mut m = M::new(false);
        for (seq, b) in [(0, "a"), (1, "b"), (2, "c")] {
            live(&mut m, seq, b);
        }
        live(&mut m, 1, "y");
        assert_eq!(m.counters().publisher_restarts, 1);
        assert!(!m.history_complete());
    }

    #[test]
    fn consecutive_batches_are_applied_and_advance_the_cursor() {
        let mut m = M::new(true);
        live(&mut m, 0, "a");
        assert_eq!(live(&mut m, 1, "b"), vec![apply(1, "b")]);
        assert_eq!(m.cursor(), Some(1));
        assert_eq!(m.counters().applied_batches, 2);
    }

    #[test]
    fn batch_at_or_below_the_cursor_is_a_counted_duplicate() {
        let mut m = joined_mid_stream(true, 5, "a");
        live(&mut m, 6, "b");
        // A re-delivery equal to the cursor, with the live stream not going backwards.
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        let g = replaying_generation(&m);
        m.on_replay_answer(g, ReplayAnswer::Batches(vec![(7, "c"), (8, "d")]), &mut out);
        assert_eq!(m.cursor(), Some(8));
        assert_eq!(live(&mut m, 7, "c"), vec![Action::Duplicate { seq: 7 }]);
        assert_eq!(live(&mut m, 8, "d"), vec![Action::Duplicate { seq: 8 }]);
        assert_eq!(m.counters().duplicate_batches, 2);
        assert_eq!(m.cursor(), Some(8));
    }

    #[test]
    fn seq_zero_after_a_cursor_past_zero_is_a_restart_that_clears_then_applies() {
        let mut m = joined_mid_stream(true, 9, "a");
        let out = live(&mut m, 0, "new");
        assert_eq!(
            out,
            vec![
                Action::PublisherRestarted,
                Action::ClearRank,
                apply(0, "new")
            ]
        );
        assert_eq!(m.cursor(), Some(0));
        assert_eq!(m.counters().publisher_restarts, 1);
    }

    #[test]
    fn a_different_batch_at_the_cursor_seq_is_a_restart_even_at_seq_zero() {
        let mut m = M::new(true);
        live(&mut m, 0, "a");
        assert_eq!(
            live(&mut m, 0, "other"),
            vec![
                Action::PublisherRestarted,
                Action::ClearRank,
                apply(0, "other")
            ]
        );
        // The very same batch again is only a duplicate.
        assert_eq!(live(&mut m, 0, "other"), vec![Action::Duplicate { seq: 0 }]);
    }

    #[test]
    fn live_stream_going_backwards_is_a_restart_and_replays_the_new_origin() {
        let mut m = M::new(true);
        live(&mut m, 500, "a");
        // The new publisher's batch 0 and 1 were lost to the slow joiner.
        let out = live(&mut m, 2, "n2");
        assert_eq!(
            out,
            vec![
                Action::PublisherRestarted,
                Action::ClearRank,
                Action::StartReplay {
                    generation: 0,
                    from_seq: 0,
                    stop_before: Some(2)
                }
            ]
        );
        let mut out = Vec::new();
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(0, "n0"), (1, "n1"), (2, "n2")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                apply(0, "n0"),
                apply(1, "n1"),
                apply(2, "n2"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Repaired
                }
            ]
        );
    }

    #[test]
    fn restart_without_replay_counts_the_new_streams_missed_batches_lost() {
        let mut m = M::new(false);
        live(&mut m, 100, "a");
        let out = live(&mut m, 3, "n3");
        assert_eq!(
            out,
            vec![
                Action::PublisherRestarted,
                Action::ClearRank,
                Action::Lost { batches: 3 },
                apply(3, "n3")
            ]
        );
    }

    #[test]
    fn batch_at_cursor_plus_two_starts_a_replay_and_holds_live_batches() {
        let mut m = joined_mid_stream(true, 3, "a");
        let out = live(&mut m, 5, "c");
        // From the cursor itself: the engine's batch 3 is the witness that it is the same publisher.
        assert_eq!(
            out,
            vec![Action::StartReplay {
                generation: 0,
                from_seq: 3,
                stop_before: Some(5)
            }]
        );
        assert_eq!(live(&mut m, 6, "d"), vec![]);
        assert_eq!(m.held_len(), 2);
        assert_eq!(m.cursor(), Some(3), "nothing applied while replaying");
    }

    #[test]
    fn replay_answer_fills_the_gap_then_applies_held_batches_once_in_order() {
        let mut m = joined_mid_stream(true, 3, "a");
        live(&mut m, 5, "c");
        live(&mut m, 6, "d");
        let mut out = Vec::new();
        // The engine also returns 5 and 6, which are held: each must be applied exactly once.
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(4, "b"), (5, "c"), (6, "d")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                apply(4, "b"),
                apply(5, "c"),
                apply(6, "d"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Repaired
                }
            ]
        );
        assert_eq!(m.cursor(), Some(6));
        assert!(matches!(m.phase(), Phase::Live));
        assert_eq!(m.counters().lost_batches, 0);
    }

    #[test]
    fn replay_missing_part_of_the_gap_is_incomplete_and_counts_the_rest_lost() {
        let mut m = joined_mid_stream(true, 3, "a");
        live(&mut m, 8, "h");
        let mut out = Vec::new();
        // Buffer no longer has 4 and 5.
        m.on_replay_answer(0, ReplayAnswer::Batches(vec![(6, "f"), (7, "g")]), &mut out);
        assert_eq!(
            out,
            vec![
                Action::Lost { batches: 2 },
                apply(6, "f"),
                apply(7, "g"),
                apply(8, "h"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Incomplete
                }
            ]
        );
        assert_eq!(m.counters().lost_batches, 2);
    }

    #[test]
    fn failed_replay_counts_the_gap_lost_and_continues_from_the_live_stream() {
        let mut m = joined_mid_stream(true, 3, "a");
        live(&mut m, 6, "d");
        live(&mut m, 7, "e");
        let mut out = Vec::new();
        m.on_replay_answer(0, ReplayAnswer::Failed, &mut out);
        assert_eq!(
            out,
            vec![
                Action::Lost { batches: 2 },
                apply(6, "d"),
                apply(7, "e"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Failed
                }
            ]
        );
    }

    #[test]
    fn gap_without_a_replay_endpoint_counts_lost_and_applies() {
        let mut m = joined_mid_stream(false, 3, "a");
        assert_eq!(
            live(&mut m, 7, "e"),
            vec![Action::Lost { batches: 3 }, apply(7, "e")]
        );
        assert_eq!(m.counters().lost_batches, 3);
    }

    #[test]
    fn stale_replay_answer_is_ignored() {
        let mut m = joined_mid_stream(true, 3, "a");
        live(&mut m, 5, "c");
        let mut out = Vec::new();
        m.on_replay_answer(7, ReplayAnswer::Batches(vec![(4, "b")]), &mut out);
        assert!(out.is_empty());
        assert_eq!(m.held_len(), 1);
    }

    #[test]
    fn overflowing_the_hold_abandons_the_replay_and_applies_held_in_order() {
        let mut m = M::new(true);
        live(&mut m, 0, "a");
        live(&mut m, 2, "x");
        for seq in 3..(2 + HELD_BATCHES_MAX as i64) {
            assert_eq!(live(&mut m, seq, "x"), vec![]);
        }
        assert_eq!(m.held_len(), HELD_BATCHES_MAX);
        let overflow_seq = 2 + HELD_BATCHES_MAX as i64;
        let out = live(&mut m, overflow_seq, "last");
        assert_eq!(
            out[0],
            Action::ReplayFinished {
                outcome: ReplayOutcome::Failed
            }
        );
        assert_eq!(out[1], Action::Lost { batches: 1 });
        let applied: Vec<i64> = out
            .iter()
            .filter_map(|a| match a {
                Action::Apply { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect();
        let expected: Vec<i64> = (2..=overflow_seq).collect();
        assert_eq!(applied, expected);
        assert!(matches!(m.phase(), Phase::Live));
        // The late answer of the abandoned replay must not apply anything.
        let mut late = Vec::new();
        m.on_replay_answer(0, ReplayAnswer::Batches(vec![(1, "b")]), &mut late);
        assert!(late.is_empty());
    }

    #[test]
    fn restart_while_replaying_drops_held_batches_and_the_old_replay() {
        let mut m = joined_mid_stream(true, 10, "a");
        live(&mut m, 12, "c");
        let out = live(&mut m, 0, "n0");
        assert_eq!(
            out,
            vec![
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Failed
                },
                Action::PublisherRestarted,
                Action::ClearRank,
                apply(0, "n0")
            ]
        );
        let mut late = Vec::new();
        m.on_replay_answer(0, ReplayAnswer::Batches(vec![(11, "b")]), &mut late);
        assert!(late.is_empty(), "old replay answer applied: {late:?}");
        assert_eq!(m.cursor(), Some(0));
    }

    #[test]
    fn duplicate_live_batch_while_replaying_is_not_held_twice() {
        let mut m = joined_mid_stream(true, 1, "a");
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        assert_eq!(live(&mut m, 1, "a"), vec![Action::Duplicate { seq: 1 }]);
        assert_eq!(m.held_len(), 0);
    }

    #[test]
    fn reconnect_with_a_cursor_replays_from_the_cursor_to_verify_it() {
        let mut m = joined_mid_stream(true, 4, "a");
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        assert_eq!(
            out,
            vec![Action::StartReplay {
                generation: 0,
                from_seq: 4,
                stop_before: None
            }]
        );
        // Live batches that arrive meanwhile are held; the replay brings the one the SUB missed.
        assert_eq!(live(&mut m, 6, "c"), vec![]);
        let mut out = Vec::new();
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(4, "a"), (5, "b"), (6, "c")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                apply(5, "b"),
                apply(6, "c"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Repaired
                }
            ]
        );
    }

    #[test]
    fn reconnect_without_cursor_or_replay_endpoint_does_nothing() {
        let mut fresh = M::new(true);
        let mut out = Vec::new();
        fresh.on_reconnect(&mut out);
        assert!(out.is_empty());
        let mut no_replay = M::new(false);
        live(&mut no_replay, 1, "a");
        no_replay.on_reconnect(&mut out);
        assert!(out.is_empty());
        assert!(matches!(no_replay.phase(), Phase::Live));
    }

    #[test]
    fn reconnect_while_already_replaying_starts_no_second_replay() {
        let mut m = joined_mid_stream(true, 1, "a");
        live(&mut m, 3, "c");
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        assert!(out.is_empty());
        assert_eq!(m.counters().replays_started, 1);
    }

    #[test]
    fn replayed_batches_never_reapply_below_the_cursor() {
        let mut m = joined_mid_stream(true, 4, "a");
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        out.clear();
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(2, "old"), (3, "old"), (5, "b")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                Action::Duplicate { seq: 2 },
                Action::Duplicate { seq: 3 },
                apply(5, "b"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Repaired
                }
            ]
        );
    }

    #[test]
    fn replay_witness_at_the_cursor_is_neither_applied_nor_a_duplicate() {
        let mut m = joined_mid_stream(true, 3, "a");
        live(&mut m, 5, "c");
        let mut out = Vec::new();
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(3, "a"), (4, "b"), (5, "c")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                apply(4, "b"),
                apply(5, "c"),
                Action::ReplayFinished {
                    outcome: ReplayOutcome::Repaired
                }
            ]
        );
        assert_eq!(m.counters().duplicate_batches, 0);
    }

    #[test]
    fn replay_whose_cursor_batch_differs_is_a_restart_and_replays_from_origin() {
        let mut m = joined_mid_stream(true, 3, "old3");
        let mut out = Vec::new();
        m.on_reconnect(&mut out);
        // A new publisher has already counted past 3 while the SUB was away.
        assert_eq!(live(&mut m, 6, "new6"), vec![]);
        let mut out = Vec::new();
        m.on_replay_answer(
            0,
            ReplayAnswer::Batches(vec![(3, "new3"), (4, "new4"), (5, "new5")]),
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                Action::PublisherRestarted,
                Action::ClearRank,
                Action::StartReplay {
                    generation: 1,
                    from_seq: 0,
                    stop_before: Some(6)
                }
            ]
        );
        assert_eq!(m.held_len(), 1, "the new publisher's live batch stays held");
        let mut out = Vec::new();
        let fresh: Vec<(i64, &'static str)> = vec![
            (0, "n0"),
            (1, "n1"),
            (2, "n2"),
            (3, "new3"),
            (4, "new4"),
            (5, "new5"),
        ];
        m.on_replay_answer(1, ReplayAnswer::Batches(fresh), &mut out);
        let applied: Vec<i64> = out
            .iter()
            .filter_map(|a| match a {
                Action::Apply { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect();
        assert_eq!(applied, vec![0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(m.counters().publisher_restarts, 1);
        assert_eq!(m.counters().lost_batches, 0);
    }
}

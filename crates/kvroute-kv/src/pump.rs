//! The pump: the one task per model that owns the model's `IndexWriter`.
//!
//! Subscriber, load and replay tasks never touch the index; they send [`PumpMsg`]s through one
//! bounded channel (`PUMP_CHANNEL_CAPACITY`), which gives the index a single writer without
//! locks and gives every rank a total order of its inputs. A full channel back-pressures the
//! subscribers (the engine's PUB then drops for us, which the sequence numbers reveal as a gap)
//! rather than growing memory.
//!
//! Per-rank ordering decisions are delegated to the pure [`RankMachine`]; this module only routes
//! messages to the right rank (dropping those of removed ranks or old incarnations), executes the
//! machine's actions against the index, starts replay tasks, and mirrors state into metrics and
//! the status table. Registration and removal also go through the channel with an acknowledgement,
//! which is how `remove_worker` knows the ranks are gone from the index before it returns.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_index::{IndexWriter, RankId};
use kvroute_wire::snapshot::RankRef;
use kvroute_wire::{EventBatch, KvEvent, LoadStat};
use parking_lot::RwLock;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::metrics::{KvMetrics, TIER_LABELS};
use crate::rank_state::{Action, Phase, RankMachine, ReplayAnswer};
use crate::status::{RankKey, StatusTable};
use crate::transport::KvSource;

/// Messages queued to one model's pump before senders wait.
pub const PUMP_CHANNEL_CAPACITY: usize = 4096;

pub enum PumpMsg {
    Batch {
        key: RankKey,
        incarnation: u64,
        seq: i64,
        batch: EventBatch,
    },
    /// The rank's SUB (re)connected.
    Reconnected { key: RankKey, incarnation: u64 },
    ReplayResult {
        key: RankKey,
        incarnation: u64,
        generation: u64,
        answer: ReplayAnswer<EventBatch>,
    },
    AddRank {
        key: RankKey,
        incarnation: u64,
        replay_endpoint: Option<String>,
        done: oneshot::Sender<()>,
    },
    /// Removes every rank of `url` from the index, then acknowledges.
    RemoveRanks {
        url: Arc<str>,
        done: oneshot::Sender<()>,
    },
    Load {
        key: RankKey,
        incarnation: u64,
        stat: LoadStat,
    },
}

struct PumpRank {
    incarnation: u64,
    rank_id: RankId,
    machine: RankMachine<EventBatch>,
    replay_endpoint: Option<String>,
}

pub(crate) struct Pump<S: KvSource> {
    pub writer: IndexWriter,
    pub source: Arc<S>,
    pub tx: mpsc::Sender<PumpMsg>,
    pub metrics: KvMetrics,
    pub status: Arc<StatusTable>,
    pub loads: Arc<RwLock<HashMap<RankKey, LoadStat>>>,
    pub cancel: CancellationToken,
    ranks: HashMap<RankKey, PumpRank>,
    actions: Vec<Action<EventBatch>>,
}

impl<S: KvSource> Pump<S> {
    pub fn new(
        writer: IndexWriter,
        source: Arc<S>,
        tx: mpsc::Sender<PumpMsg>,
        metrics: KvMetrics,
        status: Arc<StatusTable>,
        loads: Arc<RwLock<HashMap<RankKey, LoadStat>>>,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            writer,
            source,
            tx,
            metrics,
            status,
            loads,
            cancel,
            ranks: HashMap::new(),
            actions: Vec::new(),
        }
    }

    pub async fn run(mut self, mut rx: mpsc::Receiver<PumpMsg>) {
        loop {
            let msg = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => break,
                msg = rx.recv() => msg,
            };
            match msg {
                Some(msg) => self.handle(msg),
                None => break,
            }
        }
    }

    fn handle(&mut self, msg: PumpMsg) {
        match msg {
            PumpMsg::Batch {
                key,
                incarnation,
                seq,
                batch,
            } => {
                let Some(rank) = current(&mut self.ranks, &key, incarnation) else {
                    return;
                };
                rank.machine.on_live_batch(seq, batch, &mut self.actions);
                self.execute(&key);
            }
            PumpMsg::Reconnected { key, incarnation } => {
                let Some(rank) = current(&mut self.ranks, &key, incarnation) else {
                    return;
                };
                rank.machine.on_reconnect(&mut self.actions);
                self.execute(&key);
            }
            PumpMsg::ReplayResult {
                key,
                incarnation,
                generation,
                answer,
            } => {
                let Some(rank) = current(&mut self.ranks, &key, incarnation) else {
                    return;
                };
                rank.machine
                    .on_replay_answer(generation, answer, &mut self.actions);
                self.execute(&key);
            }
            PumpMsg::AddRank {
                key,
                incarnation,
                replay_endpoint,
                done,
            } => {
                if let Some(old) = self.ranks.remove(&key) {
                    self.writer.remove_rank(old.rank_id);
                }
                let rank_id = self.writer.add_rank(RankRef {
                    worker_url: key.url.to_string(),
                    dp_rank: key.dp_rank,
                });
                self.ranks.insert(
                    key,
                    PumpRank {
                        incarnation,
                        rank_id,
                        machine: RankMachine::new(replay_endpoint.is_some()),
                        replay_endpoint,
                    },
                );
                let _ = done.send(());
            }
            PumpMsg::RemoveRanks { url, done } => {
                let keys: Vec<RankKey> = self
                    .ranks
                    .keys()
                    .filter(|k| k.url == url)
                    .cloned()
                    .collect();
                for key in keys {
                    if let Some(rank) = self.ranks.remove(&key) {
                        self.writer.remove_rank(rank.rank_id);
                    }
                    self.loads.write().remove(&key);
                }
                let _ = done.send(());
            }
            PumpMsg::Load {
                key,
                incarnation,
                stat,
            } => {
                if current(&mut self.ranks, &key, incarnation).is_some() {
                    self.loads.write().insert(key, stat);
                }
            }
        }
    }

    fn execute(&mut self, key: &RankKey) {
        let Some(rank) = self.ranks.get_mut(key) else {
            self.actions.clear();
            return;
        };
        for action in self.actions.drain(..) {
            match action {
                Action::Apply { seq, batch } => {
                    for ev in &batch.events {
                        let kind = match ev {
                            KvEvent::BlockStored(_) => "block_stored",
                            KvEvent::BlockRemoved(_) => "block_removed",
                            KvEvent::AllBlocksCleared => "all_blocks_cleared",
                        };
                        self.metrics.events_applied.with_label_values(&[kind]).inc();
                    }
                    self.writer.apply_batch(rank.rank_id, seq, &batch);
                    self.metrics.batches_applied.inc();
                }
                Action::ClearRank => {
                    self.writer.clear_rank(rank.rank_id);
                    // The old cursor speaks of the dead publisher; an exporter must not pair it
                    // with the new stream.
                    self.writer.set_cursor(rank.rank_id, None);
                }
                Action::StartReplay {
                    generation,
                    from_seq,
                    stop_before,
                } => match &rank.replay_endpoint {
                    Some(endpoint) => spawn_replay(
                        self.source.clone(),
                        endpoint.clone(),
                        key.clone(),
                        rank.incarnation,
                        generation,
                        from_seq,
                        stop_before,
                        self.tx.clone(),
                        self.metrics.clone(),
                        self.cancel.clone(),
                    ),
                    None => {
                        // The machine only replays when told an endpoint exists.
                        tracing::error!(worker = %key.url, dp_rank = key.dp_rank,
                            "replay requested for a rank without replay endpoint");
                    }
                },
                Action::Duplicate { .. } => self.metrics.duplicate_batches.inc(),
                Action::Lost { batches } => {
                    self.metrics.lost_batches.inc_by(batches);
                    tracing::debug!(worker = %key.url, dp_rank = key.dp_rank, batches,
                        "KV event batches lost");
                }
                Action::PublisherRestarted => {
                    self.metrics.publisher_restarts.inc();
                    tracing::info!(worker = %key.url, dp_rank = key.dp_rank,
                        "engine publisher restarted; rank cleared");
                }
                Action::ReplayFinished { outcome } => {
                    self.metrics
                        .replays
                        .with_label_values(&[outcome.label()])
                        .inc();
                }
                // Only bootstrapping ranks emit these, and this pump registers none yet.
                Action::Graft { .. }
                | Action::DiscardGraft
                | Action::ProbeSiblings { .. }
                | Action::RequestFreshSnapshot { .. }
                | Action::BootstrapFinished { .. } => {
                    tracing::error!(worker = %key.url, dp_rank = key.dp_rank,
                        "bootstrap action for a rank this pump did not register as bootstrapping");
                }
            }
        }
        let replaying = matches!(rank.machine.phase(), Phase::Replaying { .. });
        self.status.update_from_pump(
            key,
            rank.incarnation,
            rank.machine.cursor(),
            rank.machine.counters(),
            replaying,
            &self.metrics,
        );
        if let Some(stats) = self.writer.reader().rank_stats(rank.rank_id) {
            let dp = key.dp_rank.to_string();
            for (tier, blocks) in TIER_LABELS.iter().zip(stats.tier_blocks) {
                self.metrics
                    .carried_blocks
                    .with_label_values(&[&*key.url, dp.as_str(), tier])
                    .set(blocks as i64);
            }
        }
    }
}

/// The rank if it is registered under this incarnation; anything else is a late message of a
/// removed or replaced registration and must not touch the index.
fn current<'a>(
    ranks: &'a mut HashMap<RankKey, PumpRank>,
    key: &RankKey,
    incarnation: u64,
) -> Option<&'a mut PumpRank> {
    ranks.get_mut(key).filter(|r| r.incarnation == incarnation)
}

#[allow(clippy::too_many_arguments)]
fn spawn_replay<S: KvSource>(
    source: Arc<S>,
    endpoint: String,
    key: RankKey,
    incarnation: u64,
    generation: u64,
    from_seq: i64,
    stop_before: Option<i64>,
    tx: mpsc::Sender<PumpMsg>,
    metrics: KvMetrics,
    cancel: CancellationToken,
) {
    tokio::spawn(async move {
        let fetched = tokio::select! {
            _ = cancel.cancelled() => return,
            r = source.replay(&endpoint, from_seq, stop_before) => r,
        };
        let answer = match fetched {
            Ok(raw) => {
                let mut batches = Vec::with_capacity(raw.len());
                for (seq, payload) in raw {
                    match kvroute_wire::decode_batch(&payload) {
                        Ok(batch) => batches.push((seq, batch)),
                        // Left out: the machine counts it lost when it passes over the hole.
                        Err(e) => {
                            metrics.decode_errors.inc();
                            tracing::debug!(%endpoint, seq, error = %e, "replayed batch undecodable");
                        }
                    }
                }
                ReplayAnswer::Batches(batches)
            }
            Err(e) => {
                tracing::info!(%endpoint, from_seq, error = %e, "replay failed");
                ReplayAnswer::Failed
            }
        };
        let msg = PumpMsg::ReplayResult {
            key,
            incarnation,
            generation,
            answer,
        };
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = tx.send(msg) => {}
        }
    });
}

#[cfg(test)]
mod tests {
    //! The pump's routing rules (incarnations, removal, load) on a real index, with a transport
    //! that never delivers (these tests feed the channel directly, as subscriber tasks would).
    use super::*;
    use crate::transport::{KvSubscription, SourceEvent, TransportError};
    use bytes::Bytes;
    use kvroute_index::{IndexConfig, IndexReader, PrefixIndex};
    use kvroute_wire::{BlockStored, EngineHash};

    struct SilentSub;
    impl KvSubscription for SilentSub {
        async fn next_event(&mut self) -> SourceEvent {
            std::future::pending().await
        }
    }

    struct NoEngine;
    impl KvSource for NoEngine {
        type Subscription = SilentSub;
        async fn subscribe(&self, _: &str, _: &str) -> SilentSub {
            std::future::pending().await
        }
        async fn replay(
            &self,
            _: &str,
            _: i64,
            _: Option<i64>,
        ) -> Result<Vec<(i64, Bytes)>, TransportError> {
            Err(TransportError::ReplayTimeout { timeout_ms: 0 })
        }
    }

    struct Harness {
        tx: mpsc::Sender<PumpMsg>,
        reader: IndexReader,
        loads: Arc<RwLock<HashMap<RankKey, LoadStat>>>,
        status: Arc<StatusTable>,
        cancel: CancellationToken,
    }

    fn harness() -> Harness {
        let (writer, reader) = PrefixIndex::new(IndexConfig::new(4));
        let (tx, rx) = mpsc::channel(PUMP_CHANNEL_CAPACITY);
        let metrics = KvMetrics::register(&prometheus::Registry::new()).unwrap();
        let loads = Arc::new(RwLock::new(HashMap::new()));
        let cancel = CancellationToken::new();
        let status = Arc::new(StatusTable::default());
        let pump = Pump::new(
            writer,
            Arc::new(NoEngine),
            tx.clone(),
            metrics,
            status.clone(),
            loads.clone(),
            cancel.clone(),
        );
        tokio::spawn(pump.run(rx));
        Harness {
            tx,
            reader,
            loads,
            status,
            cancel,
        }
    }

    fn key(url: &str) -> RankKey {
        RankKey {
            url: Arc::from(url),
            dp_rank: 0,
        }
    }

    fn one_block_batch(engine_hash: u64) -> EventBatch {
        EventBatch {
            ts: 1.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![EngineHash(engine_hash)],
                parent_block_hash: None,
                // Distinct content per engine hash, so distinct batches store distinct blocks.
                token_ids: vec![engine_hash as u32; 4],
                block_size: 4,
                lora_id: None,
                lora_name: None,
                medium: None,
                extra_keys: vec![],
                group_idx: None,
            })],
            dp_rank: None,
        }
    }

    impl Harness {
        async fn add(&self, key: RankKey, incarnation: u64) {
            let (done, rx) = oneshot::channel();
            let msg = PumpMsg::AddRank {
                key,
                incarnation,
                replay_endpoint: None,
                done,
            };
            self.tx.send(msg).await.unwrap();
            rx.await.unwrap();
        }

        async fn remove(&self, url: &str) {
            let (done, rx) = oneshot::channel();
            let msg = PumpMsg::RemoveRanks {
                url: Arc::from(url),
                done,
            };
            self.tx.send(msg).await.unwrap();
            rx.await.unwrap();
        }

        /// Everything sent before has been handled once this returns (the channel is FIFO).
        async fn barrier(&self) {
            self.remove("http://barrier").await;
        }

        async fn batch(&self, key: RankKey, incarnation: u64, seq: i64, hash: u64) {
            let msg = PumpMsg::Batch {
                key,
                incarnation,
                seq,
                batch: one_block_batch(hash),
            };
            self.tx.send(msg).await.unwrap();
        }
    }

    #[tokio::test]
    async fn batches_of_a_stale_incarnation_never_reach_the_index() {
        let h = harness();
        h.add(key("http://w"), 2).await;
        h.batch(key("http://w"), 1, 0, 11).await;
        h.barrier().await;
        assert_eq!(h.reader.total_carried(), 0, "old incarnation applied");
        h.batch(key("http://w"), 2, 0, 11).await;
        h.barrier().await;
        assert_eq!(h.reader.total_carried(), 1);
        h.cancel.cancel();
    }

    #[tokio::test]
    async fn batches_of_a_removed_rank_are_dropped_and_removal_is_acknowledged_after_it() {
        let h = harness();
        h.add(key("http://w"), 1).await;
        h.batch(key("http://w"), 1, 0, 11).await;
        h.barrier().await;
        assert_eq!(h.reader.total_carried(), 1);
        h.remove("http://w").await;
        assert!(h.reader.ranks().is_empty());
        assert_eq!(h.reader.total_carried(), 0);
        h.batch(key("http://w"), 1, 1, 12).await;
        h.barrier().await;
        assert!(h.reader.ranks().is_empty());
        assert_eq!(h.reader.total_carried(), 0);
        h.cancel.cancel();
    }

    #[tokio::test]
    async fn load_is_kept_only_for_registered_ranks_and_dropped_on_removal() {
        let h = harness();
        let stat = LoadStat {
            num_running_reqs: 3,
            ..LoadStat::default()
        };
        let load = |url: &str, incarnation| PumpMsg::Load {
            key: key(url),
            incarnation,
            stat,
        };
        h.tx.send(load("http://unknown", 1)).await.unwrap();
        h.add(key("http://w"), 1).await;
        h.tx.send(load("http://w", 1)).await.unwrap();
        h.barrier().await;
        assert_eq!(h.loads.read().get(&key("http://w")), Some(&stat));
        assert_eq!(h.loads.read().get(&key("http://unknown")), None);
        h.remove("http://w").await;
        assert!(h.loads.read().is_empty());
        h.cancel.cancel();
    }

    #[tokio::test]
    async fn a_failed_replay_counts_the_gap_and_applies_what_was_held() {
        let h = harness();
        h.status.insert(key("http://w"), "m", 1);
        let (done, rx) = oneshot::channel();
        h.tx.send(PumpMsg::AddRank {
            key: key("http://w"),
            incarnation: 1,
            replay_endpoint: Some("tcp://127.0.0.1:9".into()),
            done,
        })
        .await
        .unwrap();
        rx.await.unwrap();
        h.batch(key("http://w"), 1, 0, 11).await;
        h.batch(key("http://w"), 1, 3, 12).await;
        // The replay task answers Failed through the channel; wait for its effect.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            h.barrier().await;
            if h.reader.total_carried() == 2 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "held batch 3 never applied; carried {}",
                h.reader.total_carried()
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let status = &h.status.snapshot()[0];
        assert_eq!(status.lost_batches, 2, "{status:?}");
        assert_eq!(status.cursor, Some(3));
        h.cancel.cancel();
    }
}

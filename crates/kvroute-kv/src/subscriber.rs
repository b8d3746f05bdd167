//! Subscriber tasks: one per engine rank for KV events, one per rank for load stats when the
//! engine publishes them.
//!
//! They run in the background from registration on, because connecting waits for the engine's
//! port to accept and an engine may come up long after the router registers it; registration and
//! readiness must never wait on them. Payloads are decoded here, in the subscriber's own task, so
//! decoding cost is spread across tasks and the pump only applies already-typed batches.
//! Every await is raced against the worker's cancellation token, so `remove_worker` can stop a
//! task wherever it is (connecting, receiving, or waiting on a full pump channel).

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::KvMetrics;
use crate::pump::PumpMsg;
use crate::status::{RankKey, StatusTable, SubscriberState};
use crate::transport::{KvSource, KvSubscription, SourceEvent};

/// Everything one subscriber task needs.
pub(crate) struct SubscriberCtx<S: KvSource> {
    pub source: Arc<S>,
    pub endpoint: String,
    pub topic: String,
    pub key: RankKey,
    pub incarnation: u64,
    pub tx: mpsc::Sender<PumpMsg>,
    pub cancel: CancellationToken,
    pub status: Arc<StatusTable>,
    pub metrics: KvMetrics,
}

impl<S: KvSource> SubscriberCtx<S> {
    /// Sends to the pump unless cancelled first; `false` means stop.
    async fn send(&self, msg: PumpMsg) -> bool {
        tokio::select! {
            biased;
            _ = self.cancel.cancelled() => false,
            r = self.tx.send(msg) => r.is_ok(),
        }
    }

    async fn connect(&self) -> Option<S::Subscription> {
        tokio::select! {
            biased;
            _ = self.cancel.cancelled() => None,
            sub = self.source.subscribe(&self.endpoint, &self.topic) => Some(sub),
        }
    }

    /// The subscription's next event, or `None` once cancelled (cancellation wins a tie, so a
    /// removed worker stops even while its engine keeps publishing).
    async fn next_event(&self, sub: &mut S::Subscription) -> Option<SourceEvent> {
        tokio::select! {
            biased;
            _ = self.cancel.cancelled() => None,
            ev = sub.next_event() => Some(ev),
        }
    }

    fn set_state(&self, state: SubscriberState) {
        self.status
            .set_socket_state(&self.key, self.incarnation, state, &self.metrics);
    }
}

/// The KV-event subscriber of one rank.
pub(crate) async fn run_kv_subscriber<S: KvSource>(ctx: SubscriberCtx<S>) {
    ctx.set_state(SubscriberState::Connecting);
    let Some(mut sub) = ctx.connect().await else {
        return;
    };
    loop {
        let Some(ev) = ctx.next_event(&mut sub).await else {
            return;
        };
        let msg = match ev {
            SourceEvent::Connected => {
                ctx.set_state(SubscriberState::Connected);
                PumpMsg::Reconnected {
                    key: ctx.key.clone(),
                    incarnation: ctx.incarnation,
                }
            }
            SourceEvent::Disconnected => {
                ctx.set_state(SubscriberState::Disconnected);
                continue;
            }
            SourceEvent::Malformed(e) => {
                ctx.metrics.malformed_messages.inc();
                tracing::debug!(endpoint = %ctx.endpoint, error = %e, "malformed KV message dropped");
                continue;
            }
            SourceEvent::Message { seq, payload } => match kvroute_wire::decode_batch(&payload) {
                Ok(batch) => PumpMsg::Batch {
                    key: ctx.key.clone(),
                    incarnation: ctx.incarnation,
                    seq,
                    batch,
                },
                Err(e) => {
                    // Dropped: the next batch then looks like a gap and replay may recover it.
                    ctx.metrics.decode_errors.inc();
                    tracing::debug!(endpoint = %ctx.endpoint, seq, error = %e,
                        "undecodable KV batch dropped");
                    continue;
                }
            },
        };
        if !ctx.send(msg).await {
            return;
        }
    }
}

/// The load-stat subscriber of one rank. Load is a gauge, so nothing is sequenced or replayed:
/// the latest stat wins.
pub(crate) async fn run_load_subscriber<S: KvSource>(ctx: SubscriberCtx<S>) {
    let Some(mut sub) = ctx.connect().await else {
        return;
    };
    loop {
        let Some(ev) = ctx.next_event(&mut sub).await else {
            return;
        };
        let SourceEvent::Message { payload, .. } = ev else {
            continue;
        };
        match kvroute_wire::decode_load_stat(&payload) {
            Ok(stat) => {
                let msg = PumpMsg::Load {
                    key: ctx.key.clone(),
                    incarnation: ctx.incarnation,
                    stat,
                };
                if !ctx.send(msg).await {
                    return;
                }
            }
            Err(e) => {
                ctx.metrics.decode_errors.inc();
                tracing::debug!(endpoint = %ctx.endpoint, error = %e, "undecodable load stat dropped");
            }
        }
    }
}

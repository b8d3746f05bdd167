//! The chat-shaped synthetic index the benchmarks share (this crate's `match_latency` and
//! `graft`, and the KV plane's `graft_under_load`, which includes this file by path): each rank
//! carries conversations that open with one of `SYSTEM_PROMPTS` system prompts of 1k-4k tokens
//! (skewed popularity, one node per block shared by every rank that stored it) and continue with
//! a tail of their own, until the rank carries the blocks asked for.
//!
//! One generator (and one query mix, [`chat_query`], for `match_latency` and the router's
//! `scale_1024`), so the benchmarks measure the same shape; the random draws come through
//! [`Draws`] so each bench keeps the generator it has always used (and its figures stay
//! reproducible).

#![allow(dead_code)]

use kvroute_wire::event::{BlockStored, EngineHash, KvEvent};

pub const BLOCK_SIZE: u32 = 16;
pub const SYSTEM_PROMPTS: u32 = 300;
/// Blocks per store event (a chain is published in events of at most this many blocks).
pub const BLOCKS_PER_EVENT: usize = 16;

/// The random draws the generator makes, in this order per conversation.
pub trait Draws {
    /// Uniform in [0, 1): the prompt popularity draw.
    fn unit(&mut self) -> f64;
    /// Uniform in 16..=160: the conversation's own tail, in blocks.
    fn tail_blocks(&mut self) -> usize;
}

pub fn token(seed: u64, pos: u64) -> u32 {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ pos.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    z ^= z >> 32;
    (z % 128_000) as u32
}

/// 64..=256 blocks = 1k..4k tokens.
pub fn sys_blocks(p: u32) -> usize {
    64 + (p as usize * 37) % 193
}

pub fn sys_seed(p: u32) -> u64 {
    1 << 40 | u64::from(p)
}

pub fn conv_seed(net: u32, rank: u32, conv: u64) -> u64 {
    2 << 40 | u64::from(net) << 36 | u64::from(rank) << 20 | conv
}

pub fn store_event(
    hashes: Vec<EngineHash>,
    parent: Option<EngineHash>,
    tokens: Vec<u32>,
) -> KvEvent {
    KvEvent::BlockStored(BlockStored::new(hashes, parent, tokens, BLOCK_SIZE))
}

/// One conversation as generated: which prompt, its seed and its tail.
#[derive(Clone, Copy)]
pub struct Conversation {
    pub prompt: u32,
    pub seed: u64,
    pub tail_blocks: usize,
}

/// Generates rank `rank` of network `net` until it carries at least `blocks` blocks: each store
/// event goes to `emit` in publish order and each conversation to `on_conversation`. Engine
/// hashes of tails come from `engine_seq` (incremented before each use); a system prompt's
/// hashes are derived from the prompt, so equal content has equal hashes on every rank. Returns
/// the last engine hash of each system prompt the rank stored, in prompt order.
pub fn chat_rank(
    draws: &mut impl Draws,
    engine_seq: &mut u64,
    net: u32,
    rank: u32,
    blocks: u64,
    mut emit: impl FnMut(KvEvent),
    mut on_conversation: impl FnMut(Conversation),
) -> Vec<EngineHash> {
    let mut has_prompt = vec![None::<EngineHash>; SYSTEM_PROMPTS as usize];
    let mut carried = 0u64;
    let mut conv = 0u64;
    while carried < blocks {
        let u = draws.unit();
        let p = ((u * u) * f64::from(SYSTEM_PROMPTS)) as u32 % SYSTEM_PROMPTS;
        let last_sys = match has_prompt[p as usize] {
            Some(h) => h,
            None => {
                let n = sys_blocks(p);
                let mut parent = None;
                for start in (0..n).step_by(BLOCKS_PER_EVENT) {
                    let k = BLOCKS_PER_EVENT.min(n - start);
                    let hashes: Vec<EngineHash> = (0..k)
                        .map(|i| EngineHash(sys_seed(p) << 12 | (start + i) as u64))
                        .collect();
                    let tokens = (0..k as u64 * u64::from(BLOCK_SIZE))
                        .map(|t| token(sys_seed(p), start as u64 * 16 + t))
                        .collect();
                    let last = hashes[k - 1];
                    emit(store_event(hashes, parent, tokens));
                    parent = Some(last);
                }
                carried += n as u64;
                has_prompt[p as usize] = parent;
                parent.expect("prompt has blocks")
            }
        };
        let tail = draws.tail_blocks();
        let seed = conv_seed(net, rank, conv);
        conv += 1;
        let mut parent = Some(last_sys);
        for start in (0..tail).step_by(BLOCKS_PER_EVENT) {
            let k = BLOCKS_PER_EVENT.min(tail - start);
            let hashes: Vec<EngineHash> = (0..k)
                .map(|_| {
                    *engine_seq += 1;
                    EngineHash(*engine_seq)
                })
                .collect();
            let tokens = (0..k as u64 * u64::from(BLOCK_SIZE))
                .map(|t| token(seed, start as u64 * 16 + t))
                .collect();
            let last = hashes[k - 1];
            emit(store_event(hashes, parent, tokens));
            parent = Some(last);
        }
        carried += tail as u64;
        on_conversation(Conversation {
            prompt: p,
            seed,
            tail_blocks: tail,
        });
    }
    has_prompt.into_iter().flatten().collect()
}

/// Query `query` of `len_tokens` tokens over the conversations `convs` (the benches' query mix):
/// with `kind` < 0.8 it opens with a conversation's system prompt (the conversation drawn by
/// `pick(convs.len())`), below 0.5 it also continues that conversation's tail, and the rest is
/// new content. `pick` is called only when a conversation is used, so each bench keeps its
/// draw sequence.
pub fn chat_query(
    convs: &[Conversation],
    query: u64,
    len_tokens: usize,
    kind: f64,
    pick: impl FnOnce(usize) -> usize,
) -> Vec<u32> {
    let mut toks = Vec::with_capacity(len_tokens);
    if kind < 0.8 {
        let c = convs[pick(convs.len())];
        let n = sys_blocks(c.prompt) as u64 * 16;
        toks.extend((0..n).map(|t| token(sys_seed(c.prompt), t)));
        if kind < 0.5 {
            toks.extend((0..c.tail_blocks as u64 * 16).map(|t| token(c.seed, t)));
        }
    }
    let fresh = 9 << 40 | query;
    let mut t = 0;
    while toks.len() < len_tokens {
        toks.push(token(fresh, t));
        t += 1;
    }
    toks.truncate(len_tokens);
    toks
}

/// The `p` quantile of ascending `sorted` (the nearest rank at or below it).
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

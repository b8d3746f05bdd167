//! PLACEHOLDER: filled in by the wire work (encoder for each engine encoding).
use crate::event::{EventBatch, LoadStat};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// SGLang today: array batch `[ts, events, attn_dp_rank]`, map events, signed i64 hashes,
    /// optional keys omitted.
    Sglang,
    /// vLLM 0.33: array batch, map events with `lora_name`, unsigned u64 hashes.
    Vllm,
    /// vLLM 0.33 in bytes mode: 32-byte binary block hashes.
    VllmBytes,
    /// Newer vLLM sources: the batch itself a map `{ts, events, data_parallel_rank}`.
    VllmMap,
    /// Older engines: tagged positional-array events.
    Legacy,
}

pub fn encode_batch(_batch: &EventBatch, _encoding: Encoding) -> Vec<u8> {
    todo!("wire encoder")
}

pub fn encode_load_stat(_stat: &LoadStat) -> Vec<u8> {
    todo!("wire encoder")
}

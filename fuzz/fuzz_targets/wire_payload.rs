//! Engine KV-event payload decoding, every encoding at once: the decoder sniffs the shape (array
//! or map batch, map- or array-tagged events, signed/unsigned/32-byte hashes), so one target
//! reaches all of them; the seeds hold each engine's golden fixture and its re-encodings.
//!
//! Properties: decoding never panics and never allocates past the libFuzzer malloc limit; a batch
//! it accepts re-encodes in every engine encoding into bytes that decode back to the same batch,
//! up to what that encoding cannot carry (`lost_in`, below: fields the engine's struct lacks,
//! bytes-mode hashes folded to 64 bits, `extra_keys` digests re-digested); the same for the
//! SGLang load record.
#![no_main]

use kvroute_wire::{
    BlockRemoved, BlockStored, Encoding, EngineHash, EventBatch, KvEvent, decode_batch,
    decode_load_stat, encode_batch, encode_load_stat, encoded_extra_key_digest,
    engine_hash_bytes32,
};
use libfuzzer_sys::fuzz_target;

/// `batch` as it must come back from `decode(encode(batch, enc))`.
fn lost_in(batch: &EventBatch, enc: Encoding) -> EventBatch {
    let hash = |h: EngineHash| match enc {
        Encoding::VllmBytes => EngineHash::from_bytes(&engine_hash_bytes32(h)),
        _ => h,
    };
    // SGLang's and the legacy structs have no extra_keys or group_idx; legacy has no lora_name.
    let keeps_vllm_fields = !matches!(enc, Encoding::Sglang | Encoding::Legacy);
    let events = batch
        .events
        .iter()
        .map(|ev| match ev {
            KvEvent::BlockStored(s) => KvEvent::BlockStored(BlockStored {
                block_hashes: s.block_hashes.iter().map(|&h| hash(h)).collect(),
                parent_block_hash: s.parent_block_hash.map(hash),
                lora_name: s.lora_name.clone().filter(|_| enc != Encoding::Legacy),
                extra_keys: if keeps_vllm_fields {
                    let digest = |k: &Option<u64>| k.map(encoded_extra_key_digest);
                    s.extra_keys.iter().map(digest).collect()
                } else {
                    Vec::new()
                },
                group_idx: s.group_idx.filter(|_| keeps_vllm_fields),
                ..s.clone()
            }),
            KvEvent::BlockRemoved(r) => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: r.block_hashes.iter().map(|&h| hash(h)).collect(),
                medium: r.medium,
                group_idx: r.group_idx.filter(|_| keeps_vllm_fields),
            }),
            KvEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
        })
        .collect();
    EventBatch {
        ts: batch.ts,
        events,
        dp_rank: batch.dp_rank,
    }
}

/// Equality with `ts` compared by bits, so a NaN timestamp compares equal to itself.
fn same(a: &EventBatch, b: &EventBatch) -> bool {
    a.ts.to_bits() == b.ts.to_bits() && a.events == b.events && a.dp_rank == b.dp_rank
}

fuzz_target!(|data: &[u8]| {
    if let Ok(batch) = decode_batch(data) {
        for enc in Encoding::ALL {
            let bytes = encode_batch(&batch, enc);
            let again = decode_batch(&bytes)
                .unwrap_or_else(|e| panic!("{enc:?} encoding of a decoded batch refused: {e}"));
            let want = lost_in(&batch, enc);
            assert!(
                same(&again, &want),
                "{enc:?} round trip\n got: {again:?}\nwant: {want:?}"
            );
        }
    }
    if let Ok(stat) = decode_load_stat(data) {
        let again =
            decode_load_stat(&encode_load_stat(&stat)).expect("an encoded load stat decodes");
        assert_eq!(again, stat);
    }
});

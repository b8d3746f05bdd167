//! Property tests: the decoder never panics on any input, and decoding inverts encoding in every
//! encoding (modulo the documented rules for what an encoding cannot carry).

use kvroute_wire::{
    BlockRemoved, BlockStored, Encoding, EngineHash, EventBatch, KvEvent, LoadStat, Medium,
    decode_batch, decode_load_stat, encode_batch, encode_load_stat, encoded_extra_key_digest,
    engine_hash_bytes32,
};
use proptest::prelude::*;

fn medium() -> impl Strategy<Value = Option<Medium>> {
    prop_oneof![
        Just(None),
        Just(Some(Medium::Device)),
        Just(Some(Medium::Host)),
        Just(Some(Medium::Disk)),
        Just(Some(Medium::External)),
        Just(Some(Medium::Unknown)),
    ]
}

fn hash() -> impl Strategy<Value = EngineHash> {
    prop_oneof![
        any::<u64>().prop_map(EngineHash),
        (0u64..300).prop_map(EngineHash),
        any::<i8>().prop_map(|v| EngineHash::from_i64(v.into())),
    ]
}

fn hashes() -> impl Strategy<Value = Vec<EngineHash>> {
    // Up to 20 so both fixarray and array16 headers occur.
    prop::collection::vec(hash(), 0..20)
}

fn stored() -> impl Strategy<Value = KvEvent> {
    (
        hashes(),
        prop::option::of(hash()),
        prop::collection::vec(prop_oneof![any::<u32>(), 0u32..200, Just(u32::MAX)], 0..40),
        any::<u32>(),
        prop::option::of(any::<i64>()),
        prop::option::of("\\PC{0,40}"),
        medium(),
        prop::collection::vec(prop::option::of(any::<u64>()), 0..6),
        prop::option::of(any::<i64>()),
    )
        .prop_map(
            |(
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                lora_name,
                medium,
                extra_keys,
                group_idx,
            )| {
                KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    lora_name,
                    medium,
                    extra_keys,
                    group_idx,
                })
            },
        )
}

fn removed() -> impl Strategy<Value = KvEvent> {
    (hashes(), medium(), prop::option::of(any::<i64>())).prop_map(
        |(block_hashes, medium, group_idx)| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            })
        },
    )
}

fn batch() -> impl Strategy<Value = EventBatch> {
    (
        any::<f64>().prop_filter("finite ts", |t| t.is_finite()),
        prop::collection::vec(
            prop_oneof![3 => stored(), 2 => removed(), 1 => Just(KvEvent::AllBlocksCleared)],
            0..8,
        ),
        prop::option::of(any::<u32>()),
    )
        .prop_map(|(ts, events, dp_rank)| EventBatch {
            ts,
            events,
            dp_rank,
        })
}

fn encoding() -> impl Strategy<Value = Encoding> {
    prop::sample::select(Encoding::ALL.to_vec())
}

/// What `decode(encode(b, enc))` must equal: `b` with the fields `enc`'s engine struct lacks
/// dropped, bytes-mode hashes folded, and `extra_keys` digests replaced by the digest of the
/// entry the encoder wrote for them.
fn expected_after_round_trip(b: &EventBatch, enc: Encoding) -> EventBatch {
    let fold = |h: EngineHash| match enc {
        Encoding::VllmBytes => EngineHash::from_bytes(&engine_hash_bytes32(h)),
        _ => h,
    };
    let sglang_like = matches!(enc, Encoding::Sglang | Encoding::Legacy);
    let events = b
        .events
        .iter()
        .map(|ev| match ev {
            KvEvent::BlockStored(s) => KvEvent::BlockStored(BlockStored {
                block_hashes: s.block_hashes.iter().copied().map(fold).collect(),
                parent_block_hash: s.parent_block_hash.map(fold),
                lora_name: if enc == Encoding::Legacy {
                    None
                } else {
                    s.lora_name.clone()
                },
                extra_keys: if sglang_like {
                    Vec::new()
                } else {
                    s.extra_keys
                        .iter()
                        .map(|k| k.map(encoded_extra_key_digest))
                        .collect()
                },
                group_idx: if sglang_like { None } else { s.group_idx },
                ..s.clone()
            }),
            KvEvent::BlockRemoved(r) => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: r.block_hashes.iter().copied().map(fold).collect(),
                medium: r.medium,
                group_idx: if sglang_like { None } else { r.group_idx },
            }),
            KvEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
        })
        .collect();
    EventBatch {
        ts: b.ts,
        events,
        dp_rank: b.dp_rank,
    }
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, xor: u8 },
    Set { at: usize, byte: u8 },
    Insert { at: usize, byte: u8 },
    Delete { at: usize },
    Truncate { at: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, xor)| Mutation::Flip { at, xor }),
        // Headers and markers are where a decoder is easiest to fool.
        (
            any::<usize>(),
            prop::sample::select(vec![
                0xc0u8, 0xc1, 0xc4, 0xc6, 0xcf, 0xd3, 0xd9, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0xff,
                0x9f, 0x8f, 0xbf, 0x00
            ])
        )
            .prop_map(|(at, byte)| Mutation::Set { at, byte }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert { at, byte }),
        any::<usize>().prop_map(|at| Mutation::Delete { at }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    if bytes.is_empty() {
        return;
    }
    let n = bytes.len();
    match *m {
        Mutation::Flip { at, xor } => bytes[at % n] ^= xor,
        Mutation::Set { at, byte } => bytes[at % n] = byte,
        Mutation::Insert { at, byte } => bytes.insert(at % (n + 1), byte),
        Mutation::Delete { at } => {
            bytes.remove(at % n);
        }
        Mutation::Truncate { at } => bytes.truncate(at % n),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn decode_inverts_encode_in_every_encoding(b in batch(), enc in encoding()) {
        let bytes = encode_batch(&b, enc);
        let decoded = decode_batch(&bytes).map_err(|e| TestCaseError::fail(format!("{enc:?}: {e}")))?;
        prop_assert_eq!(decoded, expected_after_round_trip(&b, enc));
    }

    #[test]
    fn load_stat_round_trips(
        running in any::<u64>(), waiting in any::<u64>(), tokens in any::<u64>(),
        max in any::<u64>(), rank in prop::option::of(any::<u32>()),
    ) {
        let stat = LoadStat {
            num_running_reqs: running,
            num_waiting_reqs: waiting,
            num_tokens: tokens,
            max_total_num_tokens: max,
            dp_rank: rank,
        };
        prop_assert_eq!(decode_load_stat(&encode_load_stat(&stat)), Ok(stat));
    }

    #[test]
    fn random_bytes_never_panic_the_decoder(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
        let _ = decode_load_stat(&bytes);
    }

    #[test]
    fn mutated_valid_payloads_never_panic_the_decoder(
        b in batch(),
        enc in encoding(),
        mutations in prop::collection::vec(mutation(), 1..6),
    ) {
        let mut bytes = encode_batch(&b, enc);
        for m in &mutations {
            apply(&mut bytes, m);
        }
        let _ = decode_batch(&bytes);
        let _ = decode_load_stat(&bytes);
    }
}

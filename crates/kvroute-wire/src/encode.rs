//! Encoder writing a batch exactly as each engine's msgspec writes it, for the simulated engine.
//!
//! The point is byte-for-byte fidelity (golden tests compare against bytes the real msgspec
//! produced from mirrors of the engines' structs), so the rules msgspec follows are reproduced
//! here rather than delegated to a generic serializer: map keys in struct declaration order with
//! the `"type"` tag first; fields at their default omitted under `omit_defaults`, but required
//! fields written even when nil; `array_like` structs always write every position (trailing nils
//! included); integers, strings and arrays in their smallest header; floats always float64; and a
//! struct map header sized by the struct's *declared* field count (a `map16` header once a struct
//! has more than 15 fields plus tag, even when fewer are written).
//!
//! It appends to a caller-owned `Vec<u8>` ([`encode_batch_into`]) so a publisher can reuse one
//! buffer; nothing else is allocated.
//!
//! What the data model cannot carry back: `extra_keys` arrive as digests, so each `Some(d)` is
//! written as the one-element tuple `[d]` (see [`encoded_extra_key_digest`]); encodings whose
//! engine struct lacks a field drop it (see [`Encoding`]).

use xxhash_rust::xxh3::xxh3_64;

use crate::event::{
    BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, LoadStat, Medium,
    engine_hash_bytes32,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// SGLang 0.5.23: array batch `[ts, events, attn_dp_rank]`, map events, signed i64 hashes,
    /// `medium` and `lora_name` omitted when unset. Drops `extra_keys` and `group_idx`.
    Sglang,
    /// vLLM 0.33: array batch, map events (map16 header) always carrying `medium` and
    /// `lora_name`, unsigned u64 hashes, `extra_keys`/`group_idx` only when set.
    Vllm,
    /// vLLM 0.33 in bytes mode: as [`Encoding::Vllm`] with 32-byte binary block hashes
    /// ([`engine_hash_bytes32`]).
    VllmBytes,
    /// Newer vLLM sources: the batch itself a map `{ts, events, data_parallel_rank}` (rank
    /// omitted when unset), events with the smaller field set of that source (fixmap header).
    VllmMap,
    /// Older engines: array batch and tagged positional-array events with signed hashes,
    /// `["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]`. Drops
    /// `lora_name`, `extra_keys` and `group_idx`.
    Legacy,
}

impl Encoding {
    pub const ALL: [Encoding; 5] = [
        Encoding::Sglang,
        Encoding::Vllm,
        Encoding::VllmBytes,
        Encoding::VllmMap,
        Encoding::Legacy,
    ];
}

/// Encodes one batch payload in `encoding`.
pub fn encode_batch(batch: &EventBatch, encoding: Encoding) -> Vec<u8> {
    let mut out = Vec::with_capacity(estimated_len(batch));
    encode_batch_into(batch, encoding, &mut out);
    out
}

/// Appends one batch payload in `encoding` to `out` (which the caller may reuse).
pub fn encode_batch_into(batch: &EventBatch, encoding: Encoding, out: &mut Vec<u8>) {
    out.reserve(estimated_len(batch));
    match encoding {
        Encoding::VllmMap => {
            put_map_len(out, 2 + usize::from(batch.dp_rank.is_some()));
            put_str(out, "ts");
            put_f64(out, batch.ts);
            put_str(out, "events");
            put_events(out, &batch.events, encoding);
            if let Some(rank) = batch.dp_rank {
                put_str(out, "data_parallel_rank");
                put_uint(out, rank.into());
            }
        }
        _ => {
            put_array_len(out, 3);
            put_f64(out, batch.ts);
            put_events(out, &batch.events, encoding);
            match batch.dp_rank {
                Some(rank) => put_uint(out, rank.into()),
                None => out.push(NIL),
            }
        }
    }
}

/// Encodes SGLang's `["LoadStat", running, waiting, tokens, max_total_tokens, attn_dp_rank]`.
pub fn encode_load_stat(stat: &LoadStat) -> Vec<u8> {
    let mut out = Vec::with_capacity(48);
    put_array_len(&mut out, 6);
    put_str(&mut out, "LoadStat");
    put_uint(&mut out, stat.num_running_reqs);
    put_uint(&mut out, stat.num_waiting_reqs);
    put_uint(&mut out, stat.num_tokens);
    put_uint(&mut out, stat.max_total_num_tokens);
    match stat.dp_rank {
        Some(rank) => put_uint(&mut out, rank.into()),
        None => out.push(NIL),
    }
    out
}

/// The `extra_keys` digest the decoder reports for an entry this encoder wrote for digest `d`
/// (the tuple `[d]`): `decode(encode(b)).extra_keys[i] == b.extra_keys[i].map(encoded_extra_key_digest)`.
pub fn encoded_extra_key_digest(d: u64) -> u64 {
    let mut buf = Vec::with_capacity(10);
    put_extra_key(&mut buf, d);
    xxh3_64(&buf)
}

const NIL: u8 = 0xc0;

/// Declared fields (tag included) of vLLM 0.33's `BlockStored`: over 15, so msgspec writes a
/// map16 header whatever it omits.
const VLLM_033_BLOCK_STORED_DECLARED_FIELDS: usize = 16;
/// Declared fields (tag included) of the newer vLLM source's `BlockStored` (map batch).
const VLLM_MAP_BLOCK_STORED_DECLARED_FIELDS: usize = 12;

fn estimated_len(batch: &EventBatch) -> usize {
    let mut len = 32;
    for ev in &batch.events {
        len += match ev {
            KvEvent::BlockStored(s) => {
                128 + 33 * s.block_hashes.len() + 5 * s.token_ids.len() + 10 * s.extra_keys.len()
            }
            KvEvent::BlockRemoved(r) => 48 + 33 * r.block_hashes.len(),
            KvEvent::AllBlocksCleared => 24,
        };
    }
    len
}

fn put_events(out: &mut Vec<u8>, events: &[KvEvent], encoding: Encoding) {
    put_array_len(out, events.len());
    for ev in events {
        match (ev, encoding) {
            (KvEvent::BlockStored(s), Encoding::Legacy) => put_legacy_stored(out, s),
            (KvEvent::BlockRemoved(r), Encoding::Legacy) => put_legacy_removed(out, r),
            (KvEvent::AllBlocksCleared, Encoding::Legacy) => {
                put_array_len(out, 1);
                put_str(out, "AllBlocksCleared");
            }
            (KvEvent::BlockStored(s), Encoding::Sglang) => put_sglang_stored(out, s),
            (KvEvent::BlockRemoved(r), Encoding::Sglang) => put_sglang_removed(out, r),
            (KvEvent::BlockStored(s), _) => put_vllm_stored(out, s, encoding),
            (KvEvent::BlockRemoved(r), _) => put_vllm_removed(out, r, encoding),
            (KvEvent::AllBlocksCleared, _) => {
                put_map_len(out, 1);
                put_str(out, "type");
                put_str(out, "AllBlocksCleared");
            }
        }
    }
}

fn put_sglang_stored(out: &mut Vec<u8>, s: &BlockStored) {
    let fields = 6 + usize::from(s.medium.is_some()) + usize::from(s.lora_name.is_some());
    put_map_len(out, fields);
    put_stored_common(out, s, Encoding::Sglang);
    if let Some(m) = s.medium {
        put_str(out, "medium");
        put_str(out, medium_name(m, Encoding::Sglang));
    }
    if let Some(name) = &s.lora_name {
        put_str(out, "lora_name");
        put_str(out, name);
    }
}

fn put_sglang_removed(out: &mut Vec<u8>, r: &BlockRemoved) {
    put_map_len(out, 2 + usize::from(r.medium.is_some()));
    put_str(out, "type");
    put_str(out, "BlockRemoved");
    put_str(out, "block_hashes");
    put_hashes(out, &r.block_hashes, Encoding::Sglang);
    if let Some(m) = r.medium {
        put_str(out, "medium");
        put_str(out, medium_name(m, Encoding::Sglang));
    }
}

fn put_vllm_stored(out: &mut Vec<u8>, s: &BlockStored, encoding: Encoding) {
    let written = 8 + usize::from(!s.extra_keys.is_empty()) + usize::from(s.group_idx.is_some());
    let declared = if encoding == Encoding::VllmMap {
        VLLM_MAP_BLOCK_STORED_DECLARED_FIELDS
    } else {
        VLLM_033_BLOCK_STORED_DECLARED_FIELDS
    };
    put_struct_map_len(out, written, declared);
    put_stored_common(out, s, encoding);
    put_str(out, "medium");
    put_opt_medium(out, s.medium, encoding);
    put_str(out, "lora_name");
    match &s.lora_name {
        Some(name) => put_str(out, name),
        None => out.push(NIL),
    }
    if !s.extra_keys.is_empty() {
        put_str(out, "extra_keys");
        put_array_len(out, s.extra_keys.len());
        for entry in &s.extra_keys {
            match entry {
                Some(d) => put_extra_key(out, *d),
                None => out.push(NIL),
            }
        }
    }
    if let Some(g) = s.group_idx {
        put_str(out, "group_idx");
        put_int(out, g);
    }
}

fn put_vllm_removed(out: &mut Vec<u8>, r: &BlockRemoved, encoding: Encoding) {
    put_map_len(out, 3 + usize::from(r.group_idx.is_some()));
    put_str(out, "type");
    put_str(out, "BlockRemoved");
    put_str(out, "block_hashes");
    put_hashes(out, &r.block_hashes, encoding);
    put_str(out, "medium");
    put_opt_medium(out, r.medium, encoding);
    if let Some(g) = r.group_idx {
        put_str(out, "group_idx");
        put_int(out, g);
    }
}

/// `type` through `lora_id`: identical keys and order in every map-event engine.
fn put_stored_common(out: &mut Vec<u8>, s: &BlockStored, encoding: Encoding) {
    put_str(out, "type");
    put_str(out, "BlockStored");
    put_str(out, "block_hashes");
    put_hashes(out, &s.block_hashes, encoding);
    put_str(out, "parent_block_hash");
    put_opt_hash(out, s.parent_block_hash, encoding);
    put_str(out, "token_ids");
    put_tokens(out, &s.token_ids);
    put_str(out, "block_size");
    put_uint(out, s.block_size.into());
    put_str(out, "lora_id");
    put_opt_int(out, s.lora_id);
}

fn put_legacy_stored(out: &mut Vec<u8>, s: &BlockStored) {
    put_array_len(out, 7);
    put_str(out, "BlockStored");
    put_hashes(out, &s.block_hashes, Encoding::Legacy);
    put_opt_hash(out, s.parent_block_hash, Encoding::Legacy);
    put_tokens(out, &s.token_ids);
    put_uint(out, s.block_size.into());
    put_opt_int(out, s.lora_id);
    put_opt_medium(out, s.medium, Encoding::Legacy);
}

fn put_legacy_removed(out: &mut Vec<u8>, r: &BlockRemoved) {
    put_array_len(out, 3);
    put_str(out, "BlockRemoved");
    put_hashes(out, &r.block_hashes, Encoding::Legacy);
    put_opt_medium(out, r.medium, Encoding::Legacy);
}

fn medium_name(m: Medium, encoding: Encoding) -> &'static str {
    match (m, encoding) {
        (Medium::Device, _) => "GPU",
        // SGLang's StorageMedium names host memory CPU_PINNED; vLLM's offloading writes CPU.
        (Medium::Host, Encoding::Sglang | Encoding::Legacy) => "CPU_PINNED",
        (Medium::Host, _) => "CPU",
        (Medium::Disk, _) => "DISK",
        (Medium::External, _) => "EXTERNAL",
        (Medium::Unknown, _) => "UNKNOWN",
    }
}

fn put_opt_medium(out: &mut Vec<u8>, m: Option<Medium>, encoding: Encoding) {
    match m {
        Some(m) => put_str(out, medium_name(m, encoding)),
        None => out.push(NIL),
    }
}

#[inline]
fn put_hash(out: &mut Vec<u8>, h: EngineHash, encoding: Encoding) {
    match encoding {
        Encoding::Sglang | Encoding::Legacy => put_int(out, h.0 as i64),
        Encoding::Vllm | Encoding::VllmMap => put_uint(out, h.0),
        Encoding::VllmBytes => put_bin(out, &engine_hash_bytes32(h)),
    }
}

fn put_opt_hash(out: &mut Vec<u8>, h: Option<EngineHash>, encoding: Encoding) {
    match h {
        Some(h) => put_hash(out, h, encoding),
        None => out.push(NIL),
    }
}

fn put_hashes(out: &mut Vec<u8>, hashes: &[EngineHash], encoding: Encoding) {
    put_array_len(out, hashes.len());
    for &h in hashes {
        put_hash(out, h, encoding);
    }
}

fn put_tokens(out: &mut Vec<u8>, tokens: &[u32]) {
    put_array_len(out, tokens.len());
    for &t in tokens {
        put_uint(out, t.into());
    }
}

fn put_extra_key(out: &mut Vec<u8>, d: u64) {
    put_array_len(out, 1);
    put_uint(out, d);
}

fn put_opt_int(out: &mut Vec<u8>, v: Option<i64>) {
    match v {
        Some(v) => put_int(out, v),
        None => out.push(NIL),
    }
}

#[inline]
pub(crate) fn put_uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if v <= 0xff {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= 0xffff {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= 0xffff_ffff {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// msgspec writes non-negative integers in unsigned forms and negative ones in the smallest
/// signed form.
#[inline]
pub(crate) fn put_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        put_uint(out, v as u64);
    } else if v >= -32 {
        out.push(v as i8 as u8);
    } else if v >= i8::MIN.into() {
        out.extend_from_slice(&[0xd0, v as i8 as u8]);
    } else if v >= i16::MIN.into() {
        out.push(0xd1);
        out.extend_from_slice(&(v as i16).to_be_bytes());
    } else if v >= i32::MIN.into() {
        out.push(0xd2);
        out.extend_from_slice(&(v as i32).to_be_bytes());
    } else {
        out.push(0xd3);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

pub(crate) fn put_f64(out: &mut Vec<u8>, v: f64) {
    out.push(0xcb);
    out.extend_from_slice(&v.to_bits().to_be_bytes());
}

pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) {
    let len = s.len();
    if len < 32 {
        out.push(0xa0 | len as u8);
    } else if len <= 0xff {
        out.extend_from_slice(&[0xd9, len as u8]);
    } else if len <= 0xffff {
        out.push(0xda);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

pub(crate) fn put_bin(out: &mut Vec<u8>, b: &[u8]) {
    let len = b.len();
    if len <= 0xff {
        out.extend_from_slice(&[0xc4, len as u8]);
    } else if len <= 0xffff {
        out.push(0xc5);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0xc6);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
    out.extend_from_slice(b);
}

pub(crate) fn put_array_len(out: &mut Vec<u8>, len: usize) {
    if len <= 15 {
        out.push(0x90 | len as u8);
    } else if len <= 0xffff {
        out.push(0xdc);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
}

pub(crate) fn put_map_len(out: &mut Vec<u8>, len: usize) {
    if len <= 15 {
        out.push(0x80 | len as u8);
    } else if len <= 0xffff {
        out.push(0xde);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0xdf);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
}

/// msgspec sizes a struct's map header for every field it could write (declared fields plus
/// the tag), then fills in how many it did write.
fn put_struct_map_len(out: &mut Vec<u8>, written: usize, declared: usize) {
    if declared > 15 {
        out.push(0xde);
        out.extend_from_slice(&(written as u16).to_be_bytes());
    } else {
        put_map_len(out, written);
    }
}

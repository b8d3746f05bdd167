#!/usr/bin/env python3
"""Golden KV-event payloads for kvroute-wire, written by the engines' own serializer (msgspec).

Each engine generation is mirrored as msgspec Structs with the options that engine declares
(array_like, tag=True, omit_defaults, gc=False) and the fields in its declaration order, because
msgspec derives the bytes from exactly those: key order, omitted defaults, trailing nils of
array_like structs, and the map16 header of a struct with more than 15 fields plus tag.

Modes:
  gen_wire_fixtures.py [--out DIR]   write DIR/*.msgpack and DIR/manifest.json (default: the
                                     crate's tests/fixtures). manifest.json lists, per fixture,
                                     the values a decoder must produce and, where kvroute's
                                     encoder claims byte equality, the Encoding that must
                                     reproduce the file exactly.
  gen_wire_fixtures.py --check DIR   regenerate in memory and fail if DIR differs.
  gen_wire_fixtures.py --reencode    read (encoding, payload-hex) lines on stdin, decode each
                                     payload with that engine's typed mirror and re-encode it;
                                     print "same" or "diff <msgspec hex>" per line. Lets the Rust
                                     tests prove the encoder's output is what msgspec itself
                                     writes for the same values, for arbitrary batches.

Run with the project venv: "$(scripts/python-env.sh)" scripts/gen_wire_fixtures.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Union

import msgspec

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "crates" / "kvroute-wire" / "tests" / "fixtures"

Hash = Union[int, bytes]


# --- SGLang 0.5.23: array batch, tagged map events, signed int64 hashes -----------------------
class SglEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class SglEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class SglBlockStored(SglEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class SglBlockRemoved(SglEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class SglAllBlocksCleared(SglEvent, tag="AllBlocksCleared"):
    pass


class SglBatch(SglEventBatch):
    events: list[Union[SglBlockStored, SglBlockRemoved, SglAllBlocksCleared]]


# --- vLLM 0.33: array batch, tagged map events (15 fields + tag: map16), u64 or bytes hashes ---
class V33EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class V33Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class V33BlockStored(V33Event, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[Any] = None
    ownership: Optional[Any] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[list[int]] = None


class V33BlockRemoved(V33Event, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[Any] = None
    ownership: Optional[Any] = None


class V33AllBlocksCleared(V33Event, tag="AllBlocksCleared"):
    pass


class V33Batch(V33EventBatch):
    events: list[Union[V33BlockStored, V33BlockRemoved, V33AllBlocksCleared]]


# --- newer vLLM source: the batch a map; BlockStored with 11 fields (fixmap) ----------------
class VMapEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class VMapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VMapBlockStored(VMapEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class VMapBlockRemoved(VMapEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class VMapAllBlocksCleared(VMapEvent, tag="AllBlocksCleared"):
    pass


class VMapBatch(VMapEventBatch):
    events: list[Union[VMapBlockStored, VMapBlockRemoved, VMapAllBlocksCleared]]


# --- legacy: array batch, tagged positional-array events (older SGLang / vLLM) ---------------
class LegEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class LegEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegBlockStored(LegEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class LegBlockStoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class LegBlockStoredWithMetadata(LegBlockStored, tag="BlockStored", kw_only=True):
    metadata: LegBlockStoredMetadata


class LegBlockRemoved(LegEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class LegAllBlocksCleared(LegEvent, tag="AllBlocksCleared"):
    pass


class LegBatch(LegEventBatch):
    events: list[Union[LegBlockStored, LegBlockRemoved, LegAllBlocksCleared]]


class OldestEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The first engines' batch: no rank at all, so a 2-element array."""

    ts: float
    events: list[Any]


# --- SGLang load topic --------------------------------------------------------------------------
class LoadStat(msgspec.Struct, array_like=True, gc=False, tag=True):
    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    max_total_num_tokens: int
    attn_dp_rank: Optional[int] = None


class LoadStatExtended(LoadStat, tag="LoadStat"):
    num_waiting_uncached_tokens: Optional[int] = None


ENC = msgspec.msgpack.Encoder()

# The Rust Medium each engine string must decode to.
MEDIUM = {
    None: None,
    "GPU": "Device",
    "DEVICE": "Device",
    "CPU": "Host",
    "CPU_PINNED": "Host",
    "CPU_TIER1": "Host",
    "CPU_TIER2": "Disk",
    "DISK": "Disk",
    "NVME": "Disk",
    "STORAGE": "Disk",
    "EXTERNAL": "External",
    "NETWORK": "External",
    "REMOTE": "External",
    "SHARED": "External",
}


def medium(m: Optional[str]) -> Optional[str]:
    return MEDIUM.get(m, "Unknown")


def h(v: Hash) -> dict:
    return {"bytes": v.hex()} if isinstance(v, bytes) else {"int": v}


def expect_event(ev: Any) -> dict:
    tag = type(ev).__struct_config__.tag
    if tag == "AllBlocksCleared":
        return {"type": tag}
    if tag == "BlockRemoved":
        return {
            "type": tag,
            "block_hashes": [h(x) for x in ev.block_hashes],
            "medium": medium(ev.medium),
            "group_idx": getattr(ev, "group_idx", None),
        }
    extra = getattr(ev, "extra_keys", None) or []
    return {
        "type": tag,
        "block_hashes": [h(x) for x in ev.block_hashes],
        "parent_block_hash": None if ev.parent_block_hash is None else h(ev.parent_block_hash),
        "token_ids": list(ev.token_ids),
        "block_size": ev.block_size,
        "lora_id": ev.lora_id,
        "lora_name": getattr(ev, "lora_name", None),
        "medium": medium(ev.medium),
        # The exact encoded bytes of each entry: the decoder must report xxh3_64 of these.
        "extra_keys": [None if e is None else ENC.encode(e).hex() for e in extra],
        "group_idx": getattr(ev, "group_idx", None),
    }


def expect_batch(b: Any) -> dict:
    rank = getattr(b, "attn_dp_rank", None)
    if rank is None:
        rank = getattr(b, "data_parallel_rank", None)
    return {"ts": b.ts, "dp_rank": rank, "events": [expect_event(e) for e in b.events]}


TS = 1764467272.5  # exactly representable, so JSON carries it without rounding
TOK = list(range(1000, 1004))
BIG_A = 2465420568987988355
BIG_B = 14799765119358052597  # >= 2^63
BIG_C = (1 << 64) - 1


def fixtures() -> list[tuple[str, str, Optional[str], Any, dict]]:
    """(name, kind, encoding the Rust encoder must reproduce or None, struct, expected)."""
    out = []

    def batch(name: str, enc: Optional[str], b: Any) -> None:
        out.append((name, "batch", enc, b, expect_batch(b)))

    def raw(name: str, obj: Any, expected_from: Any) -> None:
        """A payload msgspec writes from plain containers (shapes no engine struct produces,
        such as keys out of declaration order), with the expectation of an equivalent struct."""
        out.append((name, "batch", None, obj, expect_batch(expected_from)))

    # SGLang
    batch(
        "sglang_stored_negative_hash",
        "Sglang",
        SglBatch(
            TS,
            [SglBlockStored([-521283848079677608], -5, TOK, 4, None, medium="GPU")],
            0,
        ),
    )
    batch(
        "sglang_stored_nil_and_omitted_optionals",
        "Sglang",
        SglBatch(TS, [SglBlockStored([42], None, TOK, 4, None)], 1),
    )
    batch(
        "sglang_stored_lora",
        "Sglang",
        SglBatch(
            TS,
            [
                SglBlockStored(
                    [-(1 << 63)], (1 << 63) - 1, TOK, 4, 7, medium="CPU_PINNED", lora_name="adapter-a"
                )
            ],
            2,
        ),
    )
    batch(
        "sglang_stored_cache_salt_session",
        None,
        SglBatch(
            TS,
            [
                SglBlockStored(
                    [9, 10], 8, list(range(8)), 4, None, medium="DISK", cache_salt="salt-1",
                    session_id="sess-1",
                )
            ],
            0,
        ),
    )
    batch(
        "sglang_removed_with_and_without_medium",
        "Sglang",
        SglBatch(
            TS,
            [SglBlockRemoved([-1, 2]), SglBlockRemoved([3], medium="EXTERNAL")],
            0,
        ),
    )
    batch("sglang_all_blocks_cleared_35_bytes", "Sglang", SglBatch(TS, [SglAllBlocksCleared()], 0))
    batch(
        "sglang_mixed_batch",
        "Sglang",
        SglBatch(
            TS,
            [
                SglBlockStored([11], None, TOK, 4, None, medium="GPU"),
                SglBlockStored([12], 11, [5, 6, 7, 8], 4, None, medium="GPU"),
                SglBlockRemoved([11], medium="GPU"),
                SglAllBlocksCleared(),
                SglBlockStored([-13], None, [70000, 1 << 31, (1 << 32) - 1, 0], 4, None),
            ],
            3,
        ),
    )
    batch("sglang_rank_nil", "Sglang", SglBatch(TS, [SglBlockRemoved([5])], None))
    batch("sglang_empty_events", "Sglang", SglBatch(TS, [], 0))
    batch(
        "sglang_bigram_tokens",
        "Sglang",
        SglBatch(TS, [SglBlockStored([77], 76, [1, 2, 2, 3, 3, 4, 4, 5], 4, None, medium="GPU")], 0),
    )
    batch(
        "sglang_many_blocks_array16",
        "Sglang",
        SglBatch(TS, [SglBlockRemoved(list(range(-20, 20)))], 0),
    )

    # vLLM 0.33 (int mode)
    batch(
        "vllm_multi_block_big_hashes",
        "Vllm",
        V33Batch(
            TS,
            [
                V33BlockStored(
                    [BIG_A, BIG_B, BIG_C], None, list(range(1000, 1012)), 4, None, "GPU", None,
                    group_idx=0,
                )
            ],
            0,
        ),
    )
    batch(
        "vllm_lora_name_and_extra_keys",
        None,
        V33Batch(
            TS,
            [
                V33BlockStored(
                    [BIG_B, 3], BIG_A, list(range(8)), 4, 5, "CPU", "sql-lora",
                    extra_keys=[("mm-hash-1", 0), None], group_idx=2,
                    kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None,
                )
            ],
            1,
        ),
    )
    batch(
        # Not claimed for decode-then-encode (entries decode to digests); golden.rs rebuilds it
        # from the digests' preimages and checks the encoder's bytes directly.
        "vllm_extra_keys_int_tuples",
        None,
        V33Batch(
            TS,
            [
                V33BlockStored(
                    [1, 2], 0, list(range(8)), 4, None, "GPU", "l", extra_keys=[(BIG_B,), None]
                )
            ],
            0,
        ),
    )
    batch(
        "vllm_removed_group_and_cleared",
        "Vllm",
        V33Batch(
            TS,
            [
                V33BlockRemoved([BIG_B], "CPU", group_idx=1),
                V33BlockRemoved([4], None),
                V33AllBlocksCleared(),
            ],
            None,
        ),
    )
    batch("vllm_all_blocks_cleared_35_bytes", "Vllm", V33Batch(TS, [V33AllBlocksCleared()], 0))

    # vLLM 0.33 bytes mode (32-byte sha256 digests)
    d = [bytes(range(i, i + 32)) for i in (0, 32, 64)]
    batch(
        "vllm_bytes_mode",
        None,
        V33Batch(
            TS,
            [
                V33BlockStored(d[:2], d[2], list(range(8)), 4, None, "GPU", None),
                V33BlockRemoved([d[0]], "GPU"),
            ],
            0,
        ),
    )

    # newer vLLM source: map batch
    batch(
        "vllm_map_batch",
        "VllmMap",
        VMapBatch(
            TS,
            [
                VMapBlockStored([BIG_A, BIG_B], 9, list(range(8)), 4, None, "GPU", None, group_idx=0),
                VMapBlockRemoved([BIG_A], "GPU"),
                VMapAllBlocksCleared(),
            ],
            4,
        ),
    )
    batch(
        "vllm_map_batch_rank_omitted",
        "VllmMap",
        VMapBatch(TS, [VMapBlockRemoved([1], None)]),
    )

    # legacy: tagged positional-array events
    batch(
        "legacy_array_events",
        "Legacy",
        LegBatch(
            TS,
            [
                LegBlockStored([-7], None, TOK, 4, None, "GPU"),
                LegBlockStored([8], -7, TOK, 4, 3),
                LegBlockRemoved([-7]),
                LegBlockRemoved([8], "CPU_PINNED"),
                LegAllBlocksCleared(),
            ],
            0,
        ),
    )
    batch(
        "legacy_stored_with_metadata",
        None,
        LegBatch(
            TS,
            [LegBlockStoredWithMetadata([5], None, TOK, 4, None, "GPU", metadata=LegBlockStoredMetadata("s"))],
            0,
        ),
    )
    oldest = OldestEventBatch(TS, [LegBlockStored([5], None, TOK, 4, None, "GPU")])
    out.append(("legacy_two_element_batch", "batch", None, oldest, {**expect_batch(oldest), "dp_rank": None}))

    # shapes msgspec never writes from a struct but a tolerant decoder must read
    raw(
        "map_event_type_last_with_nested_unknowns",
        [
            TS,
            [
                {
                    "block_hashes": [BIG_B],
                    "weird": {"a": [1, [2, {"b": None, "c": b"\x00\x01"}]], "f": 1.5},
                    "token_ids": TOK,
                    "parent_block_hash": None,
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "NVME",
                    "type": "BlockStored",
                }
            ],
            6,
            "trailing-element",
        ],
        V33Batch(TS, [V33BlockStored([BIG_B], None, TOK, 4, None, "NVME", None)], 6),
    )
    raw(
        "map_batch_attn_dp_rank_unknown_keys",
        {"events": [{"type": "BlockRemoved", "block_hashes": [1], "medium": "SOMETHING_NEW"}],
         "extra": [1, 2, 3], "attn_dp_rank": 2, "ts": TS},
        V33Batch(TS, [V33BlockRemoved([1], "SOMETHING_NEW")], 2),
    )
    raw(
        "integer_ts_two_element_batch",
        [1764467272, [{"type": "AllBlocksCleared"}]],
        V33Batch(1764467272.0, [V33AllBlocksCleared()], None),
    )

    # load topic
    out.append(("load_stat", "load_stat", "LoadStat", LoadStat(3, 7, 12345, 1 << 40, 1), {
        "num_running_reqs": 3, "num_waiting_reqs": 7, "num_tokens": 12345,
        "max_total_num_tokens": 1 << 40, "dp_rank": 1}))
    out.append(("load_stat_rank_nil", "load_stat", "LoadStat", LoadStat(0, 0, 0, 0), {
        "num_running_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0,
        "max_total_num_tokens": 0, "dp_rank": None}))
    out.append(("load_stat_extended", "load_stat", None, LoadStatExtended(1, 2, 3, 4, 0, num_waiting_uncached_tokens=99), {
        "num_running_reqs": 1, "num_waiting_reqs": 2, "num_tokens": 3,
        "max_total_num_tokens": 4, "dp_rank": 0}))
    return out


def render() -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    manifest = []
    for name, kind, enc, obj, expected in fixtures():
        payload = ENC.encode(obj)
        files[f"{name}.msgpack"] = payload
        manifest.append({
            "name": name,
            "file": f"{name}.msgpack",
            "kind": kind,
            "reencodes_as": enc,
            "len_bytes": len(payload),
            "expected": expected,
        })
    header = {
        "generator": "scripts/gen_wire_fixtures.py",
        "msgspec": msgspec.__version__,
        "fixtures": manifest,
    }
    files["manifest.json"] = (json.dumps(header, indent=1) + "\n").encode()
    return files


MIRRORS = {
    "Sglang": SglBatch,
    "Vllm": V33Batch,
    "VllmBytes": V33Batch,
    "VllmMap": VMapBatch,
    "Legacy": LegBatch,
    "LoadStat": LoadStat,
}


def reencode() -> int:
    decoders = {k: msgspec.msgpack.Decoder(v) for k, v in MIRRORS.items()}
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        enc, hexed = line.split(" ", 1)
        payload = bytes.fromhex(hexed)
        try:
            again = ENC.encode(decoders[enc].decode(payload))
        except Exception as e:  # noqa: BLE001 - report any rejection to the Rust side
            print(f"error {type(e).__name__}: {e}".replace("\n", " "), flush=True)
            continue
        print("same" if again == payload else f"diff {again.hex()}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--check", type=Path)
    ap.add_argument("--reencode", action="store_true")
    args = ap.parse_args()
    if args.reencode:
        return reencode()
    files = render()
    if args.check:
        bad = [n for n, b in files.items() if not (args.check / n).is_file() or (args.check / n).read_bytes() != b]
        for n in bad:
            print(f"stale or missing fixture: {n}", file=sys.stderr)
        return 1 if bad else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for n, b in files.items():
        (args.out / n).write_bytes(b)
    print(f"wrote {len(files)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A stand-in for the engines' own KV-event publishers, for kvroute's interop test.

It declares msgspec Structs mirroring the classes SGLang 0.5.23 and vLLM 0.33 publish (written
from the published schemas; no engine code is imported or copied), encodes one batch per engine
encoding with msgspec exactly as the engines do, and publishes them over a real pyzmq PUB as
`[topic, seq (8-byte big-endian), payload]`, with a ROUTER serving replay like the engines'.

Protocol with the test (stdin/stdout, so nothing relies on sleeping):
  1. prints one JSON line {"pub": port, "replay": port};
  2. publishes probe messages on topic "probe" every 20 ms until it reads "go" on stdin
     (so the subscriber can prove its subscription is live: the ZMQ slow joiner);
  3. publishes the batches on topic "kv" with seq 0..N-1, keeps them for replay, prints
     {"published": N};
  4. serves replay requests ([identity, "", start_seq]) until stdin says "quit" or closes.
"""

import json
import sys
import threading
from typing import Any, Optional, Union

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- SGLang 0.5.23 shapes: array batch (no omit_defaults), map events (omit_defaults) -------
class SgEvent(msgspec.Struct, tag=True, omit_defaults=True, array_like=False):
    pass


class SgBlockStored(SgEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None


class SgBlockRemoved(SgEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class SgAllBlocksCleared(SgEvent, tag="AllBlocksCleared"):
    pass


class SgBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[SgBlockStored, SgBlockRemoved, SgAllBlocksCleared]]
    attn_dp_rank: Optional[int] = None


# --- vLLM 0.33 shapes: array batch with omit_defaults, map events --------------------------
class VlEvent(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class VlBlockStored(VlEvent, tag="BlockStored"):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[list[int]] = None


class VlBlockRemoved(VlEvent, tag="BlockRemoved"):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class VlAllBlocksCleared(VlEvent, tag="AllBlocksCleared"):
    pass


VlEvents = list[Union[VlBlockStored, VlBlockRemoved, VlAllBlocksCleared]]


class VlBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: VlEvents
    data_parallel_rank: Optional[int] = None


class VlMapBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: VlEvents
    data_parallel_rank: Optional[int] = None


# --- Older engines: tagged positional-array events ----------------------------------------
class LgEvent(msgspec.Struct, tag=True, array_like=True):
    pass


class LgBlockStored(LgEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class LgBlockRemoved(LgEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class LgBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[LgBlockStored, LgBlockRemoved]]
    data_parallel_rank: Optional[int] = None


def batches() -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    ts = 1764460800.25
    return [
        # 0: SGLang, negative i64 hashes, one block per event, lora_name omitted.
        enc.encode(SgBatch(ts, [
            SgBlockStored([-521283848079677608], None, [1000, 1001, 1002, 1003], 4, None, "GPU"),
            SgBlockStored([7], -521283848079677608, [1004, 1005, 1006, 1007], 4, None, "GPU"),
            SgBlockRemoved([-521283848079677608], "GPU"),
            SgAllBlocksCleared(),
        ], 0)),
        # 1: vLLM 0.33 int mode: u64 hashes >= 2^63, several blocks per event, group_idx.
        enc.encode(VlBatch(ts, [
            VlBlockStored([2465420568987988355, 14799765119358052597], None,
                          list(range(1000, 1008)), 4, None, "GPU", None, group_idx=0),
            VlBlockRemoved([14799765119358052597], "GPU", group_idx=0),
        ], 1)),
        # 2: vLLM bytes mode: 32-byte hashes.
        enc.encode(VlBatch(ts, [
            VlBlockStored([bytes(range(32))], bytes(range(1, 33)), [1, 2, 3, 4], 4, None,
                          "CPU", "adapter-a"),
        ], 0)),
        # 3: newer vLLM: the batch itself a map.
        enc.encode(VlMapBatch(ts, [
            VlBlockStored([42], None, [9, 9, 9, 9], 4, 3, None, None),
            VlAllBlocksCleared(),
        ], 2)),
        # 4: legacy tagged-array events.
        enc.encode(LgBatch(ts, [
            LgBlockStored([-5, 6], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU_PINNED"),
            LgBlockRemoved([6], None),
        ], None)),
    ]


def main() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    print(json.dumps({"pub": pub_port, "replay": replay_port}), flush=True)

    go, quit_ = threading.Event(), threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "go":
                go.set()
            elif line.strip() == "quit":
                break
        go.set()
        quit_.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    probe_seq = 0
    while not go.wait(0.02):
        pub.send_multipart([b"probe", probe_seq.to_bytes(8, "big"), b""])
        probe_seq += 1

    buffer = []
    for seq, payload in enumerate(batches()):
        seq_bytes = seq.to_bytes(8, "big")
        pub.send_multipart([b"kv", seq_bytes, payload])
        buffer.append((seq, seq_bytes, payload))
    print(json.dumps({"published": len(buffer)}), flush=True)

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while not quit_.is_set():
        if not poller.poll(50):
            continue
        frames = router.recv_multipart()
        identity, start = frames[0], int.from_bytes(frames[-1], "big", signed=True)
        for seq, seq_bytes, payload in buffer:
            if seq >= start:
                router.send_multipart([identity, b"", b"kv", seq_bytes, payload])
        router.send_multipart([identity, b"", b"kv", END_SEQ, b""])
    pub.close(linger=0)
    router.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()

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
from pathlib import Path

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# The engines' event classes are mirrored ONCE, in scripts/gen_wire_fixtures.py (the golden
# fixture generator, whose mirrors are checked byte for byte against msgspec); this publisher
# imports them rather than keeping a second copy that could drift.
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts"))
from gen_wire_fixtures import (  # noqa: E402
    LegBatch,
    LegBlockRemoved,
    LegBlockStored,
    SglAllBlocksCleared,
    SglBatch,
    SglBlockRemoved,
    SglBlockStored,
    V33Batch,
    V33BlockRemoved,
    V33BlockStored,
    VMapAllBlocksCleared,
    VMapBatch,
    VMapBlockStored,
)

def batches() -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    ts = 1764460800.25
    return [
        # 0: SGLang, negative i64 hashes, one block per event, lora_name omitted.
        enc.encode(SglBatch(ts, [
            SglBlockStored([-521283848079677608], None, [1000, 1001, 1002, 1003], 4, None, "GPU"),
            SglBlockStored([7], -521283848079677608, [1004, 1005, 1006, 1007], 4, None, "GPU"),
            SglBlockRemoved([-521283848079677608], "GPU"),
            SglAllBlocksCleared(),
        ], 0)),
        # 1: vLLM 0.33 int mode: u64 hashes >= 2^63, several blocks per event, group_idx.
        enc.encode(V33Batch(ts, [
            V33BlockStored([2465420568987988355, 14799765119358052597], None,
                           list(range(1000, 1008)), 4, None, "GPU", None, group_idx=0),
            V33BlockRemoved([14799765119358052597], "GPU", group_idx=0),
        ], 1)),
        # 2: vLLM bytes mode: 32-byte hashes.
        enc.encode(V33Batch(ts, [
            V33BlockStored([bytes(range(32))], bytes(range(1, 33)), [1, 2, 3, 4], 4, None,
                           "CPU", "adapter-a"),
        ], 0)),
        # 3: newer vLLM: the batch itself a map.
        enc.encode(VMapBatch(ts, [
            VMapBlockStored([42], None, [9, 9, 9, 9], 4, 3, None, None),
            VMapAllBlocksCleared(),
        ], 2)),
        # 4: legacy tagged-array events.
        enc.encode(LegBatch(ts, [
            LegBlockStored([-5, 6], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU_PINNED"),
            LegBlockRemoved([6], None),
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

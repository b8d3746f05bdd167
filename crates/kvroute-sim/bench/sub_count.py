#!/usr/bin/env python3
"""Counts KV batches on a ZMQ PUB for N seconds and reports seq gaps (a benchmark sidecar, so
publishing is measured with a live subscriber attached, as a router would be).
Usage: sub_count.py tcp://127.0.0.1:PORT SECONDS"""
import sys
import time

import zmq

ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.connect(sys.argv[1])
sub.setsockopt(zmq.SUBSCRIBE, b"")
received, last, gaps = 0, -1, 0
end = time.time() + float(sys.argv[2])
while time.time() < end:
    if sub.poll(100):
        _topic, seq, _payload = sub.recv_multipart()
        seq = int.from_bytes(seq, "big")
        if last >= 0 and seq != last + 1:
            gaps += 1
        last, received = seq, received + 1
print(f"subscriber: {received} batches, last seq {last}, seq gaps {gaps}")

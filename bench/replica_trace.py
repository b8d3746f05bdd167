#!/usr/bin/env python3
"""Where a replica-sweep row's slow requests come from.

Reads the per-request trace of `kvroute-demo --replica-sweep --replica-trace-out PATH` and
prints, per row (1 replica, 4 with sharing, ...), over all its rounds:

* each round's p90 TTFT, sorted (on the demo workload they fall in two modes: the p90 is the
  38th slowest of 384 requests, and about that many wait behind a system prompt's first
  prefill, so whether a round's p90 is ~40 or ~110 ms depends on one or two requests);
* the requests slower than a threshold per round, split by kind (first turn of the opening
  burst, first turn of a later conversation, later turn), the router's reason and whether the
  engine reused at least half the prompt;
* for later turns: how often the index predicted more than two blocks the engine did not reuse
  (OVER-prediction: the blocks were evicted between the routing decision and the prefill, or
  the index had not yet heard of their removal), and the gap between the TTFT and the cost the
  router predicted (the queue the cost model did not see);
* for a later turn that stayed on its conversation's rank: the prompt tokens the engine had to
  compute on that rank between the conversation's two turns (what could evict its tail), for
  the turns that kept their cached tail and for those that lost it, and for the latter what
  those tokens were (first or later turns, by the router's reason);
* later turns' TTFT by the requests already on their rank when they were sent (sent earlier,
  first token not yet out: queued or in prefill). With nothing ahead, the TTFT is the path
  (client, router, engine's own overhead and prefill) alone, so a row slower there than one
  replica pays on the path, not in the queue its routing built;
* for prompts placed through their cold owner (the decision names `owner_wait_ms`): how long
  the replica waited for the owner's answer, in the opening burst and after it;
* for first turns the engine mostly computed (it reused less than half the prompt): whether
  their system prompt had been sent anywhere before in the round, and if so how long before and
  to which rank, and what the router predicted for the rank it chose. A cold first turn that
  follows its prompt's previous placement on another rank within a few milliseconds is two
  routers racing; one that follows it by longer is a copy the cost model chose, or a prompt
  that every rank had evicted.

Usage: bench/replica_trace.py TRACE.jsonl [--slow-ms 75] [--burst 32] [--split-p90-ms 80]
  --burst: conversations that start at once (the demo's concurrency).
  --split-p90-ms: report each row's rounds in two groups, those whose p90 TTFT is above this
    and the others, to compare the upper mode's rounds with the lower's.
Standard library only.
"""

import argparse
import collections
import json
import math
import statistics
import sys

OVER_TOKENS_MIN = 32  # two blocks of 16 tokens
AHEAD_MAX = 4  # requests ahead on the rank; more are counted with this many


def field(decision, name):
    for part in (decision or "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


def in_burst(r, burst):
    """A first turn of the conversations that start at once (the workload's opening burst)."""
    return r["turn"] == 0 and r["conversation"] < burst


def quantile(values, q):
    """The demo's percentile: the nearest-rank value (the ceil(q * n)-th smallest)."""
    values = sorted(values)
    return values[max(0, math.ceil(q * len(values)) - 1)] if values else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--slow-ms", type=float, default=75.0)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--split-p90-ms", type=float, default=None)
    args = ap.parse_args()

    runs = collections.defaultdict(list)
    with open(args.trace) as f:
        for line in f:
            r = json.loads(line)
            if not r.get("decision"):
                continue
            r["rank"] = (field(r["decision"], "url"), field(r["decision"], "dp_rank"))
            r["reason"] = field(r["decision"], "reason")
            r["predicted"] = int(field(r["decision"], "matched_blocks") or 0) * 16
            r["cost_ms"] = float(field(r["decision"], "cost_ms") or 0.0)
            r["computed"] = max(0, r["prompt_tokens"] - r["cached_tokens"])
            r["over"] = r["predicted"] - r["cached_tokens"] > OVER_TOKENS_MIN
            wait = field(r["decision"], "owner_wait_ms")
            r["owner_wait_ms"] = float(wait) if wait else None
            runs[(r["row"], r["round"])].append(r)
    if not runs:
        sys.exit(f"{args.trace}: no request with a decision header")

    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    for (row, _round), requests in runs.items():
        round_p90 = quantile([r["ttft_ms"] for r in requests], 0.9)
        if args.split_p90_ms is not None:
            side = ">" if round_p90 > args.split_p90_ms else "<="
            row = f"{row} [rounds with p90 {side} {args.split_p90_ms:g} ms]"
        out = rows[row]
        out["rounds"].append(1)
        out["round_p90"].append(round_p90)
        last_placement = {}
        for r in sorted(requests, key=lambda r: r["sent_ms"]):
            tenant = r.get("tenant")
            if r["turn"] == 0 and r["cached_tokens"] < r["prompt_tokens"] / 2:
                before = last_placement.get(tenant)
                if before is None:
                    out["cold_first"].append(("prompt's first placement", r["reason"], "-"))
                else:
                    age_ms = r["sent_ms"] - before["sent_ms"]
                    where = "same rank" if before["rank"] == r["rank"] else "other rank"
                    age = "< 10 ms" if age_ms < 10 else "< 100 ms" if age_ms < 100 else ">= 100 ms"
                    predicted = "predicted hit" if r["predicted"] >= r["prompt_tokens"] / 2 else "predicted miss"
                    out["cold_first"].append((f"previous {age} on {where}", r["reason"], predicted))
            if r["turn"] == 0:
                last_placement[tenant] = r
        by_conversation = collections.defaultdict(list)
        by_rank = collections.defaultdict(list)
        for r in requests:
            by_conversation[r["conversation"]].append(r)
            by_rank[r["rank"]].append(r)
            if r["ttft_ms"] > args.slow_ms:
                kind = (
                    "burst first turn" if in_burst(r, args.burst)
                    else "later first turn" if r["turn"] == 0
                    else "later turn"
                )
                reused = "hit" if r["cached_tokens"] >= r["prompt_tokens"] / 2 else "miss"
                out["slow"].append((kind, r["reason"], reused))
            if r["turn"] > 0:
                out["later"].append(r)
            if r["owner_wait_ms"] is not None:
                kind = "burst" if in_burst(r, args.burst) else "after the burst"
                out["owner_wait"].append((kind, r["owner_wait_ms"]))
        for r in requests:
            if r["turn"] > 0:
                ahead = sum(
                    1
                    for x in by_rank[r["rank"]]
                    if x["sent_ms"] < r["sent_ms"] < x["sent_ms"] + x["ttft_ms"]
                )
                out["later_by_ahead"].append((min(ahead, AHEAD_MAX), r["ttft_ms"]))
        for turns in by_conversation.values():
            turns.sort(key=lambda r: r["turn"])
            for before, after in zip(turns, turns[1:]):
                if before["rank"] != after["rank"]:
                    continue
                between = [
                    x
                    for x in by_rank[after["rank"]]
                    if before["sent_ms"] < x["sent_ms"] < after["sent_ms"]
                ]
                out["lost" if after["over"] else "kept"].append(sum(x["computed"] for x in between))
                if after["over"]:
                    for x in between:
                        kind = "first turn" if x["turn"] == 0 else "later turn"
                        out["lost_between"].append(((kind, x["reason"]), x["computed"]))

    for row in sorted(rows):
        out = rows[row]
        n_rounds = len(out["rounds"])
        later = out["later"]
        print(f"== {row} ({n_rounds} rounds)")
        print("  p90 TTFT per round, sorted: " + ", ".join(f"{p:.1f}" for p in sorted(out["round_p90"])))
        print(f"  slower than {args.slow_ms:g} ms: {len(out['slow']) / n_rounds:.1f} per round")
        for key, count in collections.Counter(out["slow"]).most_common(8):
            print(f"    {count / n_rounds:5.1f}  {' / '.join(key)}")
        if later:
            over = sum(1 for r in later if r["over"])
            gap = [r["ttft_ms"] - r["cost_ms"] for r in later]
            print(
                f"  later turns: {len(later)}; over-predicted by > 2 blocks {100 * over / len(later):.1f} %;"
                f" TTFT - predicted cost p50 {quantile(gap, .5):.1f} / p90 {quantile(gap, .9):.1f}"
                f" / p99 {quantile(gap, .99):.1f} ms"
            )
        by_ahead = collections.defaultdict(list)
        for ahead, ttft in out["later_by_ahead"]:
            by_ahead[ahead].append(ttft)
        if by_ahead:
            print(
                "  later turns' TTFT p50 by requests ahead on their rank: "
                + ", ".join(
                    f"{a}{'+' if a == AHEAD_MAX else ''}: {quantile(v, .5):.1f} ms ({len(v) / n_rounds:.0f}/round)"
                    for a, v in sorted(by_ahead.items())
                )
            )
        waits = collections.defaultdict(list)
        for kind, ms in out["owner_wait"]:
            waits[kind].append(ms)
        for kind, v in sorted(waits.items()):
            print(
                f"  waited for the cold prompt's owner, {kind}: {len(v) / n_rounds:.1f} per round,"
                f" p50 {quantile(v, .5):.2f} / p90 {quantile(v, .9):.2f} / max {max(v):.2f} ms"
            )
        cold = out["cold_first"]
        if cold:
            print(f"  first turns the engine mostly computed: {len(cold) / n_rounds:.1f} per round")
            for key, count in collections.Counter(cold).most_common(10):
                print(f"    {count / n_rounds:5.1f}  {' / '.join(key)}")
        for name in ("kept", "lost"):
            v = out[name]
            if v:
                print(
                    f"  stayed on its rank, tail {name}: {len(v)}; tokens computed on that rank"
                    f" between the two turns median {statistics.median(v):.0f}, p90 {quantile(v, .9):.0f}"
                )
        by_kind = collections.Counter()
        for key, computed in out["lost_between"]:
            by_kind[key] += computed
        total = sum(by_kind.values())
        if total:
            print("  what that rank computed between the two turns of a tail lost, by request:")
            for key, computed in by_kind.most_common(6):
                print(f"    {100 * computed / total:5.1f} %  {' / '.join(key)}")


if __name__ == "__main__":
    main()

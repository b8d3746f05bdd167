#!/usr/bin/env python3
"""Summarises a bench/quality_vs_peers.sh run: results.tsv (round, row, load, JSON path) ->
markdown tables on stdout (per row: medians over the rounds and their ranges; then every
round) and the head-to-head verdict of kvroute cache_aware against each peer's cache-aware
policy on hit rate and p90 TTFT. Medians, because a round is 160 requests on a shared 2-core
machine and one noisy round should not decide a comparison."""

import csv
import json
import statistics
import sys

ROW_ORDER = [
    "in-process oracle",
    "in-process cache_aware",
    "in-process round_robin",
    "kvroute-cache_aware",
    "kvroute-round_robin",
    "sglang-cache_aware",
    "sglang-round_robin",
    "vllm-cache_aware",
    "vllm-kv_aware",
    "vllm-round_robin",
    "sglang-cache_aware-no_dp",
    "vllm-cache_aware-no_dp",
]
PEER_CACHE_ROWS = ["sglang-cache_aware", "vllm-cache_aware", "vllm-kv_aware"]


def load(path):
    rows = {}  # name -> list of (round, load, row json)
    with open(path) as fh:
        for rec in csv.DictReader(fh, delimiter="\t"):
            try:
                doc = json.load(open(rec["json"]))
            except (OSError, ValueError):
                rows.setdefault(rec["row"], []).append((rec["round"], rec["loadavg_1m"], None))
                continue
            for r in doc["rows"]:
                name = r["name"] if rec["row"] != "in-process" else "in-process " + r["name"]
                rows.setdefault(name, []).append((rec["round"], rec["loadavg_1m"], r))
    return rows


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def fig(runs, key, scale=1.0):
    # Older result files have no p50: such rounds are left out of that column.
    return [r[key] * scale for _, _, r in runs if r is not None and key in r]


def bal(runs, key):
    return [r["balance"][key] * 100 for _, _, r in runs if r is not None and r.get("balance")]


def rng(xs, fmt):
    if not xs:
        return "-"
    if len(xs) == 1:
        return fmt % xs[0]
    return (fmt + " (" + fmt + "-" + fmt + ")") % (med(xs), min(xs), max(xs))


def main():
    rows = load(sys.argv[1])
    names = [n for n in ROW_ORDER if n in rows] + sorted(n for n in rows if n not in ROW_ORDER)
    rounds = max((len(v) for v in rows.values()), default=0)
    print("Medians over %d round(s); (min-max) when more than one." % rounds)
    print()
    print("| row | hit rate % | TTFT mean ms | TTFT p50 ms | TTFT p90 ms | req/s | failed / requests | busiest rank % | busiest engine % | load avg 1m |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        runs = rows[n]
        ok = [r for _, _, r in runs if r is not None]
        failed = sum(r["failures"] for r in ok)
        total = sum(r["requests"] + r["failures"] for r in ok)
        missing = sum(1 for _, _, r in runs if r is None)
        print("| %s | %s | %s | %s | %s | %s | %d / %d%s | %s | %s | %s |" % (
            n,
            rng(fig(runs, "hit_rate", 100), "%.1f"),
            rng(fig(runs, "ttft_mean_ms"), "%.1f"),
            rng(fig(runs, "ttft_p50_ms"), "%.1f"),
            rng(fig(runs, "ttft_p90_ms"), "%.1f"),
            rng(fig(runs, "throughput_rps"), "%.1f"),
            failed, total, (" (%d round(s) produced no result)" % missing) if missing else "",
            rng(bal(runs, "busiest_rank_share"), "%.1f"),
            rng(bal(runs, "busiest_engine_share"), "%.1f"),
            ", ".join(l for _, l, _ in runs),
        ))
    print()
    print("Every round:")
    print()
    print("| round | row | hit rate % | TTFT mean ms | TTFT p90 ms | req/s | failed | busiest rank % | busiest engine % | requests per rank (engine order) | load avg 1m |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        for rnd, la, r in rows[n]:
            if r is None:
                print("| %s | %s | no result | | | | | | | | %s |" % (rnd, n, la))
                continue
            b = r.get("balance") or {}
            per_rank = " ".join(str(x["requests"]) for x in b.get("ranks", []))
            print("| %s | %s | %.1f | %.1f | %.1f | %.1f | %d | %s | %s | %s | %s |" % (
                rnd, n, r["hit_rate"] * 100, r["ttft_mean_ms"], r["ttft_p90_ms"],
                r["throughput_rps"], r["failures"],
                "%.1f" % (b["busiest_rank_share"] * 100) if b else "-",
                "%.1f" % (b["busiest_engine_share"] * 100) if b else "-",
                per_rank or "-", la))
    print()
    ours = rows.get("kvroute-cache_aware")
    if not ours:
        return
    oh, op = med(fig(ours, "hit_rate", 100)), med(fig(ours, "ttft_p90_ms"))
    print("Head to head (medians): kvroute cache_aware hit rate %.1f%%, p90 TTFT %.1f ms" % (oh, op))
    for peer in PEER_CACHE_ROWS + ["kvroute-round_robin", "sglang-round_robin", "vllm-round_robin"]:
        if peer not in rows:
            continue
        ph, pp = med(fig(rows[peer], "hit_rate", 100)), med(fig(rows[peer], "ttft_p90_ms"))
        verdict = "beats" if oh > ph and op < pp else "does NOT beat"
        print("- vs %s: hit rate %.1f%% (%+.1f points), p90 TTFT %.1f ms (%+.1f ms, %+.0f%%): %s on both" % (
            peer, ph, oh - ph, pp, op - pp, 100.0 * (op - pp) / pp if pp else float("nan"), verdict))
    for n in names:
        moved = [(r["continuations"]["moved"], r["continuations"]["routed"], r["continuations"]["moved_by_reason"])
                 for _, _, r in rows[n] if r is not None and r.get("continuations")]
        if moved:
            print("- %s: later turns sent to another rank than their previous turn, per round: %s" % (
                n, "; ".join("%d of %d (%s)" % (m, t, ", ".join("%s %d" % kv for kv in sorted(why.items())) or "none")
                             for m, t, why in moved)))
    oracle = rows.get("in-process oracle")
    if oracle:
        orh = med(fig(oracle, "hit_rate", 100))
        print("- external kvroute cache_aware / in-process oracle hit rate: %.1f%%" % (100.0 * oh / orh if orh else float("nan")))


if __name__ == "__main__":
    main()

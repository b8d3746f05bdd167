#!/usr/bin/env bash
# Herding check: runs `kvroute-demo --json --policies cache-aware` RUNS times (fresh in-process
# fleet each time) and prints, per row (cache_aware, oracle), how many runs HERDED (the busiest
# DP rank served >= HERD_SHARE of all requests), the median and worst hit rate and p90 TTFT, and
# the largest busiest-rank share.
#
# Why: a router that herds does so in a minority of runs (1-2 runs in 20 on the demo's
# mixed load), so one demo run or five bench rounds cannot show whether a change removed it.
# Each run takes ~3 s on 2 cores.
#
# Usage: bench/demo_balance.sh [extra `kvroute-demo` flags...]
#   RUNS=20 HERD_SHARE=0.35 KVROUTE_DEMO_BIN=target/release/kvroute-demo
# Example (the earlier uniform workload): bench/demo_balance.sh --system-prompt-skew 0 \
#   --conversations 40 --concurrency 16 --fleet-prefill parallel
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${KVROUTE_DEMO_BIN:-$root/target/release/kvroute-demo}"
runs="${RUNS:-20}"
share="${HERD_SHARE:-0.35}"
[ -x "$bin" ] || { echo "no kvroute-demo binary at $bin (cargo build --release -p kvroute-demo)" >&2; exit 2; }
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
for i in $(seq 1 "$runs"); do
  if ! "$bin" --json --policies cache-aware "$@" 2>/dev/null >>"$out"; then
    echo "run $i failed" >&2
    exit 1
  fi
  echo >>"$out"
  printf '.' >&2
done
echo >&2
python3 - "$out" "$share" <<'PY'
import json, statistics, sys
path, share = sys.argv[1], float(sys.argv[2])
rows = {}
for line in open(path):
    line = line.strip()
    if not line:
        continue
    for r in json.loads(line)["rows"]:
        rows.setdefault(r["name"], []).append(r)
for name, rs in rows.items():
    busiest = [r["balance"]["busiest_rank_share"] for r in rs]
    hit = [r["hit_rate"] * 100 for r in rs]
    p90 = [r["ttft_p90_ms"] for r in rs]
    print(f"{name:12} runs {len(rs):3}  herded {sum(b >= share for b in busiest):2}  "
          f"hit % median {statistics.median(hit):.1f} min {min(hit):.1f}  "
          f"p90 ms median {statistics.median(p90):.1f} max {max(p90):.1f}  "
          f"busiest rank max {max(busiest) * 100:.1f} %")
PY

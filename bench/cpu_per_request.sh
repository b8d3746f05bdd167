#!/usr/bin/env bash
# CPU the router spends per proxied request, for two router binaries, alternating.
#
# Why it exists: the side-by-side's throughput (one 10 s wrk window per row) moves by more between
# two runs of one binary on a shared 2-core machine than a change to the data path usually does,
# so an A/B of two builds needs a quantity the neighbours disturb less. The CPU time the router
# process itself accumulates over a fixed number of requests at a fixed rate is that quantity:
# queueing behind other processes lengthens latency but adds no CPU time to the router.
#
# Set-up: the same nginx backends as bench/side_by_side.sh (two workers answering fixed JSON),
# the router on them with --policy POLICY, token-id /v1/completions bodies of 2,048 ids.
# cache-aware runs with no KV publisher, so each request hashes its 128 blocks and matches an
# empty index (the full routing path, minus hits). Per round and binary: start the router, 3 s of
# warm-up, then DURATION_S at RATE req/s (kvroute-loadgen, open loop), the router's utime + stime
# read from /proc/PID/stat before and after.
#
# Usage: ROUTER_BIN=... ROUTER_BIN_BASELINE=... bench/cpu_per_request.sh
# Env: POLICY (round-robin), ROUNDS (4), RATE (2000), DURATION_S (10), PORT_BASE (18700; ports
#      PORT_BASE..PORT_BASE+10 are used). Needs nginx, curl, python3 and a release build of
#      kvroute-bench (target/release/kvroute-loadgen).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=bench/lib.sh
. "$root/bench/lib.sh"
HEALTH_WAIT_S=60
: "${ROUTER_BIN:?the router binary to measure}"
: "${ROUTER_BIN_BASELINE:?the router binary to compare it with}"
POLICY="${POLICY:-round-robin}"
ROUNDS="${ROUNDS:-4}"
RATE="${RATE:-2000}"
DURATION_S="${DURATION_S:-10}"
PORT_BASE="${PORT_BASE:-18700}"
loadgen="$root/target/release/kvroute-loadgen"
[ -x "$loadgen" ] || { echo "no $loadgen: cargo build --release -p kvroute-bench" >&2; exit 1; }

out="$root/target/bench-cpu/$(date -u +%Y%m%dT%H%M%SZ)"
ng="$out/nginx"
NG_A=$((PORT_BASE + 1)); NG_B=$((PORT_BASE + 2)); ROUTER=$((PORT_BASE + 5))
# KV and replay ports no publisher listens on: cache-aware then routes on an empty index.
write_nginx_backend_conf "$ng" "$NG_A" "$NG_B" "$((PORT_BASE + 3))" "$((PORT_BASE + 7))" \
  "$((PORT_BASE + 9))"
python3 -c 'import json; print(json.dumps({"model": "kvroute-sim", "prompt": [(i * 7919) % 50000 + 1 for i in range(2048)], "max_tokens": 1}))' >"$out/body.json"

nginx -p "$ng" -c "$ng/nginx.conf" -g 'daemon off;' >"$ng/stdout.log" 2>&1 &
nginx_pid=$!
router_pid=""
cleanup() {
  [ -n "$router_pid" ] && kill "$router_pid" 2>/dev/null || true
  kill "$nginx_pid" 2>/dev/null || true
}
trap cleanup EXIT
wait_http "http://127.0.0.1:$NG_A/health" "nginx worker A"

ticks_per_s="$(getconf CLK_TCK)"
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
measure() { # label binary
  "$2" --host 127.0.0.1 --port "$ROUTER" --policy "$POLICY" \
    --worker-urls "http://127.0.0.1:$NG_A" "http://127.0.0.1:$NG_B" >"$out/router-$1.log" 2>&1 &
  router_pid=$!
  wait_http "http://127.0.0.1:$ROUTER/readyz" "router $1"
  local url="http://127.0.0.1:$ROUTER/v1/completions"
  "$loadgen" --url "$url" --body-file "$out/body.json" --rate "$RATE" --duration-s 3 --json >/dev/null
  local before after
  before="$(cpu_ticks "$router_pid")"
  "$loadgen" --url "$url" --body-file "$out/body.json" --rate "$RATE" --duration-s "$DURATION_S" \
    --json >"$out/$1.$round.json"
  after="$(cpu_ticks "$router_pid")"
  kill "$router_pid"; wait "$router_pid" 2>/dev/null || true; router_pid=""
  python3 - "$1" "$out/$1.$round.json" "$((after - before))" "$ticks_per_s" <<'EOF'
import json, sys
label, path, ticks, per_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
d = json.load(open(path))
ok = d["ok_total"]
errors = d["errors_status"] + d["errors_io"] + d["errors_timeout"]
print(f"{label}\tcpu_us_per_request={ticks / per_s * 1e6 / max(ok, 1):.1f}\trequests={ok}"
      f"\terrors={errors}\tp50_us={d['latency_us']['p50']:.0f}\tp99_us={d['latency_us']['p99']:.0f}")
EOF
}
log "results: $out ($POLICY, $ROUNDS rounds, $RATE req/s for ${DURATION_S}s)"
for ((round = 1; round <= ROUNDS; round++)); do
  measure main "$ROUTER_BIN"
  measure baseline "$ROUTER_BIN_BASELINE"
done | tee "$out/results.tsv"

#!/usr/bin/env bash
# Hostile clients beside a normal one: what idle, slowloris and non-reading clients cost the
# clients who behave. One router (the production build, default limits) in front of two
# instant kvroute-sim engines; a normal client sends RATE req/s of token-id completions for
# LATENCY_S seconds, first alone, then while kvroute-hostile holds IDLE idle connections,
# SLOWLORIS connections dripping a request head at one byte a second, and NON_READERS clients
# that ask for a streamed answer and never read it. The router's RSS and open file descriptors
# are sampled from /proc every second through both windows.
#
# Prints a markdown table; raw results under target/bench-hostile/<UTC time>/.
#
# Env: RATE (500) LATENCY_S (30) IDLE (5000) SLOWLORIS (100) NON_READERS (50) SKIP_BUILD (1 =
#      use the existing binaries) PORT_BASE (18600)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
RATE="${RATE:-500}"
LATENCY_S="${LATENCY_S:-30}"
IDLE="${IDLE:-5000}"
SLOWLORIS="${SLOWLORIS:-100}"
NON_READERS="${NON_READERS:-50}"
PORT_BASE="${PORT_BASE:-18600}"
HEALTH_WAIT_S=60
# shellcheck source=bench/lib.sh
. "$root/bench/lib.sh"

out="$root/target/bench-hostile/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
log "results: $out"
# 5,000 idle connections need as many descriptors in the client and in the router.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  log "cargo build --profile production -p kvroute; --release -p kvroute-sim -p kvroute-bench"
  (cd "$root" && cargo build --profile production -p kvroute &&
    cargo build --release -p kvroute-sim -p kvroute-bench) >"$out/build.log" 2>&1
fi
router_bin="${CARGO_TARGET_DIR:-$root/target}/production/kvroute"
bin="${CARGO_TARGET_DIR:-$root/target}/release"

SIM=$((PORT_BASE + 1)); SIM_KV=$((PORT_BASE + 11)); SIM_REPLAY=$((PORT_BASE + 21))
SIM_LOAD=$((PORT_BASE + 31)); ROUTER=$((PORT_BASE + 41)); INTERNAL=$((PORT_BASE + 42))
"$bin/kvroute-sim" --engines 2 --instant --port "$SIM" --kv-port-base "$SIM_KV" \
  --replay-port-base "$SIM_REPLAY" --load-port-base "$SIM_LOAD" >"$out/sim.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$SIM/health" "sim engine 0"
wait_http "http://127.0.0.1:$((SIM + 1))/health" "sim engine 1"
RUST_LOG=warn "$router_bin" --host 127.0.0.1 --port "$ROUTER" --internal-port "$INTERNAL" \
  --worker-urls "http://127.0.0.1:$SIM" "http://127.0.0.1:$((SIM + 1))" >"$out/router.log" 2>&1 &
router_pid=$!
pids+=("$router_pid")
wait_http "http://127.0.0.1:$ROUTER/readyz" "the router"

python3 - "$out/body.json" <<'PY'
import json, sys
json.dump({"model": "kvroute-sim", "prompt": list(range(1000, 1512)), "max_tokens": 1},
          open(sys.argv[1], "w"))
PY

sample() { # file: one "seconds rss_kb fds" line per second until killed
  local t0=$SECONDS
  while kill -0 "$router_pid" 2>/dev/null; do
    printf '%s %s %s\n' $((SECONDS - t0)) \
      "$(awk '/^VmRSS/ {print $2}' "/proc/$router_pid/status")" \
      "$(find "/proc/$router_pid/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)" >>"$1"
    sleep 1
  done
}

window() { # name: one open-loop window of the normal client
  "$bin/kvroute-loadgen" --url "http://127.0.0.1:$ROUTER/v1/completions" \
    --body-file "$out/body.json" --rate "$RATE" --duration-s "$LATENCY_S" --warmup-s 2 \
    --connections 32 --json >"$out/$1.json"
}

log "baseline: $RATE req/s for ${LATENCY_S}s, no hostile clients"
sample "$out/baseline.samples" & sampler=$!
window baseline
kill "$sampler" 2>/dev/null || true

log "hostile: $IDLE idle, $SLOWLORIS slowloris, $NON_READERS non-readers, then the same window"
hostile_s=$((LATENCY_S + 15))
"$bin/kvroute-hostile" --target "127.0.0.1:$ROUTER" --idle "$IDLE" --slowloris "$SLOWLORIS" \
  --non-readers "$NON_READERS" --duration-s "$hostile_s" >"$out/hostile.json" 2>"$out/hostile.err" &
hostile_pid=$!
pids+=("$hostile_pid")
sample "$out/under_hostile.samples" & sampler=$!
# Let the hostile clients connect before measuring.
deadline=$((SECONDS + 30))
while [ $SECONDS -lt $deadline ]; do
  open="$(curl -s --max-time 2 "http://127.0.0.1:$ROUTER/metrics" | awk '/^kvroute_client_connections_open / {print $2}')"
  [ "${open:-0}" -ge $((IDLE * 9 / 10)) ] && break
  sleep 0.5
done
log "router holds ${open:-?} client connections"
window under_hostile
wait "$hostile_pid" || true
kill "$sampler" 2>/dev/null || true
curl -s --max-time 2 "http://127.0.0.1:$ROUTER/metrics" | grep '^kvroute_client_connections' >"$out/metrics.txt" || true

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def samples(name):
    rows = [l.split() for l in open("%s/%s.samples" % (out, name)) if len(l.split()) == 3]
    return max(int(r[1]) for r in rows) / 1024, max(int(r[2]) for r in rows)
print("| window | req/s | p50 us | p99 us | p99.9 us | errors | router RSS max MB | router fds max |")
print("|---|---|---|---|---|---|---|---|")
for name in ("baseline", "under_hostile"):
    r = json.load(open("%s/%s.json" % (out, name)))
    lat = r["latency_us"]
    errs = r["errors_status"] + r["errors_io"] + r["errors_timeout"] + r["not_sent"]
    rss, fds = samples(name)
    print("| %s | %.0f | %d | %d | %d | %d | %.0f | %d |" % (name, r["req_per_s"],
          lat["p50"], lat["p99"], lat["p999"], errs, rss, fds))
print()
print("hostile clients: " + open("%s/hostile.json" % out).read().strip())
print("router: " + " ".join(l.strip() for l in open("%s/metrics.txt" % out)))
PY

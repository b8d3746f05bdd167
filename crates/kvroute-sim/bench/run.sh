#!/usr/bin/env bash
# kvroute-sim throughput benchmark: release build, `--instant` (no simulated delays), one wrk
# load generator on loopback, a Python SUB counting the KV batches while it runs.
#   crates/kvroute-sim/bench/run.sh [ENGINES] [DP_SIZE] [SECONDS]
# With ENGINES > 1, one wrk per engine for the first two engines (the machine has 2 cores).
set -euo pipefail
root="$(cd "$(dirname "$0")/../../.." && pwd)"
engines="${1:-1}"; dp="${2:-1}"; secs="${3:-10}"
cd "$root"
cargo build --release -q -p kvroute-sim
py="$("$root/scripts/python-env.sh")"
out="$(mktemp)"
./target/release/kvroute-sim --instant --engines "$engines" --dp-size "$dp" --capacity-blocks 1024 \
  --port 0 --kv-port-base 0 --replay-port-base 0 >"$out" 2>/dev/null &
sim=$!
trap 'kill $sim 2>/dev/null || true; rm -f "$out"' EXIT
start=$(date +%s%N)
until [ "$(grep -c http= "$out" || true)" = "$engines" ]; do
  kill -0 "$sim" 2>/dev/null || { echo "kvroute-sim died" >&2; exit 1; }
  sleep 0.005
done
echo "startup to serving: $(( ($(date +%s%N) - start) / 1000000 )) ms ($engines engines x dp $dp)"
echo "RSS idle: $(grep VmRSS /proc/$sim/status | awk '{print $2, $3}')"
url0=$(sed -n 1p "$out" | grep -o 'http=[^ ]*' | cut -d= -f2)
kv0=$(sed -n 1p "$out" | grep -o 'kv=[^ ,]*' | cut -d= -f2)
"$py" "$root/crates/kvroute-sim/bench/sub_count.py" "$kv0" "$((secs + 2))" &
subpid=$!
sleep 1 # let the SUB connect before load starts (only affects the batch count it reports)
lua="$root/crates/kvroute-sim/bench/completions.lua"
if [ "$engines" = 1 ]; then
  wrk -t2 -c64 -d"${secs}s" -s "$lua" "$url0/v1/completions"
else
  url1=$(sed -n "$((engines / 2 + 1))p" "$out" | grep -o 'http=[^ ]*' | cut -d= -f2)
  wrk -t1 -c32 -d"${secs}s" -s "$lua" "$url0/v1/completions" | sed 's/^/[engine 0] /' &
  w0=$!
  wrk -t1 -c32 -d"${secs}s" -s "$lua" "$url1/v1/completions" | sed "s/^/[engine $((engines / 2))] /"
  wait $w0
fi
wait $subpid
echo "RSS after load: $(grep VmRSS /proc/$sim/status | awk '{print $2, $3}')"

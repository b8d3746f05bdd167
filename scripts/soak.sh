#!/usr/bin/env bash
# The soak: one router in front of 16 simulated engine ranks, an open-loop client at 500 req/s
# and a chaos driver (engine restarts, withheld KV batches, hangs mid-stream, requests accepted
# and never answered), for SOAK_SECONDS (default 600), then the end-of-run checks of
# crates/kvroute-fleet/src/soak.rs: no panic, flat RSS, the router's view equal to the engines'
# caches, a response for every request, every fault accounted for. Exits non-zero when a check
# fails. The report (JSON) and the processes' logs go to target/soak/<UTC time>/.
#
#   scripts/soak.sh                                   # 10 minutes, release build
#   SOAK_SECONDS=120 SOAK_PROFILE=dev scripts/soak.sh # the CI version (reuses the test build)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

seconds="${SOAK_SECONDS:-600}"
rate="${SOAK_RATE:-500}"
chaos_period_ms="${SOAK_CHAOS_PERIOD_MS:-5000}"
profile="${SOAK_PROFILE:-release}"
case "$profile" in
  dev) profile_dir=debug; profile_flag=() ;;
  release) profile_dir=release; profile_flag=(--release) ;;
  *) profile_dir="$profile"; profile_flag=(--profile "$profile") ;;
esac

out="$root/target/soak/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
cargo build --locked "${profile_flag[@]}" -p kvroute -p kvroute-sim -p kvroute-fleet --bins
# The harness writes every process's log under $TMPDIR/kvroute-fleet-<pid>/: keep them with
# the report.
export TMPDIR="$out"
echo "soak: ${seconds} s at ${rate} req/s, a fault every ${chaos_period_ms} ms; results in $out"
status=0
KVROUTE_FLEET_BIN_DIR="$root/target/$profile_dir" \
  "$root/target/$profile_dir/kvroute-soak" --duration-s "$seconds" --rate "$rate" \
  --chaos-period-ms "$chaos_period_ms" > "$out/report.json" || status=$?
cat "$out/report.json"
exit "$status"

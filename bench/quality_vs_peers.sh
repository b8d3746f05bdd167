#!/usr/bin/env bash
# Routing quality on the `kvroute-demo` workload: kvroute vs sglang-router vs vllm-router, in one
# run, each router in front of the same kind of simulated fleet, driven by the same client.
#
# What it measures, per row: the engines' cache hit rate (sum cached_tokens / sum prompt_tokens
# from the usage chunks), time to first token (first streamed chunk at the client; mean and
# p90), throughput, failed requests, and the load balance (share of all requests served by the
# busiest DP rank and by the busiest engine, counted by the engines themselves).
#
# Why it is shaped this way:
# - The workload is the demo's, unchanged: `kvroute-demo --router-url URL` drives the same
#   conversations (same seed, 96 conversations over 8 ~700-word system prompts whose
#   popularity is Zipf 1.2, so one prompt opens ~43 % of them; 4 turns, every turn resends the
#   history, 24 output tokens, streaming chat, concurrency 32) through any router. The driver
#   is the demo's own code, not a copy. `KVROUTE_DEMO_*` variables (the demo's own flags'
#   env names) change the workload for every row alike; the earlier, uniform light workload is
#   `KVROUTE_DEMO_SYSTEM_PROMPT_SKEW=0 KVROUTE_DEMO_CONVERSATIONS=40 KVROUTE_DEMO_CONCURRENCY=16
#   FLEET_PREFILL=parallel`. `KVROUTE_DEMO_WORKLOAD=long-conversations` runs the demo's long,
#   mostly unique conversations instead (see `kvroute-demo --help`; sized like a production
#   trace, a mean prompt of ~12k tokens), with every fleet's caches sized to about half of that
#   workload (`KVROUTE_DEMO_LONG_CAPACITY_BLOCKS`, 4,096 blocks).
# - Every row gets a FRESH `kvroute-sim` process configured like the demo's in-process fleet:
#   4 engines x 2 DP ranks = 8 ranks, block 16 tokens, 320 device blocks per rank, 2 ms
#   overhead + 60 us per uncached prompt token + 1 ms per output token, load stats published,
#   and (FLEET_PREFILL=serial, the demo's default) one prefill at a time per rank, as on a
#   compute-bound GPU, so load on a rank delays its prompts. Cold caches for every row;
#   nothing a previous row left behind.
# - Each router gets its best honest configuration for 8 ranks:
#   * kvroute: `--policy cache-aware|round-robin`, the workers' `/server_info` gives it the KV
#     publishers and DP size; `--prefill-cost-us-per-token 60` (the sim's real cost, as the
#     in-process demo uses); the same tokenizer file as the engines.
#   * sglang-router 0.3.2: `--dp-aware` (it reads dp_size from `/server_info` and sends
#     `data_parallel_rank` in the body, which the sim honours), defaults otherwise.
#   * vllm-router 0.1.17: `--intra-node-data-parallel-size 2` (DP-aware; it insists on an
#     `--api-key` then, which the sim ignores) and the `x-data-parallel-rank` header. Its
#     cache_aware and kv_aware both ask every engine for the prompt's ids
#     (`/v1/chat/completions/render`, which kvroute-sim serves like vLLM). kv_aware is fed
#     vLLM-encoded KV events from every rank (`--kv-event-source URL=rank0,rank1` plus replay
#     sources), block size 16.
#   * Extra rows `*-cache_aware-no_dp`: the peers' cache_aware without DP awareness (4 workers,
#     the engine places each request on its least-loaded rank), for comparison only.
# - Before each row is measured, one tiny chat request ("readiness probe") goes through the
#   router so every router has proven it can serve; the engines' counters are read before and
#   after the run, so the probe is not counted. kvroute rows also wait until every rank's KV
#   subscriber is connected (as the in-process demo does).
# - Rounds: every row once per round, rounds repeated REPEATS times, so background load drift
#   on this shared 2-core machine hits all rows alike. The 1-minute load average is recorded
#   before each measurement.
# - The oracle row (cache_aware reading the engines' ACTUAL caches) only exists in-process, so
#   `kvroute-demo --json --policies cache-aware,round-robin` runs once per round too; its
#   in-process cache_aware / round_robin rows double as a check that the external set-up
#   reproduces the demo.
#
# Usage: bench/quality_vs_peers.sh [--help]
# Env: REPEATS (5) rounds; ROWS (regex over row names, default all); PORT_BASE (18600; ports
#      PORT_BASE..PORT_BASE+99 are used); SKIP_BUILD (1 = use the existing release binaries);
#      SKIP_INSTALL (1 = do not create the peers' venv); SETTLE_MS (500) pause after a router is
#      ready and probed, before the run (lets ZMQ subscriptions settle for the peers, which
#      expose no subscriber state); FLEET_PREFILL (serial) the fleet's prefill model, serial or
#      parallel, for the sims and the in-process rows alike; SIM_EXTRA_ARGS (empty) extra
#      kvroute-sim flags for every external row, for sensitivity runs that are NOT the demo's
#      fleet;
#      the in-process rows are skipped then, since the in-process fleet cannot take them;
#      KVROUTE_EXTRA_ARGS (empty) extra flags for the external kvroute rows (diagnostics, e.g.
#      a different cost-model weight; say so when quoting such a run).
# Output: target/bench-quality/<UTC time>/ (per-row JSON, router logs and metrics, results.tsv)
#         and a markdown table on stdout.
set -euo pipefail

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,/^set -euo pipefail/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  exit 0
fi

root="$(cd "$(dirname "$0")/.." && pwd)"
REPEATS="${REPEATS:-5}"
ROWS="${ROWS:-.}"
PORT_BASE="${PORT_BASE:-18600}"
SETTLE_MS="${SETTLE_MS:-500}"
SIM_EXTRA_ARGS="${SIM_EXTRA_ARGS:-}"
FLEET_PREFILL="${FLEET_PREFILL:-serial}"
case "$FLEET_PREFILL" in
  serial) fleet_prefill_flag=--prefill-serial ;;
  parallel) fleet_prefill_flag= ;;
  *) echo "FLEET_PREFILL must be serial or parallel, got '$FLEET_PREFILL'" >&2; exit 2 ;;
esac
KVROUTE_EXTRA_ARGS="${KVROUTE_EXTRA_ARGS:-}"
HEALTH_WAIT_S=60

out="$root/target/bench-quality/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
echo "results: $out" >&2
# shellcheck source=bench/lib.sh
. "$root/bench/lib.sh"

sim_pid=""
router_pid=""
stop_pid() { # pid: TERM, wait for it
  if [ -n "$1" ]; then
    kill "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
  fi
}
cleanup() {
  stop_pid "$router_pid"
  stop_pid "$sim_pid"
}
trap cleanup EXIT INT TERM

# ---------------------------------------------------------------------------------- install ---
venv="$root/target/bench-peers/venv"
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  if [ ! -x "$venv/bin/vllm-router" ] || [ ! -x "$venv/bin/python" ] ||
    ! "$venv/bin/python" -c 'import sglang_router' 2>/dev/null; then
    log "creating throwaway venv $venv (sglang-router, vllm-router from PyPI)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
      "sglang-router==0.3.2" "vllm-router==0.1.17" >"$out/pip.log" 2>&1
  fi
fi
"$venv/bin/pip" list 2>/dev/null | grep -Ei '^(sglang-router|vllm-router) ' >"$out/peer-versions.txt" || true

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  log "cargo build --release -p kvroute -p kvroute-demo -p kvroute-sim"
  (cd "$root" && cargo build --release -p kvroute -p kvroute-demo -p kvroute-sim) >"$out/build.log" 2>&1
fi
bin="$root/target/release"
{
  echo "git HEAD: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "uncommitted changes in the tree: $(git -C "$root" status --porcelain 2>/dev/null | wc -l) paths"
  echo "machine: $(nproc) cpus, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "kvroute binary: $(stat -c '%y' "$bin/kvroute")"
} >"$out/provenance.txt"

# ------------------------------------------------------------------------------------ ports ---
SIM_HTTP=$((PORT_BASE + 1))     # engines: 1..4
SIM_KV=$((PORT_BASE + 11))      # ranks: 11..18 (engine i rank r = 11 + 2i + r)
SIM_REPLAY=$((PORT_BASE + 31))  # 31..38
SIM_LOAD=$((PORT_BASE + 51))    # 51..58
ROUTER=$((PORT_BASE + 71))      # kvroute's internal listener takes ROUTER + 1
PROM=$((PORT_BASE + 75))
ENGINES=4
DP=2
MODEL=demo-model
engine_urls=()
for i in $(seq 0 $((ENGINES - 1))); do engine_urls+=("http://127.0.0.1:$((SIM_HTTP + i))"); done
engines_csv="$(IFS=,; echo "${engine_urls[*]}")"


# Device blocks per rank: the demo's chat workload uses 320; the long-conversations workload
# (KVROUTE_DEMO_WORKLOAD=long-conversations) sizes the caches to about half its working set,
# with the same value the in-process demo takes.
if [ "${KVROUTE_DEMO_WORKLOAD:-chat}" = long-conversations ]; then
  capacity_blocks="${KVROUTE_DEMO_LONG_CAPACITY_BLOCKS:-4096}"
else
  capacity_blocks=320
fi

start_fleet() { # name kv-encoding
  "$bin/kvroute-sim" --engines "$ENGINES" --dp-size "$DP" --port "$SIM_HTTP" \
    --kv-port-base "$SIM_KV" --replay-port-base "$SIM_REPLAY" --load-port-base "$SIM_LOAD" \
    --load-publish --block-size 16 --capacity-blocks "$capacity_blocks" --overhead-us 2000 \
    --prefill-us-per-token 60 --decode-us-per-token 1000 --served-model-name "$MODEL" \
    --kv-encoding "$2" $fleet_prefill_flag $SIM_EXTRA_ARGS >"$out/$1.sim.log" 2>&1 &
  sim_pid=$!
  for u in "${engine_urls[@]}"; do wait_http "$u/health" "kvroute-sim engine $u"; done
}

R="http://127.0.0.1:$ROUTER"
start_router() { # name kind: starts the router of row `name`
  local name="$1" kind="$2"
  case "$kind" in
    kvroute-cache_aware | kvroute-round_robin)
      local pol=cache-aware
      [ "$kind" = kvroute-round_robin ] && pol=round-robin
      "$bin/kvroute" --host 127.0.0.1 --port "$ROUTER" --policy "$pol" \
        --worker-urls "${engine_urls[@]}" --tokenizer-path "$root/assets/tokenizer/tokenizer.json" \
        --prefill-cost-us-per-token 60 --decision-header $KVROUTE_EXTRA_ARGS >"$out/$name.router.log" 2>&1 &
      router_pid=$!
      wait_http "$R/readyz" "kvroute $pol"
      wait_kvroute_subscribed
      ;;
    sglang-cache_aware | sglang-round_robin | sglang-cache_aware-no_dp)
      local dp_flag=(--dp-aware) pol="${kind#sglang-}"
      [ "$kind" = sglang-cache_aware-no_dp ] && dp_flag=() && pol=cache_aware
      HF_HUB_OFFLINE=1 "$venv/bin/python" -m sglang_router.launch_router --host 127.0.0.1 \
        --port "$ROUTER" --worker-urls "${engine_urls[@]}" --policy "$pol" "${dp_flag[@]}" \
        --log-level warn --prometheus-host 127.0.0.1 --prometheus-port "$PROM" \
        >"$out/$name.router.log" 2>&1 &
      router_pid=$!
      wait_http "$R/health" "sglang-router $kind"
      ;;
    vllm-cache_aware | vllm-round_robin | vllm-cache_aware-no_dp)
      local dp_args=(--intra-node-data-parallel-size "$DP" --api-key bench) pol="${kind#vllm-}"
      [ "$kind" = vllm-cache_aware-no_dp ] && dp_args=() && pol=cache_aware
      "$venv/bin/vllm-router" --host 127.0.0.1 --port "$ROUTER" --worker-urls "${engine_urls[@]}" \
        --policy "$pol" "${dp_args[@]}" \
        --log-level warning --prometheus-host 127.0.0.1 --prometheus-port "$PROM" \
        >"$out/$name.router.log" 2>&1 &
      router_pid=$!
      wait_http "$R/health" "vllm-router $kind"
      ;;
    vllm-kv_aware)
      local src=() i
      for i in $(seq 0 $((ENGINES - 1))); do
        src+=(--kv-event-source "${engine_urls[$i]}=tcp://127.0.0.1:$((SIM_KV + DP * i)),tcp://127.0.0.1:$((SIM_KV + DP * i + 1))")
        src+=(--kv-event-replay-source "${engine_urls[$i]}=tcp://127.0.0.1:$((SIM_REPLAY + DP * i)),tcp://127.0.0.1:$((SIM_REPLAY + DP * i + 1))")
      done
      "$venv/bin/vllm-router" --host 127.0.0.1 --port "$ROUTER" --worker-urls "${engine_urls[@]}" \
        --policy kv_aware --intra-node-data-parallel-size "$DP" --api-key bench "${src[@]}" \
        --kv-event-block-size 16 --kv-event-model "$MODEL" \
        --log-level warning --prometheus-host 127.0.0.1 --prometheus-port "$PROM" \
        >"$out/$name.router.log" 2>&1 &
      router_pid=$!
      wait_http "$R/health" "vllm-router kv_aware"
      ;;
    *) echo "unknown router kind $kind" >&2; return 1 ;;
  esac
}

wait_kvroute_subscribed() { # every rank's KV subscriber connected, as the in-process demo waits
  local deadline=$((SECONDS + HEALTH_WAIT_S)) seen=""
  while [ $SECONDS -lt $deadline ]; do
    seen="$(curl -s --max-time 2 "$R/workers" | python3 -c '
import json, sys
ranks = [r for w in json.load(sys.stdin)["workers"] for r in w.get("kv_ranks", [])]
print("%d/%d" % (sum(1 for r in ranks if str(r.get("subscriber", "")).lower() == "connected"), len(ranks)))' 2>/dev/null || true)"
    [ "$seen" = "$((ENGINES * DP))/$((ENGINES * DP))" ] && return 0
    sleep 0.1
  done
  echo "timed out waiting for kvroute's $((ENGINES * DP)) KV subscribers to connect: last seen $seen" >&2
  return 1
}

probe() { # one tiny chat request through the router; fails the row if it cannot serve
  curl -s --max-time 30 -o "$out/$1.probe.txt" -w '%{http_code}' "$R/v1/chat/completions" \
    -H 'content-type: application/json' \
    -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"readiness probe\"}],\"max_tokens\":1}"
}

results="$out/results.tsv"
printf 'round\trow\tloadavg_1m\tjson\n' >"$results"

measure_external() { # round row kind kv-encoding
  local round="$1" row="$2" kind="$3" enc="$4" name="$2.r$1" code load
  log "$name: fresh fleet ($enc events), router $kind"
  start_fleet "$name" "$enc"
  if ! start_router "$name" "$kind"; then
    log "$name: router did not become ready; row skipped (see $out/$name.router.log)"
    stop_pid "$router_pid"; router_pid=""; stop_pid "$sim_pid"; sim_pid=""
    return 0
  fi
  code="$(probe "$name" || true)"
  [ "$code" = 200 ] || log "$name: readiness probe answered HTTP '$code' (measuring anyway)"
  sleep "$(awk "BEGIN {print $SETTLE_MS / 1000}")"
  load="$(cut -d' ' -f1 /proc/loadavg)"
  log "$name: driving the demo workload (load $load)"
  "$bin/kvroute-demo" --router-url "$R" --engine-urls "$engines_csv" --label "$row" --json \
    >"$out/$name.json" 2>"$out/$name.driver.log" || log "$name: driver reported failures (see $out/$name.driver.log)"
  if [ "$kind" = "${kind#kvroute}" ]; then
    curl -s --max-time 2 "http://127.0.0.1:$PROM/metrics" >"$out/$name.metrics.txt" || true
  else
    curl -s --max-time 2 "$R/metrics" >"$out/$name.metrics.txt" || true
  fi
  stop_pid "$router_pid"; router_pid=""
  stop_pid "$sim_pid"; sim_pid=""
  printf '%s\t%s\t%s\t%s\n' "$round" "$row" "$load" "$out/$name.json" >>"$results"
}

measure_in_process() { # round
  local name="in-process.r$1" load
  load="$(cut -d' ' -f1 /proc/loadavg)"
  log "$name: kvroute-demo --json --policies cache-aware,round-robin (in-process fleet; load $load)"
  "$bin/kvroute-demo" --json --policies cache-aware,round-robin --fleet-prefill "$FLEET_PREFILL" >"$out/$name.json" \
    2>"$out/$name.driver.log" || log "$name: demo reported failures (see $out/$name.driver.log)"
  printf '%s\t%s\t%s\t%s\n' "$1" in-process "$load" "$out/$name.json" >>"$results"
}

want() { [[ "$1" =~ $ROWS ]]; }

echo "fleet prefill model: $FLEET_PREFILL; kvroute-sim extra flags for the external rows: '${SIM_EXTRA_ARGS}'" >>"$out/provenance.txt"
env | grep '^KVROUTE_DEMO_' >>"$out/provenance.txt" || true
echo "kvroute extra flags for the external kvroute rows: '${KVROUTE_EXTRA_ARGS}'" >>"$out/provenance.txt"
for round in $(seq 1 "$REPEATS"); do
  if [ -z "$SIM_EXTRA_ARGS" ]; then
    want in-process && measure_in_process "$round"
  elif [ "$round" = 1 ]; then
    log "SIM_EXTRA_ARGS='$SIM_EXTRA_ARGS': in-process rows skipped (not the same fleet)"
  fi
  want kvroute-cache_aware && measure_external "$round" kvroute-cache_aware kvroute-cache_aware sglang
  want kvroute-round_robin && measure_external "$round" kvroute-round_robin kvroute-round_robin sglang
  want sglang-cache_aware && measure_external "$round" sglang-cache_aware sglang-cache_aware sglang
  want sglang-round_robin && measure_external "$round" sglang-round_robin sglang-round_robin sglang
  want vllm-cache_aware && measure_external "$round" vllm-cache_aware vllm-cache_aware vllm
  want vllm-kv_aware && measure_external "$round" vllm-kv_aware vllm-kv_aware vllm
  want vllm-round_robin && measure_external "$round" vllm-round_robin vllm-round_robin vllm
  # Extra: the peers' cache_aware WITHOUT DP awareness (4 workers; each engine places the rank
  # itself, least loaded first), to see whether that is where one-worker pile-ups come from.
  want sglang-cache_aware-no_dp && measure_external "$round" sglang-cache_aware-no_dp sglang-cache_aware-no_dp sglang
  want vllm-cache_aware-no_dp && measure_external "$round" vllm-cache_aware-no_dp vllm-cache_aware-no_dp vllm
done

python3 "$root/bench/quality_summary.py" "$results"

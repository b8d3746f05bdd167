#!/usr/bin/env bash
# Side-by-side router benchmark: kvroute vs sglang-router vs vllm-router, in one run, on one
# machine, against the same instant backend (nginx answering fixed JSON), with the same load
# tools. Writes results under target/bench-sbs/<UTC time>/ and prints a markdown table.
#
# Why it is shaped this way:
# - The backend must never be the bottleneck, so it is nginx `return 200 '<fixed json>'`
#   (bench/nginx-backend.conf.in); two server blocks are the two "workers" of every router.
# - kvroute's cache_aware needs KV events. Two honest set-ups are measured and labelled:
#   (a) nginx workers whose /server_info advertises the KV publishers of two idle kvroute-sim
#       engines; the prompt is sent once to sim engine 0 so the index really holds it (128
#       blocks) and every routed request hashes, matches and scores a full-depth hit;
#   (b) kvroute-sim --instant engines as the backends, so the events come from the engines that
#       serve the requests (the sim is slower than nginx: its own direct row is the baseline).
# - Peers get the body shape they accept: sglang-router 0.3.2's /v1/completions refuses token
#   ids, so it gets /generate {input_ids}; its cache_aware tree works on text, so a text row is
#   measured too. vllm-router gets /v1/completions with ids and with text. Every row says what
#   the router received. Added latency = router percentile minus the percentile of a paired
#   direct window (same body, same backend, measured just before), at the same fixed rate (open
#   loop, latency from the scheduled send time); LAT_PAIRS pairs alternate per row and the row
#   reports the median of the per-pair differences (each pair is listed too).
# - kvroute runs as a deployment builds it (the `production` cargo profile: whole-program LTO,
#   one codegen unit), as the peers' wheels are built with LTO; ROUTER_PROFILE=release measures
#   the developers' build.
# - Extra rows: nginx as a plain reverse proxy (the cost floor of one extra HTTP hop), and
#   vllm-router's own KV-event policy (kv_aware) fed by vLLM-encoded sim publishers.
# - Throughput: wrk -t2 -c32 (the issue's reference tool). Latency: kvroute-loadgen open loop.
# - After the rows, a 1,000,000-request closed-loop run through kvroute cache_aware with its RSS
#   read from /proc every second (memory must stay flat after warm-up).
#
# Usage: bench/side_by_side.sh
# Env: ROUTER_PROFILE (cargo profile kvroute is built and run with: production (default; the
#      deployment build, whole-program LTO, as the README tells deployments to build it) or
#      release) SKIP_BUILD (1 = use the existing binaries) THROUGHPUT_S (10) LATENCY_S (10, per
#      window) LAT_PAIRS (3; alternating direct/router latency windows per row) RATE (1000)
#      CONNS (32) RSS_REQUESTS (1000000; 0 skips
#      the RSS run) PORT_BASE (18100; ports PORT_BASE..PORT_BASE+499 are used) ROWS (regex over
#      row names; default all) SKIP_INSTALL (1 = do not apt/pip) ROUTER_BIN_BASELINE (a second
#      kvroute binary, e.g. the parent commit's: its round_robin and cache_aware-nginx rows run
#      too, as kvroute-baseline-*, for a before/after comparison in one run)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
THROUGHPUT_S="${THROUGHPUT_S:-10}"
LATENCY_S="${LATENCY_S:-10}"
LAT_PAIRS="${LAT_PAIRS:-3}"
RATE="${RATE:-1000}"
CONNS="${CONNS:-32}"
RSS_REQUESTS="${RSS_REQUESTS:-1000000}"
PORT_BASE="${PORT_BASE:-18100}"
ROWS="${ROWS:-.}"
HEALTH_WAIT_S=60

out="$root/target/bench-sbs/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
echo "results: $out" >&2

pids=()
nginx_pid=""
cleanup() {
  if [ -n "${router_pid:-}" ]; then kill "$router_pid" 2>/dev/null || true; fi
  if [ -n "${sampler:-}" ]; then kill "$sampler" 2>/dev/null || true; fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  if [ -n "$nginx_pid" ]; then kill "$nginx_pid" 2>/dev/null || true; fi
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

# shellcheck source=bench/lib.sh
. "$root/bench/lib.sh"

# ---------------------------------------------------------------------------------- install ---
venv="$root/target/bench-peers/venv"
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  missing=()
  command -v nginx >/dev/null || missing+=(nginx-light)
  command -v wrk >/dev/null || missing+=(wrk)
  if [ "${#missing[@]}" -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" >"$out/apt.log" 2>&1
  fi
  if [ ! -x "$venv/bin/vllm-router" ] || [ ! -x "$venv/bin/sglang-router" ]; then
    log "creating throwaway venv $venv (sglang-router, vllm-router from PyPI)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
      "sglang-router==0.3.2" "vllm-router==0.1.17" >"$out/pip.log" 2>&1
  fi
fi
# Without the venv (SKIP_INSTALL=1 on a machine that never had it) the list is empty rather than
# the end of the run: a run whose ROWS leave the peers out needs none.
"$venv/bin/pip" list 2>/dev/null | grep -Ei '^(sglang-router|vllm-router) ' >"$out/peer-versions.txt" || true
nginx -v 2>"$out/nginx-version.txt" || true

ROUTER_PROFILE="${ROUTER_PROFILE:-production}"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  log "cargo build --release -p kvroute -p kvroute-sim -p kvroute-bench"
  (cd "$root" && cargo build --release -p kvroute -p kvroute-sim -p kvroute-bench) >"$out/build.log" 2>&1
  if [ "$ROUTER_PROFILE" != release ]; then
    log "cargo build --profile $ROUTER_PROFILE -p kvroute --bin kvroute"
    (cd "$root" && cargo build --profile "$ROUTER_PROFILE" -p kvroute --bin kvroute) >>"$out/build.log" 2>&1
  fi
fi
{
  echo "git HEAD: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "uncommitted changes in the tree: $(git -C "$root" status --porcelain 2>/dev/null | wc -l) paths"
  echo "machine: $(nproc) cpus, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "kvroute built with cargo profile: $ROUTER_PROFILE (the tools: release)"
  echo "baseline router binary (ROUTER_BIN_BASELINE): ${ROUTER_BIN_BASELINE:-none}"
} >"$out/provenance.txt"
bin="$root/target/release"
# The router under test; the load generator and the simulated engines are always release builds.
router_bin="$root/target/$ROUTER_PROFILE/kvroute"
if [ ! -x "$router_bin" ]; then
  echo "no router binary at $router_bin: run without SKIP_BUILD=1, or cargo build --profile $ROUTER_PROFILE -p kvroute --bin kvroute" >&2
  exit 1
fi
if [ ! -x "$bin/kvroute-loadgen" ] || [ ! -x "$bin/kvroute-sim" ]; then
  echo "no release tools in $bin: run without SKIP_BUILD=1" >&2
  exit 1
fi

# ----------------------------------------------------------------------------------- bodies ---
# 2,048-token prompts (128 blocks of 16). Token ids are fixed pseudo-random values; the text is
# ~2,000 words for the routers that work on text.
python3 - "$out" <<'EOF'
import json, random, sys
d = sys.argv[1] + "/"
r = random.Random(42)
ids = [r.randrange(100, 30000) for _ in range(2048)]
words = ("the router keeps a radix tree of every engine cache and sends each request where its "
         "prefix already lives so prefill work is skipped").split()
text = " ".join(r.choice(words) for _ in range(2000))
def dump(o, f):
    with open(d + f, "w") as fh:
        json.dump(o, fh, separators=(",", ":"))
dump({"model": "kvroute-sim", "prompt": ids, "max_tokens": 1}, "completions-ids.json")
dump({"model": "kvroute-sim", "prompt": text, "max_tokens": 1}, "completions-text.json")
dump({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}, "generate-ids.json")
# A multi-turn chat as chat clients send it: a shared ~700-word system prompt and 8 earlier
# turns resent with every request (the demo's shape); the same body every time, so kvroute's
# per-message tokenization cache is warm as it is for a conversation's earlier turns.
system = "You are a careful assistant. " + " ".join(r.choice(words) for _ in range(700))
msgs = [{"role": "system", "content": system}]
for t in range(8):
    msgs.append({"role": "user", "content": " ".join(r.choice(words) for _ in range(40))})
    msgs.append({"role": "assistant", "content": " ".join(r.choice(words) for _ in range(24))})
msgs.append({"role": "user", "content": "and the last question of this turn?"})
dump({"model": "kvroute-sim", "messages": msgs, "max_tokens": 1}, "chat.json")
dump({"text": text, "sampling_params": {"max_new_tokens": 1}}, "generate-text.json")
EOF

# ------------------------------------------------------------------------------------ ports ---
NG_A=$((PORT_BASE + 1)); NG_B=$((PORT_BASE + 2))            # nginx workers
NG_PROXY=$((PORT_BASE + 3))                                  # nginx reverse proxy over A, B
NG_PROXY_SEP=$((PORT_BASE + 4))                              # the same proxy in its own nginx
PUB_HTTP=$((PORT_BASE + 11))                                 # idle sims (publishers only): 11,12
PUB_KV=$((PORT_BASE + 101)); PUB_REPLAY=$((PORT_BASE + 201)); PUB_LOAD=$((PORT_BASE + 251))
SIM_HTTP=$((PORT_BASE + 21))                                 # serving sims: 21,22
VPUB_HTTP=$((PORT_BASE + 31))                                # vLLM-encoding publishers: 31,32
VPUB_KV=$((PORT_BASE + 121)); VPUB_REPLAY=$((PORT_BASE + 221)); VPUB_LOAD=$((PORT_BASE + 271))
SIM_KV=$((PORT_BASE + 111)); SIM_REPLAY=$((PORT_BASE + 211)); SIM_LOAD=$((PORT_BASE + 261))
ROUTER=$((PORT_BASE + 301)); PROM=$((PORT_BASE + 401))


# ------------------------------------------------------------------------- backends (nginx, sims) ---
ng="$out/nginx"
write_nginx_backend_conf "$ng" "$NG_A" "$NG_B" "$NG_PROXY" "$PUB_KV" "$PUB_REPLAY"
sim_pub_pid=""; sim_serv_pid=""; sim_vpub_pid=""; backend_restarts=0
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
# (Re)starts whichever backend is not running. Other jobs on a shared machine have been seen
# to stop these processes mid-run; a row must never be measured against a dead backend, so every
# row calls this first and the number of restarts is reported with the results.
ensure_backends() {
  if ! alive "$nginx_pid"; then
    [ -n "$nginx_pid" ] && backend_restarts=$((backend_restarts + 1)) && log "nginx had stopped; restarting"
    nginx -p "$ng" -c "$ng/nginx.conf" -g 'daemon off;' >>"$ng/stdout.log" 2>&1 &
    nginx_pid=$!
  fi
  if ! alive "$sim_pub_pid"; then
    [ -n "$sim_pub_pid" ] && backend_restarts=$((backend_restarts + 1)) && log "publisher sims had stopped; restarting"
    "$bin/kvroute-sim" --engines 2 --instant --port "$PUB_HTTP" --kv-port-base "$PUB_KV" \
      --replay-port-base "$PUB_REPLAY" --load-port-base "$PUB_LOAD" >>"$out/sim-publishers.log" 2>&1 &
    sim_pub_pid=$!
    pids+=("$sim_pub_pid")
  fi
  if ! alive "$sim_serv_pid"; then
    [ -n "$sim_serv_pid" ] && backend_restarts=$((backend_restarts + 1)) && log "serving sims had stopped; restarting"
    "$bin/kvroute-sim" --engines 2 --instant --port "$SIM_HTTP" --kv-port-base "$SIM_KV" \
      --replay-port-base "$SIM_REPLAY" --load-port-base "$SIM_LOAD" >>"$out/sim-serving.log" 2>&1 &
    sim_serv_pid=$!
    pids+=("$sim_serv_pid")
  fi
  if ! alive "$sim_vpub_pid"; then
    [ -n "$sim_vpub_pid" ] && backend_restarts=$((backend_restarts + 1)) && log "vLLM-encoding publisher sims had stopped; restarting"
    "$bin/kvroute-sim" --engines 2 --instant --kv-encoding vllm --port "$VPUB_HTTP" \
      --kv-port-base "$VPUB_KV" --replay-port-base "$VPUB_REPLAY" --load-port-base "$VPUB_LOAD" \
      >>"$out/sim-vllm-publishers.log" 2>&1 &
    sim_vpub_pid=$!
    pids+=("$sim_vpub_pid")
  fi
  wait_http "http://127.0.0.1:$NG_A/health" "nginx worker A"
  wait_http "http://127.0.0.1:$NG_B/health" "nginx worker B"
  for p in "$PUB_HTTP" $((PUB_HTTP + 1)) "$SIM_HTTP" $((SIM_HTTP + 1)) "$VPUB_HTTP" $((VPUB_HTTP + 1)); do
    wait_http "http://127.0.0.1:$p/health" "kvroute-sim engine on $p"
  done
}
ensure_backends

# ------------------------------------------------------------------------------------- rows ---
results="$out/results.tsv"
printf 'row\trouter\tpolicy\tbackend\tendpoint\tbody\treq_per_s\twrk_non2xx\tp50_us\tp90_us\tp99_us\tp999_us\tmax_us\tlat_errors\tbase_p50_us\tbase_p99_us\tadded_p50_us\tadded_p99_us\tadded_p50_each_us\ttokenize_calls\tloadavg\n' >"$results"

router_pid=""
stop_router() {
  if [ -n "$router_pid" ]; then
    kill "$router_pid" 2>/dev/null || true
    wait "$router_pid" 2>/dev/null || true
    router_pid=""
  fi
}

measure() { # name router policy backend url body
  local name="$1" router="$2" policy="$3" backend="$4" url="$5" body="$6"
  local endpoint="${url#http://*/}"
  local load tok0 tok1 wrk_out rps non2xx lat
  ensure_backends
  load="$(cut -d' ' -f1-3 /proc/loadavg)"
  tok0="$(wc -l <"$ng/tokenize.log" 2>/dev/null || echo 0)"
  log "$name: wrk -t2 -c$CONNS -d${THROUGHPUT_S}s ($router $policy, $body, load $load)"
  wrk_out="$(WRK_BODY_FILE="$out/$body" wrk -t2 -c"$CONNS" -d"${THROUGHPUT_S}s" \
    -s "$root/bench/wrk-post-file.lua" "$url")"
  echo "$wrk_out" >"$out/$name.wrk.txt"
  rps="$(awk '/^Requests\/sec/ {print $2}' <<<"$wrk_out")"
  non2xx="$(awk '/Non-2xx/ {print $NF}' <<<"$wrk_out")"
  tok1="$(wc -l <"$ng/tokenize.log" 2>/dev/null || echo 0)"
  # Paired baselines: the same body straight to the backend, measured right before each router
  # window, so "added" compares two measurements taken under the same background load (other
  # jobs share this machine and its load drifts over a run). LAT_PAIRS windows of each kind
  # alternate (direct, router, direct, router, ...); the added figure is the median of the
  # per-pair differences (each listed in the results; every window's JSON is kept), so one
  # noisy window neither makes nor breaks a row.
  local direct_url="" k
  if [ "$router" != direct ]; then
    direct_url="http://127.0.0.1:$NG_A/$endpoint"
    [ "$backend" = kvroute-sim ] && direct_url="http://127.0.0.1:$SIM_HTTP/$endpoint"
  fi
  latency_window() { # kind (base|lat) url: one open-loop window into $name.<kind>.$k.json
    log "$name: $1 window $k/$LAT_PAIRS, $RATE req/s for ${LATENCY_S}s to $2"
    "$bin/kvroute-loadgen" --url "$2" --body-file "$out/$body" --rate "$RATE" \
      --duration-s "$LATENCY_S" --warmup-s 2 --connections "$CONNS" --json \
      >"$out/$name.$1.$k.json" 2>"$out/$name.$1.$k.err" ||
      log "$name: $1 window $k failed: $(cat "$out/$name.$1.$k.err")"
  }
  for ((k = 1; k <= LAT_PAIRS; k++)); do
    if [ -n "$direct_url" ]; then latency_window base "$direct_url"; fi
    latency_window lat "$url"
  done
  # Columns: p50 p90 p99 p999 max (medians over the router windows), errors (summed, plus one
  # per window that failed or recorded nothing), the medians of the direct windows' p50 and
  # p99, then the added p50 and p99 (medians of the per-pair differences) and each pair's added
  # p50 (comma-separated).
  lat="$(python3 - "$out" "$name" "$LAT_PAIRS" <<'PY'
import json, statistics, sys
out, name, pairs = sys.argv[1], sys.argv[2], int(sys.argv[3])
def load(kind, k):  # None for a window that failed or recorded no request
    try:
        r = json.load(open("%s/%s.%s.%d.json" % (out, name, kind, k)))
    except (OSError, ValueError):
        return None
    return r if r.get("recorded", 0) > 0 else None
router = [load("lat", k) for k in range(1, pairs + 1)]
base = [load("base", k) for k in range(1, pairs + 1)]
ok = [r for r in router if r]
if not ok:
    # Every router window failed: no latency, and each failed window counts as an error.
    print("\t".join(["0"] * 5 + [str(pairs), "-", "-", "-", "-", "-"])); sys.exit()
med = lambda xs: round(statistics.median(xs))
cols = [med([r["latency_us"][q] for r in ok]) for q in ("p50", "p90", "p99", "p999", "max")]
errs = sum(r["errors_status"] + r["errors_io"] + r["errors_timeout"] + r["not_sent"] for r in ok)
errs += sum(1 for r in router if not r)
paired = [(r["latency_us"], b["latency_us"]) for r, b in zip(router, base) if r and b]
if paired:
    d50 = [round(r["p50"] - b["p50"]) for r, b in paired]
    d99 = [round(r["p99"] - b["p99"]) for r, b in paired]
    extra = [med([b["p50"] for _, b in paired]), med([b["p99"] for _, b in paired]),
             med(d50), med(d99), ",".join("%+d" % d for d in d50)]
else:
    extra = ["-"] * 5
print("\t".join(str(x) for x in cols + [errs] + extra))
PY
)"
  # Router-side evidence (routing decisions, matched blocks, tokenize calls) for the row.
  if [ "$router" = kvroute ]; then
    curl -s --max-time 2 "http://127.0.0.1:$ROUTER/metrics" >"$out/$name.metrics.txt" || true
  elif [ "$router" != direct ]; then
    curl -s --max-time 2 "http://127.0.0.1:$PROM/metrics" >"$out/$name.metrics.txt" || true
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$router" "$policy" "$backend" \
    "/$endpoint" "$body" "$rps" "${non2xx:-0}" "$lat" "$((tok1 - tok0))" "$load" >>"$results"
}

want() { [[ "$1" =~ $ROWS ]]; }

fresh_sims() { # publishers|serving: stop them so ensure_backends starts them with empty caches
  local pid
  if [ "$1" = serving ]; then pid="$sim_serv_pid"; sim_serv_pid=""; else pid="$sim_pub_pid"; sim_pub_pid=""; fi
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

start_sglang() { # policy
  ensure_backends
  "$venv/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port "$ROUTER" \
    --worker-urls "http://127.0.0.1:$NG_A" "http://127.0.0.1:$NG_B" --policy "$1" \
    --log-level warn --prometheus-host 127.0.0.1 --prometheus-port "$PROM" \
    >"$out/sglang-$1.log" 2>&1 &
  router_pid=$!
  wait_http "http://127.0.0.1:$ROUTER/health" "sglang-router $1"
}
start_vllm() { # policy
  ensure_backends
  "$venv/bin/vllm-router" --host 127.0.0.1 --port "$ROUTER" \
    --worker-urls "http://127.0.0.1:$NG_A" "http://127.0.0.1:$NG_B" --policy "$1" \
    --log-level warning --prometheus-host 127.0.0.1 --prometheus-port "$PROM" \
    >"$out/vllm-$1.log" 2>&1 &
  router_pid=$!
  wait_http "http://127.0.0.1:$ROUTER/health" "vllm-router $1"
}
start_kvroute() { # policy worker-port-a worker-port-b [extra kvroute flags...]
  ensure_backends
  local policy="$1" port_a="$2" port_b="$3"
  shift 3
  "$router_bin" --host 127.0.0.1 --port "$ROUTER" --policy "$policy" \
    --worker-urls "http://127.0.0.1:$port_a" "http://127.0.0.1:$port_b" "$@" >"$out/kvroute-$policy-$port_a.log" 2>&1 &
  router_pid=$!
  wait_http "http://127.0.0.1:$ROUTER/readyz" "kvroute $policy"
}
kv_applied() { # sum of applied KV batches over kvroute's workers
  curl -s --max-time 2 "http://127.0.0.1:$ROUTER/workers" | python3 -c '
import json, sys
print(sum(r["applied_batches"] for w in json.load(sys.stdin)["workers"] for r in w["kv_ranks"]))'
}
wait_kv_applied() { # what: kvroute has applied at least one KV batch
  local deadline=$((SECONDS + HEALTH_WAIT_S)) seen=0
  while [ $SECONDS -lt $deadline ]; do
    seen="$(kv_applied 2>/dev/null || echo 0)"
    [ "${seen:-0}" -gt 0 ] && return 0
    sleep 0.1
  done
  echo "timed out waiting for kvroute to apply a KV batch ($1): applied_batches=$seen" >&2
  return 1
}

D="http://127.0.0.1:$NG_A"
want direct-completions-ids && measure direct-completions-ids direct - nginx "$D/v1/completions" completions-ids.json
want direct-generate-ids && measure direct-generate-ids direct - nginx "$D/generate" generate-ids.json
want direct-generate-text && measure direct-generate-text direct - nginx "$D/generate" generate-text.json
want direct-completions-text && measure direct-completions-text direct - nginx "$D/v1/completions" completions-text.json
want direct-sim-completions-ids && measure direct-sim-completions-ids direct - kvroute-sim "http://127.0.0.1:$SIM_HTTP/v1/completions" completions-ids.json

want nginx-proxy && measure nginx-proxy-completions-ids "nginx-proxy (same process as the backends)" round_robin nginx "http://127.0.0.1:$NG_PROXY/v1/completions" completions-ids.json
if want nginx-proxy-separate; then
  # The same proxy in its own nginx process (see bench/nginx-proxy.conf.in): the honest floor.
  ngp="$out/nginx-proxy"
  mkdir -p "$ngp"/{body,proxy,fastcgi,uwsgi,scgi}
  sed -e "s|@PREFIX@|$ngp|g" -e "s|@PORT_A@|$NG_A|" -e "s|@PORT_B@|$NG_B|" -e "s|@PORT_PROXY@|$NG_PROXY_SEP|" \
    "$root/bench/nginx-proxy.conf.in" >"$ngp/nginx.conf"
  nginx -p "$ngp" -c "$ngp/nginx.conf" -g 'daemon off;' >>"$ngp/stdout.log" 2>&1 &
  router_pid=$!
  wait_http "http://127.0.0.1:$NG_PROXY_SEP/health" "separate nginx proxy"
  measure nginx-proxy-separate-completions-ids "nginx-proxy (own process)" round_robin nginx "http://127.0.0.1:$NG_PROXY_SEP/v1/completions" completions-ids.json
  stop_router
fi

R="http://127.0.0.1:$ROUTER"
for pol in round_robin cache_aware; do
  if want "sglang-$pol"; then
    start_sglang "$pol"
    measure "sglang-$pol-generate-ids" sglang-router "$pol" nginx "$R/generate" generate-ids.json
    [ "$pol" = cache_aware ] && measure "sglang-$pol-generate-text" sglang-router "$pol" nginx "$R/generate" generate-text.json
    stop_router
  fi
  if want "vllm-$pol"; then
    start_vllm "$pol"
    measure "vllm-$pol-completions-ids" vllm-router "$pol" nginx "$R/v1/completions" completions-ids.json
    [ "$pol" = cache_aware ] && measure "vllm-$pol-completions-text" vllm-router "$pol" nginx "$R/v1/completions" completions-text.json
    stop_router
  fi
done

# The kvroute rows every comparison needs, for one router binary under a row-name label. With
# ROUTER_BIN_BASELINE set they run again with that binary (rows kvroute-baseline-*), in the same
# run against the same backends, so a change is judged against its parent side by side.
kvroute_core_rows() { # label binary
  local label="$1"
  router_bin="$2"
  if want "$label-round_robin"; then
    start_kvroute round-robin "$NG_A" "$NG_B"
    measure "$label-round_robin-completions-ids" kvroute round_robin nginx "$R/v1/completions" completions-ids.json
    stop_router
  fi
  if want "$label-cache_aware-nginx"; then
    # Fresh publisher sims: a prompt they already cached produces no new KV event, so a second
    # router (the baseline pass) would never learn it.
    fresh_sims publishers
    start_kvroute cache-aware "$NG_A" "$NG_B"
    # Put the prompt into the index: sim publisher engine 0 stores it and publishes the blocks,
    # which kvroute attributes to nginx worker A (whose /server_info advertises that publisher).
    curl -s --max-time 10 -o /dev/null -XPOST "http://127.0.0.1:$PUB_HTTP/v1/completions" -H 'content-type: application/json' \
      --data-binary "@$out/completions-ids.json"
    if ! wait_kv_applied "prompt stored by the publisher sim"; then
      log "$label-cache_aware-nginx: the index never received the prompt; the row measures cold routing"
    fi
    curl -s --max-time 10 -D "$out/$label-decision-nginx.txt" -o /dev/null -XPOST "$R/v1/completions" \
      -H 'content-type: application/json' --data-binary "@$out/completions-ids.json"
    measure "$label-cache_aware-nginx-completions-ids" kvroute cache_aware "nginx + sim KV publishers" "$R/v1/completions" completions-ids.json
    stop_router
  fi
}
router_bin_main="$router_bin"
kvroute_core_rows kvroute "$router_bin_main"
if [ -n "${ROUTER_BIN_BASELINE:-}" ]; then
  kvroute_core_rows kvroute-baseline "$ROUTER_BIN_BASELINE"
fi
router_bin="$router_bin_main"
if want kvroute-cache_aware-chat; then
  # Multi-turn chat through kvroute: the router renders the chat template and tokenizes with the
  # bundled tokenizer (segment cache warm), hashes, matches, scores and forwards. The paired
  # direct run sends the same chat body straight to nginx.
  start_kvroute cache-aware "$NG_A" "$NG_B" --tokenizer-path "$root/assets/tokenizer/tokenizer.json"
  measure kvroute-cache_aware-chat kvroute cache_aware nginx "$R/v1/chat/completions" chat.json
  stop_router
fi
if want kvroute-cache_aware-sim; then
  # Fresh serving sims: the direct-sim row already cached the prompt there, and a prompt that
  # is already cached produces no new KV event, so a router started now would never learn it.
  fresh_sims serving
  start_kvroute cache-aware "$SIM_HTTP" $((SIM_HTTP + 1))
  curl -s --max-time 10 -o /dev/null -XPOST "$R/v1/completions" -H 'content-type: application/json' \
    --data-binary "@$out/completions-ids.json"
  if wait_kv_applied "prompt stored by the serving sim"; then
    measure kvroute-cache_aware-sim-completions-ids kvroute cache_aware kvroute-sim "$R/v1/completions" completions-ids.json
  else
    log "kvroute-cache_aware-sim: row skipped (index never received the prompt)"
  fi
  stop_router
fi

# vllm-router 0.1.17 also has a KV-event policy, kv_aware: the closest peer to kvroute's
# cache_aware. It is fed vLLM-encoded events from two idle sims attributed to the nginx workers,
# and the prompt is stored once on sim 0, exactly like kvroute's nginx row.
if want vllm-kv_aware; then
  ensure_backends
  "$venv/bin/vllm-router" --host 127.0.0.1 --port "$ROUTER" \
    --worker-urls "http://127.0.0.1:$NG_A" "http://127.0.0.1:$NG_B" --policy kv_aware \
    --kv-event-source "http://127.0.0.1:$NG_A=tcp://127.0.0.1:$VPUB_KV" \
    --kv-event-source "http://127.0.0.1:$NG_B=tcp://127.0.0.1:$((VPUB_KV + 1))" \
    --kv-event-block-size 16 --kv-event-model kvroute-sim \
    --log-level warning --prometheus-host 127.0.0.1 --prometheus-port "$PROM" \
    >"$out/vllm-kv_aware.log" 2>&1 &
  router_pid=$!
  wait_http "http://127.0.0.1:$ROUTER/health" "vllm-router kv_aware"
  # Store the prompt on sim 0, then probe through the router until its placement lookups
  # report a hit (its /metrics), i.e. the events were applied before measuring.
  curl -s --max-time 10 -o /dev/null -XPOST "http://127.0.0.1:$VPUB_HTTP/v1/completions" -H 'content-type: application/json' \
    --data-binary "@$out/completions-ids.json"
  hits=0; deadline=$((SECONDS + HEALTH_WAIT_S))
  while [ $SECONDS -lt $deadline ]; do
    curl -s --max-time 10 -o /dev/null -XPOST "$R/v1/completions" -H 'content-type: application/json' \
      --data-binary "@$out/completions-ids.json"
    hits="$(curl -s --max-time 2 "http://127.0.0.1:$PROM/metrics" |
      awk '/^vllm_router_kv_placement_lookups_total\{result="hit"\}/ {print $2}')"
    [ "${hits:-0}" != 0 ] && break
    sleep 0.1
  done
  [ "${hits:-0}" != 0 ] || log "vllm-router kv_aware never reported a placement hit (hits='$hits'); measuring anyway"
  measure vllm-kv_aware-completions-ids vllm-router kv_aware "nginx + sim KV publishers (vLLM enc.)" "$R/v1/completions" completions-ids.json
  stop_router
fi

# ---------------------------------------------------------------------------------- RSS run ---
if [ "$RSS_REQUESTS" -gt 0 ] && want kvroute-rss; then
  fresh_sims publishers # the nginx row's prompt is cached there already (no new event)
  start_kvroute cache-aware "$NG_A" "$NG_B"
  curl -s --max-time 10 -o /dev/null -XPOST "http://127.0.0.1:$PUB_HTTP/v1/completions" -H 'content-type: application/json' \
    --data-binary "@$out/completions-ids.json"
  wait_kv_applied "prompt stored by the publisher sim (RSS run)"
  log "RSS run: $RSS_REQUESTS requests, closed loop c=$CONNS, RSS sampled every second"
  (
    t=0
    while kill -0 "$router_pid" 2>/dev/null; do
      printf '%s\t%s\n' "$t" "$(awk '/^VmRSS/ {print $2}' "/proc/$router_pid/status")"
      sleep 1
      t=$((t + 1))
    done
  ) >"$out/rss.tsv" &
  sampler=$!
  "$bin/kvroute-loadgen" --url "$R/v1/completions" --body-file "$out/completions-ids.json" \
    --connections "$CONNS" --duration-s 0 --requests "$RSS_REQUESTS" --json >"$out/rss-run.json"
  sleep 1.5 # one more sample after the last request
  stop_router
  echo "backend restarts during the RSS run or earlier: $backend_restarts" >"$out/rss-notes.txt"
  wait "$sampler" 2>/dev/null || true
fi

echo "$backend_restarts" >"$out/backend-restarts.txt"
python3 - "$out" <<'EOF'
import csv, json, os, sys
out = sys.argv[1]
rows = list(csv.DictReader(open(out + "/results.tsv"), delimiter="\t"))
def added(r):
    if r["router"] == "direct" or r.get("added_p50_us") in (None, "", "-"):
        return "-"
    return "%+d / %+d (base %s / %s; pairs %s)" % (int(r["added_p50_us"]), int(r["added_p99_us"]),
        r["base_p50_us"], r["base_p99_us"], r["added_p50_each_us"])
print("| router | policy | backend | request | req/s (wrk c=32) | p50 / p99 us @%s req/s | added p50 / p99 us vs paired direct (median of pairs) | errors | /tokenize calls | load avg |" % os.environ.get("RATE", "1000"))
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    errs = int(r["wrk_non2xx"] or 0) + int(r["lat_errors"] or 0)
    print("| %s | %s | %s | %s %s | %s | %s / %s | %s | %d | %s | %s |" % (
        r["router"], r["policy"], r["backend"], r["endpoint"], r["body"].replace(".json", ""),
        f'{float(r["req_per_s"]):,.0f}' if r["req_per_s"] else "?", r["p50_us"], r["p99_us"],
        added(r), errs, r["tokenize_calls"], r["loadavg"]))
print("\nbackend restarts during the run: " + open(out + "/backend-restarts.txt").read().strip())
rss = out + "/rss.tsv"
if os.path.exists(rss) and os.path.exists(out + "/rss-run.json"):
    samples = [tuple(map(int, l.split())) for l in open(rss) if l.strip() and len(l.split()) == 2]
    run = json.load(open(out + "/rss-run.json"))
    # Warm-up: the first 10 s (or the first tenth of a shorter run).
    warm_s = min(10, max(1, len(samples) // 10))
    warm = [s for s in samples if s[0] >= warm_s]
    if warm:
        start, end, peak = warm[0][1], warm[-1][1], max(s[1] for s in warm)
        print("\nRSS run: %d requests ok (errors %d), %.0f req/s; RSS after %d s warm-up %.1f MB, end %.1f MB (%+.1f%%), peak %.1f MB, %d samples" % (
            run["ok_total"], run["errors_status"] + run["errors_io"] + run["errors_timeout"],
            run["req_per_s"], warm_s, start / 1024, end / 1024, 100.0 * (end - start) / start, peak / 1024, len(samples)))
EOF

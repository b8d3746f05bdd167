#!/usr/bin/env bash
# Fleet end-to-end on a real Kubernetes cluster (kind): the scale-up and rolling-update scenarios
# of issue 16, with the router image from the repository's Dockerfile and simulated engines
# (kvroute-sim) discovered as pods.
#
# THIS SCRIPT CANNOT RUN ON THE PROJECT'S OWN MACHINES: they have no container engine (no
# docker/podman) and no kind, so it has never been run there. It is for users with Docker. The
# proof that runs in CI is the process-level harness, crates/kvroute-fleet (`cargo test -p
# kvroute-fleet`), which runs the same scenarios, and more, on the same binaries as real OS
# processes on loopback and compares every replica's index with the engines' true caches.
#
# Needs: docker, kind, kubectl, curl, python3. Usage:
#   scripts/e2e-kind.sh            # build images, create the cluster, run both scenarios
#   KEEP_CLUSTER=1 scripts/e2e-kind.sh   # leave the cluster up afterwards
#
# What it asserts, like the harness (but without its cursor-exact settling: kubectl gives no
# hook for that, so views are compared after the engines have been quiet and every replica's
# cursors equal the engines' last_seq, polled with a deadline):
#   scale-up: 2 router replicas, events stored on the engines; scale to 4; the 2 new replicas
#     settle `warm` on every rank and all 4 views are equal and equal the engines' caches;
#   rolling update: `kubectl rollout restart` while events are stored and requests sent; at the
#     end every replica settled `warm` and every view equals the engines' caches.
set -euo pipefail

CLUSTER=${CLUSTER:-kvroute-e2e}
NS=kvroute
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WAIT_S=${WAIT_S:-180}
PIDS=()

cleanup() {
  for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done
  if [[ -z "${KEEP_CLUSTER:-}" ]]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

for tool in docker kind kubectl curl python3; do
  command -v "$tool" >/dev/null || { echo "e2e-kind: '$tool' is required" >&2; exit 2; }
done

log() { printf '[e2e-kind] %s\n' "$*"; }

# ---- images and cluster ---------------------------------------------------------------------
log "building images"
docker build -t kvroute:0.1.0 "$ROOT"
docker build --target sim -t kvroute-sim:e2e "$ROOT"
if ! kind get clusters | grep -qx "$CLUSTER"; then kind create cluster --name "$CLUSTER" --wait 120s; fi
kind load docker-image --name "$CLUSTER" kvroute:0.1.0 kvroute-sim:e2e

# ---- the fleet ---------------------------------------------------------------------------------
kubectl apply -f "$ROOT/deploy/kubernetes/namespace.yaml"
kubectl apply -f "$ROOT/deploy/kubernetes/rbac.yaml" -f "$ROOT/deploy/kubernetes/services.yaml"
TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
kubectl -n "$NS" create secret generic kvroute-internal-auth --from-literal=token="$TOKEN" \
  --dry-run=client -o yaml | kubectl apply -f -

# Two engines of two DP ranks each, with the test-only control endpoints.
kubectl -n "$NS" apply -f - <<'YAML'
apiVersion: apps/v1
kind: Deployment
metadata: {name: kvroute-sim}
spec:
  replicas: 2
  selector: {matchLabels: {app: kvroute-sim}}
  template:
    metadata: {labels: {app: kvroute-sim}}
    spec:
      containers:
        - name: sim
          image: kvroute-sim:e2e
          imagePullPolicy: Never
          args: [--host=0.0.0.0, --port=8000, --kv-port-base=5557, --replay-port-base=5657,
                 --dp-size=2, --served-model-name=m, --instant, --enable-control]
          ports: [{containerPort: 8000}, {containerPort: 5557}, {containerPort: 5558},
                  {containerPort: 5657}, {containerPort: 5658}]
          readinessProbe: {httpGet: {path: /health, port: 8000}, periodSeconds: 1}
YAML
kubectl -n "$NS" rollout status deploy/kvroute-sim --timeout="${WAIT_S}s"

# The shipped router Deployment, pointed at the engine pods, with a short bootstrap deadline.
kubectl apply -f "$ROOT/deploy/kubernetes/deployment.yaml"
kubectl -n "$NS" patch deploy/kvroute --type=json -p '[
  {"op":"replace","path":"/spec/template/spec/containers/0/imagePullPolicy","value":"Never"},
  {"op":"add","path":"/spec/template/spec/containers/0/args/-","value":"--service-discovery"},
  {"op":"add","path":"/spec/template/spec/containers/0/args/-","value":"--selector=app=kvroute-sim"},
  {"op":"add","path":"/spec/template/spec/containers/0/args/-","value":"--service-discovery-port=8000"},
  {"op":"add","path":"/spec/template/spec/containers/0/args/-","value":"--kv-bootstrap-timeout-ms=20000"}
]'
# (No model label: the router asks each engine's /v1/models, which answers "m".)
kubectl -n "$NS" scale deploy/kvroute --replicas=2
kubectl -n "$NS" rollout status deploy/kvroute --timeout="${WAIT_S}s"

# ---- helpers -------------------------------------------------------------------------------------
NEXT_PORT=20000
# pf POD PORT -> prints a local port forwarded to POD:PORT
pf() {
  local local_port=$NEXT_PORT; NEXT_PORT=$((NEXT_PORT + 1))
  kubectl -n "$NS" port-forward "pod/$1" "$local_port:$2" >/dev/null 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 100); do curl -s -o /dev/null "http://127.0.0.1:$local_port/" && break; sleep 0.1; done
  echo "$local_port"
}
# pods SELECTOR -> names of running pods that are not being deleted
pods() {
  kubectl -n "$NS" get pods -l "$1" -o json | python3 -c '
import json, sys
for p in json.load(sys.stdin)["items"]:
    if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp"):
        print(p["metadata"]["name"])'
}

ENGINE_PORTS=()
for p in $(pods app=kvroute-sim); do ENGINE_PORTS+=("$(pf "$p" 8000)"); done
CHAIN=0
store_chains() { # N: store N chains spread over every engine rank
  for _ in $(seq 1 "$1"); do
    for port in "${ENGINE_PORTS[@]}"; do
      for rank in 0 1; do
        CHAIN=$((CHAIN + 1))
        python3 - "$port" "$rank" "$CHAIN" <<'PY'
import json, sys, urllib.request
port, rank, i = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fam = i % 8
chain = [(1000 + fam * 997 + t * 13) % 30000 for t in range(32)] + \
        [((i * 2654435761 + t * 40503) & 0xffffffff) % 30000 for t in range(32)]
req = urllib.request.Request(f"http://127.0.0.1:{port}/control/store",
    data=json.dumps({"chains": [chain], "dp_rank": rank}).encode(),
    headers={"content-type": "application/json"})
urllib.request.urlopen(req, timeout=10).read()
PY
      done
    done
  done
}

# compare_views WARM_PODS: every running router pod's index == the engines' caches, and every
# rank of each pod named in WARM_PODS (space separated, "all" for every pod) settled `warm`.
compare_views() {
  local want=$1 routers=() eports=()
  for p in $(pods app.kubernetes.io/component=router); do routers+=("$p:$(pf "$p" 8080):$(pf "$p" 8081)"); done
  for port in "${ENGINE_PORTS[@]}"; do eports+=("$port"); done
  python3 - "$want" "$TOKEN" "$WAIT_S" "${#eports[@]}" "${eports[@]}" "${routers[@]}" <<'PY'
import json, sys, time, urllib.request
want, token, wait_s, n = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
engines, routers = sys.argv[5:5 + n], sys.argv[5 + n:]
def get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())
def truth():
    blocks, seqs = {}, {}
    for port in engines:
        cache = get(f"http://127.0.0.1:{port}/control/cache")
        for r in cache["ranks"]:
            # The router names a worker by its pod URL, the harness by its forwarded port:
            # ranks are compared as a sorted list of per-rank block sets, not by name.
            key = (port, r["dp_rank"])
            seqs[key] = r["last_seq"]
            blocks[key] = sorted((b["hash"], b["parent"] or "", b["engine_hash"],
                                  (1 if b["device"] else 0) | (2 if b["host"] else 0))
                                 for b in r["blocks"])
    return blocks, seqs
def view(internal):
    s = get(f"http://127.0.0.1:{internal}/internal/kv_snapshot?max_age_ms=0",
            {"authorization": f"Bearer {token}", "accept": "application/json"})
    out = {}
    for node in s["nodes"]:
        parent = s["nodes"][node["parent"]]["hash"] if node["parent"] is not None else ""
        for c in node["carriers"]:
            r = s["ranks"][c["rank"]]
            out.setdefault((r["worker_url"], r["dp_rank"]), []).append(
                (node["hash"], parent, c["engine_hash"], c["tiers"]))
    return {k: sorted(v) for k, v in out.items()}
deadline = time.time() + wait_s
while True:
    want_blocks, _ = truth()
    want_sets = sorted(v for v in want_blocks.values() if v)
    problems = []
    for spec in routers:
        pod, public, internal = spec.split(":")
        workers = get(f"http://127.0.0.1:{public}/workers")["workers"]
        outcomes = [r["bootstrap"]["outcome"] for w in workers for r in w["kv_ranks"]]
        if (want == "all" or pod in want.split()) and any(o != "warm" for o in outcomes):
            problems.append(f"{pod}: outcomes {outcomes}, want warm")
        have = sorted(v for v in view(internal).values() if v)
        if have != want_sets:
            problems.append(f"{pod}: view differs from the engines' caches "
                            f"({sum(map(len, have))} vs {sum(map(len, want_sets))} blocks)")
    if not problems:
        print(f"views equal on {len(routers)} replicas: {sum(map(len, want_sets))} blocks")
        break
    if time.time() > deadline:
        sys.exit("e2e-kind: " + "; ".join(problems))
    time.sleep(1)
PY
}

# ---- scenario 1: scale-up ---------------------------------------------------------------------
log "scale-up: 2 warm replicas, events flowing, scale to 4"
store_chains 10
BEFORE=$(pods app.kubernetes.io/component=router)
store_chains 5 &
STORE=$!
kubectl -n "$NS" scale deploy/kvroute --replicas=4
kubectl -n "$NS" rollout status deploy/kvroute --timeout="${WAIT_S}s"
wait "$STORE"
NEW=$(comm -13 <(echo "$BEFORE" | sort) <(pods app.kubernetes.io/component=router | sort) | tr '\n' ' ')
compare_views "$NEW"
log "scale-up passed"

# ---- scenario 2: rolling update -------------------------------------------------------------------
log "rolling update under events and requests"
kubectl -n "$NS" scale deploy/kvroute --replicas=3
kubectl -n "$NS" rollout status deploy/kvroute --timeout="${WAIT_S}s"
ROUTER_SVC_PORT=$NEXT_PORT; NEXT_PORT=$((NEXT_PORT + 1))
kubectl -n "$NS" port-forward svc/kvroute "$ROUTER_SVC_PORT:8080" >/dev/null 2>&1 & PIDS+=($!)
( for i in $(seq 1 200); do
    curl -s -o /dev/null -H 'content-type: application/json' \
      -d "{\"model\":\"m\",\"prompt\":[$((i % 32 + 1)),2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],\"max_tokens\":1}" \
      "http://127.0.0.1:$ROUTER_SVC_PORT/v1/completions" || true
    sleep 0.05
  done ) & CLIENT=$!
store_chains 10 & STORE=$!
kubectl -n "$NS" rollout restart deploy/kvroute
kubectl -n "$NS" rollout status deploy/kvroute --timeout="${WAIT_S}s"
wait "$STORE" "$CLIENT"
compare_views all
log "rolling update passed"

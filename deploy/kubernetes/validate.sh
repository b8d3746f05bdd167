#!/usr/bin/env bash
# Offline check of the Kubernetes manifests: every object against the Kubernetes OpenAPI JSON
# schemas in strict mode (unknown fields, wrong types and missing required fields fail), then
# the cross-object checks of check_manifests.py (peer selector -> headless Service -> port,
# RBAC, downward API, probes, rollout). No cluster and no network are needed to validate: the
# schemas ship inside the pinned kubernetes-validate package, installed once from the package
# registry into a venv (like scripts/python-env.sh does for the test venv).
#
# Usage: validate.sh [DIR]   validate DIR/*.yaml (default: this directory), then prove the
#                            checks bite by running them on broken copies, which must fail.
#        validate.sh --no-self-test DIR   validate only (used by the self-test itself).
# Env: KVROUTE_K8S_VERSION (schema version, default 1.33.0: the oldest Kubernetes we support,
#      the same minor as k8s-openapi's v1_33 feature), KVROUTE_K8S_VALIDATE_VENV.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
k8s_version="${KVROUTE_K8S_VERSION:-1.33.0}"
venv="${KVROUTE_K8S_VALIDATE_VENV:-$root/target/k8s-validate-venv}"
req="$here/requirements-validate.txt"
stamp="$venv/.requirements.sha256"

self_test=1
if [ "${1:-}" = "--no-self-test" ]; then
  self_test=0
  shift
fi
dir="$(cd "${1:-$here}" && pwd)"

want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/kubernetes-validate" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
  echo "$want" >"$stamp"
fi

validate_dir() {
  local d="$1" out rc=0
  local files=("$d"/*.yaml)
  [ -e "${files[0]}" ] || { echo "ERROR no manifests in $d" >&2; return 1; }
  out="$("$venv/bin/kubernetes-validate" --strict --quiet -k "$k8s_version" "${files[@]}" 2>&1)" || rc=$?
  [ -z "$out" ] || printf '%s\n' "$out" >&2
  # An unknown kind/apiVersion is only a warning to the tool; an unchecked object is a failure here.
  if [ "$rc" -ne 0 ] || grep -qE '^(WARN|ERROR)' <<<"$out"; then
    return 1
  fi
  "$venv/bin/python" "$here/check_manifests.py" "${files[@]}" >&2
}

if ! validate_dir "$dir"; then
  echo "kubernetes manifests in $dir: INVALID" >&2
  exit 1
fi
echo "kubernetes manifests in $dir: valid (Kubernetes $k8s_version schemas, strict) and consistent"

[ "$self_test" = 1 ] || exit 0

# Each case breaks one thing in a copy; validate.sh must exit non-zero on every copy.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cases=(
  "unknown-field|deployment.yaml|s/readinessProbe:/readinesProbe:/"
  "wrong-type|deployment.yaml|s/replicas: 3/replicas: three/"
  "missing-required|deployment.yaml|s/- name: router/- nam: router/"
  "unknown-kind|services.yaml|s/^kind: Service\$/kind: Servce/"
  "selector-names-no-service|deployment.yaml|s/service-name=kvroute-internal/service-name=kvroute-nope/"
  "peer-port-renamed|services.yaml|s/- name: internal/- name: peer/"
  "rbac-without-endpointslices|rbac.yaml|s/\"endpointslices\"/\"endpoints\"/"
  "readiness-too-short|deployment.yaml|s/failureThreshold: 30/failureThreshold: 3/"
)
failed=0
for c in "${cases[@]}"; do
  IFS='|' read -r name file expr <<<"$c"
  mkdir "$tmp/$name"
  cp "$dir"/*.yaml "$tmp/$name/"
  sed -i "$expr" "$tmp/$name/$file"
  if cmp -s "$dir/$file" "$tmp/$name/$file"; then
    echo "self-test $name: the edit did not change $file (stale case)" >&2
    failed=1
  elif "$0" --no-self-test "$tmp/$name" >/dev/null 2>"$tmp/$name.err"; then
    echo "self-test $name: a broken copy PASSED validation" >&2
    failed=1
  else
    echo "self-test $name: rejected as expected ($(grep -m1 -E '^(ERROR|WARN)' "$tmp/$name.err" | cut -c1-160))"
  fi
done
if [ "$failed" -ne 0 ]; then
  echo "kubernetes manifests: validator self-test FAILED" >&2
  exit 1
fi
echo "kubernetes manifests: validator self-test passed (${#cases[@]} broken copies rejected)"

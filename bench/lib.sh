# Shared helpers of the bench/ scripts (sourced, not run). Callers set HEALTH_WAIT_S.

log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

wait_http() { # url what: polls until HTTP 200 or fails naming what was awaited and the last code
  local url="$1" what="$2" code="" deadline=$((SECONDS + HEALTH_WAIT_S))
  while [ $SECONDS -lt $deadline ]; do
    code="$(curl -s --max-time 2 -o /dev/null -w '%{http_code}' "$url" 2>/dev/null || true)"
    [ "$code" = 200 ] && return 0
    sleep 0.1
  done
  echo "timed out after ${HEALTH_WAIT_S}s waiting for $what ($url): last HTTP code '$code'" >&2
  return 1
}

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

# Writes the nginx backends' config into dir (bench/nginx-backend.conf.in: two workers answering
# fixed JSON, a reverse proxy over them, /server_info naming KV publisher ports): dir port_a
# port_b port_proxy kv_port_a replay_port_a (worker B's KV and replay ports are A's + 1).
write_nginx_backend_conf() {
  local dir="$1" bench_dir
  bench_dir="$(dirname "${BASH_SOURCE[0]}")"
  mkdir -p "$dir"/{body,proxy,fastcgi,uwsgi,scgi}
  sed -e "s|@PREFIX@|$dir|g" "$bench_dir/nginx-common-locations.conf" >"$dir/common-locations.conf"
  sed -e "s|@PREFIX@|$dir|g" -e "s|@PORT_A@|$2|" -e "s|@PORT_B@|$3|" -e "s|@PORT_PROXY@|$4|" \
    -e "s|@KV_PORT_A@|$5|" -e "s|@KV_PORT_B@|$(($5 + 1))|" \
    -e "s|@REPLAY_PORT_A@|$6|" -e "s|@REPLAY_PORT_B@|$(($6 + 1))|" \
    "$bench_dir/nginx-backend.conf.in" >"$dir/nginx.conf"
}

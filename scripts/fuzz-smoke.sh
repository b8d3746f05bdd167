#!/usr/bin/env bash
# CI smoke of the cargo-fuzz targets in fuzz/: builds every target with the nightly toolchain
# (cargo-fuzz's sanitizer flags need it) and runs each one for a fixed number of executions from
# its committed seed corpus, with the same bounds as the long runs (fuzz/README.md). A crash,
# a timeout or an allocation over the bounds fails the script, and libFuzzer leaves the input
# in fuzz/artifacts/<target>/.
#
# Why fixed run counts and not a time budget: a count does the same work on a fast and a slow
# machine, so a failure reproduces with the same command; the counts are sized so the whole
# script, cold build included, fits in about six minutes on two cores (measured figures in
# fuzz/README.md). FUZZ_SMOKE_SCALE multiplies every count (e.g. 0.1 for a quicker local check).
# Grown corpora go to a temporary directory, so a CI run never changes the tree.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root/fuzz"

# Executions per target: the cheap parsers get more, the snapshot pipeline (decompression,
# vetting, restore and graft per input) fewer.
targets=(
  "wire_payload 200000"
  "zmq_frames 200000"
  "snapshot_vet_graft 30000"
  "http1_request 200000"
  "http1_response_chunked 200000"
  "token_ids 200000"
  "load_frame 200000"
)
# The bounds every run enforces: resident memory, any single allocation, time per input.
bounds=(-rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10)
scale="${FUZZ_SMOKE_SCALE:-1}"

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  echo "fuzz-smoke: no nightly toolchain; installing one (rustup toolchain install nightly --profile minimal)"
  if ! rustup toolchain install nightly --profile minimal; then
    echo "fuzz-smoke: ERROR: cargo-fuzz needs a nightly toolchain and none could be installed" >&2
    exit 1
  fi
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "fuzz-smoke: installing cargo-fuzz (cargo install cargo-fuzz --locked)"
  cargo install cargo-fuzz --locked
fi

start=$(date +%s)
# The committed seeds must be what the generator writes: a generator that no longer builds (a
# type grew a field), or seeds edited by hand that it would overwrite, fail here instead of
# rotting until someone regenerates them. In a clean checkout the run changes nothing.
cargo +nightly run --quiet --example gen_seeds >/dev/null
if git -C "$root" rev-parse --git-dir >/dev/null 2>&1 &&
  [ -n "$(git -C "$root" status --porcelain -- fuzz/seeds)" ]; then
  git -C "$root" status --short -- fuzz/seeds >&2
  echo "fuzz-smoke: FAILED: fuzz/seeds differ from what examples/gen_seeds.rs writes; commit the generator's output" >&2
  exit 1
fi
cargo +nightly fuzz build
built=$(date +%s)
echo "fuzz-smoke: build took $((built - start)) s"

corpora="$(mktemp -d)"
trap 'rm -rf "$corpora"' EXIT
for entry in "${targets[@]}"; do
  read -r target runs <<<"$entry"
  runs="$(awk -v r="$runs" -v s="$scale" 'BEGIN { n = int(r * s); print (n < 1 ? 1 : n) }')"
  mkdir -p "$corpora/$target"
  t0=$(date +%s)
  echo "fuzz-smoke: $target, $runs runs"
  log="$corpora/$target.log"
  if ! cargo +nightly fuzz run "$target" "$corpora/$target" "seeds/$target" -- \
    -runs="$runs" "${bounds[@]}" -print_final_stats=1 >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz-smoke: FAILED: $target (the input is in fuzz/artifacts/$target/)" >&2
    exit 1
  fi
  grep -E '^(INFO: Seed|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb)' "$log" || true
  echo "fuzz-smoke: $target done in $(($(date +%s) - t0)) s"
done
echo "fuzz-smoke: all targets passed in $(($(date +%s) - start)) s (build $((built - start)) s)"

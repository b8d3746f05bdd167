#!/usr/bin/env bash
# The whole test suite, as CI runs it: formatting, lints, and every test of the workspace
# (unit, property, golden, component and end-to-end tests over real sockets and processes).
# Installs what the tests need (a Python venv with msgspec + pyzmq) on a fresh machine.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

# No incremental compilation state: a suite run builds each crate once, and the state would add
# gigabytes to the target directory of a fresh machine for nothing.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

step() { printf '\n==> %s\n' "$*"; }

step "python venv for the interop tests"
KVROUTE_PYTHON="$("$root/scripts/python-env.sh")"
export KVROUTE_PYTHON

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo clippy -p kvroute-discovery --no-default-features (the build without Kubernetes)"
cargo clippy -p kvroute-discovery --no-default-features --lib --locked -- -D warnings

step "cargo test"
cargo test --workspace --locked --no-fail-fast

if [ -f "$root/deploy/kubernetes/validate.sh" ]; then
  step "kubernetes manifests (offline schema check)"
  "$root/deploy/kubernetes/validate.sh"
fi

step "soak, 2 minutes (one router, 16 engine ranks, 500 req/s, a fault every 5 s)"
SOAK_SECONDS=120 SOAK_PROFILE=dev "$root/scripts/soak.sh"

step "fuzz smoke (every cargo-fuzz target in fuzz/, fixed run counts; nightly)" && "$root/scripts/fuzz-smoke.sh"

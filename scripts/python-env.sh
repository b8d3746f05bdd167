#!/usr/bin/env bash
# Creates (once) the project's Python venv at .venv with the packages the tests need, and prints
# the interpreter's path. Idempotent: a venv whose requirements stamp matches is reused.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv"
req="$root/scripts/requirements-test.txt"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
  echo "$want" >"$stamp"
fi
echo "$venv/bin/python"

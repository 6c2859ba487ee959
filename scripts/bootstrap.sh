#!/usr/bin/env bash
# Creates .venv (once) and installs verispec with its test/bench extras.
# torch is pinned and installed first: an unpinned torch resolves to a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VERISPEC_VENV:-$root/.venv}"
stamp="$venv/.verispec-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[dev]"
  touch "$stamp"
fi

#!/usr/bin/env bash
# The test suite on a fresh machine: bootstraps .venv, then runs pytest offline.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"

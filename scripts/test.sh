#!/usr/bin/env bash
# The test suite on a fresh machine: bootstraps .venv, then runs pytest offline.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
# The llama.cpp baseline's tests need the `llama` extra, built from source once per machine and CPU (about 10 minutes
# on 2 cores, cached under the user cache); VERISPEC_LLAMACPP=0 skips it and those tests skip.
[ "${VERISPEC_LLAMACPP:-1}" = 0 ] || bash "$root/scripts/llamacpp.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"

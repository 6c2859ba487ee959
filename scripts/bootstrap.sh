#!/usr/bin/env bash
# Creates .venv (once) and installs verispec with its test/bench extras (dev; ray for the replica tests), saying
# each step and package on stderr (a few minutes the first time; silent once installed).
# torch is pinned and installed first: an unpinned torch resolves to a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VERISPEC_VENV:-$root/.venv}"
stamp="$venv/.verispec-installed"
[ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] || exit 0

say() { echo "bootstrap.sh: $*" >&2; }

# pip's output as one line per package (a read loop: awk may buffer its input and hold the lines back).
per_package() {
  local line name version pkgs
  while IFS= read -r line; do
    case "$line" in
      "Collecting "*) line=${line#Collecting }; echo "  collecting ${line%% *}" ;;
      "Processing "*.whl*) line=${line#Processing }; line=${line%% *}; IFS=- read -r name version _ <<< "${line##*/}"
                           echo "  collecting $name $version" ;;
      "Installing collected packages: "*) IFS=', ' read -ra pkgs <<< "${line#*: }"
                                          echo "  unpacking ${#pkgs[@]} packages (the slow part)" ;;
      "Successfully installed "*) echo "  done" ;;
    esac
  done
}

# pip install with a line per package on stderr (stdout is the caller's result); pip's whole log goes to
# $venv/pip.log, and its tail is printed if pip fails.
pip_install() {
  if ! PYTHONUNBUFFERED=1 "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off "$@" \
      2>&1 | tee -a "$venv/pip.log" | per_package >&2; then
    tail -20 "$venv/pip.log" >&2
    say "pip failed; its log: $venv/pip.log"
    exit 1
  fi
}

say "setting up $venv (first run only: a few minutes; about 2.5 on an idle 2-core machine)"
say "[1/3] creating the virtual environment"
python3 -m venv "$venv"
: > "$venv/pip.log"
say "[2/3] installing torch 2.13.0 (the CPU build)"
pip_install torch==2.13.0
say "[3/3] installing verispec (editable) with its dev and ray extras: transformers, scipy, matplotlib, openai, ray, ..."
pip_install -e "$root[dev,ray]"
touch "$stamp"
say "ready in ${SECONDS} s"

#!/usr/bin/env bash
# The main job on a fresh machine: bootstraps .venv, then generates speculatively with the shipped model zoo
# and compares with plain decoding (exactness and speedup). Extra arguments go to `verispec generate`.
#
# Without a zoo target (zoo/target), it falls back to a random-init ~49M Llama written to .cache/ on first
# use. Pass `--target DIR` to use any local Hugging Face Llama/Qwen2/Qwen3/Mistral checkpoint instead.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
py="$root/.venv/bin/python"
args=("$@")
if [[ " $* " != *" --target "* && ! -f "$root/zoo/target/config.json" ]]; then
  target="$root/.cache/random-50m"
  "$py" -m verispec.bench.checkpoints "$target"
  args=(--target "$target" "${args[@]}")
fi
if [[ " $* " != *" --prompt"* ]]; then
  args+=(--prompt-file "$root/scripts/demo_prompt.py")
fi
exec "$py" -m verispec generate --drafter ngram --k 8 --max-tokens 128 --compare "${args[@]}"

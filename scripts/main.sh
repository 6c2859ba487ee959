#!/usr/bin/env bash
# The main job on a fresh machine: bootstraps .venv, then generates speculatively with the shipped model zoo
# and compares with plain decoding (exactness and speedup). Extra arguments go to `verispec generate`.
#
# The drafter is `verispec generate`'s default: the zoo's fastest for its target (lookup:dspark:zoo/dspark, or
# ngram without zoo/dspark), at k=8. It prints the prompt, the continuation, and plain and speculative decoding
# timed in 5 interleaved repeats (equal_to_plain for each, median speedups end to end and per output token).
# Without a zoo target (zoo/target), it falls back to a random-init ~49M Llama written to .cache/ on first
# use (drafted by ngram). Pass `--target DIR` to use any local Hugging Face Llama/Qwen2/Qwen3/Mistral checkpoint.
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
exec "$py" -m verispec generate --k 8 --max-tokens 128 --compare --repeats 5 "${args[@]}"

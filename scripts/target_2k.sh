#!/usr/bin/env bash
# data/target-2k: zoo/target plus a third training stage on 2,048-token windows (issue 23's long-context target).
# zoo/target was trained on 1,024-token windows, so past ~1,500 positions it extrapolates (reports/vericache/README.md,
# "Far positions"). Not shipped in zoo/: its 57 MB would take the zoo past its size budget (tests/test_zoo.py), so
# this rebuilds it: about 31 minutes on 2 cores (Zen 4), nothing else running. CPU training is not bit-reproducible
# across thread counts and machines; the committed card is reports/vericache/target-2k/model/.
#   1. the training corpus (the stdlib and the python3.11-doc reST sources, `verispec train target`'s), tokenized
#      with zoo/target's own tokenizer (copied first, so that no new one is trained);
#   2. 200 steps of 4 x 2,048 tokens from zoo/target's weights, peak lr 3e-4 (fresh optimizer, cosine schedule).
# The doc sources come from the .deb in apt's cache where it is there, else from `apt-get download`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VERISPEC_VENV:-$root/.venv}"
[ -x "$venv/bin/python" ] || bash "$root/scripts/bootstrap.sh"
cd "$root"
mkdir -p data/tokenizer
cp zoo/target/tokenizer.json zoo/target/tokenizer_config.json data/tokenizer/
docs=()
deb="$(ls /var/cache/apt/archives/python3.11-doc_*.deb 2>/dev/null | head -n 1 || true)"
if [ -n "$deb" ] && [ ! -f data/corpus/manifest.json ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    dpkg-deb -x "$deb" "$tmp"
    docs=(--doc-dir "$tmp/usr/share/doc/python3.11/html/_sources")
fi
"$venv/bin/python" -m verispec train target "${docs[@]}" --init-from zoo/target --data-offset 880 --seq-len 2048 \
    --batch-size 4 --max-steps 200 --warmup-steps 10 --lr 3e-4 --threads 2 --out data/runs/target-2k \
    --zoo-dir data/target-2k

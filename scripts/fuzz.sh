#!/usr/bin/env bash
# The long fuzz run (issue 19): the suite's fuzzers with more examples, then the schemathesis CLI against a real
# `verispec serve` on loopback (a tiny random checkpoint, built here). Loopback only, bounded by the example count.
#   FUZZ_EXAMPLES  examples per route and mode, and per API property (default 500)
#   FUZZ_SEED      schemathesis CLI seed (default 0)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$root/.venv/bin/python"
examples="${FUZZ_EXAMPLES:-500}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$root"

echo "== pytest fuzzers, $examples examples each"
VERISPEC_FUZZ_EXAMPLES="$examples" "$py" -m pytest -q -p no:warnings tests/test_fuzz_server.py tests/test_fuzz_api.py

work="$(mktemp -d)"
server=""
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

echo "== schemathesis CLI against verispec serve on loopback"
PYTHONPATH="$root/tests" "$py" - "$work/target" <<'EOF'
import sys
from conftest import make_tokenizer, tiny_model
from verispec.model import save_model
tokenizer = make_tokenizer()
save_model(tiny_model(vocab_size=tokenizer.vocab_size), sys.argv[1])
tokenizer.save(sys.argv[1])
EOF
port="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
key="fuzz-$RANDOM$RANDOM"
"$root/.venv/bin/verispec" serve --target "$work/target" --dtype fp32 --host 127.0.0.1 --port "$port" \
  --api-key "$key" --drafter ngram --drafters ngram:2,model --cache-budget-tokens 4096 >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 "$server" 2>/dev/null || { cat "$work/server.log"; exit 1; }
  sleep 0.2
done
"$root/.venv/bin/schemathesis" run "http://127.0.0.1:$port/openapi.json" -H "Authorization: Bearer $key" \
  --include-method POST --max-examples "$examples" --seed "${FUZZ_SEED:-0}" --request-timeout 30 \
  --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,negative_data_rejection \
  --continue-on-failure --workers 1

#!/usr/bin/env bash
# NVIDIA aiperf against the OpenAI-compatible HTTP API of a local mesh (`pdmesh up`), which the
# router process serves itself (its HTTP door; there is no gateway process).
#
#   bench/aiperf_gateway.sh [REQUESTS] [CONCURRENCY]      (defaults: 64 requests, 4 at a time)
#   PRESET=small ISL=200 OSL=32 ENDPOINT=completions bench/aiperf_gateway.sh
#
# aiperf needs ~1.2 GB of dependencies, so it lives in its own venv (.venv-aiperf, created on
# first use, git-ignored from inside) and never in `make test`. The mesh is the project's own
# .venv: kvtransfer + 1 prefill + 1 decode + router (gRPC and HTTP) on loopback, any free ports. The
# run is bounded by REQUESTS; aiperf prints its summary table; the mesh is stopped by PID.
# aiperf's synthetic prompts are measured with a byte-level Hugging Face tokenizer written here
# (aiperf's "builtin" tokenizer downloads its vocabulary), so ISL/OSL are the built-in model's
# own tokens (bytes); the default ISL 600 is above the decode worker's 512-token local-prefill
# threshold, so requests take the remote prefill path (KV over NIXL). Token counts in the
# summary are the server's own (usage fields).
set -euo pipefail
cd "$(dirname "$0")/.."

REQUESTS=${1:-${REQUESTS:-64}}
CONCURRENCY=${2:-${CONCURRENCY:-4}}
PRESET=${PRESET:-tiny}
ISL=${ISL:-600}
OSL=${OSL:-32}
ENDPOINT=${ENDPOINT:-chat}
AIPERF_VENV=${AIPERF_VENV:-.venv-aiperf}
AIPERF_VERSION=0.13.0
PYTHON=${PYTHON:-python3.11}

if [ ! -x "$AIPERF_VENV/bin/aiperf" ]; then
  echo "== creating $AIPERF_VENV with aiperf $AIPERF_VERSION (about 1.2 GB, once)"
  "$PYTHON" -m venv "$AIPERF_VENV"
  echo '*' > "$AIPERF_VENV/.gitignore"
  "$AIPERF_VENV/bin/pip" install -q --upgrade pip
  "$AIPERF_VENV/bin/pip" install -q "aiperf==$AIPERF_VERSION"
fi
[ -x .venv/bin/pdmesh ] || { echo "no .venv/bin/pdmesh: run 'make venv' first" >&2; exit 1; }

WORK=$(mktemp -d -t pdmesh-aiperf-XXXXXX)
.venv/bin/pdmesh up --router-port 0 --http-port 0 --preset "$PRESET" --workdir "$WORK" >"$WORK/up.out" 2>&1 &
MESH_PID=$!
stop_mesh() {
  if kill -0 "$MESH_PID" 2>/dev/null; then
    kill -TERM "$MESH_PID"
    wait "$MESH_PID" 2>/dev/null || true
  fi
}
trap stop_mesh EXIT

echo "== starting the mesh (preset $PRESET; logs in $WORK)"
for _ in $(seq 1 600); do  # up to 5 minutes: models load, services report ready
  grep -q "serving on" "$WORK/up.out" && break
  kill -0 "$MESH_PID" 2>/dev/null || { cat "$WORK/up.out"; echo "pdmesh up exited" >&2; exit 1; }
  sleep 0.5
done
grep -q "serving on" "$WORK/up.out" || { cat "$WORK/up.out"; echo "mesh not ready" >&2; exit 1; }
cat "$WORK/up.out"
# A byte-level tokenizer folder matching the built-in model (one token per UTF-8 byte).
"$AIPERF_VENV/bin/python" - "$WORK/tokenizer" <<'PY'
import json, pathlib, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
tok.decoder = decoders.ByteLevel()
tok.save(str(out / "tokenizer.json"))
(out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
PY
GATEWAY=$(grep -o 'http *http://[0-9.:]*' "$WORK/up.out" | grep -o 'http://[0-9.:]*')
MODEL="builtin-$PRESET"

echo "== aiperf: $REQUESTS $ENDPOINT requests, concurrency $CONCURRENCY, ISL $ISL, OSL $OSL, streaming, $GATEWAY"
"$AIPERF_VENV/bin/aiperf" profile \
  --model "$MODEL" \
  --url "$GATEWAY" \
  --endpoint-type "$ENDPOINT" \
  --streaming \
  --tokenizer "$WORK/tokenizer" \
  --use-server-token-count \
  --request-count "$REQUESTS" \
  --warmup-request-count 4 \
  --concurrency "$CONCURRENCY" \
  --isl "$ISL" \
  --prompt-input-tokens-stddev 0 \
  --osl "$OSL" \
  --prompt-output-tokens-stddev 0 \
  --extra-inputs ignore_eos:true \
  --random-seed 0 \
  --ui-type none \
  --output-artifact-dir "$WORK/aiperf"

echo "== HTTP door counters (the router process)"
curl -s "$GATEWAY/metrics" | grep -E '^pdmesh_gateway_(requests_total|client_disconnects_total|tokens_total)' || true

#!/usr/bin/env bash
# NVIDIA Dynamo 1.6.1 as a benchmark peer: its own venv and a local model folder.
#
#   bench/peers/dynamo/setup.sh          (idempotent; ~700 MB once, then seconds)
#
# Creates bench/peers/dynamo/.venv (git-ignored) with the pinned packages of the recipe in
# ../shared/peers/dynamo.md: `pip install ai-dynamo` fails here (its dependency `aisimulate`
# is a stub that downloads from an unreachable vendor index; only Dynamo's planner imports
# it), so ai-dynamo goes in with --no-deps and its runtime dependencies are listed by hand.
# Then writes bench/peers/dynamo/model/ (git-ignored): the WordLevel tokenizer folder that
# both Dynamo's mocker and pdmesh's sim workers load (make_model_folder.py).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${DYNAMO_VENV:-$HERE/.venv}"
PYTHON="${PYTHON:-python3.11}"
DYNAMO_VERSION=1.6.1

if ! "$VENV/bin/python" -c "import dynamo.frontend, dynamo.mocker" 2>/dev/null; then
  echo "== creating $VENV with ai-dynamo $DYNAMO_VERSION (about 700 MB, once)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q --no-deps "ai-dynamo==$DYNAMO_VERSION"
  "$VENV/bin/pip" install -q "ai-dynamo-runtime==$DYNAMO_VERSION" "aiohttp<4,>=3.14.3" \
    "certifi>=2026.10.19" "kubernetes<33,>=32.0.1" "msgspec>=0.19" "prometheus-client<1,>=0.23.1" \
    "pyzmq>=26" "redis<9,>=6.2" tqdm "transformers>=4.56" "typing-extensions>=4.10" \
    "zstandard<1,>=0.23"
  "$VENV/bin/python" -c "import dynamo.frontend, dynamo.mocker" \
    || { echo "ai-dynamo installed but dynamo.frontend / dynamo.mocker do not import" >&2; exit 1; }
fi
"$VENV/bin/pip" show ai-dynamo ai-dynamo-runtime 2>/dev/null | grep -E '^(Name|Version):' | paste - -

"$VENV/bin/python" "$HERE/make_model_folder.py" "$HERE/model"
echo "== ready: $VENV, model folder $HERE/model"

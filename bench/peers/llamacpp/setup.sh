#!/usr/bin/env bash
# llama.cpp (through llama-cpp-python) as a CPU benchmark peer: its own venv.
#
#   bench/peers/llamacpp/setup.sh        (idempotent; ~10 min compile once, then seconds)
#
# Creates bench/peers/llamacpp/.venv (git-ignored). llama-cpp-python builds llama.cpp from
# source (there is no CPU wheel on PyPI); the build runs at low priority and one job at a time
# by default because the machine is shared (override CMAKE_BUILD_PARALLEL_LEVEL / NICE).
# GGML_NATIVE=ON compiles for this CPU's instruction set (AVX-512/AMX where present), which is
# what a user building it locally gets; it makes the venv non-portable across CPUs.
# LLAVA_BUILD=OFF skips the multimodal library (not used by the benchmark, a third of the compile).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${LLAMACPP_VENV:-$HERE/.venv}"
PYTHON="${PYTHON:-python3.11}"
VERSION="${LLAMACPP_PYTHON_VERSION:-}"

if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "== creating $VENV with llama-cpp-python ${VERSION:-latest} (compiles llama.cpp, ~10 min)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-1}"
  export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF}"
  nice -n "${NICE:-15}" "$VENV/bin/pip" install --no-cache-dir "llama-cpp-python${VERSION:+==$VERSION}"
  "$VENV/bin/python" -c "import llama_cpp" \
    || { echo "llama-cpp-python installed but does not import" >&2; exit 1; }
fi
"$VENV/bin/pip" show llama-cpp-python 2>/dev/null | grep -E '^(Name|Version):' | paste - -
echo "== ready: $VENV"

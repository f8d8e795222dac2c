"""Weights from a GGUF file (llama.cpp's format) into the engine's LlamaModel.

The file is memory-mapped; the `gguf` package gives the tensor types and sizes. Every tensor is
dequantized at load (`gguf.quants.dequantize`) to float32 and then cast to the
engine's dtype: the engine runs dense matmuls, so a 4-bit file costs the same
memory and speed as its fp32/bf16 weights would (llama.cpp keeps them packed).

llama.cpp's converter permutes the rows of Q and K so that its RoPE kernel can
rotate adjacent pairs (GPT-J style); this model rotates halves (HF's
`rotate_half`), so the permutation is undone here, as transformers' GGUF loader
does. Names map to ours as `loader.py` maps Hugging Face's, with q/k/v and
gate/up fused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.loader import WeightLoadError
from services.engine.model import LlamaModel
from services.model.gguf import read_tensor_directory
from services.model.model_config import UnsupportedModelError

# Tensor types the loader can dequantize (gguf.quants implements them in numpy).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")

_TOP = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "attn_output.weight": "attn.o.weight",
    "attn_output.bias": "attn.o.bias",
    "ffn_down.weight": "mlp.down.weight",
    "ffn_down.bias": "mlp.down.bias",
}
_FUSED = {"attn.qkv": ("attn_q", "attn_k", "attn_v"), "mlp.gate_up": ("ffn_gate", "ffn_up")}


def _gguf_names(model: LlamaModel) -> dict[str, list[str]]:
    """Our parameter name -> the GGUF tensor names it is made of (in order)."""
    own = dict(model.named_parameters())
    names: dict[str, list[str]] = {ours: [g] for g, ours in _TOP.items()}
    for i in range(model.config.num_layers):
        for g, ours in _LAYER.items():
            names[f"layers.{i}.{ours}"] = [f"blk.{i}.{g}"]
        for ours, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{ours}.{kind}"] = [f"blk.{i}.{p}.{kind}" for p in parts]
    if model.config.tie_word_embeddings:
        del names["lm_head.weight"]
    return {k: v for k, v in names.items() if k in own}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf.py's `permute` (rows of Q or K, weight or bias)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(path: Path) -> dict[str, tuple[np.ndarray, Any, tuple[int, ...]]]:
    """name -> (raw bytes as [rows, bytes per row], gguf type, dims fastest-first), memory-mapped.

    The directory is parsed by services/model/gguf.py (gguf.GGUFReader builds a numpy view per
    metadata array element: seconds for a 49k-token vocabulary); sizes and types are the gguf
    package's.
    """
    import gguf

    infos, data_offset = read_tensor_directory(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, (dims, code, offset) in infos.items():
        try:
            qtype = gguf.GGMLQuantizationType(code)
        except ValueError:
            raise UnsupportedModelError(f"{path}: tensor {name} has unknown GGML type {code}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block * type_size
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        start = data_offset + offset
        out[name] = (raw[start : start + rows * row_bytes].reshape(rows, row_bytes), qtype, dims)
    return out


def load_gguf_weights(model: LlamaModel, path: str | Path) -> None:
    """Copy the file's tensors (dequantized, un-permuted) into `model`, cast to its dtype."""
    import gguf

    path = Path(path)
    tensors = _tensors(path)
    bad = sorted({t[1].name for t in tensors.values()} - set(SUPPORTED_TENSOR_TYPES))
    if bad:
        raise UnsupportedModelError(
            f"{path}: GGUF tensor types {bad} are not supported; one of {SUPPORTED_TENSOR_TYPES}"
        )
    cfg = model.config
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    params = dict(model.named_parameters())
    wanted = _gguf_names(model)
    used = {n for parts in wanted.values() for n in parts}
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise WeightLoadError(f"{path}: unexpected tensors {unexpected[:8]}")
    for ours, names in wanted.items():
        missing = [n for n in names if n not in tensors]
        if missing:
            raise WeightLoadError(f"{path}: missing tensors {missing}")
        parts = []
        for n in names:
            data, qtype, dims = tensors[n]
            # Dequantized to float32 [rows, cols]; GGUF lists dims fastest-first.
            w = gguf.quants.dequantize(data, qtype).reshape(tuple(reversed(dims)))
            kind = n.split(".")[-2]
            if kind in heads:
                w = _unpermute(w, heads[kind])
            parts.append(torch.from_numpy(np.array(w, dtype=np.float32)))  # a writable copy of the mmap
        tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
        param = params[ours]
        if tensor.shape != param.shape:
            raise WeightLoadError(
                f"{path}: {names} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)

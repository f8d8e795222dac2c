"""Weights in and out of Hugging Face safetensors folders.

`load_model` builds the model an EngineSpec describes; `load_hf_weights` fills
it from `*.safetensors` (single file or sharded), fusing q/k/v and gate/up
projections; `export_hf_folder` writes a
model back under HF names with a LlamaConfig-style config.json, so that
`transformers` can run the exact same weights (benchmark and tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.engine.engine_spec import EngineSpec
from services.engine.model import LlamaModel
from services.model.model_config import UnsupportedModelError

_LAYER_PARTS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.o_proj.weight": "attn.o.weight",
    "self_attn.o_proj.bias": "attn.o.bias",
    "mlp.down_proj.weight": "mlp.down.weight",
    "mlp.down_proj.bias": "mlp.down.bias",
}
# Fused parameters: (ours, HF parts in concatenation order).
_FUSED = {
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
}
_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


# Names quantized checkpoints give their scale / zero-point tensors (compressed-tensors, fp8, AWQ, GPTQ).
_SCALE_SUFFIXES = (
    "weight_scale",
    "input_scale",
    "weight_scale_inv",
    "weight_zero_point",
    ".scales",
    ".qzeros",
    ".g_idx",
)
# Buffers some exporters save that the model recomputes (RoPE inverse frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """The safetensors do not match the model (missing, unexpected or misshapen tensors)."""


def load_model(spec: EngineSpec) -> LlamaModel:
    """The spec's model in eval mode on its device and dtype: HF weights, or the seeded built-in ones."""
    cfg = spec.config
    model = LlamaModel(spec.model, spec.max_model_len)
    if cfg.model_path is not None and cfg.model_path.lower().endswith(".gguf"):
        from services.engine.gguf_loader import load_gguf_weights  # imports loader (WeightLoadError)

        load_gguf_weights(model, cfg.model_path)
    elif cfg.model_path is not None:
        load_hf_weights(model, cfg.model_path)
    else:
        model.init_random(cfg.seed)
    return model.to(device=cfg.device, dtype=spec.layout.torch_dtype).eval().requires_grad_(False)


def _hf_names(model: LlamaModel) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensor names it is made of (in order)."""
    names: dict[str, list[str]] = {ours: [hf] for hf, ours in _TOP.items()}
    if model.config.tie_word_embeddings:
        del names["lm_head.weight"]
    own = dict(model.named_parameters())
    for i in range(model.config.num_layers):
        for hf, ours in _LAYER_PARTS.items():
            names[f"layers.{i}.{ours}"] = [f"model.layers.{i}.{hf}"]
        for ours, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{ours}.{kind}"] = [f"model.layers.{i}.{p}.{kind}" for p in parts]
    return {k: v for k, v in names.items() if k in own}


def _open_tensors(folder: Path) -> dict[str, tuple[Path, str]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in model folder {folder}")
    where: dict[str, tuple[Path, str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                where[key] = (f, key)
    return where


def load_hf_weights(model: LlamaModel, folder: str | Path) -> None:
    """Copy the folder's tensors into `model` (cast to its dtype)."""
    folder = Path(folder)
    where = _open_tensors(folder)
    params = dict(model.named_parameters())
    files = {path: safe_open(str(path), framework="pt") for path, _ in where.values()}
    wanted = _hf_names(model)
    used = {n for names in wanted.values() for n in names}
    # Quantized checkpoints carry scales next to their weights (weight_scale, input_scale, ...):
    # casting those weights and dropping the scales would run, and produce garbage.
    scales = sorted(n for n in where if n.endswith(_SCALE_SUFFIXES))
    if scales:
        raise UnsupportedModelError(
            f"{folder}: quantized checkpoint (scale tensors {scales[:4]}) is not supported"
        )
    unexpected = sorted(n for n in set(where) - used if not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise WeightLoadError(f"{folder}: unexpected tensors {unexpected[:8]}")
    for ours, hf_names in wanted.items():
        missing = [n for n in hf_names if n not in where]
        if missing:
            raise WeightLoadError(f"{folder}: missing tensors {missing}")
        parts = [files[where[n][0]].get_tensor(n) for n in hf_names]
        float8 = [
            n
            for n, t in zip(hf_names, parts, strict=True)
            if t.dtype.is_floating_point and t.element_size() == 1
        ]
        if float8:
            raise UnsupportedModelError(f"{folder}: float8 tensors {float8[:4]} are not supported")
        tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
        param = params[ours]
        if tensor.shape != param.shape:
            raise WeightLoadError(
                f"{folder}: {hf_names} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)


def export_hf_folder(model: LlamaModel, folder: str | Path) -> None:
    """Write `model` as an HF Llama checkpoint (config.json + model.safetensors)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for ours, hf_names in _hf_names(model).items():
        sizes = _split_sizes(model, ours, params[ours].shape[0], len(hf_names))
        for name, part in zip(hf_names, params[ours].detach().split(sizes), strict=True):
            tensors[name] = part.contiguous().clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(_llama_config_dict(model), indent=2))


def _split_sizes(model: LlamaModel, ours: str, rows: int, n: int) -> list[int]:
    cfg = model.config
    if n == 1:
        return [rows]
    if ".attn.qkv." in ours:
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def _llama_config_dict(model: LlamaModel) -> dict:
    cfg = model.config
    if cfg.qkv_bias != cfg.o_bias or cfg.rope_scaling.rope_type != "default":
        raise ValueError("export_hf_folder writes plain Llama configs only")
    dtype = next(model.parameters()).dtype
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }

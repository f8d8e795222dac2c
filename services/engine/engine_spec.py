"""EngineSpec: what an EngineConfig resolves to before any weight is loaded.

Reads the model's config and tokenizer (cheap), sizes the KV pool and the
context limit, and describes the engine (EngineInfo). The async engine builds
it at construction so `info` and `tokenizer` exist before `start()`;
LLMEngine and ModelRunner are built from it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

from kvtransfer.layout import KvLayout
from services.engine.api import EngineCapabilities, EngineInfo, Tokenizer
from services.engine.config import EngineConfig
from services.model.model_config import ModelConfig, RopeScaling
from services.model.tokenizer import ByteTokenizer, HfTokenizer


@dataclass(frozen=True)
class EngineSpec:
    config: EngineConfig
    model: ModelConfig
    tokenizer: Tokenizer
    layout: KvLayout
    num_blocks: int
    # Context limit: the configured one, capped by what the pool can hold.
    max_model_len: int
    info: EngineInfo

    @classmethod
    def resolve(cls, config: EngineConfig) -> EngineSpec:
        if config.model_path is not None:
            model = ModelConfig.from_hf_folder(config.model_path)
            tokenizer: Tokenizer = HfTokenizer(config.model_path, model.vocab_size, model.eos_token_ids)
        else:
            model = ModelConfig.from_preset(config.preset)
            tokenizer = ByteTokenizer()
        model = _resolve_rope(config, model)
        eos = model.eos_token_ids or tuple(tokenizer.eos_token_ids)
        layout = KvLayout(
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=config.dtype,
            block_size=config.block_size,
            quant=config.kv_cache_quant,
            fingerprint=model_fingerprint(config, model),
        )
        max_len = _context_limit(config, model)
        num_blocks = config.num_blocks
        if num_blocks is None:
            by_memory = config.kv_cache_bytes // layout.block_bytes
            by_use = config.max_num_seqs * -(-max_len // config.block_size)
            num_blocks = max(1, min(by_memory, by_use))
        max_len = min(max_len, num_blocks * config.block_size)
        info = EngineInfo(
            backend="torch",
            model_id=config.resolved_model_id,
            vocab_size=model.vocab_size,
            max_model_len=max_len,
            block_size=config.block_size,
            num_blocks=num_blocks,
            layout=layout,
            eos_token_ids=eos,
            device=config.device,
            capabilities=EngineCapabilities(moves_kv_itself=False, exports_kv_pool=True),
        )
        return cls(config, model, tokenizer, layout, num_blocks, max_len, info)


def model_fingerprint(config: EngineConfig, model: ModelConfig) -> str:
    """A short hash of what makes one engine's KV usable by another: the model's config, which
    weights (model id; the seed of the built-in ones) and how they are quantized. KV from an int4
    engine differs from the fp one's by more than the KV quantization a receiver expects.
    The dtype and KV scheme are checked as layout fields of their own."""
    ident = {
        "model": asdict(model),
        "model_id": config.resolved_model_id,
        "seed": config.seed if config.model_path is None else None,
        "weights": config.weights,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _dynamic_limit(model: ModelConfig) -> int:
    s = model.rope_scaling
    return int((s.original_max_position_embeddings or model.max_position_embeddings) * s.factor)


def _resolve_rope(config: EngineConfig, model: ModelConfig) -> ModelConfig:
    """Dynamic NTK only when the configured context exceeds the original one (see rope.py).

    Decided from the configured limit, not the pool-capped one, so the frequencies never
    depend on the KV pool size. Within the original context, plain RoPE is what transformers
    computes too.
    """
    s = model.rope_scaling
    if s.rope_type != "dynamic":
        return model
    original = s.original_max_position_embeddings or model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > original:
        return replace(model, rope_scaling=replace(s, original_max_position_embeddings=original))
    return replace(model, rope_scaling=RopeScaling())


def _context_limit(config: EngineConfig, model: ModelConfig) -> int:
    limit = model.max_position_embeddings
    if model.rope_scaling.rope_type == "dynamic":  # only dynamic NTK extends it: to original x factor
        limit = _dynamic_limit(model)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's context of {limit} tokens"
        )
    return config.max_model_len

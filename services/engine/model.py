"""A Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

RMSNorm, RoPE, GQA, SwiGLU; optional q/k/v bias and tied embeddings. q/k/v and
gate/up projections are fused into one matmul each (`loader.py` maps HF names).
Input is the step's flat token batch (see `attention.py`); only the rows that
need a next token go through the LM head. T = tokens in the step, D = hidden
size, H / Hkv = query / KV heads, Dh = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention import AttentionMetadata, paged_attention
from services.engine.rope import RotaryEmbedding, apply_rope
from services.model.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32, as transformers does, then back to the model dtype before the weight.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_layer, meta: AttentionMetadata):
        t, h = x.shape[0], self.num_heads
        qk_size = self.sizes[0] + self.sizes[1]
        qkv = self.qkv(x)  # [T, (H + 2 Hkv) * Dh]
        # q and k rotated together (one set of ops for both heads' kinds), then split.
        qk = apply_rope(qkv[:, :qk_size].view(t, h + self.num_kv_heads, self.head_dim), *rope)
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        return self.o(paged_attention(q, k, v, kv_layer, meta))  # [T, D]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [T, I] each
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, kv_layer, meta):
        x = x + self.attn(self.attn_norm(x), rope, kv_layer, meta)
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_len)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_layers: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_layers[i]: pool view [N, 2, bs, Hkv, Dh]. Returns [T, D]."""
        x = self.embed(input_ids)
        rope = self.rope(positions, x.dtype)  # cos, signed sin [T, 1, Dh]
        for layer, kv_layer in zip(self.layers, kv_layers, strict=True):
            x = layer(x, rope, kv_layer, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, D] -> float32 logits [B, V]."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Deterministic weights for the built-in model: N(0, 0.02) matrices, unit norms."""
        g = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.02)

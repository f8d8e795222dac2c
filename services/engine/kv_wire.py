"""KV blocks quantized for the wire only: a full-precision cache, 1-byte blocks in transit.

`--kv-wire-quant int8|fp8` (services/worker/wire_kv.py) keeps the engine's pool in
its dtype and quantizes only what a handoff moves: the holder quantizes the
handed-off blocks on export, the receiver dequantizes them on import into its
own full-precision pool. A wire block is byte for byte a block of the in-cache
scheme (kvtransfer/layout.py: the values [L, 2, bs, Hkv, Dh], then float32
scales [L, 2, Hkv], one per block, layer, K/V and head = the block's absmax over
its tokens and head dim / 127 for int8, / 448 for fp8), so its layout is the
cache's with `quant` set, the handle carries that scheme and scale layout, and a
receiver whose wire or cache scheme differs refuses it (LayoutMismatch). A block
quantized here and one a quantized cache wrote differ only in their scales'
history (the cache's grow token by token; the absmax is the same), so a quantized
cache can receive wire blocks, and a wire receiver can receive a quantized cache's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvtransfer.layout import KV_QUANT_VALUES, KvLayout
from services.engine.attention import kv_qmax


def wire_layout(layout: KvLayout, scheme: str) -> KvLayout:
    """The wire layout of a full-precision pool's `layout` under `scheme` (int8 / fp8)."""
    if layout.quant != "none":
        raise ValueError(f"wire quantization needs a full-precision KV cache, not {layout.quant!r}")
    if scheme not in KV_QUANT_VALUES:
        raise ValueError(f"wire quantization must be one of {sorted(KV_QUANT_VALUES)}, got {scheme!r}")
    return replace(layout, quant=scheme)


def quantize_blocks(blocks: torch.Tensor, wire: KvLayout) -> torch.Tensor:
    """Full-precision blocks [n, L, 2, bs, Hkv, Dh] -> their wire bytes, uint8 [n, wire.block_bytes].

    The in-cache scheme's arithmetic (attention.quantize_kv: x / scale rounded, for int8) in
    fewer passes over the blocks: the absmax from max and min along the contiguous head dim
    (no |x| copy), one multiply by the reciprocal scales, rounding in place, and no clamp (the
    scale is the block's own absmax / qmax, so |x / scale| <= qmax already). On a loaded
    2-vCPU machine this took the 2,048-token `small` handoff's quantize from ~300-1,800 ms
    to ~60-90 ms (bench/kv_transfer.py's wire-int8 row)."""
    n = blocks.shape[0]
    values_dtype = getattr(torch, KV_QUANT_VALUES[wire.quant][0])
    x = blocks if blocks.dtype == torch.float32 else blocks.float()
    amax = torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg_()).amax(dim=3)  # [n, L, 2, Hkv]
    scales = (amax / kv_qmax(values_dtype)).clamp_(min=1e-12)
    q = x * scales.reciprocal()[:, :, :, None, :, None]
    if values_dtype == torch.int8:
        q.round_()
    values = q.to(values_dtype)
    return torch.cat(
        [values.view(torch.uint8).reshape(n, -1), scales.view(torch.uint8).reshape(n, -1)], dim=1
    )


def dequantize_blocks(packed: torch.Tensor, wire: KvLayout) -> torch.Tensor:
    """Wire bytes uint8 [n, wire.block_bytes] -> blocks [n, L, 2, bs, Hkv, Dh] in wire.dtype."""
    data, scales = wire.kv_views(packed)  # the values in the scheme's dtype, float32 scales
    assert scales is not None
    out = data.float().mul_(scales[:, :, :, None, :, None])
    return out if wire.torch_dtype == torch.float32 else out.to(wire.torch_dtype)

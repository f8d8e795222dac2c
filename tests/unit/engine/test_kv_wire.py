"""Wire-only KV quantization (services/engine/kv_wire.py): round-trip bounds, the wire format.

A wire block must be the in-cache scheme's block byte for byte (values, then per
block/layer/K/V/head float32 scales), so the layout handshake that refuses another
scheme also guards the wire, and a quantized cache and a wire receiver interoperate.
"""

from __future__ import annotations

import pytest
import torch

from kvtransfer.layout import KvLayout, LayoutMismatch, layout_from_proto, layout_to_proto
from services.engine.attention import QuantKvLayer, write_quantized
from services.engine.kv_wire import dequantize_blocks, quantize_blocks, wire_layout

FP = KvLayout(num_layers=2, num_kv_heads=3, head_dim=8, dtype="float32", block_size=4, fingerprint="m")


def blocks(n=5, seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *FP.kv_shape, generator=g) * 3
    # per-head magnitudes far apart, as real K/V heads are: a shared scale would lose the small ones
    x *= torch.tensor([0.01, 1.0, 40.0])[None, None, None, None, :, None]
    return x.to(dtype)


def scales_of(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """The per (block, layer, K/V, head) step the scheme uses, broadcast to x."""
    return (x.float().abs().amax(dim=(3, 5), keepdim=True) / qmax).clamp(min=1e-12)


def test_int8_wire_round_trip_is_within_half_a_step_per_head():
    wire = wire_layout(FP, "int8")
    x = blocks()
    packed = quantize_blocks(x, wire)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (5, wire.block_bytes)
    y = dequantize_blocks(packed, wire)
    assert y.dtype == torch.float32 and y.shape == x.shape
    step = scales_of(x, 127.0)
    assert bool(((y - x).abs() <= step / 2 + 1e-6 * x.abs()).all())
    # the small head kept its own precision (one scale per head, not per block)
    small = (y - x)[:, :, :, :, 0].abs().max()
    assert small < 0.01 * 3 * 4 / 127


def test_fp8_wire_round_trip_is_within_e4m3_rounding():
    wire = wire_layout(FP, "fp8")
    x = blocks(seed=1)
    y = dequantize_blocks(quantize_blocks(x, wire), wire)
    step = scales_of(x, 448.0)
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals below 2^-6 steps of 2^-9 (x scale)
    assert bool(((y - x).abs() <= x.abs() * 2**-4 + step * 2**-9 + 1e-7).all())


def test_bf16_cache_dequantizes_into_bf16():
    bf = KvLayout(2, 3, 8, "bfloat16", 4)
    wire = wire_layout(bf, "int8")
    x = blocks(dtype=torch.bfloat16)
    y = dequantize_blocks(quantize_blocks(x, wire), wire)
    assert y.dtype == torch.bfloat16
    assert wire.block_bytes < 0.6 * bf.block_bytes


def test_a_wire_block_is_the_in_cache_schemes_block():
    """Quantizing a block for the wire and writing it token by token into an int8 cache give
    the same bytes' meaning: the cache reads wire bytes back to the same values."""
    wire = wire_layout(FP, "int8")
    x = blocks(n=1, seed=2)
    cache_pool = wire.allocate_pool(1)
    data, scales = wire.kv_views(cache_pool)
    for layer in range(FP.num_layers):
        q = QuantKvLayer(data[:, layer], scales[:, layer])
        for t in range(FP.block_size):
            k, v = x[0, layer, 0, t], x[0, layer, 1, t]
            write_quantized(q, torch.tensor([0]), torch.tensor([t]), k[None], v[None])
    from_cache = dequantize_blocks(cache_pool, wire)
    from_wire = dequantize_blocks(quantize_blocks(x, wire), wire)
    step = scales_of(x, 127.0)
    # the wire block is within half a step of x; the cache, re-rounded each time a token raised
    # its scale (attention.write_quantized), within a few half steps
    assert bool(((from_cache - from_wire).abs() <= 2 * step + 1e-6).all())
    assert torch.allclose(wire.kv_views(quantize_blocks(x, wire))[1], scales, rtol=1e-6)


def test_the_wire_layout_travels_and_is_refused_by_another_scheme():
    wire = wire_layout(FP, "int8")
    assert (wire.quant, wire.scale_layout, wire.fingerprint) == ("int8", "float32[layer,kv,head]/block", "m")
    assert wire.block_bytes / FP.block_bytes <= 0.3
    back = layout_from_proto(layout_to_proto(wire))
    assert back == wire
    for other, field in ((FP, "quant"), (wire_layout(FP, "fp8"), "quant")):
        with pytest.raises(LayoutMismatch, match=field):
            back.check_compatible(other)
    msg = layout_to_proto(wire)
    msg.kv_scale_layout = "float32[layer,kv]/block"
    with pytest.raises(LayoutMismatch, match="scale layout"):
        layout_from_proto(msg)


def test_wire_layout_refuses_a_quantized_cache_and_unknown_schemes():
    with pytest.raises(ValueError, match="full-precision"):
        wire_layout(wire_layout(FP, "int8"), "int8")
    with pytest.raises(ValueError, match="one of"):
        wire_layout(FP, "int4")

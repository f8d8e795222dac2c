"""Weight-only int8 / int4 linears and int8 KV blocks: round-trip error bounds, engines that use them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvtransfer.layout import KvLayout, LayoutMismatch, layout_from_proto, layout_to_proto
from services.engine.attention import QuantKvLayer, write_quantized
from services.engine.quantize import (
    INT4_GROUP,
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    quantize_linears,
)
from tests.unit.engine.conftest import prompt_of, request

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "_weight_int4pack_mm_for_cpu"), reason="torch lacks the kernels"
)


def weight(n=96, k=128, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_round_trip_is_within_half_a_step_per_channel():
    w = weight()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (w.shape[0],)
    err = (dequantize_int8(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    assert bool((q.abs().amax(dim=1) == 127).all())  # every channel uses its full range


def test_int4_round_trip_is_within_half_a_step_per_group():
    w = weight()
    q, scale, zero = quantize_int4(w)
    assert int(q.min()) >= 0 and int(q.max()) <= 15 and scale.shape == (96, 128 // INT4_GROUP)
    err = (dequantize_int4(q, scale, zero) - w).abs().view(96, -1, INT4_GROUP)
    assert bool((err <= scale[..., None] / 2 + 1e-6).all())
    with pytest.raises(ValueError, match="divisible"):
        quantize_int4(torch.randn(4, 48))


@pytest.mark.parametrize(("cls", "bound"), [(Int8Linear, 0.02), (Int4Linear, 0.15)])
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_matches_the_dense_one(cls, bound, bias):
    torch.manual_seed(0)
    dense = nn.Linear(128, 96, bias=bias)
    x = torch.randn(5, 128)
    with torch.no_grad():
        want = dense(x)
    got = cls(dense)(x)
    assert got.dtype == x.dtype and got.shape == want.shape
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < bound, rel
    assert got.shape == cls(dense)(x[None]).shape[1:]  # leading dims kept


def test_quantize_linears_keeps_the_lm_head_in_int8_and_reports_bytes():
    model = nn.Sequential()
    model.add_module("a", nn.Linear(64, 64))
    model.add_module("lm_head", nn.Linear(64, 10))
    model.add_module("kept", nn.Linear(64, 10))
    report = quantize_linears(model, "int4", int8_only=("lm_head",), skip=("kept",))
    assert isinstance(model.a, Int4Linear) and isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.kept, nn.Linear)
    assert report.num_linears == 2 and report.quant_bytes * 3 < report.fp_bytes
    assert 0 < report.max_rel_error < 0.1
    with pytest.raises(ValueError, match="weight scheme"):
        quantize_linears(model, "int3")


# ---- int8 KV blocks ---------------------------------------------------------------


def quant_layer(n=6, bs=4, hkv=2, d=8) -> QuantKvLayer:
    return QuantKvLayer(torch.zeros(n, 2, bs, hkv, d, dtype=torch.int8), torch.zeros(n, 2, hkv))


def dequant(layer: QuantKvLayer) -> torch.Tensor:
    return layer.data.float() * layer.scales[:, :, None, :, None]


def test_int8_kv_written_a_token_at_a_time_stays_within_one_step_of_the_values():
    layer = quant_layer()
    g = torch.Generator().manual_seed(1)
    want = torch.zeros(6, 2, 4, 2, 8)
    blocks = [3, 3, 3, 3, 5, 5]
    for t, b in enumerate(blocks):  # growing magnitudes force requantization of earlier tokens
        k, v = (torch.randn(1, 2, 8, generator=g) * (t + 1) for _ in range(2))
        want[b, 0, t % 4], want[b, 1, t % 4] = k[0], v[0]
        write_quantized(layer, torch.tensor([b]), torch.tensor([t % 4]), k, v)
    for b in (3, 5):
        amax = want[b].abs().amax(dim=(1, 3))  # [2, Hkv]
        assert torch.allclose(layer.scales[b], amax / 127)
        err = (dequant(layer)[b] - want[b]).abs()
        # Half a step for the last write, plus at most half a step for each rescale.
        assert bool((err <= layer.scales[b][:, None, :, None] * 2.5).all()), float(err.max())


def test_int8_kv_block_reused_from_offset_zero_starts_a_fresh_scale():
    layer = quant_layer()
    big = torch.full((4, 2, 8), 100.0)
    write_quantized(layer, torch.full((4,), 2), torch.arange(4), big, big)
    small = torch.full((1, 2, 8), 0.5)
    write_quantized(layer, torch.tensor([2]), torch.tensor([0]), small, small)
    assert torch.allclose(layer.scales[2], torch.full((2, 2), 0.5 / 127))


def test_int8_kv_layout_puts_the_scales_inside_each_block():
    fp = KvLayout(2, 2, 8, "float32", 4)
    q = KvLayout(2, 2, 8, "float32", 4, quant="int8")
    assert q.block_bytes == fp.block_bytes // 4 + 2 * 2 * 2 * 4
    pool = q.allocate_pool(3)
    assert pool.dtype == torch.uint8 and pool.shape == (3, q.block_bytes)
    data, scales = q.kv_views(pool)
    data[1].fill_(7)
    scales[1].fill_(0.25)
    assert int(pool[0].sum()) == 0 and int(pool[2].sum()) == 0  # block 1's bytes only
    assert data.data_ptr() == pool.data_ptr()
    with pytest.raises(LayoutMismatch, match="quant"):
        fp.check_compatible(q)


def test_fp8_kv_written_a_token_at_a_time_stays_within_e4m3_rounding_of_the_values():
    f8 = torch.float8_e4m3fn
    layer = QuantKvLayer(torch.zeros(6, 2, 4, 2, 8, dtype=f8), torch.zeros(6, 2, 2))
    g = torch.Generator().manual_seed(1)
    want = torch.zeros(6, 2, 4, 2, 8)
    for t, b in enumerate([3, 3, 3, 3, 5, 5]):  # growing magnitudes force requantization
        k, v = (torch.randn(1, 2, 8, generator=g) * (t + 1) for _ in range(2))
        want[b, 0, t % 4], want[b, 1, t % 4] = k[0], v[0]
        write_quantized(layer, torch.tensor([b]), torch.tensor([t % 4]), k, v)
    for b in (3, 5):
        amax = want[b].abs().amax(dim=(1, 3))  # [2, Hkv]
        assert torch.allclose(layer.scales[b], amax / 448)
        got = layer.data[b].float() * layer.scales[b][:, None, :, None]
        # e4m3 keeps 3 mantissa bits: 1/16 relative per rounding, a rounding per rescale (<= 4).
        # Values far below the block's absmax fall into e4m3's subnormals: an absolute floor.
        floor = layer.scales[b][:, None, :, None] * 2.0**-6
        assert bool(((got - want[b]).abs() <= want[b].abs() * 0.25 + floor).all())


def test_fp8_kv_layout_has_int8s_bytes_and_is_refused_by_an_int8_side():
    i8 = KvLayout(2, 2, 8, "float32", 4, quant="int8")
    f8 = KvLayout(2, 2, 8, "float32", 4, quant="fp8")
    assert f8.block_bytes == i8.block_bytes
    data, scales = f8.kv_views(f8.allocate_pool(3))
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    with pytest.raises(LayoutMismatch, match="quant"):
        i8.check_compatible(f8)
    with pytest.raises(LayoutMismatch, match="quant"):
        layout_from_proto(layout_to_proto(f8)).check_compatible(i8)


# ---- engines --------------------------------------------------------------------------


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> float:
    same = sum(x == y for r in a for x, y in zip(a[r], b[r], strict=True))
    return same / sum(len(v) for v in a.values())


def requests():
    return [request(f"r{i}", prompt_of(9 + 13 * i, seed=i), max_tokens=32) for i in range(3)]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_engine_with_quantized_weights_runs_and_is_fingerprinted_apart(make_engine, weights):
    fp, quant = make_engine(), make_engine(weights=weights)
    out = quant.generate(requests())
    assert all(len(v) == 32 for v in out.values())
    assert quant.runner.quant_report.num_linears == 2 * quant.spec.model.num_layers * 2 + 1
    assert quant.runner.quant_report.quant_bytes * 3 < quant.runner.quant_report.fp_bytes
    # Same shapes, other weights: its KV is not the fp engine's.
    assert quant.spec.layout.fingerprint != fp.spec.layout.fingerprint
    with pytest.raises(LayoutMismatch, match="fingerprint"):
        fp.spec.layout.check_compatible(quant.spec.layout)


def test_engine_with_int8_kv_agrees_with_the_fp_engine(make_engine):
    fp, quant = make_engine(), make_engine(kv_cache_quant="int8")
    want, got = fp.generate(requests()), quant.generate(requests())
    # Measured 1.0 on these prompts (tiny preset); the bound leaves room for a tie flipping.
    assert agreement(want, got) >= 0.9
    assert quant.spec.layout.block_bytes / fp.spec.layout.block_bytes <= 0.3


def test_engine_with_fp8_kv_agrees_with_the_fp_engine_and_hands_over(make_engine):
    from tests.unit.engine.test_disagg import hand_over

    fp, quant = make_engine(), make_engine(kv_cache_quant="fp8")
    want, got = fp.generate(requests()), quant.generate(requests())
    assert agreement(want, got) >= 0.9
    assert quant.spec.layout.block_bytes / fp.spec.layout.block_bytes <= 0.3
    req = request("h", prompt_of(57, seed=5), max_tokens=20)
    alone = make_engine(kv_cache_quant="fp8").generate([req])["h"]
    assert hand_over(make_engine(kv_cache_quant="fp8"), make_engine(kv_cache_quant="fp8"), req) == alone


def test_int8_kv_handover_between_engines_gives_the_int8_engine_tokens(make_engine):
    from tests.unit.engine.test_disagg import hand_over

    req = request("h", prompt_of(57, seed=5), max_tokens=20)
    want = make_engine(kv_cache_quant="int8").generate([req])["h"]
    prefill, decode = make_engine(kv_cache_quant="int8"), make_engine(kv_cache_quant="int8")
    assert hand_over(prefill, decode, req) == want


@pytest.mark.parametrize(
    ("prefill_kw", "decode_kw", "field"),
    [
        ({"kv_cache_quant": "int8"}, {}, "quant"),
        ({}, {"kv_cache_quant": "int8"}, "quant"),
        ({"weights": "int8"}, {}, "fingerprint"),
        ({"seed": 1}, {}, "fingerprint"),
    ],
)
def test_import_refuses_another_quantization_or_model(make_engine, prefill_kw, decode_kw, field):
    from tests.unit.engine.test_disagg import prefill_only

    prefill, decode = make_engine(**prefill_kw), make_engine(**decode_kw)
    req = request("m", prompt_of(20, seed=2), max_tokens=4)
    _, held = prefill_only(prefill, req)
    res = decode.reserve_external(req)
    with pytest.raises(LayoutMismatch, match=field):
        decode.import_blocks(res.transfer_block_ids, prefill.export_blocks(held.block_ids), held.layout)
    assert prefill.release("m")
    decode.abort("m")


def test_stats_and_metrics_count_bytes_by_scheme(make_engine):
    from prometheus_client import CollectorRegistry

    from services.worker.metrics import EngineCollector

    fp, quant = make_engine(), make_engine(weights="int4", kv_cache_quant="int8")
    s, f = quant.stats(), fp.stats()
    assert (s.weight_scheme, s.kv_scheme, f.weight_scheme, f.kv_scheme) == ("int4", "int8", "fp", "none")
    assert s.weight_bytes > 0 and 0 < s.weight_quant_error < 0.1 and f.weight_bytes == 0
    assert s.kv_pool_bytes * 3 < f.kv_pool_bytes  # same block count, int8 blocks
    registry = CollectorRegistry()
    registry.register(EngineCollector(quant.stats, "decode"))
    labels = {"role": "decode", "scheme": "int8"}
    assert registry.get_sample_value("pdmesh_kv_pool_bytes", labels) == s.kv_pool_bytes
    labels["scheme"] = "int4"
    assert registry.get_sample_value("pdmesh_engine_weight_quant_error", labels) == s.weight_quant_error


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_batched_steps_use_the_dense_copy_and_small_ones_the_packed_kernel(cls):
    from services.engine.quantize import MAX_QUANT_ROWS

    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    calls = []

    class Dense(nn.Module):
        def forward(self, x):
            calls.append(x.shape[0])
            with torch.no_grad():
                return linear(x)

    q = cls(linear, Dense())
    small, big = torch.randn(MAX_QUANT_ROWS, 64), torch.randn(MAX_QUANT_ROWS + 1, 64)
    q(small)
    assert calls == []
    q(big)
    assert calls == [MAX_QUANT_ROWS + 1]
    assert cls(linear)(big).shape == (MAX_QUANT_ROWS + 1, 32)  # without a copy: the kernel

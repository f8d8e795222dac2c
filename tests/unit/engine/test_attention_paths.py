"""The three attention paths (fresh prompt, prompt chunk after context, decode) agree numerically."""

from __future__ import annotations

import pytest
import torch

from services.engine.model_runner import scratch_sequence
from tests.unit.engine.conftest import prompt_of


def logits_in_chunks(engine, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    seq = scratch_sequence(tokens, engine.block_size)
    assert engine.block_manager.allocate_slots(seq, len(tokens))
    try:
        parts = []
        for n in chunks:
            parts.append(engine.runner.chunk_logits(seq, n))
            seq.num_computed_tokens += n
        return torch.cat(parts)
    finally:
        engine.block_manager.free(seq)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_and_decode_logits_equal_one_pass(make_engine, dtype):
    engine = make_engine(dtype=dtype)
    tokens = prompt_of(75, seed=9)
    whole = engine.prompt_logits(tokens)
    # A chunk at a block boundary, one mid-block, single tokens (the decode path), then the rest.
    chunked = logits_in_chunks(engine, tokens, [16, 21, 1, 1, 1, 35])
    one_by_one = logits_in_chunks(engine, tokens, [1] * 75)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == "float32" else {"atol": 0.05, "rtol": 0.05}
    torch.testing.assert_close(chunked, whole, **tol)
    torch.testing.assert_close(one_by_one, whole, **tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_compute_the_same_model(make_engine, dtype):
    from services.engine.packing import PackedLinear, can_pack

    packed, plain = make_engine(dtype=dtype), make_engine(dtype=dtype, pack_weights=False)
    if not can_pack(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip("no oneDNN linear prepacking here for this dtype (the build, or bf16 on this CPU)")
    assert isinstance(packed.runner.model.layers[0].mlp.gate_up, PackedLinear)
    assert not isinstance(plain.runner.model.layers[0].mlp.gate_up, PackedLinear)
    tokens = prompt_of(40, seed=2)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == "float32" else {"atol": 0.05, "rtol": 0.05}
    torch.testing.assert_close(packed.prompt_logits(tokens), plain.prompt_logits(tokens), **tol)

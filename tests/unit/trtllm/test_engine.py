"""TrtllmEngine against the fake TensorRT-LLM, in one process (two engines = two workers)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import aclosing

import pytest

from services.engine.api import (
    EngineError,
    EngineRequest,
    FinishReason,
    InvalidHandoffError,
    InvalidRequestError,
    KvEventKind,
    KvHandoffEngine,
    SamplingParams,
)
from services.engine.async_engine import TorchEngine
from services.engine.config import EngineConfig
from services.engine.factory import create_engine
from services.engine.trtllm.engine import TrtllmEngine
from services.engine.trtllm.handoff import state_from_params
from tests.support.poll import eventually

PROMPT = [(i * 37) % 500 + 2 for i in range(45)]  # 2 full blocks of 16 + 13 tokens


def config(model, **over) -> EngineConfig:
    return EngineConfig(backend="trtllm", model_path=str(model), num_threads=1, **over)


@pytest.fixture
async def pair(tiny_llama):
    """A 'prefill' and a 'decode' engine on the same model."""
    engines = [create_engine(config(tiny_llama)), create_engine(config(tiny_llama))]
    for e in engines:
        await e.start()
    yield engines
    for e in engines:
        await e.close()


async def collect(stream) -> tuple[list[int], FinishReason | None]:
    tokens, reason = [], None
    async with aclosing(stream) as s:
        async for out in s:
            tokens += out.token_ids
            reason = out.finish_reason
    return tokens, reason


def test_importing_the_backend_does_not_import_tensorrt_llm():
    code = (
        "import sys; import services.engine.factory, services.engine.trtllm.engine; "
        "assert 'tensorrt_llm' not in sys.modules, 'imported'"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
    }  # the fake is importable, still not imported
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_the_backend_needs_a_model_folder():
    with pytest.raises(ValueError, match="model-path"):
        TrtllmEngine(EngineConfig(backend="trtllm"))


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 3}])
async def test_remote_handoff_equals_local_generate_and_the_torch_engine(pair, tiny_llama, sampling):
    prefill, decode = pair
    assert isinstance(decode, KvHandoffEngine) and decode.info.capabilities.moves_kv_itself
    assert decode.kv_pool() is None and not decode.info.capabilities.exports_kv_pool
    sp = SamplingParams(max_tokens=12, ignore_eos=True, **sampling)
    local, local_reason = await collect(decode.generate(EngineRequest("l", PROMPT, sp)))
    res = await prefill.prefill(EngineRequest("p", PROMPT, sp))
    assert not res.finished and res.held is None
    assert res.engine_state["backend"] == "trtllm" and isinstance(res.engine_state["opaque_state"], bytes)
    assert res.engine_state["first_gen_tokens"] == [res.first_token_id]
    remote, remote_reason = await collect(
        decode.generate_from_state(EngineRequest("d", PROMPT, sp), res.engine_state)
    )
    assert remote == local and len(local) == 12 and local_reason is remote_reason is FinishReason.LENGTH
    assert remote[0] == res.first_token_id
    # The fake's outputs are the torch engine's: same model, same tokens.
    torch_engine = TorchEngine(EngineConfig(model_path=str(tiny_llama), num_threads=1))
    await torch_engine.start()
    try:
        reference, _ = await collect(torch_engine.generate(EngineRequest("t", PROMPT, sp)))
    finally:
        await torch_engine.close()
    assert reference == local
    assert decode.stats().prompt_tokens_transferred == len(PROMPT)


async def test_handoff_when_the_decode_side_already_caches_every_block(pair):
    prefill, decode = pair
    prompt = [(i * 41) % 500 + 2 for i in range(48)]  # exactly 3 blocks: nothing left to transfer
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    local, _ = await collect(decode.generate(EngineRequest("l48", prompt, sp)))
    res = await prefill.prefill(EngineRequest("p48", prompt, sp))
    remote, _ = await collect(decode.generate_from_state(EngineRequest("d48", prompt, sp), res.engine_state))
    assert remote == local
    server = prefill._llm._executor.server  # the context side was still told to drop its KV
    await _settled(lambda: not server._held)


async def test_first_token_that_finishes_skips_decode_and_frees_the_context_kv(pair):
    prefill, _ = pair
    res = await prefill.prefill(EngineRequest("p1", PROMPT, SamplingParams(max_tokens=1)))
    assert res.finished and res.finish_reason is FinishReason.LENGTH and res.engine_state is None
    server = prefill._llm._executor.server  # the fake transceiver: nothing left held
    await _settled(lambda: not server._held)


async def test_kv_events_carry_pdmesh_hashes_rebuilt_from_tokens(pair):
    from services.model.hashing import block_hashes

    _, decode = pair
    await collect(decode.generate(EngineRequest("e", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))))
    want = block_hashes(PROMPT, 16)
    await _settled(lambda: decode.prefix_lookup(PROMPT) == 32)
    stored = [h for e in decode.kv_events_since(0) if e.kind is KvEventKind.STORED for h in e.block_hashes]
    assert stored[:2] == want
    assert set(want) <= {h for _, h in decode.kv_snapshot()[1]}


async def test_malformed_opaque_state_fails_before_any_token(pair):
    prefill, decode = pair
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    res = await prefill.prefill(EngineRequest("p2", PROMPT, sp))
    bad = {**res.engine_state, "opaque_state": b"not the context worker's state"}
    with pytest.raises(EngineError, match="opaque_state"):
        await collect(decode.generate_from_state(EngineRequest("d2", PROMPT, sp), bad))
    with pytest.raises(InvalidHandoffError):
        decode.generate_from_state(EngineRequest("d3", PROMPT, sp), {**res.engine_state, "backend": "sim"})
    assert decode.stats().running == 0


async def test_closing_a_stream_aborts_the_request_and_gives_its_blocks_back(pair):
    _, decode = pair
    free = decode._llm._executor.engine.stats().free_blocks
    stream = decode.generate(EngineRequest("c", PROMPT, SamplingParams(max_tokens=500, ignore_eos=True)))
    first = await anext(stream)
    assert first.token_ids and not first.finished
    await stream.aclose()
    assert decode.stats().running == 0
    await _settled(lambda: decode._llm._executor.engine.stats().free_blocks >= free)


async def test_unsupported_sampling_is_a_clear_invalid_argument(pair):
    _, decode = pair
    with pytest.raises(InvalidRequestError) as e:
        decode.generate(EngineRequest("s", PROMPT, SamplingParams(stop=("x",))))
    assert e.value.field == "sampling.stop"


def test_state_from_params_refuses_a_missing_handoff():
    with pytest.raises(InvalidHandoffError):
        state_from_params(None)


async def _settled(pred) -> None:
    """Wait on another thread's observable state (the fake's executor), yielding to the loop."""
    await eventually(pred, timeout=10.0, what="the fake executor's state")

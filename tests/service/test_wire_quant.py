"""Wire-only KV quantization on the remote path, over both transports (issue 22 item 1).

The in-process mesh of test_kv_integrity.py (real servicers on MeshServers on port 0,
real NIXL agents or the gRPC KvSource stream) with `kv_wire_quant="int8"` on both
workers: float32 caches, 1-byte blocks in the holder's staging pool, dequantized into
the receiver's reserved blocks. Each path that ends a handoff (pulled, refused by the
digests, no staging block free on either side) leaves both engines' pools, the leases
and both staging pools at their free counts.
"""

from __future__ import annotations

import time

import pytest

from kvtransfer.layout import KvLayout
from pdmesh.v1 import decode_pb2
from services.decode.remote_prefill import RemotePrefillFailed
from services.engine.api import EngineRequest, SamplingParams
from tests.service.test_kv_integrity import MAX_TOKENS, PROMPT, Mesh, reference_tokens


@pytest.fixture(params=["nixl", "grpc"])
async def mesh(request):
    m = Mesh(request.param, wire="int8")
    try:
        await m.start()
        yield m
    finally:
        await m.close()


def staging_free(mesh) -> tuple[int, int]:
    return mesh.decode.wire.free_blocks, mesh.prefill.wire.free_blocks


def fp32_block_bytes(mesh) -> int:
    layout: KvLayout = mesh.decode.engine.info.layout
    return layout.block_bytes


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


async def test_a_wire_quantized_handoff_fills_the_float32_cache(mesh):
    want = reference_tokens(PROMPT)
    initial, staged = mesh.free(), staging_free(mesh)
    assert mesh.decode.engine.info.layout.quant == "none"
    assert mesh.decode.transport.layout.quant == "int8"
    req = EngineRequest("w", tuple(PROMPT), sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    res = await mesh.remote.run(req, mesh.candidate, time.monotonic() + 20)
    tokens: list[int] = []
    assert res.outputs is not None
    async for out in res.outputs:  # from the remotely sampled first token on
        tokens += out.token_ids
    blocks = -(-len(PROMPT) // 16)
    assert 0 < res.bytes_transferred <= 0.3 * blocks * fp32_block_bytes(mesh)
    # kv-wire-int8 changed 0.3-1.3% of greedy tokens (bench/quant_accuracy.py); 0.9 = its limit.
    assert agreement(tokens, want) >= 0.9
    assert mesh.prefill.wire.counters.staged_blocks == blocks
    assert mesh.decode.wire.counters.unstaged_blocks == blocks
    await mesh.settled((initial[0], initial[1], 0))
    assert staging_free(mesh) == staged


async def test_corrupted_wire_bytes_are_refused_and_every_pool_comes_back(mesh):
    want = reference_tokens(PROMPT)
    initial, staged = mesh.free(), staging_free(mesh)
    mesh.corrupter.on = True  # flips a byte of the leased staging block, after its digest
    tokens, final = await mesh.generate("bad", decode_pb2.DISAGG_MODE_REMOTE)
    assert final.prefill_path == "local" and tokens == want
    assert mesh.fallbacks("integrity") == 1
    await mesh.settled((initial[0], initial[1], 0))
    assert staging_free(mesh) == staged


async def test_no_free_staging_block_on_either_side_falls_back(mesh):
    want = reference_tokens(PROMPT)
    initial, staged = mesh.free(), staging_free(mesh)
    # The receiver's staging pool is full: the path fails before the pull, nothing held anywhere.
    req = EngineRequest("d", tuple(PROMPT), sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    taken = mesh.decode.wire.alloc(mesh.decode.wire.free_blocks)
    try:
        with pytest.raises(RemotePrefillFailed) as e:
            await mesh.remote.run(req, mesh.candidate, time.monotonic() + 20)
        assert (e.value.stage, e.value.reason) == ("reserve", "capacity")
    finally:
        mesh.decode.wire.free(taken)
    await mesh.settled((initial[0], initial[1], 0))
    assert staging_free(mesh) == staged
    # The holder's is: its Prefill answers RESOURCE_EXHAUSTED and the decode worker prefills locally.
    taken = mesh.prefill.wire.alloc(mesh.prefill.wire.free_blocks)
    try:
        tokens, final = await mesh.generate("full", decode_pb2.DISAGG_MODE_REMOTE)
        assert final.prefill_path == "local" and tokens == want
    finally:
        mesh.prefill.wire.free(taken)
    assert mesh.fallbacks("resource_exhausted") == 1
    await mesh.settled((initial[0], initial[1], 0))
    assert staging_free(mesh) == staged

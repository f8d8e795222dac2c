"""Quantized KV handed over between real prefill and decode processes (issue 22).

int8 KV on both sides moves a quarter of float32's bytes per token (plus the scales inside
each block) and gives the tokens the int8 engine gives on its own; a decode worker whose KV
scheme or model differs from the prefill worker's refuses the handle (the layout handshake)
and prefills locally, with every pool back to its free count.
"""

from __future__ import annotations

import random

import pytest

from kvtransfer.layout import KvLayout
from pdmesh.launcher import flags
from pdmesh.v1 import decode_pb2
from services.model.model_config import ModelConfig
from tests.e2e.helpers import generate, start_mesh, wait_until

pytestmark = pytest.mark.e2e

REMOTE, LOCAL = decode_pb2.DISAGG_MODE_REMOTE, decode_pb2.DISAGG_MODE_LOCAL
INT8 = flags(engine_kv_cache_quant="int8")


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.choice([40, 97, 150]))] for _ in range(n)]


def free_counts(mesh) -> tuple[int, int, int]:
    d, p = mesh.decode_stats(), mesh.prefill_stats()
    return d.load.free_blocks, p.load.free_blocks, p.leases.held


def fp32_bytes_per_token() -> int:
    m = ModelConfig.from_preset("tiny")
    return KvLayout(m.num_layers, m.num_kv_heads, m.head_dim, "float32", 16).bytes_per_token()


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_int8_kv_handoff_moves_a_quarter_of_the_bytes_and_keeps_the_tokens(tmp_path, transport):
    mesh = start_mesh(tmp_path, prefill_args=INT8, decode_args=INT8, kv_transport=transport)
    try:
        stub = mesh.decode_stub()
        initial = free_counts(mesh)
        before = mesh.decode_stats()
        ps = prompts(4, seed=3)
        remote = [generate(stub, p, request_id=f"r{i}", mode=REMOTE) for i, p in enumerate(ps)]
        after = mesh.decode_stats()
        local = [generate(stub, p, request_id=f"l{i}", mode=LOCAL) for i, p in enumerate(ps)]
        assert all(f.prefill_path == "remote" for _, f in remote)
        for i in range(len(ps)):
            assert remote[i][0] == local[i][0], f"prompt {i} differs between remote and local"
        moved = after.transfers.bytes - before.transfers.bytes
        tokens = after.counters.prompt_tokens_transferred - before.counters.prompt_tokens_transferred
        assert tokens > 0
        # Whole blocks move (the last one partly filled): bound by blocks, not tokens.
        blocks = sum(-(-len(p) // 16) for p in ps)
        assert moved <= blocks * 16 * fp32_bytes_per_token() * 0.3
        wait_until(lambda: free_counts(mesh) == initial, what="pools back to their free counts")
    finally:
        mesh.close()


@pytest.mark.parametrize(
    ("prefill_args", "decode_args"),
    [(INT8, ()), ((), INT8), (flags(engine_seed=1), ())],
    ids=["int8-to-fp", "fp-to-int8", "other-model"],
)
def test_decode_refuses_another_kv_scheme_or_model_and_prefills_locally(tmp_path, prefill_args, decode_args):
    mesh = start_mesh(tmp_path, prefill_args=prefill_args, decode_args=decode_args)
    try:
        stub = mesh.decode_stub()
        initial = free_counts(mesh)
        before = mesh.decode_stats()
        p = prompts(1, seed=4)[0]
        tokens, final = generate(stub, p, request_id="m", mode=REMOTE)
        assert final.prefill_path == "local", final
        want, _ = generate(stub, p, request_id="m-local", mode=LOCAL)
        assert tokens == want
        after = mesh.decode_stats()
        assert after.counters.prompt_tokens_transferred == before.counters.prompt_tokens_transferred
        wait_until(lambda: free_counts(mesh) == initial, what="pools back to their free counts")
    finally:
        mesh.close()

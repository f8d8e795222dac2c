"""Prefill + decode + kvtransfer as real processes on loopback (issue 5).

One mesh per module: kvtransfer, one prefill worker, one decode worker (tiny
built-in model), KV handed over with NIXL. Fault tests that kill a process
start their own mesh.
"""

from __future__ import annotations

import random
import signal
import threading

import grpc
import pytest

from pdmesh.v1 import decode_pb2
from tests.e2e.helpers import generate, metric_value, scrape, start_mesh, wait_until

pytestmark = pytest.mark.e2e

LOCAL, REMOTE, AUTO = (
    decode_pb2.DISAGG_MODE_LOCAL,
    decode_pb2.DISAGG_MODE_REMOTE,
    decode_pb2.DISAGG_MODE_UNSPECIFIED,
)
THRESHOLD = 64  # conditional mode: prompts above 64 uncached tokens go remote


def prompts(n: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice([3, 9, 17, 33, 50, 64, 65, 97, 150, 230]) for _ in range(n)]
    return [[rng.randrange(256) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(
        tmp_path_factory.mktemp("disagg"), decode_args=("--max-local-prefill-tokens", str(THRESHOLD))
    )
    yield m
    m.close()


def free_counts(mesh) -> tuple[int, int, int]:
    d, p = mesh.decode_stats(), mesh.prefill_stats()
    return d.load.free_blocks, p.load.free_blocks, p.leases.held


def settled(mesh, want):
    return wait_until(lambda: free_counts(mesh) == want, what=f"block pools back to {want}")


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_remote_local_and_conditional_paths_give_identical_tokens(mesh, sampling):
    stub = mesh.decode_stub()
    before = mesh.decode_stats()
    initial = free_counts(mesh)
    kw = {"temperature": 0.0} if sampling == "greedy" else {"temperature": 0.9}
    ps = prompts(seed=1 if sampling == "greedy" else 2)
    tag = sampling[0]
    # Remote first, while the decode worker's prefix cache is cold, so the KV really moves.
    remote = [generate(stub, p, request_id=f"{tag}r{i}", mode=REMOTE, seed=i, **kw) for i, p in enumerate(ps)]
    after_remote = mesh.decode_stats()
    local = [generate(stub, p, request_id=f"{tag}l{i}", mode=LOCAL, seed=i, **kw) for i, p in enumerate(ps)]
    cond = [generate(stub, p, request_id=f"{tag}c{i}", mode=AUTO, seed=i, **kw) for i, p in enumerate(ps)]

    for i in range(len(ps)):
        assert remote[i][0] == local[i][0] == cond[i][0], f"prompt {i} ({len(ps[i])} tokens) differs"
        assert 1 <= len(local[i][0]) <= 16
    assert all(f.prefill_path == "remote" for _, f in remote)
    assert all(f.prefill_path == "local" for _, f in local)
    # The remote path moved KV and the decode worker computed no prompt tokens for it.
    moved = after_remote.transfers.count - before.transfers.count
    assert moved > 0 and after_remote.transfers.bytes > before.transfers.bytes
    assert after_remote.counters.prompt_tokens_computed == before.counters.prompt_tokens_computed
    assert after_remote.counters.prompt_tokens_transferred > before.counters.prompt_tokens_transferred
    settled(mesh, initial)


def test_long_prompt_goes_remote_short_stays_local(mesh):
    stub = mesh.decode_stub()
    decode = mesh.decodes[0]
    m0 = scrape(decode)
    generate(stub, [7] * 10, request_id="short")
    generate(stub, [random.Random(5).randrange(256) for _ in range(300)], request_id="long")
    m1 = scrape(decode)

    def delta(path, reason):
        name = "pdmesh_disagg_decisions_total"
        return metric_value(m1, name, path=path, reason=reason) - metric_value(
            m0, name, path=path, reason=reason
        )

    assert delta("local", "short_prompt") == 1
    assert delta("remote", "long_prompt") == 1


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "field"),
    [
        ([], 4, "prompt_token_ids"),
        ([1, 2], 0, "max_tokens"),
        ([1, 2], -1, "max_tokens"),
        ([1, 99999], 4, "prompt_token_ids"),
        ([1] * 5000, 4, "prompt_token_ids"),
    ],
)
def test_invalid_requests_allocate_nothing(mesh, prompt, max_tokens, field):
    initial = free_counts(mesh)
    with pytest.raises(grpc.RpcError) as e:
        generate(mesh.decode_stub(), prompt, request_id="bad", max_tokens=max_tokens)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    assert free_counts(mesh) == initial


def test_client_disconnect_mid_stream_frees_blocks_on_both_engines(mesh):
    initial = free_counts(mesh)
    stub = mesh.decode_stub()
    prompt = [random.Random(9).randrange(256) for _ in range(200)]
    req = decode_pb2.DecodeServiceGenerateRequest(
        request_id="cancel-me", prompt_token_ids=prompt, disagg_mode=REMOTE
    )
    req.sampling.max_tokens = 1500
    req.sampling.ignore_eos = True
    call = stub.Generate(req, timeout=60)
    got = 0
    for msg in call:
        got += len(msg.tokens.token_ids)
        if got >= 3:
            call.cancel()
            break
    assert got >= 3
    stats = wait_until(lambda: (s := mesh.decode_stats()).load.running == 0 and s, what="decode idle")
    assert stats.requests_cancelled >= 1
    settled(mesh, initial)


def test_prefill_worker_killed_during_remote_prefill_falls_back_locally(tmp_path):
    mesh = start_mesh(tmp_path)
    try:
        stub = mesh.decode_stub()
        prompt = [random.Random(3).randrange(256) for _ in range(120)]
        expected, _ = generate(stub, prompt, request_id="ref", mode=LOCAL)
        initial_free = mesh.decode_stats().load.free_blocks
        before = mesh.decode_stats().disagg_decisions.get("remote/forced_remote", 0)
        mesh.launcher.kill("prefill-0", signal.SIGSTOP)  # freeze it: the Prefill call will hang
        result = {}
        t = threading.Thread(
            target=lambda: result.update(out=generate(stub, [*prompt[:-1], 1], request_id="x", mode=REMOTE))
        )
        t.start()
        wait_until(
            lambda: mesh.decode_stats().disagg_decisions.get("remote/forced_remote", 0) > before,
            what="the decode worker to choose the remote path",
        )
        mesh.launcher.kill("prefill-0", signal.SIGKILL)
        t.join(60)
        tokens, final = result["out"]
        reference, _ = generate(stub, [*prompt[:-1], 1], request_id="ref2", mode=LOCAL)
        assert tokens == reference and len(expected) == 16
        assert final.prefill_path == "local" and final.disagg_reason == "fallback"
        stats = mesh.decode_stats()
        assert stats.transfers.fallbacks >= 1
        wait_until(lambda: mesh.decode_stats().load.free_blocks == initial_free, what="decode blocks freed")
    finally:
        mesh.close()

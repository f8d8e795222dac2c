"""Prefill + decode workers on the trtllm backend as real processes (issue 8).

The workers run `--engine-backend trtllm` with the fake TensorRT-LLM from
tests/fakes on their PYTHONPATH (a tiny random Llama folder as the model), so
the KV of a remote prefill crosses processes through the fake's cache
transceiver, not through pdmesh's kvtransfer (no kvtransfer service runs).
Same scenarios as the torch backend's test_disagg_e2e: remote / local /
conditional give identical tokens, the conditional rule, cancel; plus the
backend's bad inputs: a malformed handoff, a handoff from another model, a
transfer that never arrives (deadline), unsupported sampling.
"""

from __future__ import annotations

import json
import os
import random
import socket
from concurrent import futures

import grpc
import pytest

from pdmesh.launcher import Launcher, ServiceSpec, flags
from pdmesh.v1 import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc
from tests.e2e.helpers import Mesh, generate, metric_value, scrape, wait_until
from tests.fakes import FAKES_DIR
from tests.fakes.tiny_model import make_tiny_llama

pytestmark = pytest.mark.e2e

LOCAL, REMOTE, AUTO = (
    decode_pb2.DISAGG_MODE_LOCAL,
    decode_pb2.DISAGG_MODE_REMOTE,
    decode_pb2.DISAGG_MODE_UNSPECIFIED,
)
THRESHOLD = 64
PREFILL_TIMEOUT_S = 8  # the decode worker's bound on a remote prefill (call + KV arrival)


def prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice([3, 17, 33, 64, 65, 97, 150, 230]) for _ in range(n)]
    return [[rng.randrange(2, 500) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    work = tmp_path_factory.mktemp("trtllm")
    model = make_tiny_llama(work / "tiny-llama")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAKES_DIR), env.get("PYTHONPATH")) if p)
    launcher = Launcher(work, base_env=env)
    m = Mesh(launcher)
    engine = flags(engine_backend="trtllm", engine_model_path=model, engine_num_threads=1, metrics_port=0)
    try:
        specs = [
            ServiceSpec(
                name,
                "services.prefill.main",
                flags(worker_id=name) + engine + extra,
                ready_service="pdmesh.v1.PrefillService",
            )
            for name, extra in (("prefill-0", ()), ("prefill-other", flags(engine_model_id="another-model")))
        ]
        m.prefills = [launcher.start(s) for s in specs]
        for p in m.prefills:
            launcher.wait_ready(p)
        decode_flags = flags(
            worker_id="decode-0",
            prefill_workers=[m.prefills[0].address],
            max_local_prefill_tokens=THRESHOLD,
            prefill_timeout_s=PREFILL_TIMEOUT_S,
        )
        m.decodes = [
            launcher.start(
                ServiceSpec(
                    "decode-0",
                    "services.decode.main",
                    decode_flags + engine,
                    ready_service="pdmesh.v1.DecodeService",
                )
            )
        ]
        launcher.wait_ready(m.decodes[0])
    except BaseException:
        launcher.close()
        raise
    m.model_id = model.name  # type: ignore[attr-defined]
    yield m
    m.close()


def used_blocks(mesh) -> tuple[int, int]:
    """KV blocks in use on (decode, prefill), as of the engines' last iteration stats
    (cached blocks count as free); (0, 0) when nothing is running or held."""
    return mesh.decode_stats().load.used_blocks, mesh.prefill_stats().load.used_blocks


def generate_via(stub, prompt, candidate: str, request_id: str, mode=REMOTE, **sampling):
    req = decode_pb2.DecodeServiceGenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        disagg_mode=mode,
        prefill_candidates=[decode_pb2.PrefillCandidate(worker_id=candidate, address=candidate)],
    )
    req.sampling.max_tokens = sampling.pop("max_tokens", 16)
    for k, v in sampling.items():
        setattr(req.sampling, k, v)
    tokens, final = [], None
    for msg in stub.Generate(req, timeout=60):
        if msg.HasField("tokens"):
            tokens += msg.tokens.token_ids
        else:
            final = msg.final
    return tokens, final


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_remote_local_and_conditional_paths_give_identical_tokens(mesh, sampling):
    stub = mesh.decode_stub()
    before, p_before = mesh.decode_stats(), mesh.prefill_stats()
    kw = {"temperature": 0.0} if sampling == "greedy" else {"temperature": 0.9}
    ps = prompts(seed=1 if sampling == "greedy" else 2)
    tag = sampling[0]
    remote = [generate(stub, p, request_id=f"{tag}r{i}", mode=REMOTE, seed=i, **kw) for i, p in enumerate(ps)]
    after_remote, p_after = mesh.decode_stats(), mesh.prefill_stats()
    local = [generate(stub, p, request_id=f"{tag}l{i}", mode=LOCAL, seed=i, **kw) for i, p in enumerate(ps)]
    cond = [generate(stub, p, request_id=f"{tag}c{i}", mode=AUTO, seed=i, **kw) for i, p in enumerate(ps)]

    for i in range(len(ps)):
        assert remote[i][0] == local[i][0] == cond[i][0], f"prompt {i} ({len(ps[i])} tokens) differs"
        assert 1 <= len(local[i][0]) <= 16
    assert all(f.prefill_path == "remote" for _, f in remote), [f.disagg_reason for _, f in remote]
    assert all(f.prefill_path == "local" for _, f in local)
    # The engine moved the KV: no kvtransfer bytes, the prefill worker did the prompts,
    # the decode worker computed none of them.
    assert after_remote.transfers.bytes == before.transfers.bytes
    assert p_after.counters.prompt_tokens_computed - p_before.counters.prompt_tokens_computed > 0
    assert after_remote.counters.prompt_tokens_computed == before.counters.prompt_tokens_computed
    assert after_remote.counters.prompt_tokens_transferred > before.counters.prompt_tokens_transferred


def test_long_prompt_goes_remote_short_stays_local(mesh):
    stub = mesh.decode_stub()
    decode = mesh.decodes[0]
    m0 = scrape(decode)
    generate(stub, [7] * 10, request_id="short")
    _, final = generate(stub, [random.Random(5).randrange(2, 500) for _ in range(300)], request_id="long")
    m1 = scrape(decode)

    def delta(path, reason):
        name = "pdmesh_disagg_decisions_total"
        return metric_value(m1, name, path=path, reason=reason) - metric_value(
            m0, name, path=path, reason=reason
        )

    assert delta("local", "short_prompt") == 1
    assert delta("remote", "long_prompt") == 1
    assert final.prefill_path == "remote"


def test_client_disconnect_mid_stream_frees_blocks_on_both_engines(mesh):
    wait_until(lambda: used_blocks(mesh) == (0, 0), what="idle engines")
    stub = mesh.decode_stub()
    prompt = [random.Random(9).randrange(2, 500) for _ in range(200)]
    req = decode_pb2.DecodeServiceGenerateRequest(
        request_id="cancel-me", prompt_token_ids=prompt, disagg_mode=REMOTE
    )
    req.sampling.max_tokens = 700
    req.sampling.ignore_eos = True
    call = stub.Generate(req, timeout=60)
    got = 0
    for msg in call:
        got += len(msg.tokens.token_ids)
        if got >= 3:
            wait_until(lambda: used_blocks(mesh)[0] > 0, what="the request's blocks in use on decode")
            call.cancel()
            break
    assert got >= 3
    stats = wait_until(lambda: (s := mesh.decode_stats()).load.running == 0 and s, what="decode idle")
    assert stats.requests_cancelled >= 1
    wait_until(lambda: used_blocks(mesh) == (0, 0), what="every block back on both engines")


def test_handoff_from_another_model_falls_back_to_local(mesh):
    stub = mesh.decode_stub()
    prompt = [random.Random(11).randrange(2, 500) for _ in range(120)]
    expected, _ = generate(stub, prompt, request_id="ref-m", mode=LOCAL)
    tokens, final = generate_via(stub, prompt, mesh.prefills[1].address, "other-model")
    assert tokens == expected
    assert final.prefill_path == "local" and final.disagg_reason == "fallback"


class RoguePrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """A prefill worker whose handoff is bad in a chosen way."""

    def __init__(self, model_id: str, opaque_state: bytes):
        self.model_id, self.opaque_state = model_id, opaque_state

    def Prefill(self, request, context):
        n = len(request.prompt_token_ids)
        state = common_pb2.EngineState(
            backend="trtllm", first_gen_tokens=[5], ctx_request_id=1, opaque_state=self.opaque_state
        )
        handle = common_pb2.KvHandle(
            handle_id=request.request_id,
            issued_to=request.requester_id,
            model_id=self.model_id,
            num_tokens=n,
            engine_state=state,
        )
        return prefill_pb2.PrefillResponse(handle=handle, first_token_id=5, computed_tokens=n)


@pytest.fixture
def rogue(mesh):
    servers = []

    def start(opaque_state: bytes) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(
            RoguePrefill(mesh.model_id, opaque_state), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(None)


def test_malformed_opaque_state_gives_a_clear_failure_and_local_fallback(mesh, rogue):
    stub = mesh.decode_stub()
    prompt = [random.Random(12).randrange(2, 500) for _ in range(100)]
    expected, _ = generate(stub, prompt, request_id="ref-o", mode=LOCAL)
    before = mesh.decode_stats().transfers.fallbacks
    tokens, final = generate_via(stub, prompt, rogue(b"\xff garbage"), "malformed")
    assert tokens == expected
    assert final.prefill_path == "local" and final.disagg_reason == "fallback"
    assert mesh.decode_stats().transfers.fallbacks == before + 1
    log = mesh.decodes[0].log_path.read_text()
    assert "remote_prefill_failed" in log and "opaque_state" in log


def test_kv_that_never_arrives_is_bounded_by_the_deadline_then_local(mesh, rogue):
    """The handoff names a context worker that accepts the connection and never answers."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        state = {
            "v": 1,
            "endpoint": f"127.0.0.1:{silent.getsockname()[1]}",
            "ctx_request_id": 1,
            "num_tokens": 150,
            "layout": {
                "num_layers": 2,
                "num_kv_heads": 2,
                "head_dim": 16,
                "dtype": "float32",
                "block_size": 16,
            },
        }
        stub = mesh.decode_stub()
        prompt = [random.Random(13).randrange(2, 500) for _ in range(150)]
        expected, _ = generate(stub, prompt, request_id="ref-d", mode=LOCAL)
        tokens, final = generate_via(stub, prompt, rogue(json.dumps(state).encode()), "silent")
        assert tokens == expected
        assert final.prefill_path == "local" and final.disagg_reason == "fallback"
        assert "no KV from the prefill engine within the deadline" in mesh.decodes[0].log_path.read_text()
        wait_until(lambda: mesh.decode_stats().load.running == 0, what="the abandoned request aborted")
    finally:
        silent.close()


def test_unsupported_sampling_is_invalid_argument(mesh):
    req = decode_pb2.DecodeServiceGenerateRequest(
        request_id="stop-str", prompt_token_ids=[5] * 10, disagg_mode=LOCAL
    )
    req.sampling.stop.append("END")
    with pytest.raises(grpc.RpcError) as e:
        list(mesh.decode_stub().Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.stop" in e.value.details() and "trtllm" in e.value.details()

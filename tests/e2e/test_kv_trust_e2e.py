"""A hostile KV registry writer during load, with real processes (issue 13, item 1).

kvtransfer + one prefill worker + one decode worker (tiny built-in model, KV
over NIXL) as processes on loopback. While remote-prefill requests run, an
attacker re-registers the prefill worker's NIXL agent every 0.2 s with its pool
shifted by one block (`address + block_bytes`, `num_blocks - 1`), and tries to
heartbeat and deregister it: the attack of the issue, which made 72 of 130
requests return OK with wrong tokens and left garbage in the decode worker's
prefix cache. Every response must be token-exact (against an engine of the
same seeded model in this process) or an error, never wrong tokens with OK,
every attacker call must be refused, and afterwards a local request of each
prompt (served from the decode worker's prefix cache where it has the blocks)
must give the reference tokens too.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdmesh.v1 import decode_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc
from services.engine.api import EngineRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.e2e.helpers import generate, start_mesh, wait_until

pytestmark = pytest.mark.e2e

REMOTE, LOCAL = decode_pb2.DISAGG_MODE_REMOTE, decode_pb2.DISAGG_MODE_LOCAL
MAX_TOKENS = 12


def reference(prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the same seeded tiny model as the workers', in this process."""
    engine = LLMEngine(EngineConfig(preset="tiny", num_threads=1))
    reqs = [
        EngineRequest(f"ref{i}", tuple(p), sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        for i, p in enumerate(prompts)
    ]
    out = engine.generate(reqs)
    return [out[f"ref{i}"] for i in range(len(prompts))]


class Attacker:
    """Re-registers, heartbeats and deregisters the victim's agent in a loop."""

    def __init__(self, kv_address: str, victim: str):
        self.stub = kvtransfer_pb2_grpc.KvTransferServiceStub(grpc.insecure_channel(kv_address))
        self.victim = victim
        self.stop = threading.Event()
        self.codes: list[grpc.StatusCode] = []
        self.accepted = 0

    def run(self) -> None:
        secret = random.Random(1).randbytes(32)
        while not self.stop.is_set():
            real = self.stub.GetAgent(kvtransfer_pb2.GetAgentRequest(name=self.victim), timeout=5).agent
            hostile = kvtransfer_pb2.AgentInfo()
            hostile.CopyFrom(real)
            hostile.region.address += real.layout.block_bytes
            hostile.num_blocks -= 1
            for call, msg in (
                (
                    self.stub.RegisterAgent,
                    kvtransfer_pb2.RegisterAgentRequest(agent=hostile, owner_secret=secret),
                ),
                (
                    self.stub.Heartbeat,
                    kvtransfer_pb2.HeartbeatRequest(
                        name=self.victim, incarnation=real.incarnation, owner_secret=secret
                    ),
                ),
                (
                    self.stub.DeregisterAgent,
                    kvtransfer_pb2.DeregisterAgentRequest(
                        name=self.victim, incarnation=real.incarnation, owner_secret=secret
                    ),
                ),
            ):
                try:
                    call(msg, timeout=5)
                    self.accepted += 1
                except grpc.RpcError as e:
                    self.codes.append(e.code())
            self.stop.wait(0.2)  # the attack's own pace (0.2 s, as in the issue)


def test_hostile_reregistration_during_load_never_yields_wrong_tokens(tmp_path):
    mesh = start_mesh(tmp_path)
    try:
        stub = mesh.decode_stub()
        victim = mesh.prefill_stats().info.kv_agent_name
        assert victim
        rng = random.Random(13)
        prompts = [[rng.randrange(256) for _ in range(rng.choice([65, 97, 150, 230]))] for _ in range(24)]
        want = reference(prompts)
        before = mesh.decode_stats()
        attacker = Attacker(mesh.kv.address, victim)
        thread = threading.Thread(target=attacker.run, name="attacker")
        thread.start()
        try:
            wait_until(lambda: len(attacker.codes) >= 3, what="the attack to start")

            def one(i: int):
                try:
                    return generate(
                        stub, prompts[i], request_id=f"load-{i}", mode=REMOTE, max_tokens=MAX_TOKENS
                    )
                except grpc.RpcError as e:
                    return e

            with ThreadPoolExecutor(3) as pool:
                results = list(pool.map(one, range(len(prompts))))
        finally:
            attacker.stop.set()
            thread.join(30)
        ok = 0
        for i, r in enumerate(results):
            if isinstance(r, grpc.RpcError):
                continue  # an error is acceptable; wrong tokens with OK are not
            tokens, _final = r
            assert tokens == want[i], f"request {i} answered OK with wrong tokens"
            ok += 1
        assert ok >= len(prompts) // 2  # the attack may not turn the mesh into an outage either
        assert attacker.accepted == 0 and set(attacker.codes) == {grpc.StatusCode.PERMISSION_DENIED}
        after = mesh.decode_stats()
        assert after.transfers.count > before.transfers.count  # the KV really moved, under attack
        # The decode worker's prefix cache is clean: local requests (hits where cached) give the reference.
        for i, p in enumerate(prompts):
            tokens, final = generate(stub, p, request_id=f"later-{i}", mode=LOCAL, max_tokens=MAX_TOKENS)
            assert tokens == want[i], f"prompt {i}: the prefix cache served wrong KV"
            assert final.prefill_path == "local"
    finally:
        mesh.close()

"""The Link token path with real processes (issue 16 item 3): two sim decode workers and a
router on loopback; one worker is SIGKILLed while several requests stream on its link.

Every request on the killed worker's link migrates and its stream equals an undisturbed
run token for token; the requests on the other worker are not disturbed (no migration,
same tokens); the surviving worker's pool returns to its free count.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdmesh.launcher import Launcher, flags
from pdmesh.v1 import common_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2
from tests.e2e.helpers import start_decodes_and_router, wait_until

pytestmark = pytest.mark.e2e

# Speedup 5, not 20: at 20 a 600-token request lasted ~1 s, and in a loaded clean-clone run some
# streams had already finished on their worker before ListWorkers was read, so the precondition
# (streams in flight on both workers) failed ({'decode-0': 0, 'decode-1': 2}).
SIM = flags(engine_backend="sim", engine_sim_speedup=5.0, engine_num_blocks=1024)
FAST = flags(health_interval_s=0.2, stats_interval_s=0.2, resubscribe_max_s=0.5, policy="round_robin")
N = 6


def greedy(i: int, max_tokens: int = 600) -> router_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return router_pb2.GenerateRequest(text=f"link request {i} " * 3, sampling=sampling)


def run(stub, req) -> tuple[list[int], router_pb2.GenerateFinal]:
    tokens, final = [], None
    for msg in stub.Generate(req, timeout=120):
        if msg.HasField("delta"):
            tokens += msg.delta.token_ids
        else:
            final = msg.final
    assert final is not None
    return tokens, final


def test_sigkill_migrates_every_request_on_the_link_and_leaves_the_other_worker_alone(tmp_path):
    with Launcher(tmp_path) as launcher:
        decodes, router = start_decodes_and_router(launcher, 2, SIM, FAST)
        stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(router.address))
        survivor_stats = [
            decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(d.address)).Stats for d in decodes
        ]
        free = [s(worker_pb2.StatsRequest(), timeout=10).load.free_blocks for s in survivor_stats]
        want = [run(stub, greedy(i))[0] for i in range(N)]

        streams = [stub.Generate(greedy(i), timeout=120) for i in range(N)]
        got = [list(next(s).delta.token_ids) for s in streams]  # every stream under way
        internal = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(router.internal_address))
        busy = {
            w.info.worker_id: w.inflight
            for w in internal.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers
        }
        assert all(busy.values()), busy  # round robin: both workers carry some
        launcher.kill("decode-0")  # SIGKILL: the link just breaks

        def finish(i: int):
            final = None
            for msg in streams[i]:
                if msg.HasField("delta"):
                    got[i] += msg.delta.token_ids
                else:
                    final = msg.final
            return final

        with ThreadPoolExecutor(N) as pool:
            finals = list(pool.map(finish, range(N)))
        for i in range(N):
            assert got[i] == want[i], f"request {i}"
            assert finals[i].worker_id == "decode-1"
        migrated = [f.migrations for f in finals]
        assert migrated.count(1) == busy["decode-0"] and migrated.count(0) == busy["decode-1"]
        wait_until(
            lambda: survivor_stats[1](worker_pb2.StatsRequest(), timeout=10).load.free_blocks == free[1],
            what="the surviving worker's pool back to its free count",
        )

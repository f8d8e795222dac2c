"""A decode worker frozen mid-stream (issue 18, "Done when"): real processes on loopback.

Two decode workers with the tiny torch model (same seed: the same weights) and a
round-robin router. Several greedy streams run, some on each worker; once every
one has its first tokens, decode-0 is SIGSTOPped. Then:

- the router's view (ListWorkers) shows decode-0 NOT_SERVING (its health probes
  time out: a frozen process cannot answer them);
- every stream completes on decode-1, token for token equal to an undisturbed
  run of the same request, the ones that were on decode-0 with a migration;
- a request sent while decode-0 is frozen runs on decode-1, token-exact too;
- every call ends before its deadline (gRPC would end it with DEADLINE_EXCEEDED,
  which fails the test);
- after SIGCONT both pools return to their free counts (the frozen worker's
  requests were cancelled by the router, so nothing stays allocated there).

Processes are stopped in `finally`: SIGCONT first (a stopped process cannot act
on SIGTERM), then the launcher's SIGTERM, escalating to SIGKILL.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdmesh.launcher import Launcher, flags
from pdmesh.v1 import common_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2
from tests.e2e.helpers import TINY, start_decodes_and_router, wait_until

pytestmark = pytest.mark.e2e

ROUTER = flags(
    policy="round_robin",
    # Not the outlier detector's test: on a loaded machine it can steer round robin away from a
    # healthy worker on noise (BENCHMARKS.md, session 30), and the precondition below needs streams
    # on both workers.
    outlier_enabled=False,
    health_interval_s=0.2,
    health_timeout_s=0.5,
    stats_interval_s=0.2,
    resubscribe_max_s=0.5,
    stall_timeout_s=2.0,  # a stream with no token for 2 s migrates
)
N = 4
# Long enough that no stream can finish between its first token and the SIGSTOP: at 200 a
# loaded machine once finished both of decode-0's streams (~2 ms a token here) before the
# test looked, and the precondition (both workers busy) failed.
MAX_TOKENS = 1000
DEADLINE_S = 90.0  # generous for a loaded machine; what matters is that nothing hits it


def greedy(i: int) -> router_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return router_pb2.GenerateRequest(text=f"frozen worker request {i} " * 2, sampling=sampling)


def drain(stream, tokens: list[int]) -> router_pb2.GenerateFinal:
    final = None
    for msg in stream:
        if msg.HasField("delta"):
            tokens += msg.delta.token_ids
        else:
            final = msg.final
    assert final is not None, "stream ended without a final message"
    return final


def test_sigstopped_decode_worker_goes_not_serving_and_its_streams_finish_elsewhere(tmp_path):
    launcher = Launcher(tmp_path)
    decodes = []
    try:
        decodes, router = start_decodes_and_router(launcher, 2, TINY, ROUTER)
        stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(router.address))
        internal = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(router.internal_address))
        stats = [decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(d.address)).Stats for d in decodes]

        def view() -> dict[str, router_pb2.WorkerStatus]:
            resp = internal.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
            return {w.info.worker_id: w for w in resp.workers}

        wait_until(
            lambda: (
                all(w.health == router_pb2.WORKER_HEALTH_SERVING for w in view().values())
                and len(view()) == 2
            ),
            what="the router to see both workers serving",
        )
        free = [s(worker_pb2.StatsRequest(), timeout=10).load.free_blocks for s in stats]

        def undisturbed(i: int) -> list[int]:
            tokens: list[int] = []
            drain(stub.Generate(greedy(i), timeout=DEADLINE_S), tokens)
            assert len(tokens) == MAX_TOKENS
            return tokens

        with ThreadPoolExecutor(N + 1) as pool:  # together, as the streams below run together
            want = list(pool.map(undisturbed, range(N + 1)))

        t0 = time.monotonic()
        streams = [stub.Generate(greedy(i), timeout=DEADLINE_S) for i in range(N)]
        got = [list(next(s).delta.token_ids) for s in streams]  # every stream under way
        busy = {w: s.inflight for w, s in view().items()}
        assert busy["decode-0"] and busy["decode-1"], busy  # round robin: both carry some
        decodes[0].proc.send_signal(signal.SIGSTOP)

        wait_until(
            lambda: view()["decode-0"].health == router_pb2.WORKER_HEALTH_NOT_SERVING,
            timeout=30,
            what="decode-0 NOT_SERVING in the router's view",
        )
        late: list[int] = []  # sent while decode-0 is frozen and known not serving
        late_final = drain(stub.Generate(greedy(N), timeout=DEADLINE_S), late)

        with ThreadPoolExecutor(N) as pool:
            finals = list(pool.map(lambda i: drain(streams[i], got[i]), range(N)))
        elapsed = time.monotonic() - t0
        assert elapsed < DEADLINE_S
        for i in range(N):
            assert got[i] == want[i], f"request {i} differs from its undisturbed run"
            assert finals[i].worker_id == "decode-1", f"request {i} finished on {finals[i].worker_id}"
        assert [f.migrations for f in finals].count(1) == busy["decode-0"]
        assert late == want[N] and late_final.worker_id == "decode-1" and late_final.migrations == 0

        decodes[0].proc.send_signal(signal.SIGCONT)
        for i, s in enumerate(stats):
            wait_until(
                lambda s=s, i=i: s(worker_pb2.StatsRequest(), timeout=10).load.free_blocks == free[i],
                timeout=60,
                what=f"decode-{i}'s pool back to its free count",
            )
        wait_until(
            lambda: internal.Stats(router_pb2.RouterServiceStatsRequest(), timeout=10).inflight == 0,
            what="nothing in flight at the router",
        )
    finally:
        for d in decodes:  # a stopped process cannot act on SIGTERM: wake it first
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGCONT)
        launcher.close(grace_s=10)

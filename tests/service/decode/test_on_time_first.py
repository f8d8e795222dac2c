"""On-time-first admission in a real decode worker process (sim backend, one slot).

The worker runs `--engine-queue-late-after-s 60 --engine-max-num-seqs 1`. While a long
request holds the only slot, a request that says it waited 100 s elsewhere (`waited_s`,
as the router sends for a re-route or a hedge copy) and then a fresh one queue behind it;
the fresh one, on time, gets the slot first. The order does not depend on timing: the
first is late from its arrival, the second on time for a minute. A stream moved off
another worker (`front`) queued behind a fresh request takes the slot first. Bad
`waited_s` values are refused with INVALID_ARGUMENT, and the pool comes back.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from pdmesh.launcher import flags
from pdmesh.v1 import common_pb2, decode_pb2
from tests.e2e.helpers import start_mesh, wait_until
from tests.unit.engine.conftest import prompt_of

pytestmark = pytest.mark.e2e

LOCAL = decode_pb2.DISAGG_MODE_LOCAL


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    args = flags(
        engine_backend="sim",
        engine_sim_speedup=1.0,
        engine_num_blocks=256,
        engine_max_num_seqs=1,
        engine_queue_late_after_s=60.0,
    )
    m = start_mesh(tmp_path_factory.mktemp("ontime"), prefill=0, decode_args=args)
    yield m
    m.close()


def req(rid: str, seed: int, max_tokens: int, waited_s: float = 0.0, front: bool = False):
    return decode_pb2.DecodeServiceGenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt_of(32, seed=seed),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        disagg_mode=LOCAL,
        waited_s=waited_s,
        front=front,
    )


def first_tokens_in_order(mesh, queued: list) -> list[str]:
    """Hold the only slot with a long request, queue `queued` behind it one by one (each seen
    waiting before the next is sent), release, and return the order of first tokens."""
    stub = mesh.decode_stub()
    firsts: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run(r) -> None:
        try:
            for msg in stub.Generate(r, timeout=120):
                if msg.HasField("tokens"):
                    with lock:
                        if r.request_id not in firsts:
                            firsts.append(r.request_id)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    hold = threading.Thread(target=run, args=(req("hold", 1, 400),))
    hold.start()
    threads = []
    try:
        wait_until(lambda: "hold" in firsts, what="the long request running")
        for k, r in enumerate(queued, 1):
            t = threading.Thread(target=run, args=(r,))
            t.start()
            threads.append(t)
            wait_until(lambda k=k: mesh.decode_stats().load.waiting >= k, what=f"{r.request_id} queued")
        assert firsts == ["hold"]  # the slot was still held
    finally:
        for t in (hold, *threads):
            t.join(timeout=120)
    assert not errors
    return firsts


def test_a_stream_moved_off_another_worker_goes_ahead_of_the_queue(mesh):
    """`front` (the router sets it for a stream moved off another worker): queued behind a
    fresh request, it takes the slot first; the pool comes back."""
    initial = mesh.decode_stats().load.free_blocks
    ahead = mesh.decode_stats().counters.moved_ahead
    order = first_tokens_in_order(mesh, [req("queued", 5, 4), req("moved", 6, 4, front=True)])
    assert order == ["hold", "moved", "queued"]
    assert mesh.decode_stats().counters.moved_ahead == ahead + 1
    wait_until(lambda: mesh.decode_stats().load.free_blocks == initial, what="decode pool back")


def test_a_fresh_request_takes_the_slot_before_one_that_waited_elsewhere(mesh):
    initial = mesh.decode_stats().load.free_blocks
    ahead = mesh.decode_stats().counters.admitted_ahead
    order = first_tokens_in_order(mesh, [req("late", 2, 4, waited_s=100.0), req("fresh", 3, 4)])
    assert order == ["hold", "fresh", "late"]
    assert mesh.decode_stats().counters.admitted_ahead == ahead + 1
    wait_until(lambda: mesh.decode_stats().load.free_blocks == initial, what="decode pool back")


@pytest.mark.parametrize("waited_s", [-1.0, float("nan"), float("inf"), 1e9])
def test_a_bad_waited_s_is_refused_with_invalid_argument(mesh, waited_s):
    with pytest.raises(grpc.RpcError) as e:
        list(mesh.decode_stub().Generate(req("bad", 4, 4, waited_s=waited_s), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "waited_s" in e.value.details()

"""Retried arrivals (services/router/retries.py): a retry carrying the idempotency key of a
running request follows it, with no second call to a decode worker (no new prefill).

Fake decode workers (fakes.py) on port 0 behind the in-process router; the first client
goes away mid-stream (its call cancelled), as the OpenAI SDK's does on a timeout before it
retries.
"""

from __future__ import annotations

import asyncio
import http.client
import json

import grpc
import pytest

from services.common.server import ServerConfig
from services.common.tls import TlsConfig
from services.router.config import HttpDoorConfig
from services.router.http_door import HttpDoor
from services.router.retries import RetryAttachConfig
from tests.service.router.conftest import request, tokens_of
from tests.service.router.fakes import expected_tokens
from tests.support.poll import eventually

KEY = (("idempotency-key", "order-42"),)


def counter(router, outcome: str) -> float:
    return (
        router.metrics.registry.get_sample_value("pdmesh_router_retried_arrivals_total", {"outcome": outcome})
        or 0.0
    )


async def first_client_gives_up(h, prompt: str, max_tokens: int, metadata=KEY) -> None:
    """A call that reads its first message, then is cancelled (its client went away)."""
    call = h.stub.Generate(request(prompt, max_tokens), timeout=30, metadata=metadata)
    msg = await call.read()
    assert msg.HasField("delta")
    call.cancel()


async def test_a_retry_with_the_key_follows_the_running_request_from_its_first_token(mesh):
    d = await mesh.decode("d1")
    d.pause_after = 3
    h = await mesh.router([d])
    await first_client_gives_up(h, "hello there", 8)
    await asyncio.wait_for(d.reached.wait(), 30)
    retry = asyncio.create_task(h.generate("hello there", max_tokens=8, metadata=KEY))
    await eventually(lambda: counter(h.router, "attached") == 1, what="the retry attached", timeout=30)
    d.resume.set()
    deltas, final, _ = await retry
    prompt = list(b"hello there")
    assert tokens_of(deltas) == expected_tokens(prompt, 8)  # every token, from the first one
    assert final.usage.completion_tokens == 8
    assert len(d.calls) == 1 and not d.cancelled  # one prefill, never cancelled
    assert h.router.stats().requests_succeeded == 1


async def test_without_a_key_the_retry_is_a_new_request(mesh):
    d = await mesh.decode("d1")
    d.pause_after = 3
    h = await mesh.router([d])
    await first_client_gives_up(h, "hello there", 8, metadata=None)
    await eventually(lambda: d.cancelled, what="the first call cancelled", timeout=30)
    d.pause_after = None
    d.resume.set()
    await h.generate("hello there", max_tokens=8)
    assert len(d.calls) == 2 and counter(h.router, "attached") == 0


async def test_a_succeeded_request_is_replayed_to_its_late_retry(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    first, _, _ = await h.generate("again", max_tokens=5, metadata=KEY)
    again, final, _ = await h.generate("again", max_tokens=5, metadata=KEY)
    assert tokens_of(again) == tokens_of(first) and final.usage.completion_tokens == 5
    assert len(d.calls) == 1 and counter(h.router, "replayed") == 1


async def test_a_key_reused_for_another_request_is_refused(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    await h.generate("one thing", max_tokens=3, metadata=KEY)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.generate("another thing", max_tokens=3, metadata=KEY)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "idempotency-key" in e.value.details()
    assert counter(h.router, "conflict") == 1 and len(d.calls) == 1


async def test_a_failed_request_leaves_the_table_so_its_retry_runs_afresh(mesh):
    d = await mesh.decode("d1")
    d.fail_with = grpc.StatusCode.INVALID_ARGUMENT  # a failure that is not retried inside
    h = await mesh.router([d])
    with pytest.raises(grpc.aio.AioRpcError):
        await h.generate("x", max_tokens=3, metadata=KEY)
    d.fail_with = None
    _, final, _ = await h.generate("x", max_tokens=3, metadata=KEY)
    assert final.usage.completion_tokens == 3 and len(d.calls) == 2
    assert counter(h.router, "replayed") == counter(h.router, "attached") == 0


async def test_an_abandoned_keyed_request_is_cancelled_after_the_grace(mesh):
    d = await mesh.decode("d1")
    d.pause_after = 2
    h = await mesh.router([d], retry_attach=RetryAttachConfig(detach_grace_s=0.2))
    await first_client_gives_up(h, "left alone", 50)
    await eventually(lambda: d.cancelled, what="the decode call cancelled after the grace", timeout=30)
    await eventually(lambda: not h.router.flows, what="the flow closed", timeout=30)
    assert h.router.stats().requests_cancelled == 1 and len(h.router.retried) == 0


async def test_a_bad_key_is_refused_with_a_clear_status(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.generate("x", max_tokens=3, metadata=(("idempotency-key", "k" * 300),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(d.calls) == 0
    assert "idempotency-key" in e.value.details()


def _post(address: str, body: dict, key: str) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"content-type": "application/json", "Idempotency-Key": key},
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


async def test_the_http_door_reads_the_idempotency_key_header(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    door = HttpDoor(h.router, HttpDoorConfig(port=0, request_timeout_s=30), ServerConfig(port=0), TlsConfig())
    await door.start()
    try:
        body = {"model": "builtin-tiny", "prompt": "http retry", "max_tokens": 4}
        s1, b1 = await asyncio.to_thread(_post, door.address, body, "http-1")
        s2, b2 = await asyncio.to_thread(_post, door.address, body, "http-1")
    finally:
        await door.stop()
    assert s1 == s2 == 200
    assert json.loads(b1)["choices"][0]["text"] == json.loads(b2)["choices"][0]["text"]
    assert len(d.calls) == 1 and counter(h.router, "replayed") == 1


async def test_over_http_a_token_id_prompt_is_part_of_what_the_key_names(mesh):
    # The door hands token ids to the flow without the request's repeated field: the
    # fingerprint must still cover them (same ids replay, other ids under the key conflict).
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    door = HttpDoor(h.router, HttpDoorConfig(port=0, request_timeout_s=30), ServerConfig(port=0), TlsConfig())
    await door.start()
    try:
        body = {"model": "builtin-tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4}
        s1, b1 = await asyncio.to_thread(_post, door.address, body, "ids-1")
        s2, b2 = await asyncio.to_thread(_post, door.address, body, "ids-1")
        other = {**body, "prompt": [5, 6, 7, 9]}
        s3, b3 = await asyncio.to_thread(_post, door.address, other, "ids-1")
    finally:
        await door.stop()
    assert s1 == s2 == 200 and json.loads(b1)["choices"] == json.loads(b2)["choices"]
    assert counter(h.router, "replayed") == 1
    assert s3 == 400 and "idempotency-key" in json.loads(b3)["error"]["message"]
    assert len(d.calls) == 1 and counter(h.router, "conflict") == 1


async def test_with_a_real_worker_the_retry_costs_no_second_request_and_the_pool_comes_back(mesh):
    from tests.service.router.test_link import SimDecode
    from tests.service.router.test_slow_workers import Hold

    w = await SimDecode("s1", speedup=5.0).start()
    try:
        h = await mesh.router(decode=[w])
        free = w.free()
        want, _, _ = await h.generate("a real one", max_tokens=300)
        calls = w.rt.registry.get_sample_value("pdmesh_decode_requests_total")
        first = h.stub.Generate(request("a real one", 300), timeout=30, metadata=KEY)
        assert (await first.read()).HasField("delta")
        with Hold(w) as hold:  # the engine stops mid-stream; the first client gives up
            first.cancel()
            await asyncio.to_thread(hold.entered.wait, 30)
            retry = asyncio.create_task(h.generate("a real one", max_tokens=300, metadata=KEY))
            await eventually(
                lambda: counter(h.router, "attached") == 1, what="the retry attached", timeout=30
            )
        deltas, final, _ = await retry
        assert tokens_of(deltas) == tokens_of(want) and final.usage.completion_tokens == 300
        assert w.rt.registry.get_sample_value("pdmesh_decode_requests_total") == calls + 1
        await eventually(lambda: w.free() == free and w.running() == 0, what="the pool free", timeout=30)
    finally:
        await w.close()

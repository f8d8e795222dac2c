"""Hostile and random HTTP bodies at the gateway in front of the real in-process mesh
(issue 13 item 5): every answer is 200 or a 4xx OpenAI error object, never a 5xx or a
traceback, and afterwards /health is 200 and the mesh's pools and queues are as before.

The gateway runs under uvicorn on the mesh's own event loop (port 0) and forwards to
the mesh's real router; the bodies go over a real socket.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import uvicorn
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.app import Gateway
from services.gateway.config import GatewayConfig
from services.gateway.main import bind
from tests.e2e.helpers import wait_until
from tests.fuzz.conftest import fuzz_settings
from tests.fuzz.inproc import InProcessMesh
from tests.service.gateway import httpio

BIG = [2**31, 2**33, 2**40, 2**63, 2**64, -(2**63) - 1]

# Each of these answered 500 with a traceback before the schema (issue 13 item 5).
HOSTILE: list[tuple[str, bytes]] = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2147483648}'),
    ("/v1/completions", b'{"prompt": "x", "top_k": 1099511627776}'),
    ("/v1/completions", b'{"prompt": [1, 1099511627776]}'),
    ("/v1/completions", b'{"prompt": "x", "stop_token_ids": [8589934592]}'),
    ("/v1/completions", b'{"prompt": "\\ud800"}'),
    ("/v1/completions", b'{"prompt": "x", "stop": "\\udfff"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 4400 + b"}"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}'),
]


class _Server(uvicorn.Server):
    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self.ready = True


@pytest.fixture(scope="module")
def gateway(mesh: InProcessMesh):
    gw = Gateway(GatewayConfig(port=0, router_address=mesh.addresses["router"], request_timeout_s=60))
    sock = bind("127.0.0.1", 0)
    server = _Server(uvicorn.Config(gw.app(), log_config=None, access_log=False, lifespan="on"))
    server.ready = False
    task = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), mesh.loop)
    try:
        wait_until(lambda: server.ready, timeout=30, what="gateway serving")
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        task.result(30)


def check_answer(status: int, body: bytes, what: str) -> None:
    assert status == 200 or 400 <= status < 500, f"{what}: {status} {body[:300]!r}"
    if status != 200:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], what
        assert "Traceback" not in err["message"], what


def check_mesh_at_rest(gateway: str, mesh: InProcessMesh, base) -> None:
    status, _, body = httpio.request(gateway, "GET", "/health")
    assert status == 200, body
    wait_until(lambda: mesh.snapshot() == base, timeout=20, what="pools and queues back at rest")


@pytest.mark.parametrize("path, raw", HOSTILE, ids=[f"hostile{i}" for i in range(len(HOSTILE))])
def test_hostile_bodies_are_400s_and_the_mesh_stays_healthy(gateway, mesh, path, raw):
    base = mesh.snapshot()
    status, _, body = httpio.request(gateway, "POST", path, raw=raw)
    assert status == 400, body[:300]
    check_answer(status, body, raw[:60].decode(errors="replace"))
    check_mesh_at_rest(gateway, mesh, base)


def _values():
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-4, max_value=4),
        st.sampled_from(BIG),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=8),
        st.lists(st.sampled_from([0, 1, 2**32, 2**40, "a"]), max_size=3),
        st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    )


FIELDS = ["max_tokens", "top_k", "top_p", "temperature", "seed", "stop", "stop_token_ids", "n", "stream"]


@fuzz_settings(short=40)
@given(
    chat=st.booleans(),
    fields=st.dictionaries(st.sampled_from(FIELDS), _values(), max_size=4),
    content=st.one_of(st.none(), st.text(max_size=8), st.sampled_from([5, [], [{"type": "text"}]])),
)
def test_random_field_values_never_get_a_5xx(gateway, mesh, chat, fields, content):
    body = dict(fields)
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": content}]
    else:
        path, body["prompt"] = "/v1/completions", content if content is not None else "hi"
    # json.dumps escapes any lone surrogate hypothesis draws as \\udXXX, as a hostile client would.
    status, _, raw = httpio.request(gateway, "POST", path, raw=json.dumps(body).encode())
    check_answer(status, raw, json.dumps(body)[:200])

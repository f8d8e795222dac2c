"""Hostile and random HTTP bodies at the HTTP door in front of the real in-process mesh
(issue 13 item 5): every answer is 200 or a 4xx OpenAI error object, never a 5xx or a
traceback, and afterwards /health is 200 and the mesh's pools and queues are as before.

The router's HTTP door (services/router/http_door.py: the gateway's app under uvicorn)
runs on the mesh's own event loop (port 0) and calls the mesh's real router's request
flow in-process, as in the router process; the bodies go over a real socket.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.server import ServerConfig
from services.common.tls import TlsConfig
from services.router.config import HttpDoorConfig
from services.router.http_door import HttpDoor
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


BASELINE: list = []


@pytest.fixture(scope="module")
def gateway(mesh: InProcessMesh):
    async def make() -> HttpDoor:  # on the mesh's loop, as the router process makes it
        return HttpDoor(
            mesh.router, HttpDoorConfig(port=0, request_timeout_s=60), ServerConfig(port=0), TlsConfig()
        )

    door = asyncio.run_coroutine_threadsafe(make(), mesh.loop).result(30)
    BASELINE.append(mesh.snapshot())  # before any HTTP request: what every test must return to
    asyncio.run_coroutine_threadsafe(door.start(), mesh.loop).result(30)
    try:
        yield door.address
    finally:
        asyncio.run_coroutine_threadsafe(door.drain(), mesh.loop).result(30)


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


def _int(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, st.sampled_from(BIG), st.integers(min_value=-(2**70), max_value=2**70))


_text = st.text(alphabet=st.characters(codec=None), max_size=6)  # lone surrogates included
# Each field: mostly values of the right type (valid or out of range), sometimes anything.
FIELDS = {
    "max_tokens": _int(st.integers(1, 4)),
    "top_k": _int(st.integers(-1, 5)),
    "seed": _int(st.integers(0, 2**64 - 1)),
    "temperature": st.floats(-1, 3, allow_nan=False),
    "top_p": st.floats(-0.5, 1.5, allow_nan=False),
    "stop": st.one_of(_text, st.lists(_text, max_size=3)),
    "stop_token_ids": st.lists(_int(st.integers(0, 100)), max_size=3),
    "stream": st.booleans(),
}
ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=4), st.lists(st.integers(), max_size=2)
)


@st.composite
def bodies(draw) -> tuple[str, dict]:
    names = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=4))
    body = {n: draw(FIELDS[n] if draw(st.integers(0, 9)) else ANYTHING) for n in names}
    prompt = draw(st.one_of(_text.filter(bool), st.lists(_int(st.integers(0, 100)), min_size=1, max_size=3)))
    if draw(st.booleans()):
        content = draw(st.one_of(_text, st.none(), st.sampled_from([5, [], [{"type": "text"}]])))
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": content}]}
    return "/v1/completions", {**body, "prompt": prompt}


@fuzz_settings(short=60)
@given(case=bodies())
def test_random_field_values_never_get_a_5xx(gateway, mesh, case):
    path, body = case
    # json.dumps escapes any lone surrogate as \\udXXX, as a hostile client would send it.
    status, _, raw = httpio.request(gateway, "POST", path, raw=json.dumps(body).encode())
    check_answer(status, raw, json.dumps(body)[:200])


def test_after_the_fuzzing_the_mesh_is_healthy_and_at_rest(gateway, mesh):
    check_mesh_at_rest(gateway, mesh, BASELINE[0])
    assert set(mesh.healthy().values()) == {"SERVING"}

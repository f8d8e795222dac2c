"""Router.Generate end to end over gRPC against fake decode workers."""

import subprocess
import sys

import grpc
import pytest

from pdmesh.v1 import common_pb2
from services.router.detokenizer import ByteDetokenizer
from tests.service.router.conftest import tokens_of
from tests.service.router.fakes import expected_tokens


async def test_streams_the_workers_tokens_with_text_and_usage(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    deltas, final, call = await h.generate("hello world", max_tokens=12, request_id="r-1")
    prompt = list(b"hello world")
    assert tokens_of(deltas) == expected_tokens(prompt, 12)
    assert "".join(x.text for x in deltas) == bytes(expected_tokens(prompt, 12)).decode()
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.request_id == "r-1" and final.worker_id == "d1" and final.migrations == 0
    assert final.usage.prompt_tokens == len(prompt) and final.usage.completion_tokens == 12
    assert final.usage.computed_tokens == len(prompt) + 12
    assert final.prefill_path == "local"
    assert ("x-request-id", "r-1") in tuple(await call.initial_metadata())
    # The worker got token ids (the router tokenized), the original budget and a deadline.
    sent = d.calls[0]
    assert list(sent.prompt_token_ids) == prompt and sent.sampling.max_tokens == 12
    assert d.deadlines[0] is not None


async def test_assigns_a_request_id_when_none_is_given(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    _, final, call = await h.generate("x", max_tokens=2)
    md = dict(tuple(await call.initial_metadata()))
    assert md["x-request-id"] and md["x-request-id"] == final.request_id == d.calls[0].request_id


async def test_token_ids_prompt_is_forwarded_as_is(mesh):
    d = await mesh.decode("d1")
    h = await mesh.router([d])
    deltas, _, _ = await h.generate([256, 1, 2, 3], max_tokens=3)
    assert list(d.calls[0].prompt_token_ids) == [256, 1, 2, 3]
    assert tokens_of(deltas) == expected_tokens([256, 1, 2, 3], 3)


async def test_tokens_ready_together_go_out_in_one_message(mesh):
    d = await mesh.decode("d1")
    d.tokens_per_message = 4
    h = await mesh.router([d])
    deltas, _, _ = await h.generate("abc", max_tokens=8)
    assert [len(x.token_ids) for x in deltas] == [4, 4]


async def test_multibyte_characters_split_across_tokens_come_out_whole(mesh):
    text = "hé€llo 😀!"
    d = await mesh.decode("d1")
    d.script = list(text.encode())
    h = await mesh.router([d])
    deltas, _, _ = await h.generate("abc", max_tokens=len(d.script))
    # The router may coalesce tokens that arrive while the client is slow, so the split into
    # messages varies; what must hold is that every message ends on whole characters: the text so
    # far is exactly the bytes so far up to their last complete character.
    seen, out = b"", ""
    for x in deltas:
        seen += bytes(x.token_ids)
        out += x.text
        assert out == _complete_prefix(seen), (seen, out)
    assert seen == text.encode() and out == text


def _complete_prefix(data: bytes) -> str:
    for cut in range(4):
        try:
            return data[: len(data) - cut].decode()
        except UnicodeDecodeError:
            continue
    raise AssertionError(f"not UTF-8: {data!r}")


def test_byte_detokenizer_skips_specials_and_keeps_partial_bytes():
    detok = ByteDetokenizer()
    euro = "€".encode()
    assert detok.push_many([euro[0], 257]) == ""
    assert detok.push_many([*list(euro[1:]), ord("a")]) == "€a"


async def test_no_decode_worker_is_unavailable(mesh):
    h = await mesh.router([], wait=False)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await h.generate("x")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_router_process_never_imports_torch():
    code = (
        "import sys, asyncio\n"
        "import services.router.main\n"
        "from services.router.config import parse_settings, ModelSpec\n"
        "from services.router.router import Router\n"
        "async def go():\n"
        "    s = parse_settings(['--decode-workers', '127.0.0.1:1'], {})\n"
        "    Router(s, ModelSpec.load(s.router))\n"
        "asyncio.run(go())\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

"""The raw link's wire (services/common/link_wire.py): frames, their reassembly, the
hand-encoded open frame, the inbox between a protocol and its task."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdmesh.v1 import common_pb2, decode_pb2
from services.common import link_wire
from tests.support.poll import eventually


def _request(n: int, rid: str = "r") -> decode_pb2.DecodeServiceGenerateRequest:
    rng = random.Random(n)
    return decode_pb2.DecodeServiceGenerateRequest(
        request_id=rid,
        prompt_token_ids=[rng.randrange(0, 1 << 32) for _ in range(n)],
        sampling=common_pb2.SamplingParams(max_tokens=7, temperature=0.5),
        tenant="t",
    )


@pytest.mark.parametrize("link_id", [1, 127, 128, 300, 1 << 40])
@pytest.mark.parametrize("timeout_s", [0.0, 0.25, 3600.0])
@pytest.mark.parametrize("n", [0, 1, 2_000])
@pytest.mark.parametrize("notify", [False, True])
def test_the_hand_encoded_open_frame_is_the_message_encoded(link_id, timeout_s, n, notify):
    req = _request(n)
    want = link_wire.encode(
        decode_pb2.DecodeServiceLinkRequest(
            open=decode_pb2.LinkOpen(link_id=link_id, request=req, timeout_s=timeout_s, notify_started=notify)
        )
    )
    got = link_wire.encode_open(link_id, req.SerializeToString(), timeout_s, notify)
    assert got == want
    frame = decode_pb2.DecodeServiceLinkRequest.FromString(got[4:])
    assert frame.open.link_id == link_id and frame.open.timeout_s == timeout_s
    assert frame.open.notify_started is notify
    assert list(frame.open.request.prompt_token_ids) == list(req.prompt_token_ids)


def test_frames_come_out_whole_whatever_the_pieces():
    frames = [link_wire.encode(_request(n, f"r{n}")) for n in (0, 3, 500, 1)]
    stream = b"".join(frames)
    rng = random.Random(0)
    for _ in range(20):
        buf, out, pos = link_wire.FrameBuffer(1 << 20), [], 0
        while pos < len(stream):
            step = rng.randrange(1, 700)
            out += buf.feed(stream[pos : pos + step])
            pos += step
        assert [decode_pb2.DecodeServiceGenerateRequest.FromString(b).request_id for b in out] == [
            "r0",
            "r3",
            "r500",
            "r1",
        ]
        assert buf.buffered == 0


def test_a_length_above_the_limit_is_refused_before_its_bytes_arrive():
    buf = link_wire.FrameBuffer(1024)
    assert buf.feed(link_wire.HEADER.pack(1024) + b"x" * 10) == []  # at the limit: waits for it
    with pytest.raises(link_wire.FrameTooLarge):
        link_wire.FrameBuffer(1024).feed(link_wire.HEADER.pack(1025))


async def test_the_inbox_hands_frames_in_order_then_ends_or_raises():
    inbox = link_wire.FrameInbox()
    got: list[int] = []

    async def consume() -> None:
        async for x in inbox:
            got.append(x)

    task = asyncio.create_task(consume())
    await eventually(lambda: inbox._waiter is not None, what="the consumer waiting")
    inbox.put(1)
    inbox.put(2)
    await eventually(lambda: got == [1, 2], what="both handed over")
    inbox.put(3)
    inbox.close()
    inbox.put(4)  # after the close: still handed over before the end (the frames already in)
    await asyncio.wait_for(task, 5)
    assert got == [1, 2, 3, 4]

    failing = link_wire.FrameInbox()
    failing.put("a")
    failing.close(ValueError("bad frame"))
    seen = []
    with pytest.raises(ValueError, match="bad frame"):
        async for x in failing:
            seen.append(x)
    assert seen == ["a"]

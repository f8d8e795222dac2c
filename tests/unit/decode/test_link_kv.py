"""KV events on a decode worker's Link (services/worker/serving.py `kv_link_stream`,
services/decode/link.py `LinkSession`): the subscription SubscribeKvEvents serves, carried in
the frames that carry tokens. A fake engine stands in for the event log (its API: snapshot,
events since a seq, a wait for new ones), so a gap can be made on purpose."""

from __future__ import annotations

import asyncio

import pytest

from pdmesh.v1 import decode_pb2
from services.decode.link import LinkMalformed, LinkSession
from services.engine.api import KvEvent, KvEventKind
from services.worker.serving import kv_link_stream


class EventLog:
    """The engine's KV-event API: a snapshot at `seq`, and `events` appended by the test."""

    def __init__(self) -> None:
        self.seq = 0
        self.events: list[KvEvent] = []
        self.snapshots = 0
        self._new = asyncio.Event()

    def kv_snapshot(self):
        self.snapshots += 1
        return self.seq, [(None, 11), (11, 12)]

    def kv_events_since(self, seq: int) -> list[KvEvent]:
        return [e for e in self.events if e.seq > seq]

    async def wait_kv_events(self, after_seq: int) -> None:
        while not self.kv_events_since(after_seq):
            self._new.clear()
            await self._new.wait()

    def store(self, seq: int, *hashes: int) -> None:
        self.events.append(KvEvent(seq, KvEventKind.STORED, hashes, None))
        self.seq = max(self.seq, seq)
        self._new.set()


async def test_the_link_stream_is_a_snapshot_then_batches_and_a_new_snapshot_after_a_gap():
    log = EventLog()
    stream = kv_link_stream(log, "d0")
    first = await anext(stream)
    assert first.worker_id == "d0" and first.WhichOneof("body") == "snapshot"
    assert [tuple(c.block_hashes) for c in first.snapshot.chains] == [(11,), (12,)]
    log.store(1, 21, 22)
    batch = await anext(stream)
    assert [e.seq for e in batch.events.events] == [1]
    assert list(batch.events.events[0].stored.block_hashes) == [21, 22]
    # Event 2 was dropped from the bounded log: a gRPC subscription would end with DATA_LOSS;
    # on a link (whose requests must not end with it) the next message is a fresh snapshot.
    log.events.clear()
    log.store(3, 31)
    again = await anext(stream)
    assert again.WhichOneof("body") == "snapshot" and again.snapshot.seq == 3
    assert log.snapshots == 2
    await stream.aclose()


class Frames:
    """The router's side of one LinkSession: frames in through `send`, the session's out."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()

    def send(self, frame: decode_pb2.DecodeServiceLinkRequest | None) -> None:
        self.inbox.put_nowait(frame)

    async def __aiter__(self):
        while (f := await self.inbox.get()) is not None:
            yield f


def subscribe() -> decode_pb2.DecodeServiceLinkRequest:
    return decode_pb2.DecodeServiceLinkRequest(subscribe_kv=decode_pb2.LinkSubscribeKv(subscriber="r"))


async def test_a_session_sends_kv_only_when_asked_and_a_second_subscribe_restarts_with_a_snapshot():
    log = EventLog()
    session = LinkSession(None, None, None, kv_stream=lambda: kv_link_stream(log, "d0"))  # type: ignore[arg-type]
    frames = Frames()
    out = session.run(frames.__aiter__())
    frames.send(subscribe())
    f1 = await anext(out)
    assert [m.WhichOneof("body") for m in f1.kv] == ["snapshot"] and not f1.tokens
    log.store(1, 21)
    f2 = await anext(out)
    assert [m.WhichOneof("body") for m in f2.kv] == ["events"]
    frames.send(subscribe())
    f3 = await anext(out)
    assert [m.WhichOneof("body") for m in f3.kv] == ["snapshot"] and f3.kv[0].snapshot.seq == 1
    frames.send(None)  # the router closes its side: with no request open, the session ends
    with pytest.raises(StopAsyncIteration):
        await anext(out)
    assert log.snapshots == 2


async def test_a_subscribe_to_a_worker_without_link_kv_is_malformed():
    session = LinkSession(None, None, None)  # type: ignore[arg-type]
    frames = Frames()
    out = session.run(frames.__aiter__())
    frames.send(subscribe())
    with pytest.raises(LinkMalformed, match="link_kv_events"):
        await anext(out)

"""LinkSession (the worker's end of DecodeService.Link) as a plain core, with a stand-in DecodeWorker.

The stand-in (it only yields events when the test lets it) makes an ordering
deterministic that a real engine hits only by chance under load: a request
ending while the session is suspended at its previous frame's yield.
"""

import asyncio

from pdmesh.v1 import decode_pb2
from services.decode.link import LinkSession
from tests.support.poll import eventually


class GatedWorker:
    """STAND-IN for DecodeWorker.generate: one token, then the end once `finish` is set."""

    def __init__(self):
        self.finish = asyncio.Event()

    async def generate(self, job, sink):
        sink([7])  # the link's path: tokens to the sink, only the end is yielded
        await self.finish.wait()
        yield "finished"  # LinkSession hands the yielded end to final_of


def open_frame(lid: int) -> decode_pb2.DecodeServiceLinkRequest:
    req = decode_pb2.DecodeServiceGenerateRequest(request_id=f"r{lid}")
    return decode_pb2.DecodeServiceLinkRequest(open=decode_pb2.LinkOpen(link_id=lid, request=req))


async def router_frames(frames, hold: asyncio.Event):
    """The router's side of the stream: the given frames, then open until `hold` is set."""
    for f in frames:
        yield f
    await hold.wait()


async def test_a_request_ending_while_the_last_frame_is_written_still_gets_its_end_on_drain():
    # The drained link ends once its requests did, but not before the last one's end is
    # sent: it ended while the session was suspended at its previous frame's yield (the
    # frame being written), and the session returned without a LinkEnd, so the router saw
    # the link end under an open request ("the worker ended the link") and failed it over.
    worker, draining, hold = GatedWorker(), asyncio.Event(), asyncio.Event()
    final = decode_pb2.DecodeFinal(finish_reason=1)
    session = LinkSession(worker, lambda request, timeout: object(), lambda event: final, draining)
    run = session.run(router_frames([open_frame(1)], hold))
    try:
        first = await anext(run)  # the token frame; the session now waits at its yield
        assert [(t.link_id, list(t.token_ids)) for t in first.tokens] == [(1, [7])]
        draining.set()
        worker.finish.set()
        await eventually(lambda: session.open_requests == 0, what="the request ended", timeout=10)
        end_frame = await anext(run)
        assert [(e.link_id, e.WhichOneof("outcome")) for e in end_frame.ends] == [(1, "final")]
        try:
            await anext(run)
            raise AssertionError("the drained link should end after its last request's end")
        except StopAsyncIteration:
            pass
    finally:
        hold.set()
        await run.aclose()

"""The worker's end of DecodeService.Link: many requests of one router on one stream.

A Generate call costs a gRPC message (a sendmsg, a wakeup write and a futex on
each side) per token per request; profiles of the router and this worker put
~70% of their busy CPU there (bench/results/profile_front.txt). On a link, one
frame carries the new tokens of every request of that router that has some,
so the per-message cost is paid once per engine step, not once per request.

`LinkSession` serves one Link call. A reader task takes the router's frames:
`open` turns the request into a `DecodeJob` exactly as Generate does (the
servicer's validation) and runs it on the same `DecodeWorker` core in a task of
its own; `cancel` cancels that task, which closes the core (engine abort, KV
freed, at once) and ends the request with CANCELLED. Each request's tokens go
to one pending batch through a sink (`DecodeWorker.generate`'s: past the first
token, the engine calls it in its delivery callback, with no task of the
request woken); its end is added by its task. A request opened with
`notify_started` has its id added to the batch's `started` when the engine
begins its prefill (before that pass runs, so the frame goes at once): the
router's tied hedge races on it. Either wakes the writer, which
sends the batch as one frame. The engine delivers every output of a step in one
loop callback, so every request of a step lands in the same batch.

When the server drains, a link takes no new request (UNAVAILABLE: the router
retries elsewhere), lets the open ones finish and then ends the call (the
drain waits for it as for a Generate call, up to its grace).

A frame that breaks the protocol (no frame kind, an id of 0 or one already
open, an open without a request) ends the link with INVALID_ARGUMENT. Every
way the link ends (that, the router going away, the server stopping) cancels
the requests still open on it, so their KV is freed; the router fails them
over (services/router/link.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from functools import partial

import grpc
import structlog

from pdmesh.v1 import decode_pb2
from services.common.errors import MAX_DETAILS_CHARS, InvalidArgument, status_of
from services.decode.worker import DecodeJob, DecodeWorker, Finished

log = structlog.get_logger()

MakeJob = Callable[[decode_pb2.DecodeServiceGenerateRequest, "float | None"], DecodeJob]
FinalOf = Callable[[Finished], decode_pb2.DecodeFinal]


class LinkMalformed(InvalidArgument):
    """A frame that breaks the Link protocol; the link ends with INVALID_ARGUMENT."""


def _status(code: grpc.StatusCode, message: str) -> decode_pb2.LinkStatus:
    if len(message) > MAX_DETAILS_CHARS:
        message = message[:MAX_DETAILS_CHARS] + "..."
    return decode_pb2.LinkStatus(code=code.value[0], message=message)


class LinkSession:
    """One Link call (see the module docstring)."""

    def __init__(
        self,
        worker: DecodeWorker,
        make_job: MakeJob,
        final_of: FinalOf,
        draining: asyncio.Event | None = None,
    ):
        self._worker = worker
        self._draining = draining
        self._make_job = make_job
        self._final_of = final_of
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._cancelled: set[int] = set()  # ids the router cancelled (end with CANCELLED)
        self._tokens: dict[int, list[int]] = {}  # pending batch: new tokens per id
        self._ends: list[decode_pb2.LinkEnd] = []
        self._started: list[int] = []  # pending batch: ids whose prefill began (notify_started)
        self._ready = asyncio.Event()
        self._error: LinkMalformed | None = None
        self._reading = True
        self._drained = False  # the server drains: no new request; end once the open ones did

    @property
    def open_requests(self) -> int:
        return len(self._tasks)

    async def run(self, frames: AsyncIterator[decode_pb2.DecodeServiceLinkRequest]):
        """The worker's frames, until the router closes its side and every request
        ended; raises LinkMalformed on a bad frame."""
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(frames))
        drain = loop.create_task(self._on_drain()) if self._draining is not None else None
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                if self._tokens or self._ends or self._started:
                    yield self._frame()
                if self._error is not None:
                    raise self._error
                # Nothing left to send either: a request that ended while the frame above
                # was being written (the generator suspended at its yield) has its end
                # pending, and returning now would end the link under it (the router then
                # fails it over: the drain flake of tests/service/router/test_link.py).
                if (
                    (not self._reading or self._drained)
                    and not self._tasks
                    and not self._tokens
                    and not self._ends
                ):
                    return
        finally:
            reader.cancel()
            if drain is not None:
                drain.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            # Wait for the cores to close: the engine aborts (KV freed) are queued
            # before the call's status goes out.
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _on_drain(self) -> None:
        assert self._draining is not None
        await self._draining.wait()
        self._drained = True
        self._ready.set()

    def _frame(self) -> decode_pb2.DecodeServiceLinkResponse:
        tokens, self._tokens = self._tokens, {}
        ends, self._ends = self._ends, []
        frame = decode_pb2.DecodeServiceLinkResponse(
            tokens=[decode_pb2.LinkTokens(link_id=i, token_ids=ids) for i, ids in tokens.items()],
            ends=ends,
        )
        if self._started:  # only with hedging on, once per request: not on every step's frame
            frame.started.extend(self._started)
            self._started = []
        return frame

    # ---- router -> worker ----------------------------------------------------

    async def _read(self, frames: AsyncIterator[decode_pb2.DecodeServiceLinkRequest]) -> None:
        try:
            async for frame in frames:
                kind = frame.WhichOneof("frame")
                if kind == "open":
                    self._open(frame.open)
                elif kind == "cancel":
                    self._cancel(frame.cancel.link_id)
                else:
                    raise LinkMalformed("a link frame with neither open nor cancel")
        except LinkMalformed as e:
            log.warning("link_malformed", error=str(e))
            self._error = e
        finally:
            self._reading = False
            self._ready.set()

    def _open(self, o: decode_pb2.LinkOpen) -> None:
        lid = o.link_id
        if lid == 0:
            raise LinkMalformed("link_id must be > 0")
        if lid in self._tasks:
            raise LinkMalformed(f"link_id {lid} is already open on this link")
        if not o.HasField("request"):
            raise LinkMalformed(f"open of link_id {lid} carries no request")
        if self._drained:
            self._ends.append(
                decode_pb2.LinkEnd(
                    link_id=lid, error=_status(grpc.StatusCode.UNAVAILABLE, "the decode worker is draining")
                )
            )
            self._ready.set()
            return
        try:
            job = self._make_job(o.request, o.timeout_s if o.timeout_s > 0 else None)
        except Exception as e:  # bad request: only this one ends, with its status
            self._end_error(lid, e)
            return
        on_started = partial(self._add_started, lid) if o.notify_started else None
        self._tasks[lid] = asyncio.get_running_loop().create_task(self._serve(lid, job, on_started))

    def _cancel(self, lid: int) -> None:
        task = self._tasks.get(lid)
        if task is not None and lid not in self._cancelled:  # unknown: it ended already (a race)
            self._cancelled.add(lid)
            task.cancel()

    # ---- one request -----------------------------------------------------------

    async def _serve(self, lid: int, job: DecodeJob, on_started: Callable[[], None] | None = None) -> None:
        end = None
        try:
            # The tokens go straight into the pending batch (past the first, from the
            # engine's delivery callback); the core yields only the request's end.
            events = self._worker.generate(job, sink=partial(self._add_tokens, lid), on_started=on_started)
            async with aclosing(events):
                async for event in events:  # with a sink: only the Finished
                    end = decode_pb2.LinkEnd(link_id=lid, final=self._final_of(event))
        except asyncio.CancelledError:
            if lid not in self._cancelled:  # the link is ending: nobody to tell
                raise
            end = decode_pb2.LinkEnd(
                link_id=lid, error=_status(grpc.StatusCode.CANCELLED, "cancelled by the router")
            )
        except Exception as e:
            self._end_error(lid, e)
        finally:
            self._tasks.pop(lid, None)
            self._cancelled.discard(lid)
        if end is not None:
            self._ends.append(end)
            self._ready.set()

    def _add_started(self, lid: int) -> None:
        """The engine began `lid`'s prefill: tell the router in the next frame, sent at once
        (the pass it starts is still to run; its tied copies elsewhere can be cancelled)."""
        if lid in self._tasks and lid not in self._cancelled:
            self._started.append(lid)
            self._ready.set()

    def _add_tokens(self, lid: int, token_ids: list[int]) -> None:
        pending = self._tokens.get(lid)
        if pending is None:
            self._tokens[lid] = token_ids
        else:
            pending.extend(token_ids)
        self._ready.set()

    def _end_error(self, lid: int, e: BaseException) -> None:
        mapped = status_of(e)
        if mapped is None:
            log.error("internal_error", method="DecodeServicer.Link", exc_info=e)
            mapped = (grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__})")
        self._ends.append(decode_pb2.LinkEnd(link_id=lid, error=_status(*mapped)))
        self._ready.set()

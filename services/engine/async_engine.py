"""TorchEngine: the `Engine` protocol over the synchronous LLMEngine.

One dedicated thread owns the LLMEngine and runs `step()` in a loop; the
asyncio side hands it work as closures through a FIFO command queue and gets
results back with `loop.call_soon_threadsafe` (one callback per loop turn,
carrying every output of the step). When nothing can run, the thread blocks on
the command queue: no busy spinning. Because commands run in FIFO order, undoing
a cancelled call is just another command queued behind it. Two calls run on a
worker thread under the core's mutex instead, which the step thread releases
during the forward pass: `hold_prefix` and `reserve_external` only take cached or
free blocks, so neither waits for a loaded worker's step to end; each undoes
itself after a cancellation once its thread is done.

Loop-side bookkeeping (`_streams`, `_prefills`, `_held`, `_reserved`) answers
the synchronous calls (`abort`, `release`) and rejects duplicate ids at once.
Read-only calls (`stats`, `prefix_lookup`, KV events) read the core's
thread-safe views directly.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any

import torch

from kvtransfer.layout import KvLayout
from services.engine.api import (
    EngineError,
    EngineRequest,
    EngineStats,
    ExternalKvReservation,
    FinishReason,
    HeldKv,
    InvalidRequestError,
    KvEvent,
    PrefillResult,
    RequestOutput,
    UnknownRequestError,
)
from services.engine.config import EngineConfig
from services.engine.engine_spec import EngineSpec
from services.engine.llm_engine import LLMEngine, RunnerFactory, call_each
from services.engine.validation import validate_request

_STOP = object()


def _noop(core: LLMEngine) -> None:
    """A command that only wakes the step loop (it then delivers pending KV events)."""


class TorchEngine:
    def __init__(
        self,
        config: EngineConfig,
        spec: EngineSpec | None = None,
        runner_factory: RunnerFactory | None = None,
    ):
        """`spec` and `runner_factory` default to the torch engine's; the sim
        engine passes its own (services/engine/sim/engine.py)."""
        self.config = config
        self._spec = spec or EngineSpec.resolve(config)  # cheap: config + tokenizer files only
        self._runner_factory = runner_factory
        self.info = self._spec.info
        self.tokenizer = self._spec.tokenizer
        self._core: LLMEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._streams: dict[str, _Outputs] = {}
        self._prefills: dict[str, asyncio.Future] = {}
        self._held: set[str] = set()
        self._reserved: set[str] = set()
        self._event_waiters: list[asyncio.Future] = []
        self._calls: set[asyncio.Future] = set()  # pending `_call` results
        self._prefill_ids: set[str] = set()  # step thread only
        self._failure: Exception | None = None

    # ---- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._core = await asyncio.to_thread(LLMEngine, self.config, self._spec, self._runner_factory)
        # EngineRequest.on_started callbacks run on the loop, posted before the pass they start
        self._core.started_sink = partial(self._post, call_each)
        self._thread = threading.Thread(target=self._run, name="torch-engine-step", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        if self._thread is None or self._closed:
            return
        self._closed = True
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        closed = EngineError("engine closed")
        for fut in self._prefills.values():
            if not fut.done():
                fut.set_exception(closed)
        self._wake_event_waiters()
        self._core = None  # drops the model and the KV pool

    # ---- requests -----------------------------------------------------------

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        self._check_new(request)
        return self._open_stream(request.request_id, lambda core: core.add_request(request))

    async def prefill(self, request: EngineRequest) -> PrefillResult:
        self._check_new(request)
        rid = request.request_id
        fut = self._loop.create_future()
        self._prefills[rid] = fut

        def run(core: LLMEngine) -> None:
            try:
                core.add_request(request, prefill_only=True)
                self._prefill_ids.add(rid)
            except EngineError as e:
                self._post(self._settle, fut, None, e)

        self._submit(run)
        try:
            return await fut
        except asyncio.CancelledError:
            self._held.discard(rid)
            self._try_submit(lambda core: core.abort(rid))  # runs after `run`: frees whatever it made
            raise
        finally:
            self._prefills.pop(rid, None)

    def release(self, request_id: str) -> bool:
        if request_id not in self._held:
            return False
        self._held.discard(request_id)
        return self._try_submit(lambda core: core.release(request_id))

    async def reserve_external(self, request: EngineRequest) -> ExternalKvReservation:
        # Off the step thread, as hold_prefix: a remote prefill's or a prefix pull's blocks are
        # reserved while a loaded worker's long step runs, not after it (a step of 8,192 prompt
        # tokens on the sim is ~170 ms of model time that the router's pull price never counted).
        reservation = await self._off_step_thread(
            request, self._reserved, LLMEngine.reserve_external, LLMEngine.cancel_external
        )
        # Wake the step loop: the KV events of blocks this evicted go out with its next delivery.
        self._try_submit(_noop)
        return reservation

    def generate_external(self, request_id: str, first_token_id: int) -> AsyncIterator[RequestOutput]:
        self._check_open()
        if request_id not in self._reserved:
            raise UnknownRequestError(f"no KV reservation for request {request_id!r}")
        self._reserved.discard(request_id)
        return self._open_stream(request_id, lambda core: core.commit_external(request_id, first_token_id))

    def cancel_external(self, request_id: str) -> None:
        if request_id in self._reserved:
            self._reserved.discard(request_id)
            self._try_submit(lambda core: core.cancel_external(request_id))

    # ---- cached prefixes served to / pulled from other workers (issue 17) -----

    async def hold_prefix(self, request: EngineRequest) -> HeldKv | None:
        """Hold the prompt's cached leading blocks (LLMEngine.hold_prefix) until
        `release(request_id)`; None (nothing held) when none is cached."""
        # A loaded holder's long step does not delay the lease.
        held = await self._off_step_thread(request, self._held, LLMEngine.hold_prefix, LLMEngine.release)
        if held is None:
            self._held.discard(request.request_id)
        return held

    async def _off_step_thread(self, request: EngineRequest, ids: set[str], call, undo):
        """`call(core, request)` on a worker thread: it takes the core's mutex, which the step
        thread releases during the forward pass, so it does not wait for a step to end. The
        request's id is in `ids` (loop-side bookkeeping) from now on unless it fails. Cancelled
        while the thread runs: `undo(core, id)` as a command once the thread is done (it may
        still make what it was asked to). Refused: nothing was made (the core validates and
        checks capacity before it changes anything)."""
        self._check_new(request)
        rid = request.request_id
        ids.add(rid)
        job = asyncio.ensure_future(asyncio.to_thread(call, self._started(), request))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            ids.discard(rid)
            job.add_done_callback(lambda _: self._try_submit(lambda core: undo(core, rid)))
            raise
        except BaseException:
            ids.discard(rid)
            raise

    def generate_with_prefix(
        self, request: EngineRequest, prefix_request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """`generate(request)` after committing the prefix pulled into the blocks reserved
        under `prefix_request_id` (LLMEngine.commit_prefix), in one command, so no step
        between the two can evict the pulled blocks before the request matches them."""
        self._check_new(request)
        if prefix_request_id not in self._reserved:
            raise UnknownRequestError(f"no KV reservation for request {prefix_request_id!r}")
        self._reserved.discard(prefix_request_id)

        def start(core: LLMEngine) -> None:
            core.commit_prefix(prefix_request_id)
            core.add_request(request)

        return self._open_stream(request.request_id, start)

    def divert(self, request_id: str, sink: Callable[[RequestOutput], None]) -> bool:
        q = self._streams.get(request_id)
        return q is not None and q.divert(sink)

    def abort(self, request_id: str) -> bool:
        if not self._is_active(request_id):
            return False
        self._held.discard(request_id)
        self._reserved.discard(request_id)
        return self._try_submit(lambda core: self._abort_on_thread(core, request_id))

    # ---- KV blocks and views ------------------------------------------------------

    def kv_pool(self) -> torch.Tensor | None:
        return None if self._core is None else self._core.kv_pool()

    async def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the blocks' KV [len, *layout.block_shape] (e.g. of HeldKv.block_ids)."""
        return await self._call(lambda core: core.export_blocks(block_ids))

    async def import_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor, layout: KvLayout) -> None:
        """Write KV into reserved transfer blocks; LayoutMismatch when `layout` differs."""
        await self._call(lambda core: core.import_blocks(block_ids, blocks, layout))

    async def sync(self) -> None:
        """Return once every command issued before this call has been applied."""
        await self._call(lambda core: None)

    def prefix_lookup(self, token_ids: Sequence[int]) -> int:
        return self._started().prefix_lookup(token_ids)

    def stats(self) -> EngineStats:
        return self._started().stats()

    def kv_events_since(self, seq: int) -> list[KvEvent]:
        return self._started().kv_events_since(seq)

    def kv_snapshot(self) -> tuple[int, list[tuple[int | None, int]]]:
        return self._started().kv_snapshot()

    def kv_snapshot_tiers(self) -> tuple[int, list[tuple[int | None, int]], list[tuple[int | None, int]]]:
        """(seq, pool pairs, host-tier pairs), consistent with each other."""
        return self._started().kv_snapshot_tiers()

    async def wait_kv_events(self, after_seq: int) -> None:
        core = self._started()
        while core.block_manager.events.last_seq <= after_seq:
            self._check_open()
            fut = self._loop.create_future()
            self._event_waiters.append(fut)
            await fut

    # ---- loop side -------------------------------------------------------------

    def _started(self) -> LLMEngine:
        if self._core is None:
            raise EngineError("engine not started (or closed)")
        return self._core

    def _check_open(self) -> None:
        self._started()
        if self._failure is not None:
            raise EngineError("engine step loop failed") from self._failure
        if self._closed:
            raise EngineError("engine closed")

    def _check_new(self, request: EngineRequest) -> None:
        self._check_open()
        validate_request(request, self.info)
        if self._is_active(request.request_id):
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")

    def _is_active(self, rid: str) -> bool:
        return rid in self._streams or rid in self._prefills or rid in self._held or rid in self._reserved

    def _open_stream(self, rid: str, start: Callable[[LLMEngine], RequestOutput | None]):
        """Register the stream and submit `start` now (so an abort queued later finds the request)."""
        q = _Outputs()
        self._streams[rid] = q
        self._submit(lambda core: _start_stream(core, rid, start))
        return self._iterate(rid, q)

    async def _iterate(self, rid: str, q: _Outputs) -> AsyncIterator[RequestOutput]:
        done = False
        try:
            while not done:
                item = await q.get()
                if isinstance(item, BaseException):
                    done = not q.sink_failed  # the request still runs then: aborted below
                    raise item
                done = item.finished
                yield item
        finally:
            if self._streams.get(rid) is q:
                del self._streams[rid]
            if not done:  # closed or cancelled by the consumer
                self._try_submit(lambda core: self._abort_on_thread(core, rid))

    def _call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run fn(core) on the step thread; the future gets its result or typed error."""
        fut = self._loop.create_future()
        self._calls.add(fut)
        fut.add_done_callback(self._calls.discard)

        def run(core: LLMEngine) -> None:
            try:
                result = fn(core)
            except Exception as e:  # handed to the caller, not swallowed
                self._post(self._settle, fut, None, e)
            else:
                self._post(self._settle, fut, result, None)

        self._submit(run)
        return fut

    def _submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        self._check_open()
        self._commands.put(fn)

    def _try_submit(self, fn: Callable[[LLMEngine], Any]) -> bool:
        """Submit a clean-up command; False when the step loop is gone (it freed everything)."""
        if self._core is None or self._closed or self._failure is not None:
            return False
        self._commands.put(fn)
        return True

    def _post(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    @staticmethod
    def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)

    def _deliver(self, items: list[tuple[str, str, Any]], events_advanced: bool) -> None:
        for kind, rid, payload in items:
            if kind == "prefill":
                self._deliver_prefill(rid, payload)
            elif rid in self._streams:
                self._streams[rid].put_nowait(payload)
            elif kind == "abort" and rid in self._prefills:
                self._settle(self._prefills[rid], None, EngineError(f"request {rid!r} was aborted"))
        if events_advanced:
            self._wake_event_waiters()

    def _deliver_prefill(self, rid: str, result: PrefillResult) -> None:
        fut = self._prefills.get(rid)
        if fut is None or fut.done():  # the caller gave up: the queued abort frees the blocks
            return
        if result.held is not None:
            self._held.add(rid)
        fut.set_result(result)

    def _fail_all(self, error: Exception) -> None:
        failed = EngineError("engine step loop failed")
        failed.__cause__ = error
        for q in self._streams.values():
            q.put_nowait(failed)
        for fut in [*self._prefills.values(), *self._calls]:
            self._settle(fut, None, failed)
        self._wake_event_waiters()

    def _wake_event_waiters(self) -> None:
        waiters, self._event_waiters = self._event_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # ---- step thread ---------------------------------------------------------------

    def _run(self) -> None:
        core = self._core
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)  # per thread for OpenMP
        try:
            self._loop_until_stopped(core)
        except Exception as e:  # a bug: fail every caller loudly, stop the loop
            self._failure = e
            self._post(self._fail_all, e)

    def _loop_until_stopped(self, core: LLMEngine) -> None:
        last_event = core.block_manager.events.last_seq
        items: list[tuple[str, str, Any]] = []
        while True:
            idle = not core.has_unfinished_requests() or not core.last_step_progressed
            # An idle engine still wakes for the next workflow pin's TTL, so its
            # blocks go back to the pool without waiting for a request.
            bm = core.block_manager
            expiry = bm.next_pin_expiry()
            timeout = None if expiry is None else max(expiry - time.monotonic(), 0.0)
            for cmd in self._take_commands(block=idle, timeout=timeout):
                if cmd is _STOP:
                    with core.mutex:
                        aborted = core.abort_all()
                    items += [("abort", rid, _aborted(rid)) for rid in aborted]
                    self._post(self._deliver, items, True)
                    return
                with core.mutex:  # hold_prefix may run on another thread
                    result = cmd(core)
                if isinstance(result, list):  # deliveries; other results went through a future
                    items += result
            if expiry is not None:
                with core.mutex:
                    bm.expire_pins()
            if core.has_unfinished_requests():
                items += self._step(core)
            seq = core.block_manager.events.last_seq
            if items or seq != last_event:
                self._post(self._deliver, items, seq != last_event)
                items, last_event = [], seq

    def _take_commands(self, block: bool, timeout: float | None = None) -> list[Any]:
        cmds = []
        if block:
            try:
                cmds.append(self._commands.get(timeout=timeout))
            except queue.Empty:  # the timeout passed: a pin to expire
                return []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _step(self, core: LLMEngine) -> list[tuple[str, str, Any]]:
        items = []
        for out in core.step():
            if out.request_id in self._prefill_ids:
                self._prefill_ids.discard(out.request_id)
                items.append(("prefill", out.request_id, _prefill_result(core, out)))
            else:
                items.append(("output", out.request_id, out))
        return items

    def _abort_on_thread(self, core: LLMEngine, rid: str) -> list[tuple[str, str, Any]]:
        self._prefill_ids.discard(rid)
        return [("abort", rid, _aborted(rid))] if core.abort(rid) else []


class _Outputs:
    """One stream's outputs, from the loop's delivery callback to its one consumer
    (loop side only). asyncio.Queue did the same with an unfinished-task count, an
    Event and waiter lists touched on every put and get: once per token per request
    (issue 16 item 4).

    A diverted stream (`divert`) hands every unfinished output to its sink inside the
    delivery callback, with no task woken; the finished output or an error still
    goes to the consumer, which ends the stream as before."""

    __slots__ = ("_items", "_sink", "_waiter", "sink_failed")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future | None = None
        self._sink: Callable[[RequestOutput], None] | None = None
        self.sink_failed = False

    def divert(self, sink: Callable[[RequestOutput], None]) -> bool:
        if self._items:  # outputs the consumer has not taken yet would arrive out of order
            return False
        self._sink = sink
        return True

    def put_nowait(self, item: Any) -> None:
        sink = self._sink
        if sink is not None and not isinstance(item, BaseException) and not item.finished:
            try:
                sink(item)
                return
            except Exception as e:  # a consumer's bug: it ends this stream, not the delivery
                self._sink, self.sink_failed = None, True
                item = EngineError(f"a diverted stream's sink failed ({type(e).__name__})")
                item.__cause__ = e
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:  # cancelled while waiting
                    self._waiter = None
        return self._items.popleft()


def _start_stream(core: LLMEngine, rid: str, start: Callable[[LLMEngine], RequestOutput | None]):
    try:
        out = start(core)
    except EngineError as e:
        return [("error", rid, e)]
    return [("output", rid, out)] if out is not None else []


def _aborted(rid: str) -> RequestOutput:
    return RequestOutput(rid, [], finished=True, finish_reason=FinishReason.ABORT)


def _prefill_result(core: LLMEngine, out: RequestOutput) -> PrefillResult:
    return PrefillResult(
        request_id=out.request_id,
        first_token_id=out.token_ids[0],
        finished=out.finished,
        finish_reason=out.finish_reason,
        cached_prefix_tokens=out.num_cached_tokens,
        computed_tokens=out.num_computed_prompt_tokens,
        held=None if out.finished else core.held_kv(out.request_id),
    )

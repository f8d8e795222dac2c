"""Fake of `tensorrt_llm/executor/result.py` (1.3.0rc13): CompletionOutput and GenerationResult.

Faithful: names and shapes. `CompletionOutput.token_ids` is cumulative and
`token_ids_diff` holds the tokens new since the previous update; a streaming
result is an async iterator that yields *itself* after each update; `await
result` / `aresult()` wait for the end; `abort()` cancels (the last update then
has finish_reason "cancelled"); finish_reason is one of "stop", "length",
"timeout", "cancelled"; a failed request raises RequestError when read. For a
"generation_only" request the token_ids start with the first token the context
phase produced, as in the real streaming path.

Not faithful: updates come from the fake runtime (`_pdmesh_fake`), one per
engine step of pdmesh's torch engine; no detokenization (`text` stays "").
"""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .utils import RequestError

if TYPE_CHECKING:
    from ..disaggregated_params import DisaggregatedParams

FinishReason = Literal["stop", "length", "timeout", "cancelled"]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] | None = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list | None = field(default_factory=list)
    prompt_logprobs: list | None = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    generation_logits: Any = None
    disaggregated_params: DisaggregatedParams | None = None
    _last_token_ids_len: int = field(default=0, init=False, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]


@dataclass
class _Update:
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    disaggregated_params: DisaggregatedParams | None = None
    error: str | None = None


class GenerationResult:
    """The handle of one request; the fake runtime feeds it `_Update`s from its thread."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], streaming: bool, abort_fn):
        self._request_id = request_id
        self._prompt_token_ids = list(prompt_token_ids)
        self._streaming = streaming
        self._abort_fn = abort_fn
        self._aborted = False
        self._done = False
        self._outputs = [CompletionOutput(0)]
        self.disaggregated_params: DisaggregatedParams | None = None
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._aqueue: asyncio.Queue[_Update] | None = asyncio.Queue()
        except RuntimeError:  # no event loop: only the synchronous API works
            self._loop, self._aqueue = None, None
        self._queue: queue.Queue[_Update] = queue.Queue()

    @property
    def request_id(self) -> int:
        return self._request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._abort_fn(self._request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    # -- reading -------------------------------------------------------------------
    def result(self, timeout: float | None = None) -> GenerationResult:
        while not self._done:
            self._apply(self._queue.get(timeout=timeout))
        return self

    async def aresult(self) -> GenerationResult:
        while not self._done:
            await self._aresult_step()
        return self

    def __await__(self):
        return self.aresult().__await__()

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerationResult:
        if self._done:
            raise StopAsyncIteration
        await self._aresult_step()
        while not self._streaming and not self._done:
            await self._aresult_step()
        return self

    async def _aresult_step(self) -> None:
        if self._aqueue is None:
            raise RuntimeError("no event loop when the request was created: async reads are unavailable")
        self._apply(await self._aqueue.get())

    def _apply(self, update: _Update) -> None:
        if update.error is not None:
            self._done = True
            raise RequestError(update.error)
        out = self._outputs[0]
        out._last_token_ids_len = len(out.token_ids)
        out.token_ids.extend(update.token_ids)
        if update.disaggregated_params is not None:
            self.disaggregated_params = update.disaggregated_params
        out.disaggregated_params = self.disaggregated_params
        if update.finish_reason is not None:
            out.finish_reason = update.finish_reason
            self._done = True

    # -- fed by the fake runtime's thread ----------------------------------------------
    def _deliver(self, update: _Update) -> None:
        if self._loop is None:
            self._queue.put(update)
            return
        try:
            self._loop.call_soon_threadsafe(self._aqueue.put_nowait, update)
        except RuntimeError:  # the reader's loop is closed: nobody reads any more
            pass

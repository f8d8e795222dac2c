"""Fake workers for the router's service tests.

These are FAKES standing in for the decode and prefill services (the real
decode service, services/decode, is being built concurrently). They are real
grpc.aio servers on port 0 (MeshServer: health with the ready name, drain) that
follow decode.proto / worker.proto faithfully where the router can tell:

- Generate emits deterministic tokens, a function of (prompt, output position),
  so a migrated stream can be compared token for token with an undisturbed one;
  it honours resume_token_ids (continues at position len(resume), does not
  resend them, max_tokens counts them) and ends with a DecodeFinal whose usage
  counts computed tokens;
- it can be told to fail every request, to die mid-stream (the whole server
  stops), to stall, or to pause until released; it records every call, the
  deadline it got, and the calls that were cancelled;
- SubscribeKvEvents sends a snapshot then whatever the test pushes; Stats
  returns the worker's info and load.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc, worker_pb2
from services.common.server import MeshServer, ServerConfig
from services.model.hashing import block_hashes

BLOCK = 16
MODEL = "builtin-tiny"


def token_at(prompt: list[int] | tuple[int, ...], pos: int) -> int:
    """The fake model: output token at position `pos` for `prompt` (printable ASCII)."""
    return 33 + (sum(prompt) * 7 + len(prompt) * 3 + pos * 13) % 90


def expected_tokens(prompt, max_tokens: int) -> list[int]:
    return [token_at(prompt, i) for i in range(max_tokens)]


@dataclass
class KvFeed:
    """The KV-event side of a fake worker: a snapshot, then pushed messages."""

    worker_id: str
    snapshot_seq: int = 0
    chains: list[tuple[int | None, list[int]]] = field(default_factory=list)
    subscriptions: int = 0
    subscribed: asyncio.Event = field(default_factory=asyncio.Event)
    _queues: list[asyncio.Queue] = field(default_factory=list)

    def cache_prompt(self, tokens, block_size: int = BLOCK) -> list[int]:
        """Put a prompt's full blocks in the next snapshot; returns their hashes."""
        hashes = block_hashes(tokens, block_size)
        self.chains.append((None, hashes))
        return hashes

    def push_events(self, *events: common_pb2.KvEvent) -> None:
        msg = worker_pb2.SubscribeKvEventsResponse(
            worker_id=self.worker_id, events=worker_pb2.KvEventBatch(events=list(events))
        )
        for q in self._queues:
            q.put_nowait(msg)

    def fail_streams(self, code: grpc.StatusCode) -> None:
        for q in self._queues:
            q.put_nowait(code)

    async def stream(self, context):
        q: asyncio.Queue = asyncio.Queue()
        self._queues.append(q)
        self.subscriptions += 1
        self.subscribed.set()
        try:
            snap = worker_pb2.KvCacheSnapshot(seq=self.snapshot_seq)
            for parent, hashes in self.chains:
                stored = common_pb2.KvBlocksStored(block_hashes=hashes)
                if parent is not None:
                    stored.parent_hash = parent
                snap.chains.append(stored)
            yield worker_pb2.SubscribeKvEventsResponse(worker_id=self.worker_id, snapshot=snap)
            while True:
                item = await q.get()
                if isinstance(item, grpc.StatusCode):
                    await context.abort(item, "fake stream failure")
                yield item
        finally:
            self._queues.remove(q)


def stored_event(seq: int, hashes: list[int], parent: int | None = None) -> common_pb2.KvEvent:
    stored = common_pb2.KvBlocksStored(block_hashes=hashes)
    if parent is not None:
        stored.parent_hash = parent
    return common_pb2.KvEvent(seq=seq, stored=stored)


class FakeWorkerBase:
    ready_name = ""
    role = common_pb2.WORKER_ROLE_UNSPECIFIED

    def __init__(self, worker_id: str, block_size: int = BLOCK, model_id: str = MODEL):
        self.worker_id = worker_id
        self.block_size = block_size
        self.model_id = model_id
        self.kv = KvFeed(worker_id)
        self.load = common_pb2.WorkerLoad(free_blocks=1000)
        self.stats_calls = 0
        self.mesh: MeshServer | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.mesh = MeshServer(ServerConfig(host=host, port=port, drain_grace_s=1), self.ready_name)
        self._add(self.mesh.server)
        await self.mesh.start()
        await self.mesh.set_ready(True)
        return self.address

    def _add(self, server) -> None:
        raise NotImplementedError

    @property
    def address(self) -> str:
        assert self.mesh is not None
        return self.mesh.address

    def info(self) -> common_pb2.WorkerInfo:
        return common_pb2.WorkerInfo(
            worker_id=self.worker_id,
            address=self.address,
            role=self.role,
            model_id=self.model_id,
            block_size=self.block_size,
            accelerator=common_pb2.ACCELERATOR_KIND_CPU,
            kv_capacity_blocks=1000,
            engine_backend="fake",
            max_model_len=2048,
        )

    async def stop(self) -> None:
        if self.mesh is not None:
            await self.mesh.stop()

    async def SubscribeKvEvents(self, request, context):
        async for msg in self.kv.stream(context):
            yield msg

    async def Stats(self, request, context):
        self.stats_calls += 1
        return worker_pb2.StatsResponse(info=self.info(), load=self.load)


class FakePrefill(FakeWorkerBase, prefill_pb2_grpc.PrefillServiceServicer):
    ready_name = "pdmesh.v1.PrefillService"
    role = common_pb2.WORKER_ROLE_PREFILL

    def _add(self, server) -> None:
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(self, server)


class FakeDecode(FakeWorkerBase, decode_pb2_grpc.DecodeServiceServicer):
    ready_name = "pdmesh.v1.DecodeService"
    role = common_pb2.WORKER_ROLE_DECODE

    def __init__(self, worker_id: str, block_size: int = BLOCK, model_id: str = MODEL):
        super().__init__(worker_id, block_size, model_id)
        self.calls: list[decode_pb2.DecodeServiceGenerateRequest] = []
        self.deadlines: list[float | None] = []
        self.cancelled: list[str] = []
        self.cancelled_event = asyncio.Event()
        self.called = asyncio.Event()
        self.fail_with: grpc.StatusCode | None = None
        self.die_after: int | None = None  # output position at which the server stops
        self.stall_after: int | None = None  # output position at which the stream hangs
        self.pause_after: int | None = None  # output position at which it waits for `resume`
        self.reached = asyncio.Event()  # die/stall/pause point reached
        self.resume = asyncio.Event()
        self.tokens_per_message = 1
        self.script: list[int] | None = None  # tokens by position instead of token_at
        self.finish_reason = common_pb2.FINISH_REASON_LENGTH

    def _add(self, server) -> None:
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(self, server)

    def _token(self, prompt, pos: int) -> int:
        return self.script[pos] if self.script is not None else token_at(prompt, pos)

    def _msg(self, ids) -> decode_pb2.DecodeServiceGenerateResponse:
        return decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=ids))

    async def _halt(self, pos: int) -> None:
        """Pause, then die or stall, at output position `pos` if told to."""
        if self.pause_after is not None and pos >= self.pause_after:
            self.reached.set()
            await self.resume.wait()
        if self.die_after is not None and pos >= self.die_after:
            self.reached.set()
            asyncio.get_running_loop().create_task(self.stop())
            await asyncio.Event().wait()  # cancelled by the stopping server
        if self.stall_after is not None and pos >= self.stall_after:
            self.reached.set()
            await asyncio.Event().wait()  # until the caller cancels

    async def Generate(self, request, context):
        self.calls.append(request)
        self.deadlines.append(context.time_remaining())
        self.called.set()
        if self.fail_with is not None:
            await context.abort(self.fail_with, f"fake failure on {self.worker_id}")
        prompt = list(request.prompt_token_ids)
        resume = list(request.resume_token_ids)
        pos, total = len(resume), request.sampling.max_tokens
        try:
            while pos < total:
                await self._halt(pos)
                n = min(self.tokens_per_message, total - pos)
                yield self._msg([self._token(prompt, pos + i) for i in range(n)])
                pos += n
            generated = total - len(resume)
            yield decode_pb2.DecodeServiceGenerateResponse(
                final=decode_pb2.DecodeFinal(
                    finish_reason=self.finish_reason,
                    usage=common_pb2.Usage(
                        prompt_tokens=len(prompt),
                        completion_tokens=total,
                        computed_tokens=len(prompt) + len(resume) + generated,
                    ),
                    prefill_path="local",
                    disagg_reason="short_prompt",
                )
            )
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: cancelled at a yield
            self.cancelled.append(request.request_id)
            self.cancelled_event.set()
            raise

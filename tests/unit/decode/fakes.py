"""Stand-ins for what a DecodeWorker talks to on the remote path, for its unit tests.

- `FakePrefill` is a FAKE of the prefill service (services/prefill): a real
  grpc.aio server on loopback port 0 in this process, backed by a real tiny
  TorchEngine whose blocks it holds per handle until `Release`, as the real one
  does under a lease. It follows prefill.proto where the decode worker can tell
  (handle, first token, finished, counts) and can be told to fail before
  answering, to answer with a handle that does not cover the request, or to run
  a hook before it answers. It has no lease timer: a test that loses a Release
  sees the blocks still held, which is the point.
- `FakeTransport` is a FAKE of a KvTransport (NIXL / the gRPC byte stream, whose
  own tests are in tests/unit/kvtransfer): it copies the holder's blocks into
  the decode engine in-process, under `KvTransport.pull`'s failure contract
  (`on_failure()` once, then raise), and can fail mid-pull or hang. A completed
  pull frees the holder's blocks, as the holder side of a real transport does
  when it sees the read complete.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc

from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.transport import BlockHandle, TransferStats
from pdmesh.v1 import prefill_pb2, prefill_pb2_grpc
from services.common.server import MeshServer, ServerConfig
from services.common.validation import RequestLimits
from services.engine.api import Engine, EngineRequest
from services.model.sampling import FINISH_TO_PROTO, check_sampling


class FakePrefill(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, engine: Engine, worker_id: str = "prefill-0"):
        self.engine = engine
        self.worker_id = worker_id
        self.held: dict[str, str] = {}  # handle id -> engine request id
        self.fail_with: grpc.StatusCode | None = None  # Prefill fails before any handle exists
        self.wrong_handle = False  # the handle covers one token less than asked
        self.before_answer: Callable[[], Awaitable[None]] | None = None
        self.prefills = 0
        self.releases: list[str] = []
        self.mesh: MeshServer | None = None
        self._ids = itertools.count()

    async def start(self) -> str:
        self.mesh = MeshServer(
            ServerConfig(host="127.0.0.1", port=0, drain_grace_s=1), "pdmesh.v1.PrefillService"
        )
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(self, self.mesh.server)
        await self.mesh.start()
        await self.mesh.set_ready(True)
        return self.mesh.address

    async def stop(self) -> None:
        if self.mesh is not None:
            await self.mesh.stop()

    def holds_nothing(self) -> bool:
        s = self.engine.stats()
        return not self.held and s.held_blocks == 0 and s.free_blocks == s.total_blocks

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        self.prefills += 1
        if self.before_answer is not None:
            await self.before_answer()
        if self.fail_with is not None:
            await context.abort(self.fail_with, "injected prefill failure")
        ids = list(request.prompt_token_ids)
        cut = len(ids) - request.output_position
        sampling = check_sampling(
            request.sampling, RequestLimits(), self.engine.info.vocab_size, assign_seed=False
        )
        req = EngineRequest(
            f"{request.request_id}#{next(self._ids)}", tuple(ids[:cut]), sampling, tuple(ids[cut:])
        )
        result = await self.engine.prefill(req)
        resp = prefill_pb2.PrefillResponse(
            first_token_id=result.first_token_id,
            cached_prefix_tokens=result.cached_prefix_tokens,
            computed_tokens=result.computed_tokens,
            finished=result.finished,
            finish_reason=FINISH_TO_PROTO[result.finish_reason],
        )
        if result.finished or result.held is None:
            return resp
        held = result.held
        self.held[req.request_id] = req.request_id
        handle = BlockHandle(
            handle_id=req.request_id,
            agent_name=f"{self.worker_id}-agent",
            layout=held.layout,
            block_ids=held.block_ids,
            num_tokens=held.num_tokens - (1 if self.wrong_handle else 0),
            issued_to=request.requester_id,
        )
        resp.handle.CopyFrom(handle.to_proto(model_id=self.engine.info.model_id))
        return resp

    async def Release(self, request: prefill_pb2.ReleaseRequest, context) -> prefill_pb2.ReleaseResponse:
        self.releases.append(request.handle_id)
        return prefill_pb2.ReleaseResponse(released=self.free(request.handle_id))

    def free(self, handle_id: str) -> bool:
        rid = self.held.pop(handle_id, None)
        return rid is not None and self.engine.release(rid)


class FakeTransport:
    kind = "fake"

    def __init__(self, holder: FakePrefill, dest: Engine, agent_name: str = "decode-0-agent"):
        self.holder = holder
        self.source = holder.engine
        self.dest = dest
        self.agent_name = agent_name
        self.layout = dest.info.layout
        self.fail_after_blocks: int | None = None  # copy this many blocks, then the holder "dies"
        self.hang = False  # never finish (until cancelled or the deadline)
        self.started = asyncio.Event()
        self.pulls = 0
        self.failures = 0

    async def pull(
        self,
        handle: BlockHandle,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        *,
        deadline_s: float,
        on_failure: Callable[[], None],
    ) -> TransferStats:
        self.pulls += 1
        self.started.set()
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                n = len(src_block_ids) if self.fail_after_blocks is None else self.fail_after_blocks
                if n:
                    kv = await self.source.export_blocks(src_block_ids[:n])
                    await self.dest.import_blocks(dst_block_ids[:n], kv, handle.layout)
                if self.fail_after_blocks is not None:
                    raise KvTransferFailed(FailureKind.PEER_DEAD, "the holder went away mid-pull")
                if self.hang:
                    await asyncio.Event().wait()
        except (KvTransferFailed, asyncio.CancelledError):
            self.failures += 1
            on_failure()
            raise
        except TimeoutError as e:
            self.failures += 1
            on_failure()
            raise KvTransferFailed(FailureKind.TIMEOUT, f"pull of {handle.handle_id!r} timed out") from e
        self.holder.free(handle.handle_id)  # the read completed: the holder's lease ends
        nbytes = kv.numel() * kv.element_size()
        return TransferStats("fake", nbytes, time.perf_counter() - t0, len(src_block_ids))

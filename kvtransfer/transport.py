"""The `KvTransport` protocol and what every transport shares.

Holder side (prefill worker): the transport publishes the pool (NIXL registers
it once and announces its agent) and `attach_source(leases)` serves reads of
leased blocks; the gRPC bytes are served by `KvSourceServicer`, which the holder
mounts on its gRPC server whatever its own transport is.

Receiver side (decode worker): `pull(handle, src_block_ids, dst_block_ids,
deadline_s=..., on_failure=...)` moves the bytes of the holder's `src` blocks
straight into the receiver's `dst` blocks, then checks them against the
holder's per-block digests in the handle (`PulledBlockCheck`, issue 13): a
mismatch, or a handle without digests where they are required, is
`KvTransferFailed(INTEGRITY)` and takes the failure path below, so the caller
never receives, commits or caches unverified blocks.

Who frees what when a pull fails:
  - receiver: `pull` calls `on_failure()` exactly once, after it has made sure
    nothing can still write into `dst` (a NIXL READ is cancelled and its handle
    released first), and only then raises `KvTransferFailed`. The caller does
    not free `dst` itself; on success it owns the filled blocks. The single
    exception is a NIXL READ that cannot be cancelled: its blocks are
    quarantined (never freed; logged, counted) rather than reused under a
    writer. Cancelling the pull (CancelledError) follows the same path.
  - holder: its lease frees its blocks (released on a completed pull,
    otherwise at expiry or when the receiver's agent is known dead).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import structlog

from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.layout import KvLayout, LayoutMismatch, layout_from_proto, layout_to_proto

if TYPE_CHECKING:
    from kvtransfer.leases import LeaseManager
    from kvtransfer.pool import PoolView
    from pdmesh.v1 import common_pb2

log = structlog.get_logger()


@dataclass(frozen=True)
class BlockHandle:
    """What a receiver needs to pull KV: `NixlBlockDescriptors` plus the ids of
    the `KvHandle` that carries it."""

    handle_id: str
    agent_name: str  # holder's NIXL agent
    layout: KvLayout
    block_ids: tuple[int, ...]  # holder's blocks, in token order
    num_tokens: int
    kv_source_address: str = ""  # holder's KvSourceService (gRPC transport)
    issued_to: str = ""  # worker id allowed to read
    lease_expires_unix_ms: int = 0  # holder's wall clock; 0 = unknown
    # Holder's digest of each block, in block_ids order (kvtransfer.digest); b"" = none.
    block_digests: bytes = b""
    digest_algorithm: str = ""

    @classmethod
    def from_proto(cls, handle: common_pb2.KvHandle) -> BlockHandle:
        if handle.WhichOneof("payload") != "nixl_blocks":
            raise KvTransferFailed(
                FailureKind.INVALID, f"KV handle {handle.handle_id!r} carries no block descriptors"
            )
        d = handle.nixl_blocks
        try:
            layout = layout_from_proto(d.layout)
        except LayoutMismatch as e:
            raise KvTransferFailed(FailureKind.LAYOUT_MISMATCH, str(e)) from e
        return cls(
            handle_id=handle.handle_id,
            agent_name=d.agent_name,
            layout=layout,
            block_ids=tuple(d.block_ids),
            num_tokens=d.num_tokens,
            kv_source_address=d.kv_source_address,
            issued_to=handle.issued_to,
            lease_expires_unix_ms=handle.lease_expires_unix_ms,
            block_digests=bytes(d.block_digests),
            digest_algorithm=d.digest_algorithm,
        )

    def to_proto(self, model_id: str = "") -> common_pb2.KvHandle:
        from pdmesh.v1 import common_pb2

        return common_pb2.KvHandle(
            handle_id=self.handle_id,
            issued_to=self.issued_to,
            lease_expires_unix_ms=self.lease_expires_unix_ms,
            model_id=model_id,
            num_tokens=self.num_tokens,
            nixl_blocks=common_pb2.NixlBlockDescriptors(
                agent_name=self.agent_name,
                layout=layout_to_proto(self.layout),
                block_ids=list(self.block_ids),
                num_tokens=self.num_tokens,
                kv_source_address=self.kv_source_address,
                block_digests=self.block_digests,
                digest_algorithm=self.digest_algorithm,
            ),
        )

    def lease_remaining_s(self, wall_clock: Callable[[], float] = time.time) -> float | None:
        if not self.lease_expires_unix_ms:
            return None
        return self.lease_expires_unix_ms / 1000.0 - wall_clock()


@dataclass(frozen=True)
class TransferStats:
    transport: str
    bytes: int
    seconds: float
    blocks: int

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class TransferReporter(Protocol):
    def record(
        self,
        *,
        transport: str,
        source_agent: str,
        target_agent: str,
        nbytes: int,
        seconds: float,
        error: str = "",
    ) -> None: ...


class KvTransport(Protocol):
    """Moves KV blocks between two pools of the same layout."""

    kind: str  # "nixl" or "grpc"
    agent_name: str
    layout: KvLayout

    async def start(self, kv_source_address: str = "") -> None:
        """Publish this pool (register memory, announce the agent)."""
        ...

    def attach_source(self, leases: LeaseManager) -> None:
        """Serve reads of `leases`' blocks (holder side); completions release them."""
        ...

    async def pull(
        self,
        handle: BlockHandle,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        *,
        deadline_s: float,
        on_failure: Callable[[], None],
    ) -> TransferStats:
        """Copy the holder's `src_block_ids` (a subset of `handle.block_ids`, e.g.
        the suffix the receiver has not cached) into this pool's `dst_block_ids`,
        pairwise, within `deadline_s`. On any failure `on_failure()` has run
        (see the module docstring) and `KvTransferFailed` is raised."""
        ...

    async def close(self) -> None: ...


def check_pull(
    pool: PoolView,
    handle: BlockHandle,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    deadline_s: float,
) -> None:
    """Checks every transport makes before moving a byte."""
    try:
        pool.layout.check_compatible(handle.layout)
    except LayoutMismatch as e:
        raise KvTransferFailed(FailureKind.LAYOUT_MISMATCH, f"handle {handle.handle_id!r}: {e}") from e
    if deadline_s <= 0:
        raise KvTransferFailed(FailureKind.TIMEOUT, f"deadline {deadline_s:.3f} s has already passed")
    if len(src_block_ids) != len(dst_block_ids):
        raise KvTransferFailed(
            FailureKind.INVALID,
            f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks",
        )
    if not src_block_ids:
        raise KvTransferFailed(FailureKind.INVALID, "nothing to pull (no blocks)")
    if not set(src_block_ids) <= set(handle.block_ids):
        raise KvTransferFailed(
            FailureKind.INVALID, f"source blocks are not all in handle {handle.handle_id!r}'s blocks"
        )
    for b in dst_block_ids:
        if not 0 <= b < pool.num_blocks:
            raise KvTransferFailed(
                FailureKind.INVALID, f"destination block {b} not in [0, {pool.num_blocks})"
            )
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise KvTransferFailed(FailureKind.INVALID, "destination blocks repeat")


class PulledBlockCheck:
    """The receiver's integrity check of one pull: the bytes in `dst` must match
    the holder's digests of the `src` blocks they came from. `require=False`
    lets a handle without digests through (tests and tools that build handles
    by hand); the services always require them (`create_transport`)."""

    def __init__(self, pool: PoolView, require: bool, threads: int | None = None):
        from kvtransfer.digest import BlockHasher

        self.pool = pool
        self.require = require
        self.hasher = BlockHasher(pool, threads)
        self.failures = 0  # pulls whose bytes did not match (or came without digests)

    def expected(self, handle: BlockHandle, src_block_ids: Sequence[int]) -> list[bytes] | None:
        """The digests the `src` blocks must have; None = nothing to check.
        Called before the move, so a handle that cannot pass costs no transfer."""
        from kvtransfer.digest import split_digests

        if not handle.block_digests and not handle.digest_algorithm:
            if self.require:
                self.failures += 1
                raise KvTransferFailed(
                    FailureKind.INTEGRITY, f"handle {handle.handle_id!r} carries no block digests"
                )
            return None
        try:
            per_block = split_digests(
                handle.block_digests, handle.digest_algorithm, len(handle.block_ids), handle.handle_id
            )
        except KvTransferFailed:
            self.failures += 1
            raise
        index = {b: i for i, b in enumerate(handle.block_ids)}
        return [per_block[index[b]] for b in src_block_ids if b in index]

    async def verify(self, handle: BlockHandle, expected: list[bytes] | None, dst: Sequence[int]) -> None:
        if expected is None:
            return
        try:
            await self.hasher.verify_blocks_async(expected, dst, handle.handle_id)
        except KvTransferFailed:
            self.failures += 1
            log.error("kv_pull_integrity_failed", handle_id=handle.handle_id, agent=handle.agent_name)
            raise


async def guarded_pull(
    kind: str,
    agent_name: str,
    handle: BlockHandle,
    nblocks: int,
    block_bytes: int,
    move: Callable[[], Awaitable[None]],
    on_failure: Callable[[], None],
    reporter: TransferReporter | None,
    verify: Callable[[], Awaitable[None]] | None = None,
) -> TransferStats:
    """Run `move()` then `verify()` under the failure contract of `KvTransport.pull`.

    `move` checks the arguments and moves the bytes. When it raises, nothing
    may be in flight into the destination any more, so `on_failure` can free
    it; a move that could not make sure of that raises `Quarantined` instead,
    and the destination is deliberately not freed. `verify` (the integrity
    check) runs after a complete move; when it raises, the destination is
    freed like after any other failure, so unverified bytes never reach the
    caller, its sequence or its prefix cache.
    """
    t0 = time.perf_counter()
    error = ""
    try:
        await move()
        if verify is not None:
            await verify()
    except Quarantined as q:
        error = q.failure.reason
        log.error(
            "kv_pull_blocks_quarantined", handle_id=handle.handle_id, transport=kind, error=str(q.failure)
        )
        raise q.failure from q
    except (Exception, asyncio.CancelledError) as e:
        failure = _as_failure(e, handle)
        error = failure.reason
        try:
            on_failure()
        except Exception:  # the caller's free must not mask the transfer error
            log.exception("kv_pull_on_failure_raised", handle_id=handle.handle_id)
        log.warning("kv_pull_failed", handle_id=handle.handle_id, transport=kind, error=str(failure))
        if isinstance(e, asyncio.CancelledError | KvTransferFailed):
            raise
        raise failure from e
    finally:
        seconds = time.perf_counter() - t0
        if reporter is not None:
            reporter.record(
                transport=kind,
                source_agent=handle.agent_name,
                target_agent=agent_name,
                nbytes=0 if error else nblocks * block_bytes,
                seconds=seconds,
                error=error,
            )
    return TransferStats(transport=kind, bytes=nblocks * block_bytes, seconds=seconds, blocks=nblocks)


class Quarantined(Exception):
    """Raised by a transport's move when the destination could not be made safe."""

    def __init__(self, failure: KvTransferFailed):
        super().__init__(str(failure))
        self.failure = failure


def _as_failure(e: BaseException, handle: BlockHandle) -> KvTransferFailed:
    if isinstance(e, KvTransferFailed):
        return e
    if isinstance(e, asyncio.CancelledError):
        return KvTransferFailed(FailureKind.CANCELLED, f"pull of {handle.handle_id!r} was cancelled")
    if isinstance(e, TimeoutError):
        return KvTransferFailed(FailureKind.TIMEOUT, f"pull of {handle.handle_id!r} timed out")
    log.error("kv_pull_unexpected_error", handle_id=handle.handle_id, exc_info=e)
    return KvTransferFailed(FailureKind.TRANSPORT, f"pull of {handle.handle_id!r}: {type(e).__name__}: {e}")

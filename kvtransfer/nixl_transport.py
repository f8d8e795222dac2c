"""KV over NIXL (UCX backend): one-sided READs from the holder's pool into ours.

Holder: `start()` creates the agent, registers the whole pool once (DRAM on
CPU, VRAM on GPU) and announces the agent (metadata, pool region, layout) to
the KV-transfer service. `attach_source(leases)` starts a loop that drains
NIXL notifications: a receiver's completed READ carries `pdmesh-kv:<handle>`,
which marks that lease pulled and releases it.

Receiver: `pull` looks the holder up in the `AgentDirectory`, loads its
metadata into our agent and prepares its block descriptors once per holder
incarnation (`prep_xfer_dlist`, one descriptor per block; NIXL merges adjacent
ones), then posts one prepped READ straight into the destination blocks and
polls it to completion. A holder that restarted under the same name is noticed
by its incarnation (or a failed READ) and reloaded: stale metadata costs at
most one failed attempt.

The agent and its one thread are `NixlAgent`'s. Without a progress thread (the
default: NIXL's spins a core) the holder's worker moves only when polled, and a
small READ completes only once the holder has progressed, so the holder polls
every `notif_poll_s` while it holds leases, every `idle_poll_s` otherwise, and
at once when a lease is issued. On failure or timeout the READ is released
(NIXL cancels it) before `on_failure` frees the destination; see
`kvtransfer.transport`.

A NIXL READ cannot be pinned on the holder: if the holder's lease ended
mid-READ its blocks could be reused under us. The pull therefore ends at the
lease's end minus `lease_margin_s` at the latest (the handle carries it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from kvtransfer.agents import AgentDirectory, AgentRecord
from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.layout import LayoutMismatch
from kvtransfer.leases import LeaseManager
from kvtransfer.nixl_agent import NixlAgent
from kvtransfer.pool import PoolView
from kvtransfer.transport import (
    BlockHandle,
    PulledBlockCheck,
    Quarantined,
    TransferReporter,
    TransferStats,
    check_pull,
    guarded_pull,
)

log = structlog.get_logger()

NOTIF_PREFIX = b"pdmesh-kv:"


@dataclass(frozen=True)
class NixlConfig:
    backends: tuple[str, ...] = field(default=("UCX",), metadata={"help": "NIXL backends to create"})
    # Off by default: NIXL's progress thread busy-polls a whole core even when
    # idle (its delay is fixed at 0). On CPU the UCX CMA copy runs inside
    # transfer() and the holder's notification loop progresses the worker, so
    # nothing needs it; RDMA READs are one-sided. Turn it on for TCP-only links,
    # where a holder must progress promptly to serve a READ.
    progress_thread: bool = field(
        default=False, metadata={"help": "run NIXL's progress thread (costs a busy core per agent)"}
    )
    num_threads: int = field(default=0, metadata={"help": "UCX backend worker threads (0 = NIXL default)"})
    # Without a progress thread a READ from us (and its completion notification)
    # moves only when we poll, so poll often while leases are held (a READ may be
    # coming) and rarely when none are.
    notif_poll_s: float = field(
        default=0.001, metadata={"help": "holder: seconds between NIXL polls while leases are held"}
    )
    idle_poll_s: float = field(
        default=0.02, metadata={"help": "holder: seconds between NIXL polls when idle"}
    )
    xfer_poll_max_s: float = field(
        default=0.001, metadata={"help": "receiver: longest wait between READ polls"}
    )
    liveness_check_s: float = field(
        default=1.0, metadata={"help": "receiver: ask the directory whether the holder lives this often"}
    )
    lease_margin_s: float = field(
        default=0.25, metadata={"help": "receiver: finish a READ this long before the holder's lease ends"}
    )
    cancel_grace_s: float = field(
        default=2.0, metadata={"help": "receiver: wait this long for a READ that refuses to cancel"}
    )

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("NixlConfig.backends must name at least one backend")
        for name in ("notif_poll_s", "idle_poll_s", "xfer_poll_max_s", "liveness_check_s", "cancel_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"NixlConfig.{name} must be > 0")


@dataclass
class _Peer:
    record: AgentRecord  # the incarnation loaded into our agent


class NixlTransport:
    kind = "nixl"

    def __init__(
        self,
        agent_name: str,
        pool: PoolView,
        directory: AgentDirectory,
        *,
        worker_id: str = "",
        config: NixlConfig | None = None,
        reporter: TransferReporter | None = None,
        require_digests: bool = False,
    ):
        self.agent_name = agent_name
        self.pool = pool
        self.layout = pool.layout
        self.directory = directory
        self.worker_id = worker_id
        self.config = config or NixlConfig()
        self.reporter = reporter
        self.agent = NixlAgent(
            agent_name,
            backends=self.config.backends,
            progress_thread=self.config.progress_thread,
            num_threads=self.config.num_threads,
        )
        self._peers: dict[str, _Peer] = {}
        self._load_lock = asyncio.Lock()  # one (re)load of a holder at a time
        self._leases: LeaseManager | None = None
        self._notif_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # set when a lease is issued: poll now
        # Leases this receiver completed: the holder released them on our
        # notification, so reading them again would read reused blocks. Keyed by
        # the lease (holder, handle id, lease end), as a handle id may be reused.
        self._completed: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self.integrity = PulledBlockCheck(pool, require_digests)
        self.reads_in_flight = 0
        self.quarantined_blocks = 0
        self.reloads = 0

    @property
    def loaded_agents(self) -> list[str]:
        """Holders whose metadata is loaded into our agent."""
        return sorted(self._peers)

    # -- both sides ----------------------------------------------------------------
    async def start(self, kv_source_address: str = "") -> None:
        metadata = await self.agent.start(self.pool)
        record = AgentRecord(
            name=self.agent_name,
            metadata=metadata,
            layout=self.layout,
            num_blocks=self.pool.num_blocks,
            address=self.pool.base_address,
            length=self.pool.nbytes,
            device_id=self.pool.device_id,
            memory_type=self.pool.memory_type,
            worker_id=self.worker_id,
            kv_source_address=kv_source_address,
        )
        await self.directory.register(record)
        self.directory.start_heartbeats()

    def attach_source(self, leases: LeaseManager) -> None:
        self._leases = leases
        leases.add_issue_listener(lambda _lease: self._wake.set())
        if self._notif_task is None:
            self._notif_task = asyncio.get_running_loop().create_task(self._notif_loop(), name="nixl-notifs")

    async def _notif_loop(self) -> None:
        while True:
            notifs = await self.agent.call(self.agent.notifications)
            for sender, messages in notifs.items():
                for msg in messages:
                    self._on_notif(sender, msg)
            busy = self._leases is not None and self._leases.held > 0
            self._wake.clear()
            with contextlib.suppress(TimeoutError):  # a polling period, not synchronisation
                await asyncio.wait_for(
                    self._wake.wait(), self.config.notif_poll_s if busy else self.config.idle_poll_s
                )

    def _on_notif(self, sender: str, msg: bytes) -> None:
        if not msg.startswith(NOTIF_PREFIX) or self._leases is None:
            log.debug("nixl_notif_ignored", sender=sender, size=len(msg))
            return
        handle_id = msg[len(NOTIF_PREFIX) :].decode(errors="replace")
        try:
            lease = self._leases.get(handle_id)
        except KvTransferFailed:
            return  # already released (e.g. by PrefillService.Release) or expired
        if lease.requester_agent and lease.requester_agent != sender:
            log.warning("nixl_notif_from_other_agent", handle_id=handle_id, sender=sender)
            return
        self._leases.mark_pulled(handle_id)
        self._leases.release(handle_id)

    # -- receiver --------------------------------------------------------------------
    async def pull(
        self,
        handle: BlockHandle,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        *,
        deadline_s: float,
        on_failure: Callable[[], None],
    ) -> TransferStats:
        expected: list[list[bytes] | None] = []

        async def move() -> None:
            expected.append(self.integrity.expected(handle, src_block_ids))  # before any byte moves
            await self._move(handle, list(src_block_ids), list(dst_block_ids), deadline_s)

        return await guarded_pull(
            self.kind,
            self.agent_name,
            handle,
            len(src_block_ids),
            self.pool.block_bytes,
            move,
            on_failure,
            self.reporter,
            lambda: self.integrity.verify(handle, expected[0], dst_block_ids),
        )

    async def _move(self, handle: BlockHandle, src: list[int], dst: list[int], deadline_s: float) -> None:
        remaining = handle.lease_remaining_s()
        if remaining is not None:
            if remaining <= self.config.lease_margin_s:
                raise KvTransferFailed(
                    FailureKind.STALE_HANDLE,
                    f"the lease of {handle.handle_id!r} ends in {remaining:.3f} s: too late to READ safely",
                )
            deadline_s = min(deadline_s, remaining - self.config.lease_margin_s)
        check_pull(self.pool, handle, src, dst, deadline_s)
        lease_key = (handle.agent_name, handle.handle_id, handle.lease_expires_unix_ms)
        if handle.lease_expires_unix_ms and lease_key in self._completed:
            raise KvTransferFailed(
                FailureKind.STALE_HANDLE, f"KV handle {handle.handle_id!r} was already pulled and released"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        peer = await self._peer(handle, refresh=False)
        try:
            await self._read(peer, handle, src, dst, deadline)
        except KvTransferFailed as e:
            if e.kind != FailureKind.PEER_DEAD or loop.time() >= deadline:
                raise
            # Maybe our metadata is stale (the holder restarted): retry once if it did.
            fresh = await self._peer(handle, refresh=True)
            if fresh.record.incarnation == peer.record.incarnation:
                raise
            log.info("nixl_retry_after_holder_restart", agent=handle.agent_name, handle_id=handle.handle_id)
            await self._read(fresh, handle, src, dst, deadline)
        self._completed[lease_key] = None
        while len(self._completed) > 4096:
            self._completed.popitem(last=False)

    async def _peer(self, handle: BlockHandle, *, refresh: bool) -> _Peer:
        """The holder's loaded agent, (re)loaded when its incarnation changed."""
        async with self._load_lock:
            return await self._peer_locked(handle, refresh=refresh)

    async def _peer_locked(self, handle: BlockHandle, *, refresh: bool) -> _Peer:
        name = handle.agent_name
        if not name:
            raise KvTransferFailed(FailureKind.INVALID, f"handle {handle.handle_id!r} names no NIXL agent")
        loaded = self._peers.get(name)
        try:
            record = await self.directory.get(name, refresh=refresh)
        except KvTransferFailed as e:
            if e.kind == FailureKind.UNKNOWN_AGENT and loaded is not None:
                # Gone from the mesh: drop it from our agent too (a restarted worker
                # comes back under a new name, so nothing else would).
                del self._peers[name]
                await self.agent.call(self.agent.unload, name)
            raise
        if handle.kv_source_address not in ("", record.kv_source_address):
            # The holder moved (restarted) since we cached it, or the handle is older than the holder.
            record = await self.directory.get(name, refresh=True)
            if handle.kv_source_address != record.kv_source_address:
                raise KvTransferFailed(
                    FailureKind.STALE_HANDLE,
                    f"KV handle {handle.handle_id!r} was issued by an earlier incarnation of {name!r} "
                    f"(at {handle.kv_source_address}, now {record.kv_source_address})",
                )
        if not record.metadata:
            raise KvTransferFailed(
                FailureKind.UNKNOWN_AGENT, f"KV agent {name!r} has no NIXL metadata (gRPC only)"
            )
        try:
            self.layout.check_compatible(record.layout)
        except LayoutMismatch as e:
            raise KvTransferFailed(FailureKind.LAYOUT_MISMATCH, f"KV agent {name!r}: {e}") from e
        if loaded is not None and loaded.record.incarnation == record.incarnation:
            return loaded
        if loaded is not None:
            await self.agent.call(self.agent.unload, name)
            self.reloads += 1
        try:
            loaded_name = await self.agent.call(
                self.agent.load, record.metadata, record.block_regions(), record.memory_type
            )
        except self.agent.errors as e:
            raise KvTransferFailed(FailureKind.PEER_DEAD, f"cannot load KV agent {name!r}: {e!r}") from e
        if loaded_name != name:
            await self.agent.call(self.agent.unload, loaded_name)
            raise KvTransferFailed(
                FailureKind.UNKNOWN_AGENT, f"the metadata registered as {name!r} is agent {loaded_name!r}"
            )
        peer = _Peer(record)
        self._peers[name] = peer
        return peer

    async def _read(
        self, peer: _Peer, handle: BlockHandle, src: list[int], dst: list[int], deadline: float
    ) -> None:
        bad = [b for b in src if b >= peer.record.num_blocks]
        if bad:
            raise KvTransferFailed(
                FailureKind.INVALID,
                f"blocks {bad[:4]} are outside {handle.agent_name!r}'s {peer.record.num_blocks}",
            )
        loop = asyncio.get_running_loop()
        name = handle.agent_name
        notif = NOTIF_PREFIX + handle.handle_id.encode()
        try:
            xfer, state = await self.agent.call(self.agent.post, name, src, dst, notif)
        except self.agent.errors as e:
            raise self._failure(e, name) from e
        self.reads_in_flight += 1
        try:
            delay = 0.0
            next_check = loop.time() + self.config.liveness_check_s
            while state == "PROC":
                if loop.time() >= deadline:
                    raise KvTransferFailed(
                        FailureKind.TIMEOUT, f"NIXL READ of {handle.handle_id!r} missed its deadline"
                    )
                if loop.time() >= next_check:
                    next_check = loop.time() + self.config.liveness_check_s
                    await self._check_holder(peer, name)
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 5e-5), self.config.xfer_poll_max_s)
                xfer, state = await self.agent.call(self.agent.poll, xfer)
            if isinstance(state, BaseException):
                raise self._failure(state, name) from state
            if state != "DONE":
                raise KvTransferFailed(
                    FailureKind.PEER_DEAD, f"NIXL READ of {handle.handle_id!r} ended in {state}"
                )
        finally:
            try:
                if xfer is not None:
                    await self._release(xfer, handle, len(dst))
            finally:
                self.reads_in_flight -= 1

    async def _check_holder(self, peer: _Peer, name: str) -> None:
        try:
            record = await self.directory.get(name, refresh=True)
        except KvTransferFailed as e:
            if e.kind == FailureKind.UNKNOWN_AGENT:
                raise KvTransferFailed(
                    FailureKind.PEER_DEAD, f"KV agent {name!r} is no longer registered"
                ) from e
            return  # directory unreachable: the deadline still bounds us
        if record.incarnation != peer.record.incarnation:
            raise KvTransferFailed(FailureKind.PEER_DEAD, f"KV agent {name!r} restarted during the READ")

    def _failure(self, e: BaseException, name: str) -> KvTransferFailed:
        kind = FailureKind.PEER_DEAD if isinstance(e, self.agent.disconnect_error) else FailureKind.TRANSPORT
        return KvTransferFailed(kind, f"NIXL READ from {name!r}: {type(e).__name__}: {e}")

    async def _release(self, xfer: Any, handle: BlockHandle, nblocks: int) -> None:
        """Release the READ (NIXL cancels it if still active); if it cannot be
        cancelled, wait up to cancel_grace_s for it to end, else quarantine."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.config.cancel_grace_s
        while True:
            try:
                await self.agent.call(self.agent.release, xfer)
                return
            except self.agent.errors as e:
                if loop.time() >= give_up:
                    self.quarantined_blocks += nblocks
                    raise Quarantined(
                        KvTransferFailed(
                            FailureKind.TRANSPORT, f"NIXL READ of {handle.handle_id!r} would not stop: {e!r}"
                        )
                    ) from e
                await asyncio.sleep(0.01)

    async def close(self) -> None:
        self.integrity.hasher.close()
        if self._notif_task is not None:
            self._notif_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._notif_task
            self._notif_task = None
        await self.directory.deregister()
        self._peers.clear()
        await self.agent.close()

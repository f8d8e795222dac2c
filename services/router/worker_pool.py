"""Connections to workers: one channel each, and the loops that keep the router's view fresh.

`WorkerPool` owns one `WorkerConnection` per worker address. A connection owns
its gRPC channel (TLS with the router's `TlsConfig`: a worker whose certificate
the mesh CA did not sign fails every probe and never joins) and stubs and
three loops:

- health: grpc.health.v1 `Check` of the worker's ready name
  ("pdmesh.v1.DecodeService" / "pdmesh.v1.PrefillService") -> registry health.
  NOT_SERVING marks the worker at once; a probe without an answer counts, and
  only `health_failure_threshold` of them in a row mark it (a busy worker's
  late answer is not a dead worker);
- KV events: `SubscribeKvEvents` -> prefix index + sequencer (a snapshot first,
  then batches). A gap, a DATA_LOSS status, an index overflow or a broken
  stream clears the worker's entries and subscribes again with backoff;
- stats: `Stats` -> registry load; for a static worker it is also how the
  router learns its `WorkerInfo` (join check: model and block size) and
  notices a restart under a new id.

Static targets come from flags; names are re-resolved every `dns_refresh_s`
(a headless Service's addresses come and go). Registered workers come from the
RegisterWorker RPC via `attach`. Whenever a worker leaves the registry, its
KV subscription stops first, then its index/sequencer entries and breaker go.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.v1 import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2
from services.common import link_wire
from services.common.tls import TlsConfig, aio_channel, client_tls
from services.router.circuit_breaker import BreakerRegistry
from services.router.config import RouterConfig
from services.router.convert import KvResync, apply_kv_message, info_from_proto, load_from_proto
from services.router.link import DecodeLink, RawDecodeLink
from services.router.prefix_index import EventSequencer, IndexOverflow, PrefixIndex
from services.router.registry import (
    JoinRefused,
    WorkerRegistry,
    WorkerRole,
    WorkerSource,
    expand_targets,
    system_resolver,
)

log = structlog.get_logger()

READY_NAMES = {WorkerRole.DECODE: "pdmesh.v1.DecodeService", WorkerRole.PREFILL: "pdmesh.v1.PrefillService"}
# min_reconnect_backoff_ms is not a backoff: gRPC core uses it as the minimum *connect
# timeout* (TCP + HTTP/2 handshake). At 100 ms a connection to a worker starved of CPU failed
# with "tcp handshaker shutdown" and took its calls with it (the chaos suite under a CPU hog,
# tests/chaos/harness.py); 5 s is a handshake's worst case, not a delay: a refused connect
# still fails at once, and the retry backoff stays 100 ms .. 2 s.
# A raw link port that refused a connection is not tried again for this long (Link over gRPC).
RAW_LINK_RETRY_S = 30.0
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 5000),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


class Backoff:
    """Exponential backoff with full jitter."""

    def __init__(self, initial: float, maximum: float):
        self.initial, self.maximum, self._next = initial, maximum, initial

    def reset(self) -> None:
        self._next = self.initial

    async def sleep(self) -> None:
        delay, self._next = self._next, min(self._next * 2, self.maximum)
        await asyncio.sleep(random.uniform(delay / 2, delay))


class WorkerConnection:
    """Channel, stubs and loops of one worker (see the module docstring)."""

    def __init__(self, pool: WorkerPool, address: str, role: WorkerRole, worker_id: str | None):
        self.pool = pool
        self.address = address
        self.role = role
        self.static = worker_id is None
        self.worker_id = worker_id  # None until a static worker's Stats answered
        self.refused: str | None = None  # why a static worker was refused at join
        self.channel = aio_channel(address, pool.tls, CHANNEL_OPTIONS, pool.interceptors)
        self.decode = decode_pb2_grpc.DecodeServiceStub(self.channel)
        stub = self.decode if role is WorkerRole.DECODE else prefill_pb2_grpc.PrefillServiceStub(self.channel)
        self._worker_stub = stub  # SubscribeKvEvents and Stats: served by both roles
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._probe_now = asyncio.Event()
        self._unanswered = 0  # health probes in a row with no answer
        self._link: DecodeLink | None = None  # decode role: the token path (services/router/link.py)
        self.link_unsupported = False  # the worker answered Link with UNIMPLEMENTED
        self._raw_off_until = 0.0  # its raw link port failed to connect: gRPC until then
        self._main: asyncio.Task[None] | None = None
        self._kv: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._main = asyncio.create_task(self._run(), name=f"worker:{self.address}")

    def link(self) -> DecodeLink | None:
        """The live Link to this decode worker (a new one after a break); None when it has none."""
        if self.role is not WorkerRole.DECODE or self.link_unsupported:
            return None
        link = self._link
        if link is None or not link.alive:
            link = self._link = self._new_link()
        return link

    def _new_link(self) -> DecodeLink:
        link = self._open_link()
        link.notify_started = self.pool.notify_started
        return link

    def _open_link(self) -> DecodeLink:
        name = self.worker_id or self.address
        generate = lambda request, timeout: self.decode.Generate(request, timeout=timeout)  # noqa: E731
        port = self._raw_link_port()
        if port:
            host = self.address.rpartition(":")[0].strip("[]")
            tls = self.pool.tls
            return RawDecodeLink(
                name,
                host,
                port,
                generate,
                ssl_context=self.pool.link_ssl_context(),
                server_hostname=(tls.config.server_name or host) if tls is not None else None,
                on_connect_failed=self._raw_failed,
            )
        return DecodeLink(name, self.decode.Link, generate, self._no_link)

    def _raw_link_port(self) -> int:
        """The worker's raw link port, when it offers one and it is to be used now (0: gRPC)."""
        if not self.pool.config.raw_link or self.worker_id is None:
            return 0
        if asyncio.get_running_loop().time() < self._raw_off_until:
            return 0
        rec = self.pool.registry.get(self.worker_id)
        return rec.info.link_port if rec is not None else 0

    def _raw_failed(self, why: str) -> None:
        """The raw link could not connect: Link over gRPC for a while, then try it again."""
        self._raw_off_until = asyncio.get_running_loop().time() + RAW_LINK_RETRY_S

    def _no_link(self) -> None:
        log.info("worker_without_link", worker=self.worker_id, address=self.address)
        self.link_unsupported = True

    async def stop(self, grace_s: float | None = None, forget: bool = True) -> None:
        """Stop the loops (the KV subscription first), then forget the worker's
        index entries (unless `forget` is False: the worker lives on elsewhere);
        in-flight generate calls get `grace_s` to finish."""
        for task in (self._kv, self._main):
            if task is not None:
                task.cancel()
        for task in (self._kv, self._main):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.worker_id is not None and forget:
            self.pool.forget(self.worker_id)
        elif self.worker_id is not None:  # its KV subscription moves with it: resync there
            self.pool.index.clear(self.worker_id)
            self.pool.sequencer.forget(self.worker_id)
        link, self._link = self._link, None
        if grace_s:
            if link is not None:  # its requests finish (within the grace), then it closes
                link.retire()
            asyncio.get_running_loop().create_task(self.channel.close(grace_s))
        else:
            if link is not None:
                await link.close()
            await self.channel.close()

    # ---- loops --------------------------------------------------------------

    async def _run(self) -> None:
        cfg = self.pool.config
        if self.static:
            await self._discover()
        self._kv = asyncio.create_task(self._kv_loop(), name=f"kv:{self.address}")
        stats = asyncio.create_task(self._stats_loop(), name=f"stats:{self.address}")
        try:
            while True:
                if not await self._probe_health(cfg.health_timeout_s):
                    continue  # no answer: the next probe at once (the threshold counts them)
                # Not asyncio.wait_for: on 3.11 it swallows a cancel that lands in the same
                # step as the probe request, and stop() would then wait forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(cfg.health_interval_s):
                        await self._probe_now.wait()
                self._probe_now.clear()
        finally:
            stats.cancel()

    async def _probe_health(self, timeout: float) -> bool:
        """One probe; False when it got no answer (timed out or failed) and the worker's
        health stays as it was because fewer than `health_failure_threshold` probes in a row
        went unanswered. A worker that answers NOT_SERVING says so itself and is marked at
        once; one that does not answer may be busy, not gone (a probe starved of CPU, a long
        engine step holding the loop), and is marked only after the threshold: a single late
        answer took a healthy worker's traffic away and failed over its unstarted requests."""
        try:
            resp = await self._health.Check(
                health_pb2.HealthCheckRequest(service=READY_NAMES[self.role]), timeout=timeout
            )
        except grpc.aio.AioRpcError as e:
            self._unanswered += 1
            if self._unanswered < self.pool.config.health_failure_threshold:
                log.info(
                    "worker_probe_unanswered",
                    worker=self.worker_id,
                    code=e.code().name,
                    count=self._unanswered,
                )
                return False
            ok = False
        else:
            self._unanswered = 0
            ok = resp.status == health_pb2.HealthCheckResponse.SERVING
        if self.worker_id is not None:
            rec = self.pool.registry.get(self.worker_id)
            if rec is not None and rec.healthy != ok:
                self.pool.registry.set_health(self.worker_id, ok)
                log.info("worker_health", worker=self.worker_id, healthy=ok)
                self.pool.changed()
                if not ok:
                    self.pool.on_unhealthy(self.worker_id)
        return True

    async def _fetch_stats(self) -> worker_pb2.StatsResponse:
        return await self._worker_stub.Stats(
            worker_pb2.StatsRequest(), timeout=self.pool.config.health_timeout_s
        )

    async def _discover(self) -> None:
        """Ask a static worker who it is until it answers and the registry takes it."""
        backoff = Backoff(self.pool.config.resubscribe_initial_s, self.pool.config.resubscribe_max_s)
        while True:
            try:
                resp = await self._fetch_stats()
                if self._join_static(resp):
                    return
            except grpc.aio.AioRpcError as e:
                log.debug("worker_stats_failed", address=self.address, code=e.code().name)
            await backoff.sleep()

    def _join_static(self, resp: worker_pb2.StatsResponse) -> bool:
        info = info_from_proto(resp.info)
        if info.role is None:  # a worker that leaves its role unset gets the one of its flag
            info = dataclasses.replace(info, role=self.role)
        # The router reaches a static worker where the flag (or DNS) said, whatever it reports.
        info = dataclasses.replace(info, address=self.address)
        try:
            if info.role is not self.role:
                raise JoinRefused(
                    f"worker {info.worker_id} at {self.address} is {info.role.value}, not {self.role.value}"
                )
            result = self.pool.registry.join(info, WorkerSource.STATIC, load=load_from_proto(resp.load))
        except JoinRefused as e:
            if self.refused != str(e):
                log.warning("worker_refused", address=self.address, reason=str(e))
            self.refused = str(e)
            self.pool.changed()
            return False
        self.refused = None
        old, self.worker_id = self.worker_id, info.worker_id
        for gone in {*result.replaced, *([old] if old and old != self.worker_id else [])}:
            self.pool.forget(gone)
        log.info("worker_joined", worker=self.worker_id, address=self.address, source="static")
        self.pool.changed()
        return True

    async def _stats_loop(self) -> None:
        cfg = self.pool.config
        while True:
            await asyncio.sleep(cfg.stats_interval_s)
            try:
                resp = await self._fetch_stats()
            except grpc.aio.AioRpcError:
                continue  # health probing decides about the worker
            if self.static and resp.info.worker_id and resp.info.worker_id != self.worker_id:
                log.info(
                    "worker_restarted", address=self.address, old=self.worker_id, new=resp.info.worker_id
                )
                if self._kv is not None:
                    self._kv.cancel()
                if self._join_static(resp):
                    self._kv = asyncio.create_task(self._kv_loop(), name=f"kv:{self.address}")
                continue
            if self.worker_id is not None:
                self.pool.registry.update_load(self.worker_id, load_from_proto(resp.load))
                self.pool.changed()

    async def _kv_loop(self) -> None:
        cfg = self.pool.config
        backoff = Backoff(cfg.resubscribe_initial_s, cfg.resubscribe_max_s)
        worker_id = self.worker_id
        assert worker_id is not None
        request = worker_pb2.SubscribeKvEventsRequest(subscriber=self.pool.subscriber)
        while True:
            call = self._worker_stub.SubscribeKvEvents(request)
            try:
                async for msg in call:
                    if apply_kv_message(self.pool.index, self.pool.sequencer, worker_id, msg):
                        self.pool.changed()
                    if msg.HasField("snapshot"):
                        backoff.reset()
                reason = "stream ended"
            except (KvResync, IndexOverflow) as e:
                reason = str(e)
                call.cancel()
            except grpc.aio.AioRpcError as e:
                reason = f"{e.code().name}: {e.details()}"
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self._probe_now.set()
            finally:
                call.cancel()
            # Whatever broke the stream, what we knew may be stale: drop it and resync.
            self.pool.index.clear(worker_id)
            self.pool.sequencer.forget(worker_id)
            self.pool.changed()
            log.info("kv_resubscribe", worker=worker_id, reason=reason)
            await backoff.sleep()


class WorkerPool:
    """Every worker connection of this router, by address and by worker id."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        index: PrefixIndex,
        sequencer: EventSequencer,
        breakers: BreakerRegistry,
        changed: Callable[[], None] = lambda: None,
        subscriber: str = "router",
        resolver: Callable[[str], Sequence[str]] = system_resolver,
        tls: TlsConfig | None = None,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ):
        self.config = config
        # Links ask their workers to report when each request's prefill begins (the
        # hedge's tie: RouterSettings.hedge, set by the Router).
        self.notify_started = False
        # With TLS a worker must present a certificate of the mesh CA, or it never joins.
        self.tls = client_tls(tls)
        self.interceptors = tuple(interceptors)  # tracing's context injection, when on
        self.registry = registry
        self.index = index
        self.sequencer = sequencer
        self.breakers = breakers
        self.changed = changed
        self.subscriber = subscriber
        self._resolver = resolver
        self._by_address: dict[str, WorkerConnection] = {}
        self._dns_task: asyncio.Task[None] | None = None
        self.drain_grace_s = 30.0
        self._link_ssl: Any = None
        # Set by the Router: a worker's probe said not serving (its unstarted requests move,
        # issue 18); a removed worker's state is cleared (the outlier detector's too).
        self.on_unhealthy: Callable[[str], None] = lambda worker_id: None
        self.on_forget: Callable[[str], None] = lambda worker_id: None

    def link_ssl_context(self) -> Any:
        """The client SSLContext of raw links (None: plaintext); made again when the files change."""
        if self.tls is None:
            return None
        version = self.tls.version()
        if self._link_ssl is None or self._link_ssl[0] != version:
            self._link_ssl = (version, link_wire.client_context(self.tls.config))
        return self._link_ssl[1]

    # ---- membership ---------------------------------------------------------

    async def start_static(self) -> None:
        """Connect to the static targets and keep re-resolving their names."""
        if not (self.config.decode_workers or self.config.prefill_workers):
            return
        await self._refresh_static()
        if self.config.dns_refresh_s > 0:
            self._dns_task = asyncio.create_task(self._dns_loop(), name="router:dns")

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.dns_refresh_s)
            try:
                await self._refresh_static()
            except OSError as e:  # resolver failure: keep what we have
                log.warning("dns_refresh_failed", error=str(e))

    async def _refresh_static(self) -> None:
        wanted: dict[str, WorkerRole] = {}
        for role, targets in (
            (WorkerRole.DECODE, self.config.decode_workers),
            (WorkerRole.PREFILL, self.config.prefill_workers),
        ):
            addrs = await asyncio.to_thread(expand_targets, targets, self._resolver)
            wanted.update(dict.fromkeys(addrs, role))
        for addr, conn in list(self._by_address.items()):
            if conn.static and addr not in wanted:
                log.info("worker_gone_from_dns", address=addr, worker=conn.worker_id)
                await self._drop(addr)
        for addr, role in wanted.items():
            if addr not in self._by_address:
                conn = WorkerConnection(self, addr, role, None)
                self._by_address[addr] = conn
                conn.start()

    async def attach(self, worker_id: str, address: str, role: WorkerRole) -> None:
        """A registered worker joined (or re-joined): make sure it has a connection."""
        conn = self._by_address.get(address)
        if conn is not None and conn.worker_id == worker_id:
            return
        if conn is not None:
            await self._drop(address)
        for addr, other in list(self._by_address.items()):
            if other.worker_id == worker_id:  # the same worker moved to another address
                await self._drop(addr, keep_registered=True)
        conn = WorkerConnection(self, address, role, worker_id)
        self._by_address[address] = conn
        conn.start()

    async def detach(self, worker_id: str) -> None:
        """`worker_id` left the registry (deregistered, lease expired, replaced)."""
        for addr, conn in list(self._by_address.items()):
            if conn.worker_id == worker_id:
                await self._drop(addr, self.drain_grace_s)
                return
        self.forget(worker_id)

    async def _drop(self, address: str, grace_s: float | None = None, keep_registered: bool = False) -> None:
        conn = self._by_address.pop(address)
        if conn.worker_id is not None and not keep_registered:
            self.registry.deregister(conn.worker_id)
        await conn.stop(grace_s, forget=not keep_registered)
        self.changed()

    def forget(self, worker_id: str) -> None:
        """Clear a removed worker's state (its KV subscription must be stopped already)."""
        self.index.clear(worker_id)
        self.sequencer.forget(worker_id)
        self.breakers.remove(worker_id)
        self.on_forget(worker_id)

    async def close(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dns_task
        for addr in list(self._by_address):
            await self._drop(addr)

    # ---- lookups ------------------------------------------------------------

    def connection(self, worker_id: str) -> WorkerConnection | None:
        rec = self.registry.get(worker_id)
        if rec is None:
            return None
        conn = self._by_address.get(rec.info.address)
        return conn if conn is not None and conn.worker_id == worker_id else None

    def connections(self) -> list[WorkerConnection]:
        return list(self._by_address.values())

"""The router's registry of workers: who exists, their load, health and leases.

Owns one `WorkerRecord` per worker id (immutable snapshots, replaced on each
change). Workers enter two ways:

- static: addresses from flags; `expand_targets` turns a DNS name with several
  A/AAAA records into several addresses (a Kubernetes headless Service). The
  edge asks each address for its `WorkerInfo` (Stats RPC) and calls
  `join(info, source=STATIC)`; static workers hold no lease, and
  `retain_static` drops those whose address vanished from DNS.
- registered: the RegisterWorker RPC calls `join(info)`; the worker keeps its
  lease alive with `heartbeat`, leaves with `deregister`, or is dropped by
  `expire` when the lease runs out.

Every call that removes workers returns their ids so the caller can drop
their prefix-index entries, KV-event subscriptions and breakers. Health is set
by the edge's grpc.health.v1 prober (`set_health`); `eligible(role)` combines
it with the breaker's availability (an injected predicate) into the policy's
`Candidate`s. No protobuf here: the servicer converts messages.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from services.common.config import require, setting
from services.router.policy import Candidate, WorkerLoad


class WorkerRole(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


class WorkerSource(enum.Enum):
    STATIC = "static"
    REGISTERED = "registered"


class JoinRefused(Exception):
    """A worker may not join (FAILED_PRECONDITION / INVALID_ARGUMENT at the edge)."""


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's description (mirrors pdmesh.v1.WorkerInfo). `role` is None
    when the message left it unspecified, which `join` refuses."""

    worker_id: str
    address: str
    role: WorkerRole | None
    model_id: str
    block_size: int
    accelerator: str = "cpu"
    kv_capacity_blocks: int = 0
    engine_backend: str = ""
    max_model_len: int = 0
    kv_agent_name: str = ""
    link_port: int = 0  # the raw token link's port on the address's host (0 = Link over gRPC)
    # Heterogeneous fleets (issue 21 item 3): descriptions, not rates (worker_profile.py learns those).
    accelerator_generation: str = ""
    memory_headroom_bytes: int = 0
    warm_models: tuple[str, ...] = ()
    model_load_s: float = 0.0


@dataclass(frozen=True)
class WorkerRecord:
    info: WorkerInfo
    source: WorkerSource
    load: WorkerLoad
    healthy: bool
    inflight: int  # requests the router has running there
    pending_blocks: int  # blocks dispatched since the last load report
    lease_s: float | None  # None: static, never expires
    lease_expires_at: float | None
    joined_at: float
    last_seen_at: float

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


@dataclass(frozen=True)
class JoinResult:
    record: WorkerRecord
    heartbeat_interval_s: float | None  # None for static workers
    replaced: tuple[str, ...]  # ids removed by this join (same address, new id): clear them


@dataclass(frozen=True)
class RegistryConfig:
    model_id: str = setting("", "model id every worker must serve")
    block_size: int = setting(16, "KV block size every worker must use")
    default_lease_s: float = setting(10.0, "lease of a registered worker that asks for none")
    min_lease_s: float = setting(1.0, "shortest lease granted")
    max_lease_s: float = setting(300.0, "longest lease granted")
    heartbeat_fraction: float = setting(1 / 3, "heartbeat interval as a fraction of the lease")
    max_workers: int = setting(1024, "workers the registry holds; joins beyond are refused")

    def __post_init__(self) -> None:
        require(self.block_size >= 1, "block_size must be >= 1")
        require(
            0 < self.min_lease_s <= self.default_lease_s <= self.max_lease_s,
            "need min <= default <= max lease",
        )
        require(0 < self.heartbeat_fraction < 1, "heartbeat_fraction must be in (0, 1)")
        require(self.max_workers >= 1, "max_workers must be >= 1")


class WorkerRegistry:
    def __init__(
        self,
        config: RegistryConfig,
        clock: Callable[[], float] = time.monotonic,
        available: Callable[[str], bool] = lambda worker_id: True,
    ):
        """`available(worker_id)`: may traffic go there (BreakerRegistry.is_available)."""
        self.config = config
        self._clock = clock
        self._available = available
        self._workers: dict[str, WorkerRecord] = {}
        # Called with the worker id after each load report is taken (LoadView.reported:
        # the router's own view then knows what of its traffic the report holds).
        self.on_load: Callable[[str], None] | None = None
        self._version = 0  # bumped when a worker joins or leaves (`mixed` caches on it)
        self._mixed: dict[WorkerRole, tuple[int, bool]] = {}
        # eligible()'s caches: the ids sorted (for the ids in this order), and per worker
        # the Candidate built from its current record.
        self._order_key: tuple[str, ...] = ()
        self._order: list[str] = []
        self._cands: dict[str, tuple[WorkerRecord, Candidate]] = {}

    # ---- membership ---------------------------------------------------------

    def validate(self, info: WorkerInfo) -> None:
        """Raise JoinRefused with a clear reason when `info` cannot serve with this router."""
        cfg = self.config
        if not info.worker_id:
            raise JoinRefused("worker_id is empty")
        if not info.address:
            raise JoinRefused(f"worker {info.worker_id}: address is empty")
        if not isinstance(info.role, WorkerRole):
            raise JoinRefused(f"worker {info.worker_id}: role must be decode or prefill, got {info.role!r}")
        if info.block_size != cfg.block_size:
            raise JoinRefused(
                f"worker {info.worker_id}: block_size {info.block_size} differs from the router's "
                f"{cfg.block_size} (prefix hashes would never match)"
            )
        if info.model_id != cfg.model_id:
            raise JoinRefused(
                f"worker {info.worker_id}: model_id {info.model_id!r} differs from the router's {cfg.model_id!r}"
            )

    def join(
        self,
        info: WorkerInfo,
        source: WorkerSource = WorkerSource.REGISTERED,
        lease_s: float | None = None,
        load: WorkerLoad | None = None,
    ) -> JoinResult:
        """Add or re-add a worker. `lease_s` None means the default (registered
        workers; clamped to the configured range). A re-join of a known id keeps
        the router's in-flight count; another id at the same address replaces
        (and removes) the old one, which is a restarted process."""
        self.validate(info)
        now = self._clock()
        old = self._workers.get(info.worker_id)
        replaced = tuple(
            w for w, r in self._workers.items() if r.info.address == info.address and w != info.worker_id
        )
        if old is None and len(self._workers) - len(replaced) >= self.config.max_workers:
            raise JoinRefused(f"the registry is full ({self.config.max_workers} workers)")
        for w in replaced:
            del self._workers[w]
        if source is WorkerSource.STATIC:
            lease, expires, interval = None, None, None
        else:
            cfg = self.config
            lease = min(max(lease_s or cfg.default_lease_s, cfg.min_lease_s), cfg.max_lease_s)
            expires, interval = now + lease, lease * cfg.heartbeat_fraction
        record = WorkerRecord(
            info=info,
            source=source,
            load=load or (old.load if old else WorkerLoad(free_blocks=info.kv_capacity_blocks)),
            healthy=True,
            inflight=old.inflight if old else 0,
            pending_blocks=0,
            lease_s=lease,
            lease_expires_at=expires,
            joined_at=old.joined_at if old else now,
            last_seen_at=now,
        )
        self._workers[info.worker_id] = record
        self._version += 1
        if load is not None and self.on_load is not None:  # a join can carry a report too
            self.on_load(info.worker_id)
        return JoinResult(record, interval, replaced)

    def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        """Renew the lease and take the reported load. False: unknown worker
        (expired or router restarted), which must register again."""
        r = self._workers.get(worker_id)
        if r is None:
            return False
        now = self._clock()
        expires = now + r.lease_s if r.lease_s is not None else None
        self._workers[worker_id] = dataclasses.replace(
            r, load=load, pending_blocks=0, lease_expires_at=expires, last_seen_at=now
        )
        if self.on_load is not None:
            self.on_load(worker_id)
        return True

    def update_load(self, worker_id: str, load: WorkerLoad) -> bool:
        """A load report that is not a heartbeat (e.g. a Stats poll of a static worker)."""
        r = self._workers.get(worker_id)
        if r is None:
            return False
        self._workers[worker_id] = dataclasses.replace(r, load=load, pending_blocks=0)
        if self.on_load is not None:
            self.on_load(worker_id)
        return True

    def deregister(self, worker_id: str) -> bool:
        self._version += 1
        return self._workers.pop(worker_id, None) is not None

    def expire(self, now: float | None = None) -> list[str]:
        """Remove registered workers whose lease ran out; returns their ids."""
        now = self._clock() if now is None else now
        gone = [
            w
            for w, r in self._workers.items()
            if r.lease_expires_at is not None and r.lease_expires_at <= now
        ]
        for w in gone:
            del self._workers[w]
        self._version += bool(gone)
        return gone

    def retain_static(self, addresses: Iterable[str]) -> list[str]:
        """Keep only the static workers whose address is in `addresses` (a fresh
        DNS expansion); returns the ids removed."""
        keep = set(addresses)
        gone = [
            w
            for w, r in self._workers.items()
            if r.source is WorkerSource.STATIC and r.info.address not in keep
        ]
        for w in gone:
            del self._workers[w]
        self._version += bool(gone)
        return gone

    def mixed(self, role: WorkerRole) -> bool:
        """Do the workers of `role` describe different hardware (accelerator kind or generation,
        as they registered it)? Cached until a worker joins or leaves."""
        cached = self._mixed.get(role)
        if cached is not None and cached[0] == self._version:
            return cached[1]
        kinds = {
            (r.info.accelerator, r.info.accelerator_generation)
            for r in self._workers.values()
            if r.info.role is role
        }
        self._mixed[role] = (self._version, len(kinds) > 1)
        return len(kinds) > 1

    # ---- health and load ----------------------------------------------------

    def set_health(self, worker_id: str, healthy: bool) -> bool:
        r = self._workers.get(worker_id)
        if r is None:
            return False
        if r.healthy != healthy:
            self._workers[worker_id] = dataclasses.replace(r, healthy=healthy)
        return True

    def begin_request(self, worker_id: str, blocks: int = 0) -> None:
        """A request was dispatched there: count it in flight, and add its
        `blocks` to the load until the next report (so a burst between two
        heartbeats does not all land on the same "least loaded" worker)."""
        r = self._workers.get(worker_id)
        if r is not None:
            self._workers[worker_id] = dataclasses.replace(
                r, inflight=r.inflight + 1, pending_blocks=r.pending_blocks + max(blocks, 0)
            )

    def end_request(self, worker_id: str) -> None:
        r = self._workers.get(worker_id)
        if r is not None and r.inflight > 0:
            self._workers[worker_id] = dataclasses.replace(r, inflight=r.inflight - 1)

    # ---- views --------------------------------------------------------------

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def workers(self, role: WorkerRole | None = None) -> list[WorkerRecord]:
        """All workers (of `role`), by id."""
        return sorted(
            (r for r in self._workers.values() if role is None or r.info.role is role),
            key=lambda r: r.worker_id,
        )

    def eligible(self, role: WorkerRole) -> list[Candidate]:
        """Healthy workers of `role` whose breaker lets traffic through, as policy candidates
        (by id, as `workers`).

        Runs once per routing decision (issue 17 item 4): the id order is sorted again only
        when the set of workers changed, and a worker's Candidate is built again only when
        its record was replaced (records are immutable; every change replaces one), which
        was most of this call's time at 32 workers."""
        workers = self._workers
        keys = tuple(workers)
        if keys != self._order_key:
            self._order_key, self._order = keys, sorted(keys)
        cache, available = self._cands, self._available
        out = []
        for wid in self._order:
            r = workers[wid]
            if r.info.role is not role or not r.healthy or not available(wid):
                continue
            hit = cache.get(wid)
            if hit is None or hit[0] is not r:
                load = r.load
                if r.pending_blocks:
                    load = dataclasses.replace(
                        load, active_decode_blocks=load.active_decode_blocks + r.pending_blocks
                    )
                hit = cache[wid] = (r, Candidate(wid, load, True, r.inflight))
            out.append(hit[1])
        if len(cache) > len(workers):  # forget workers that left
            for wid in [w for w in cache if w not in workers]:
                del cache[wid]
        return out

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers


# ---- static targets ---------------------------------------------------------

Resolver = Callable[[str], Sequence[str]]


def parse_target(target: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 < int(port) < 65536):
        raise ValueError(f"worker target {target!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"worker target {target!r}: write an IPv6 address as [addr]:port")
    return host, int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _format(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def expand_targets(targets: Iterable[str], resolve: Resolver) -> list[str]:
    """Worker addresses from static targets: an IP literal stays one address,
    a name becomes one address per IP it resolves to (deduplicated, in order)."""
    out: list[str] = []
    seen: set[str] = set()
    for target in targets:
        host, port = parse_target(target.strip())
        hosts = [host] if _is_ip(host) else resolve(host)
        for ip in hosts:
            addr = _format(ip, port)
            if addr not in seen:
                seen.add(addr)
                out.append(addr)
    return out


def system_resolver(host: str) -> list[str]:
    """Every address of `host` from the system resolver (blocking: call it off the event loop)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))

"""A real mesh as processes, built to be hurt: router + kvtransfer + prefill + decode workers.

Every process binds 127.0.0.1 on port 0 (port files, pdmesh.launcher) and has
a `FaultProxy` on 127.0.0.2 at the same port; workers advertise 127.0.0.2, and
are given the router's and kvtransfer's 127.0.0.2 addresses, so all traffic
between services crosses a proxy where delay, loss, resets and partitions can
be injected (proxy.py says why not netem). Clients and the test's own
observations go straight to 127.0.0.1.

Workers join the router at run time (`--router-address`: the router's internal
port, which is the one behind the router's proxy; short leases), so a
restarted router starts empty and must rebuild its view from re-registrations,
and a restarted worker (new process, new port, same worker id) simply
registers again. The router and kvtransfer restart on their old port: they
bind with SO_REUSEPORT from the start, and a new process binds the same port
after the old one died (the kernel closed its socket); their proxies and
every client address stay valid. Intervals are short (health and Stats every
0.2 s, leases of 1.5-3 s, a 2 s stall timeout) so a fault heals in seconds.
Decode workers keep no prefix cache and prefill prompts over 32 tokens
remotely, so most requests cross a KV handoff while the faults hit.

Processes are ours alone: each node is started by this harness's Launcher and
signalled by name through it (by PID).
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field

import grpc

from pdmesh.client import health_check
from pdmesh.launcher import Launcher, RunningService, ServiceSpec, flags
from pdmesh.v1 import (
    decode_pb2_grpc,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
)
from tests.chaos.proxy import FaultProxy, ProxyHub
from tests.e2e.helpers import wait_until

FRONT = "127.0.0.2"  # where the proxies listen and what services advertise
READY = {
    "router": "pdmesh.v1.RouterService",
    "kvtransfer": "pdmesh.v1.KvTransferService",
    "prefill": "pdmesh.v1.PrefillService",
    "decode": "pdmesh.v1.DecodeService",
}
MODULES = {r: f"services.{r}.main" for r in READY}
ENGINE = flags(engine_preset="tiny", engine_num_threads=1)
ROUTER_FLAGS = flags(
    health_interval_s=0.2,
    health_timeout_s=0.5,
    stats_interval_s=0.2,
    resubscribe_max_s=0.5,
    housekeeping_interval_s=0.2,
    stall_timeout_s=2.0,
    first_token_timeout_s=8.0,
    breaker_cooldown_s=0.5,
    breaker_max_cooldown_s=2.0,
    retry_budget_min_retries_per_second=5.0,
    so_reuseport=1,
)
LEASE_FLAGS = flags(router_lease_ms=1500)
# Clients reconnect fast after a router restart (gRPC's default backoff grows to 120 s).
# min_reconnect_backoff_ms is not a backoff: gRPC core uses it as the minimum *connect timeout*
# (TCP + HTTP/2 handshake). At 100 ms a connection to a process starved of CPU (a CPU hog beside
# the suite) failed with "tcp handshaker shutdown", and the call with it; 5 s is a handshake's
# worst case here, not a delay: a refused connect still fails at once.
CLIENT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 5000),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass
class Node:
    """One incarnation of one service."""

    role: str
    index: int
    incarnation: int
    svc: RunningService
    proxy: FaultProxy | None = None
    internal_port: int = 0  # the router's membership port (what workers reach through its proxy)

    @property
    def name(self) -> str:
        return self.svc.spec.name

    @property
    def worker_id(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def direct(self) -> str:
        return self.svc.address

    @property
    def front(self) -> str:
        """The address the other services use (through the proxy)."""
        return f"{FRONT}:{self.internal_port or self.svc.port}" if self.proxy is not None else self.direct


@dataclass
class ChaosMesh:
    workdir: str
    prefill: int = 1
    decode: int = 2
    kv_transport: str = "grpc"
    seed: int = 0
    launcher: Launcher = field(init=False)
    hub: ProxyHub = field(init=False)
    nodes: dict[tuple[str, int], Node] = field(default_factory=dict)
    incarnations: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.launcher = Launcher(self.workdir)
        self.hub = ProxyHub(self.seed)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> ChaosMesh:
        try:
            router = self._spawn("router", 0)
            self._wait_port(router)
            self.launcher.wait_ready(self._spawn("kvtransfer", 0).svc, on_poll=None)
            self._proxy(self.node("kvtransfer"))
            workers = [self._spawn("prefill", i) for i in range(self.prefill)]
            workers += [self._spawn("decode", i) for i in range(self.decode)]
            for n in workers:
                self._wait_ready(n)
            self.launcher.wait_ready(router.svc)
            self.wait_recovered()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for node in self.nodes.values():  # a stopped process cannot take SIGTERM
            if node.svc.proc.poll() is None:
                node.svc.proc.send_signal(signal.SIGCONT)
        self.launcher.close(grace_s=5)
        self.hub.close()

    def _args(self, role: str, index: int, port: int, internal_port: int = 0) -> tuple[str, ...]:
        if role == "router":
            return ROUTER_FLAGS + flags(port=port, internal_port=internal_port)
        if role == "kvtransfer":
            return flags(port=port, so_reuseport=1, expiry_interval_s=0.2)
        common = flags(
            worker_id=f"{role}-{index}",
            advertise_host=FRONT,
            kvtransfer_address=self.node("kvtransfer").front,
            kv_transport=self.kv_transport,
            router_address=self.node("router").front,
        )
        if role == "prefill":
            return common + LEASE_FLAGS + ENGINE + flags(lease_ttl_s=3, lease_check_s=0.1)
        # No prefix cache on decode workers: the load repeats its prompts, and with a cache
        # they would soon all be local; without, every long prompt crosses a KV handoff.
        decode = flags(kv_lease_ms=3000, prefill_timeout_s=4, max_local_prefill_tokens=32)
        return common + LEASE_FLAGS + ENGINE + decode + flags(engine_enable_prefix_caching=0)

    def _spawn(self, role: str, index: int, port: int = 0, internal_port: int = 0) -> Node:
        n = self.incarnations.get((role, index), 0)
        self.incarnations[(role, index)] = n + 1
        name = f"{role}-{index}" + (f".{n}" if n else "")
        args = self._args(role, index, port, internal_port)
        svc = self.launcher.start(ServiceSpec(name, MODULES[role], args, ready_service=READY[role]))
        node = Node(role, index, n, svc)
        self.nodes[(role, index)] = node
        return node

    def _wait_port(self, node: Node) -> None:
        wait_until(node.svc.port_file.exists, timeout=60, what=f"{node.name}'s port file")
        ports = json.loads(node.svc.port_file.read_text())
        node.svc.port = ports["port"]
        node.internal_port = node.svc.internal_port = ports.get("internal_port") or 0
        self._proxy(node)

    def _proxy(self, node: Node) -> None:
        self.hub.remove(node.name)
        port = node.internal_port or node.svc.port  # the router: only workers cross its proxy
        node.proxy = self.hub.add(node.name, (FRONT, port), ("127.0.0.1", port))

    def _wait_ready(self, node: Node) -> None:
        """Health-gated start; the proxy goes up as soon as the port is known (the
        worker joins the router, which then dials the proxy, right after)."""

        def on_poll() -> None:
            if node.svc.port and node.proxy is None:
                self._proxy(node)

        self.launcher.wait_ready(node.svc, on_poll=on_poll)
        if node.proxy is None:
            self._proxy(node)

    def restart(self, role: str, index: int = 0) -> Node:
        """A new incarnation after the old one died: same port for the router and
        kvtransfer (SO_REUSEPORT), a new port and proxy for a worker."""
        old = self.node(role, index)
        assert old.svc.proc.poll() is not None, f"{old.name} is still running"
        self.hub.remove(old.name)
        keep = role in ("router", "kvtransfer")
        node = self._spawn(role, index, old.svc.port if keep else 0, old.internal_port)
        if role in ("router", "kvtransfer"):
            self._wait_port(node)
            if role == "kvtransfer":
                self.launcher.wait_ready(node.svc)
        else:
            self._wait_ready(node)
        return node

    def kill(self, node: Node, sig: int) -> None:
        self.launcher.kill(node.name, sig)

    # -- views ---------------------------------------------------------------------------
    def node(self, role: str, index: int = 0) -> Node:
        return self.nodes[(role, index)]

    def workers(self) -> list[Node]:
        return [n for (r, _), n in sorted(self.nodes.items()) if r in ("prefill", "decode")]

    def channel(self, node: Node) -> grpc.Channel:
        return grpc.insecure_channel(node.direct, options=CLIENT_OPTIONS)

    @property
    def router_address(self) -> str:
        return self.node("router").direct

    def router_internal(self) -> grpc.Channel:
        """ListWorkers and Stats live on the router's internal port."""
        return grpc.insecure_channel(f"127.0.0.1:{self.node('router').internal_port}", options=CLIENT_OPTIONS)

    def router_view(self) -> dict[str, int]:
        with self.router_internal() as ch:
            resp = router_pb2_grpc.RouterServiceStub(ch).ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=5
            )
        return {w.info.worker_id: w.health for w in resp.workers}

    def router_stats(self) -> router_pb2.RouterServiceStatsResponse:
        with self.router_internal() as ch:
            return router_pb2_grpc.RouterServiceStub(ch).Stats(
                router_pb2.RouterServiceStatsRequest(), timeout=5
            )

    def worker_stats(self, node: Node) -> worker_pb2.StatsResponse:
        with self.channel(node) as ch:
            if node.role == "decode":
                return decode_pb2_grpc.DecodeServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5)
            return prefill_pb2_grpc.PrefillServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5)

    def kv_agents(self) -> int:
        with self.channel(self.node("kvtransfer")) as ch:
            stub = kvtransfer_pb2_grpc.KvTransferServiceStub(ch)
            return stub.Stats(kvtransfer_pb2.KvTransferServiceStatsRequest(), timeout=5).agents

    def wait_recovered(self, timeout: float = 45.0) -> None:
        """The router is ready and sees exactly the live workers, all SERVING."""
        want = {n.worker_id: router_pb2.WORKER_HEALTH_SERVING for n in self.workers()}

        def recovered() -> bool:
            try:
                ready = health_check(self.router_address, READY["router"], timeout=1.0)[0] == "SERVING"
                return ready and self.router_view() == want
            except grpc.RpcError:
                return False

        wait_until(recovered, timeout=timeout, what=f"the router to see {sorted(want)} serving")

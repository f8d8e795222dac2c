"""Start a pdmesh deployment as local processes for a benchmark, and stop it.

`Topology` names the processes (router, kvtransfer, prefill and decode
workers with their flags); `start` brings them up in order with
pdmesh.launcher (port 0 everywhere, health-gated) and returns the router's
address. Everything started is stopped by PID on `close`.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

from pdmesh.launcher import Launcher, RunningService, ServiceSpec, flags


@dataclass(frozen=True)
class Topology:
    name: str
    prefill: int = 0
    decode: int = 1
    preset: str = "small"
    engine_threads: int = 1
    decode_flags: tuple[str, ...] = ()
    prefill_flags: tuple[str, ...] = ()
    router_flags: tuple[str, ...] = ()
    engine_flags: tuple[str, ...] = ()
    kv_transport: str = "nixl"


@dataclass
class Deployment:
    topology: Topology
    launcher: Launcher
    router: RunningService | None = None
    decodes: list[RunningService] = field(default_factory=list)
    prefills: list[RunningService] = field(default_factory=list)

    @property
    def address(self) -> str:
        assert self.router is not None
        return self.router.address

    @property
    def internal_address(self) -> str:
        """The router's internal port: ListWorkers, Stats, worker membership."""
        assert self.router is not None
        return self.router.internal_address

    def close(self) -> None:
        self.launcher.close()


def start(t: Topology, workdir: str | None = None, timeout_s: float = 300.0) -> Deployment:
    launcher = Launcher(workdir or tempfile.mkdtemp(prefix=f"pdmesh-bench-{t.name}-"))
    dep = Deployment(t, launcher)
    engine = flags(engine_preset=t.preset, engine_num_threads=t.engine_threads) + t.engine_flags
    try:
        kv_flags: tuple[str, ...] = ()
        if t.prefill:
            kv = launcher.start_ready(
                ServiceSpec(
                    "kvtransfer", "services.kvtransfer.main", ready_service="pdmesh.v1.KvTransferService"
                ),
                timeout_s,
            )
            kv_flags = flags(kvtransfer_address=kv.address, kv_transport=t.kv_transport)
        dep.prefills = [
            launcher.start(
                ServiceSpec(
                    f"prefill-{i}",
                    "services.prefill.main",
                    flags(worker_id=f"prefill-{i}") + kv_flags + engine + t.prefill_flags,
                    ready_service="pdmesh.v1.PrefillService",
                )
            )
            for i in range(t.prefill)
        ]
        dep.decodes = [
            launcher.start(
                ServiceSpec(
                    f"decode-{i}",
                    "services.decode.main",
                    flags(worker_id=f"decode-{i}") + kv_flags + engine + t.decode_flags,
                    ready_service="pdmesh.v1.DecodeService",
                )
            )
            for i in range(t.decode)
        ]
        for svc in [*dep.prefills, *dep.decodes]:
            launcher.wait_ready(svc, timeout_s)
        router_args = flags(
            decode_workers=[d.address for d in dep.decodes],
            prefill_workers=[p.address for p in dep.prefills] or None,
            preset=t.preset,
        )
        dep.router = launcher.start_ready(
            ServiceSpec(
                "router",
                "services.router.main",
                router_args + t.router_flags,
                ready_service="pdmesh.v1.RouterService",
            ),
            timeout_s,
        )
    except BaseException:
        launcher.close()
        raise
    return dep

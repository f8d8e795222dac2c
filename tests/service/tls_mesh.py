"""Helpers for the TLS/auth service tests: certificates made by `pdmesh certs`'s
code, TLS configs per role, and an in-process router (full `RouterSettings`:
TLS, API keys, limits) over fake workers that may serve TLS too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdmesh.certs import issue, write_ca, write_mesh_certs
from services.common.server import MeshServer, ServerConfig
from services.common.tls import TlsConfig, aio_channel, client_tls
from services.router.config import ModelSpec, RouterConfig, RouterSettings
from services.router.listeners import RouterListeners
from services.router.router import Router
from tests.service.router.conftest import FAST, RouterHandle, connect
from tests.service.router.fakes import FakeWorkerBase


@dataclass(frozen=True)
class Certs:
    dir: Path

    def tls(self, role: str, mtls: bool = True, **kw: Any) -> TlsConfig:
        d = self.dir
        return TlsConfig(
            cert_file=str(d / f"{role}.pem"),
            key_file=str(d / f"{role}-key.pem"),
            ca_file=str(d / "ca.pem"),
            require_client_cert=mtls,
            **kw,
        )

    def ca_only(self) -> TlsConfig:
        """A client that trusts the mesh CA but has no certificate of its own."""
        return TlsConfig(ca_file=str(self.dir / "ca.pem"))


def make_certs(root: Path, workers: tuple[tuple[str, str], ...] = ()) -> Certs:
    write_mesh_certs(root, workers=workers)
    return Certs(root)


def foreign_client(root: Path, mesh: Certs) -> TlsConfig:
    """A "client" certificate from another CA, presented by a client that trusts the mesh CA."""
    write_ca(root)
    other = issue(root, "client")
    return TlsConfig(
        cert_file=str(other.cert_file), key_file=str(other.key_file), ca_file=str(mesh.dir / "ca.pem")
    )


async def start_worker(worker: FakeWorkerBase, tls: TlsConfig | None) -> str:
    """FakeWorkerBase.start with TLS."""
    worker.mesh = MeshServer(ServerConfig(port=0, drain_grace_s=1), worker.ready_name, tls=tls)
    worker._add(worker.mesh.server)
    await worker.mesh.start()
    await worker.mesh.set_ready(True)
    return worker.address


async def start_router(
    settings: RouterSettings, client: TlsConfig | None = None, wait_workers: int | None = None
) -> RouterHandle:
    """A router on port 0 serving `settings` (TLS as settings.tls); the handle's channel uses `client`."""
    router = Router(settings, ModelSpec.load(settings.router))
    listeners = RouterListeners(router)
    await listeners.start()
    await router.start()
    tls = client_tls(client)
    handle = connect(
        router,
        listeners,
        lambda address: aio_channel("localhost:" + address.rpartition(":")[2], tls),
    )
    if wait_workers is not None:
        await router.wait_until(
            lambda: len(router.registry) == wait_workers and all(r.healthy for r in router.registry.workers())
        )
    return handle


def router_settings(decode: tuple[str, ...] = (), **sections: Any) -> RouterSettings:
    cfg = RouterConfig(decode_workers=decode, **FAST)
    return RouterSettings(
        server=sections.pop("server", ServerConfig(port=0, drain_grace_s=1)), router=cfg, **sections
    )


async def close_router(h: RouterHandle) -> None:
    await h.close()


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def call_raw(
    channel: grpc.aio.Channel, method: str, payload: bytes = b"", timeout: float = 10
) -> bytes:
    """A unary call with a raw (empty) body: enough to reach the interceptors."""
    return await channel.unary_unary(method)(payload, timeout=timeout)

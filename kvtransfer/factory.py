"""The one place a KV transport is chosen: `create_transport(kind, ...)`.

"nixl" builds a `NixlTransport` and falls back to gRPC, with a warning, when
the NIXL bindings cannot be imported (a machine without nixl-cu12). "grpc"
builds a `GrpcTransport`. Transports made here refuse a handle without
block digests (`require_digests`): the services always get the integrity
check; only tests and tools that build handles by hand turn it off. Adding a transport means one module and one branch here.
"""

from __future__ import annotations

import structlog

from kvtransfer.agents import AgentDirectory
from kvtransfer.grpc_transport import ChannelFactory, GrpcTransport, GrpcTransportConfig
from kvtransfer.nixl_transport import NixlConfig, NixlTransport
from kvtransfer.pool import PoolView
from kvtransfer.transport import KvTransport, TransferReporter

log = structlog.get_logger()

KINDS = ("nixl", "grpc")


def create_transport(
    kind: str,
    *,
    agent_name: str,
    pool: PoolView,
    worker_id: str,
    directory: AgentDirectory | None,
    nixl_config: NixlConfig | None = None,
    grpc_config: GrpcTransportConfig | None = None,
    reporter: TransferReporter | None = None,
    channel_factory: ChannelFactory | None = None,
    require_digests: bool = True,
) -> KvTransport:
    if kind not in KINDS:
        raise ValueError(f"KV transport must be one of {KINDS}, got {kind!r}")
    if kind == "nixl":
        if directory is None:
            raise ValueError("the NIXL transport needs an AgentDirectory (the KV-transfer service)")
        try:
            return NixlTransport(
                agent_name,
                pool,
                directory,
                worker_id=worker_id,
                config=nixl_config,
                reporter=reporter,
                require_digests=require_digests,
            )
        except ImportError as e:
            log.warning("nixl_unavailable_using_grpc", error=str(e))
    return GrpcTransport(
        agent_name,
        pool,
        worker_id=worker_id,
        directory=directory,
        config=grpc_config,
        reporter=reporter,
        channel_factory=channel_factory,
        require_digests=require_digests,
    )

"""One grpc.aio channel per peer address, shared by every call to that peer.

Creating a channel per request costs a TCP (and TLS) handshake; gRPC channels
multiplex calls, so workers keep one per peer for their lifetime. With a
`TlsConfig` the channels speak TLS (presenting this process's certificate for
mTLS); when the certificate files change, the next `get` replaces the cached
channel, and calls still running on the old one get `REPLACED_GRACE_S` to finish.
With tracing on, every channel carries its client interceptors (trace context
into the call's metadata, services/common/tracing.py); with it off, none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from services.common.tls import TlsConfig, aio_channel, client_tls

# Keepalive: clients ping every KEEPALIVE_TIME_MS, also between calls, so a dead peer
# (a killed pod, a dropped NAT entry) is noticed within seconds. A gRPC server refuses
# pings more often than every 5 minutes without calls by default and answers the third
# with GOAWAY "too_many_pings"; MeshServer therefore accepts what these clients send
# (server_keepalive_options). The two sides read the same number.
KEEPALIVE_TIME_MS = 10_000


def client_keepalive_options(time_ms: int = KEEPALIVE_TIME_MS) -> tuple[tuple[str, int], ...]:
    return (
        ("grpc.keepalive_time_ms", time_ms),
        ("grpc.keepalive_timeout_ms", max(1_000, time_ms // 2)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    )


def server_keepalive_options(client_time_ms: int = KEEPALIVE_TIME_MS) -> tuple[tuple[str, int], ...]:
    """What a server must allow for clients that ping every `client_time_ms` (half of it as
    the floor: timers jitter, and a ping right after a call's data counts as without data)."""
    return (
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", client_time_ms // 2),
        ("grpc.http2.min_ping_interval_without_data_ms", client_time_ms // 2),
    )


DEFAULT_OPTIONS = (
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    *client_keepalive_options(),
)
REPLACED_GRACE_S = 30.0


class ChannelCache:
    def __init__(
        self,
        options: tuple[tuple[str, object], ...] = DEFAULT_OPTIONS,
        tls: TlsConfig | None = None,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ):
        self._options = options
        self._tls = client_tls(tls)
        self.interceptors = tuple(interceptors)  # tracing's context injection, when on
        self._channels: dict[str, tuple[grpc.aio.Channel, Any]] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        version = self._tls.version() if self._tls is not None else None
        cached = self._channels.get(address)
        if cached is not None and cached[1] == version:
            return cached[0]
        if cached is not None:  # certificate files changed: new handshakes use the new ones
            asyncio.get_running_loop().create_task(cached[0].close(REPLACED_GRACE_S))
        channel = self.new_channel(address, self._options)
        self._channels[address] = (channel, version)
        return channel

    def new_channel(self, address: str, options: Any = ()) -> grpc.aio.Channel:
        """An uncached channel with this cache's credentials (the caller closes it)."""
        return aio_channel(address, self._tls, options, self.interceptors)

    async def drop(self, address: str) -> None:
        cached = self._channels.pop(address, None)
        if cached is not None:
            await cached[0].close()

    async def close(self) -> None:
        channels, self._channels = [c for c, _ in self._channels.values()], {}
        for channel in channels:
            await channel.close()

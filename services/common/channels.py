"""One grpc.aio channel per peer address, shared by every call to that peer.

Creating a channel per request costs a TCP (and later TLS) handshake; gRPC
channels multiplex calls, so workers keep one per peer for their lifetime.
"""

from __future__ import annotations

import grpc

DEFAULT_OPTIONS = (
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


class ChannelCache:
    def __init__(self, options: tuple[tuple[str, object], ...] = DEFAULT_OPTIONS):
        self._options = options
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=list(self._options))
            self._channels[address] = channel
        return channel

    async def drop(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

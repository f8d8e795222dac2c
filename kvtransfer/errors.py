"""Typed failures of the KV handoff.

Every way a pull can fail is one `FailureKind`; the transports raise
`KvTransferFailed(kind, message)` and nothing else, so callers branch on
`err.kind` instead of parsing messages. At a gRPC edge the kind maps to one
status code (`status_code`) and travels back in the `kv-failure` trailing
metadata, so the receiving side can rebuild the exact kind (`from_rpc_error`).

This module is the library's own error vocabulary: it does not depend on
`services.common.errors` (services depend on the library, not the reverse).
"""

from __future__ import annotations

import enum

import grpc

FAILURE_METADATA_KEY = "kv-failure"


class FailureKind(enum.StrEnum):
    TIMEOUT = "timeout"  # the pull's deadline passed
    PEER_DEAD = "peer_dead"  # the holder died or disconnected
    UNKNOWN_AGENT = "unknown_agent"  # the holder's agent is not (or no longer) registered
    STALE_HANDLE = "stale_handle"  # the handle was released or its lease expired
    LAYOUT_MISMATCH = "layout_mismatch"  # the two pools' layouts differ
    TRUNCATED = "truncated"  # the byte stream ended early or had a gap
    NOT_OWNER = "not_owner"  # the handle was issued to another worker
    INVALID = "invalid"  # bad arguments (block ids out of range, length mismatch)
    TRANSPORT = "transport"  # any other failure of the transport itself
    CANCELLED = "cancelled"  # the caller cancelled the pull
    INTEGRITY = "integrity"  # the pulled bytes do not match the holder's digests (or none came)


_STATUS = {
    FailureKind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    FailureKind.PEER_DEAD: grpc.StatusCode.UNAVAILABLE,
    FailureKind.UNKNOWN_AGENT: grpc.StatusCode.NOT_FOUND,
    FailureKind.STALE_HANDLE: grpc.StatusCode.NOT_FOUND,
    FailureKind.LAYOUT_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    FailureKind.TRUNCATED: grpc.StatusCode.DATA_LOSS,
    FailureKind.NOT_OWNER: grpc.StatusCode.PERMISSION_DENIED,
    FailureKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    FailureKind.TRANSPORT: grpc.StatusCode.UNAVAILABLE,
    FailureKind.CANCELLED: grpc.StatusCode.CANCELLED,
    FailureKind.INTEGRITY: grpc.StatusCode.DATA_LOSS,
}

# Without a `kv-failure` trailer (the peer died, a proxy answered), the status
# alone decides. UNAVAILABLE from a stream that was cut is a dead peer.
_KIND_OF_STATUS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: FailureKind.TIMEOUT,
    grpc.StatusCode.UNAVAILABLE: FailureKind.PEER_DEAD,
    grpc.StatusCode.NOT_FOUND: FailureKind.STALE_HANDLE,
    grpc.StatusCode.FAILED_PRECONDITION: FailureKind.LAYOUT_MISMATCH,
    grpc.StatusCode.DATA_LOSS: FailureKind.TRUNCATED,
    grpc.StatusCode.PERMISSION_DENIED: FailureKind.NOT_OWNER,
    grpc.StatusCode.INVALID_ARGUMENT: FailureKind.INVALID,
    grpc.StatusCode.CANCELLED: FailureKind.CANCELLED,
}


class KvTransferFailed(Exception):
    """A KV transfer (or a step of one) failed; `kind` says how."""

    def __init__(self, kind: FailureKind | str, message: str):
        self.kind = FailureKind(kind)
        self.message = message
        super().__init__(f"{self.kind.value}: {message}")

    @property
    def reason(self) -> str:
        """The kind as the short string used in TransferRecord.error and metrics."""
        return self.kind.value

    @property
    def status_code(self) -> grpc.StatusCode:
        return _STATUS[self.kind]

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((FAILURE_METADATA_KEY, self.kind.value),)


class StaleHandle(KvTransferFailed):
    """The handle is unknown: already released, expired, or never issued here."""

    def __init__(self, message: str):
        super().__init__(FailureKind.STALE_HANDLE, message)


class NotOwner(KvTransferFailed):
    """The handle exists but was issued to another worker."""

    def __init__(self, message: str):
        super().__init__(FailureKind.NOT_OWNER, message)


def from_rpc_error(err: grpc.aio.AioRpcError | grpc.RpcError, what: str) -> KvTransferFailed:
    """Rebuild the failure a gRPC peer reported (or the one its status implies)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    kind = None
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == FAILURE_METADATA_KEY and value in FailureKind._value2member_map_:
            kind = FailureKind(value)
    if kind is None:
        kind = _KIND_OF_STATUS.get(code, FailureKind.TRANSPORT)
    return KvTransferFailed(kind, f"{what}: {code.name if code else '?'}: {details}")

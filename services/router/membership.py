"""Who may speak for a worker in the router's membership RPCs: only the worker itself.

A registration binds the worker id to its registrant. Later calls for that id
(Heartbeat, DeregisterWorker, a re-registration while the record lives) are
accepted only from the same registrant:

- with mTLS and a per-worker certificate (`pdmesh://decode/decode-0`, made by
  `pdmesh certs --worker`), the certificate *is* the identity: a caller may only
  name the worker id its certificate names, for every membership RPC;
- otherwise (plaintext, or a certificate naming only a role) by an incarnation
  secret: RegisterWorker returns a fresh random one, and only a caller that
  presents it may heartbeat, deregister or re-register that id. A process that
  lost it (a restart) registers again once the old lease has expired.

Static workers (flags/DNS) belong to the router's configuration: no RPC may
register over them, heartbeat for them (their load comes from the router's own
Stats polls) or deregister them. A registration may replace another id at the
same address (a restarted process with a new id) only when it is allowed to
speak for that id too. Refusals are PermissionDenied (PERMISSION_DENIED).

Plain Python over `WorkerRecord`s: the servicer builds the `Caller` from the
call, `Router` asks `MembershipGuard` before it changes the registry.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from services.common.errors import PermissionDenied
from services.router.registry import WorkerRecord, WorkerSource


@dataclass(frozen=True)
class Caller:
    """Who calls a membership RPC, as far as the call proves it."""

    certified_worker: str = ""  # the worker id its verified certificate names ("" = none)
    incarnation: str = ""  # the secret it presents ("" = none)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class MembershipGuard:
    """Worker id -> the digest of its current incarnation secret (the router's own map)."""

    def __init__(self) -> None:
        self._secrets: dict[str, bytes] = {}

    def _speaks_for(self, worker_id: str, caller: Caller) -> bool:
        if caller.certified_worker:
            return caller.certified_worker == worker_id
        held = self._secrets.get(worker_id)
        return (
            bool(caller.incarnation)
            and held is not None
            and hmac.compare_digest(held, _digest(caller.incarnation))
        )

    def _check_cert(self, worker_id: str, caller: Caller) -> None:
        if caller.certified_worker and caller.certified_worker != worker_id:
            raise PermissionDenied(
                f"worker_id {worker_id!r}: the client certificate is for worker {caller.certified_worker!r}"
            )

    def check_register(
        self, worker_id: str, existing: WorkerRecord | None, replaced: list[WorkerRecord], caller: Caller
    ) -> None:
        """Raise PermissionDenied unless `caller` may (re-)register `worker_id`."""
        self._check_cert(worker_id, caller)
        for rec in ([existing] if existing is not None else []) + replaced:
            if rec.source is WorkerSource.STATIC:
                raise PermissionDenied(
                    f"worker {rec.worker_id!r} is a static worker of the router's configuration; "
                    "it cannot be registered over"
                )
            if not self._speaks_for(rec.worker_id, caller):
                raise PermissionDenied(
                    f"worker {rec.worker_id!r} is registered by another process; present its "
                    "incarnation (or its certificate), or register once its lease has expired"
                )

    def bind(self, worker_id: str, replaced: tuple[str, ...] = ()) -> str:
        """A fresh incarnation secret for a registration that was accepted."""
        for gone in replaced:
            self._secrets.pop(gone, None)
        secret = secrets.token_urlsafe(24)
        self._secrets[worker_id] = _digest(secret)
        return secret

    def check_speaks_for(self, record: WorkerRecord, caller: Caller, action: str) -> None:
        """Raise PermissionDenied unless `caller` may `action` (heartbeat, deregister) `record`."""
        worker_id = record.worker_id
        self._check_cert(worker_id, caller)
        if record.source is WorkerSource.STATIC:
            raise PermissionDenied(
                f"worker {worker_id!r} is a static worker of the router's configuration; "
                f"it cannot {action} by RPC"
            )
        if not self._speaks_for(worker_id, caller):
            raise PermissionDenied(
                f"worker {worker_id!r}: only the process that registered it may {action} "
                "(send the incarnation RegisterWorker returned)"
            )

    def forget(self, worker_ids: list[str] | tuple[str, ...]) -> None:
        for w in worker_ids:
            self._secrets.pop(w, None)

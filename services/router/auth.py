"""Tenant authentication: API keys, stored as hashes, mapped to tenants.

A client sends `authorization: Bearer <key>` (gRPC metadata; the gateway
forwards the HTTP Authorization header as is). `ApiKeyStore.authenticate`
hashes the key (SHA-256: keys are 32 random bytes, so a slow hash adds
nothing) and looks the hash up; the tenant found there — never the request's
`tenant` field — is what admission charges, and the entry may cap the
request's priority and carry the tenant's quota (`TenantLimits`).

Entries come from a JSON-lines file (`--api-keys-file`, one object a line,
written by `pdmesh keys add`) and/or inline `<sha256-hex>:<tenant>` pairs
(`--api-keys`, e.g. `PDMESH_API_KEYS` from a Secret). Raw keys are never
stored. The file is read again when it changes (a stat per call), so adding
or revoking a key needs no restart. Revocation fails closed: when the new
file has bad lines (or cannot be read), the keys in force are exactly those of
its valid lines, so a removed key is never kept nor resurrected by a typo
elsewhere; each bad line is logged and the reload counted as failed
(`on_reload_error`, the router's `pdmesh_router_api_keys_reload_errors`). Only
the first load refuses a bad file (the router does not start). Authentication
is off when neither is given.

File line: {"key_sha256": "<hex>", "tenant": "acme", "max_priority": 0,
            "requests_per_s": 5, "request_burst": 10, "tokens_per_s": 20000,
            "token_burst": 100000, "max_inflight": 8, "admin": false}   (all but the first two optional)
An `admin` key may also call the operator RPCs (ListWorkers: worker addresses).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from services.common.api_keys import append_entry as append_entry  # re-exported: tests write key files here
from services.common.api_keys import hash_key, is_digest
from services.common.api_keys import new_key as new_key  # re-exported: callers make keys here
from services.common.config import require, setting
from services.common.errors import Unauthenticated
from services.router.tenant_quota import TenantLimits

log = structlog.get_logger()

_LIMIT_FIELDS = ("requests_per_s", "request_burst", "tokens_per_s", "token_burst", "max_inflight")
_UNREADABLE = (-1, -1)  # the file signature while the file cannot be read (counted once)
_KNOWN_FIELDS = {"key_sha256", "tenant", "max_priority", "note", "admin", *_LIMIT_FIELDS}


@dataclass(frozen=True)
class AuthConfig:
    api_keys_file: str = setting("", "JSON-lines file of API-key hashes -> tenant, quota, priority cap")
    api_keys: tuple[str, ...] = setting((), "inline <sha256-hex>:<tenant> entries (hashes, never keys)")

    def __post_init__(self) -> None:
        for entry in self.api_keys:
            digest, sep, tenant = entry.partition(":")
            ok = bool(sep and tenant) and is_digest(digest)
            require(ok, f"api_keys: {entry[:12]}... is not <sha256-hex>:<tenant>")

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys_file or self.api_keys)


@dataclass(frozen=True)
class TenantGrant:
    """What a valid key gives: the tenant, a priority cap, a quota (None = the router's default)."""

    tenant: str
    max_priority: int | None = None
    limits: TenantLimits | None = None
    admin: bool = False  # may call ListWorkers (an operator's key, not a tenant's)

    def cap(self, priority: int) -> int:
        return priority if self.max_priority is None else min(priority, self.max_priority)


def parse_entry(obj: Mapping[str, Any]) -> tuple[str, TenantGrant]:
    """(hash, grant) of one keys-file object; ValueError names what is wrong."""
    unknown = set(obj) - _KNOWN_FIELDS
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    digest, tenant = str(obj.get("key_sha256", "")).lower(), obj.get("tenant")
    if not is_digest(digest):
        raise ValueError("key_sha256 must be 64 hex digits")
    if not isinstance(tenant, str) or not tenant or len(tenant.encode()) > 128:
        raise ValueError("tenant must be a non-empty string of <= 128 bytes")
    limits = None
    if any(f in obj for f in _LIMIT_FIELDS):
        limits = TenantLimits(**{f: obj[f] for f in _LIMIT_FIELDS if f in obj})
    cap = obj.get("max_priority")
    if cap is not None and not isinstance(cap, int):
        raise ValueError("max_priority must be an integer")
    admin = obj.get("admin", False)
    if not isinstance(admin, bool):
        raise ValueError("admin must be true or false")
    return digest, TenantGrant(tenant, cap, limits, admin)


def parse_valid_lines(lines: Iterable[str], source: str) -> tuple[dict[str, TenantGrant], list[str]]:
    """(grants of the valid lines, one error per bad line): a bad line never stops the others."""
    grants: dict[str, TenantGrant] = {}
    errors: list[str] = []
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("a line must be a JSON object")
            digest, grant = parse_entry(obj)
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            errors.append(f"{source}:{n}: {e}")
            continue
        grants[digest] = grant
    return grants, errors


def parse_lines(lines: Iterable[str], source: str) -> dict[str, TenantGrant]:
    """Every line's grant; ValueError at the first bad line."""
    grants, errors = parse_valid_lines(lines, source)
    if errors:
        raise ValueError(errors[0])
    return grants


class ApiKeyStore:
    """Key hash -> grant, from the config's inline entries and keys file (reloaded on change)."""

    def __init__(self, config: AuthConfig, on_reload_error: Callable[[], None] = lambda: None):
        """`on_reload_error`: called once per reload that met a bad or unreadable file."""
        self.config = config
        self._on_reload_error = on_reload_error
        self._inline = {d: TenantGrant(t) for d, _, t in (e.partition(":") for e in config.api_keys)}
        self._file_sig: tuple[int, int] | None = None
        self._file: dict[str, TenantGrant] = {}
        self._limits: dict[str, TenantLimits] = {}
        self.reloads = 0
        self.reload_errors = 0
        self._reload(initial=True)

    def _reload(self, initial: bool = False) -> None:
        path = self.config.api_keys_file
        if not path:
            return
        try:
            st = os.stat(path)
            sig = (st.st_mtime_ns, st.st_size)
        except OSError:
            sig = _UNREADABLE
        if sig == self._file_sig:
            return
        try:
            with open(path) as f:
                grants, errors = parse_valid_lines(f, path)
        except (OSError, UnicodeDecodeError) as e:
            if initial:
                raise ValueError(f"api_keys_file: {e}") from e
            # Unreadable (gone, permissions): no valid part, so no file key stays in force.
            grants, errors = {}, [f"{path}: {e}"]
        if errors and initial:
            raise ValueError(f"api_keys_file: {errors[0]}")
        dropped = len(set(self._file) - set(grants))
        self._file, self._file_sig = grants, sig
        self._limits = {g.tenant: g.limits for g in grants.values() if g.limits is not None}
        if errors:
            self.reload_errors += 1
            self._on_reload_error()
            log.error(
                "api_keys_reload_partial",
                path=path,
                errors=errors[:10],
                bad_lines=len(errors),
                keys=len(grants),
                dropped=dropped,
                note="only the valid lines' keys are in force",
            )
        else:
            self.reloads += 1
            log.info("api_keys_loaded", path=path, keys=len(grants), dropped=dropped)

    def authenticate(self, metadata: Iterable[tuple[str, Any]] | None) -> TenantGrant:
        """The grant of the call's bearer key; Unauthenticated when missing or unknown."""
        key = bearer_key(metadata)
        if not key:
            raise Unauthenticated("missing API key: send the metadata 'authorization: Bearer <key>'")
        self._reload()
        digest = hash_key(key)
        grant = self._file.get(digest) or self._inline.get(digest)
        if grant is None:
            raise Unauthenticated("invalid API key")
        return grant

    def limits_for(self, tenant: str) -> TenantLimits | None:
        """The quota a keys-file entry of `tenant` gives (the last such line wins)."""
        return self._limits.get(tenant)


def bearer_key(metadata: Iterable[tuple[str, Any]] | None) -> str:
    for k, v in metadata or ():
        if k.lower() == "authorization":
            value = v.decode() if isinstance(v, bytes) else str(v)
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return ""

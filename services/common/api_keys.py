"""The API-key file format, shared by the router and the `pdmesh keys` CLI.

The CLI writes entries (`pdmesh keys add`) and the router reads them
(`services.router.auth`); both need the same key shape, hash and line
checks, and the CLI must not import the router. This module imports nothing
of ours, so either side can use it.

A key is `pdm_` + 32 random bytes (urlsafe base64); only its SHA-256 is
stored (the keys are random, so a slow hash adds nothing). A line of the
keys file is one JSON object:
    {"key_sha256": "<hex>", "tenant": "acme", "max_priority": 0,
     "requests_per_s": 5, "request_burst": 10, "tokens_per_s": 20000,
     "token_burst": 100000, "max_inflight": 8, "admin": false, "note": "..."}
(all but the first two optional; an `admin` key may also call the operator RPCs, e.g. ListWorkers)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
from collections.abc import Mapping
from typing import Any

KEY_PREFIX = "pdm_"
LIMIT_FIELDS = ("requests_per_s", "request_burst", "tokens_per_s", "token_burst", "max_inflight")
KNOWN_FIELDS = frozenset({"key_sha256", "tenant", "max_priority", "note", "admin", *LIMIT_FIELDS})


def new_key() -> str:
    """A fresh API key (shown once; only its hash is kept)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def is_digest(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def check_entry(obj: Mapping[str, Any]) -> None:
    """Refuse a keys-file object the router would refuse; ValueError names what is wrong.

    The limit checks restate the router's `TenantLimits` rules (the CLI cannot
    import the router); tests/unit/security/test_api_keys.py checks that both
    accept and refuse the same entries.
    """
    unknown = set(obj) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    if not is_digest(str(obj.get("key_sha256", "")).lower()):
        raise ValueError("key_sha256 must be 64 hex digits")
    tenant = obj.get("tenant")
    if not isinstance(tenant, str) or not tenant or len(tenant.encode()) > 128:
        raise ValueError("tenant must be a non-empty string of <= 128 bytes")
    cap = obj.get("max_priority")
    if cap is not None and not isinstance(cap, int):
        raise ValueError("max_priority must be an integer")
    for name in ("requests_per_s", "tokens_per_s"):
        rate = obj.get(name)
        if rate is not None and not (_number(rate) and rate > 0 and math.isfinite(rate)):
            raise ValueError(f"{name} must be > 0 or None")
    for name in ("request_burst", "token_burst"):
        if name in obj and not (_number(obj[name]) and obj[name] >= 1):
            raise ValueError(f"{name} must be >= 1")
    if not isinstance(obj.get("admin", False), bool):
        raise ValueError("admin must be true or false")
    inflight = obj.get("max_inflight")
    if inflight is not None and not (_number(inflight) and inflight >= 1):
        raise ValueError("max_inflight must be >= 1 or None")


def _number(v: Any) -> bool:
    return isinstance(v, int | float)


def append_entry(path: str, tenant: str, key: str, **fields: Any) -> dict[str, Any]:
    """Add `key`'s hash for `tenant` to the keys file (created 0600); returns the line's object."""
    obj = {
        "key_sha256": hash_key(key),
        "tenant": tenant,
        **{k: v for k, v in fields.items() if v is not None},
    }
    check_entry(obj)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(json.dumps(obj, sort_keys=True) + "\n")
    return obj

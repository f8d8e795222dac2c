"""The shared key-file format (services/common/api_keys.py) that the `pdmesh keys`
CLI writes with, against the router's own reader of the same lines."""

from __future__ import annotations

import json

import pytest

from services.common.api_keys import KEY_PREFIX, append_entry, check_entry, hash_key, new_key
from services.router.auth import hash_key as router_hash_key
from services.router.auth import parse_entry

DIGEST = hash_key("k")
GOOD = [
    {"key_sha256": DIGEST, "tenant": "acme"},
    {"key_sha256": DIGEST.upper(), "tenant": "acme", "note": "ops"},
    {"key_sha256": DIGEST, "tenant": "acme", "max_priority": 2, "max_inflight": 1},
    {"key_sha256": DIGEST, "tenant": "a", "requests_per_s": 0.5, "request_burst": 1, "token_burst": 1.0},
    {"key_sha256": DIGEST, "tenant": "a", "tokens_per_s": 10, "requests_per_s": None},
]
BAD = [
    {"key_sha256": DIGEST, "tenant": "acme", "extra": 1},
    {"key_sha256": "abc", "tenant": "acme"},
    {"key_sha256": DIGEST, "tenant": ""},
    {"key_sha256": DIGEST, "tenant": "x" * 129},
    {"key_sha256": DIGEST, "tenant": "acme", "max_priority": "high"},
    {"key_sha256": DIGEST, "tenant": "acme", "requests_per_s": 0},
    {"key_sha256": DIGEST, "tenant": "acme", "tokens_per_s": float("inf")},
    {"key_sha256": DIGEST, "tenant": "acme", "request_burst": 0.5},
    {"key_sha256": DIGEST, "tenant": "acme", "token_burst": 0},
    {"key_sha256": DIGEST, "tenant": "acme", "max_inflight": 0},
    {"key_sha256": DIGEST, "tenant": "acme", "max_inflight": "8"},
]


def _router_accepts(obj) -> bool:
    try:
        parse_entry(obj)
    except (ValueError, TypeError):
        return False
    return True


@pytest.mark.parametrize("obj", GOOD)
def test_the_cli_and_the_router_accept_the_same_entries(obj):
    check_entry(obj)
    assert _router_accepts(obj)


@pytest.mark.parametrize("obj", BAD)
def test_the_cli_and_the_router_refuse_the_same_entries(obj):
    with pytest.raises(ValueError):
        check_entry(obj)
    assert not _router_accepts(obj)


def test_keys_are_hashed_the_same_on_both_sides(tmp_path):
    key = new_key()
    assert key.startswith(KEY_PREFIX) and router_hash_key(key) == hash_key(key) != key
    path = tmp_path / "keys.jsonl"
    append_entry(str(path), "acme", key, max_inflight=2, note=None)
    (line,) = path.read_text().splitlines()
    assert json.loads(line) == {"key_sha256": hash_key(key), "tenant": "acme", "max_inflight": 2}
    assert key not in line and (path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(ValueError):
        append_entry(str(path), "acme", key, max_inflight=0)
    assert len(path.read_text().splitlines()) == 1  # nothing written for a refused entry

"""API keys (services/router/auth.py): hashed at rest, mapped to tenants, reloaded on change."""

from __future__ import annotations

import json
import os

import pytest

from services.common.config import ConfigError, build
from services.common.errors import Unauthenticated
from services.router.auth import (
    ApiKeyStore,
    AuthConfig,
    TenantGrant,
    append_entry,
    bearer_key,
    hash_key,
    new_key,
    parse_entry,
)
from services.router.tenant_quota import TenantLimits


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def test_keys_are_random_and_only_their_hash_is_written(tmp_path):
    path = tmp_path / "keys.jsonl"
    a, b = new_key(), new_key()
    assert a != b and a.startswith("pdm_") and len(a) > 40
    append_entry(str(path), "acme", a, max_priority=2, tokens_per_s=100.0)
    append_entry(str(path), "beta", b)
    text = path.read_text()
    assert a not in text and b not in text and hash_key(a) in text
    assert os.stat(path).st_mode & 0o777 == 0o600
    line = json.loads(text.splitlines()[0])
    assert line == {"key_sha256": hash_key(a), "tenant": "acme", "max_priority": 2, "tokens_per_s": 100.0}


def test_authenticate_maps_a_key_to_its_grant(tmp_path):
    path = tmp_path / "keys.jsonl"
    key = new_key()
    append_entry(str(path), "acme", key, max_priority=1, requests_per_s=5.0, max_inflight=3)
    store = ApiKeyStore(AuthConfig(api_keys_file=str(path)))
    grant = store.authenticate(bearer(key))
    assert grant.tenant == "acme" and grant.cap(7) == 1 and grant.cap(-2) == -2
    assert store.limits_for("acme") == TenantLimits(requests_per_s=5.0, max_inflight=3)
    assert store.limits_for("nobody") is None


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        [],
        [("authorization", "Bearer ")],
        [("authorization", "Basic dXNlcjpwdw==")],
        [("x-api-key", "k")],
    ],
)
def test_a_missing_key_is_unauthenticated(metadata):
    store = ApiKeyStore(AuthConfig(api_keys=(f"{hash_key('k1')}:acme",)))
    with pytest.raises(Unauthenticated, match="missing API key"):
        store.authenticate(metadata)


def test_an_unknown_key_is_unauthenticated_and_inline_hashes_work():
    store = ApiKeyStore(AuthConfig(api_keys=(f"{hash_key('k1')}:acme",)))
    assert store.authenticate(bearer("k1")) == TenantGrant("acme")
    assert store.authenticate([("Authorization", b"bearer k1")]).tenant == "acme"  # case, bytes
    with pytest.raises(Unauthenticated, match="invalid API key"):
        store.authenticate(bearer("k2"))


def test_the_file_is_reloaded_on_change_and_a_broken_one_keeps_the_last(tmp_path):
    path = tmp_path / "keys.jsonl"
    first, second = new_key(), new_key()
    append_entry(str(path), "acme", first)
    store = ApiKeyStore(AuthConfig(api_keys_file=str(path)))
    with pytest.raises(Unauthenticated):
        store.authenticate(bearer(second))
    append_entry(str(path), "beta", second)
    assert store.authenticate(bearer(second)).tenant == "beta"
    path.write_text(path.read_text() + "{not json\n")  # a bad edit: the previous keys stay in force
    assert store.authenticate(bearer(first)).tenant == "acme"
    revoked = "\n".join(
        line for line in path.read_text().splitlines() if hash_key(first) not in line and "{not" not in line
    )
    path.write_text(revoked + "\n")
    with pytest.raises(Unauthenticated):  # a key removed from the file is revoked without a restart
        store.authenticate(bearer(first))
    assert store.reloads == 3


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"key_sha256": "ab", "tenant": "t"}, "64 hex"),
        ({"key_sha256": "a" * 64}, "tenant"),
        ({"key_sha256": "a" * 64, "tenant": "t", "colour": "red"}, "unknown fields"),
        ({"key_sha256": "a" * 64, "tenant": "t", "max_priority": "high"}, "max_priority"),
        ({"key_sha256": "a" * 64, "tenant": "t", "requests_per_s": -1}, "requests_per_s"),
        ({"key_sha256": "a" * 64, "tenant": "t", "max_inflight": 0}, "max_inflight"),
    ],
)
def test_bad_entries_are_refused_with_the_reason(obj, message):
    with pytest.raises(ValueError, match=message):
        parse_entry(obj)


def test_a_bad_file_or_inline_entry_fails_at_start(tmp_path):
    path = tmp_path / "keys.jsonl"
    path.write_text('{"key_sha256": "zz", "tenant": "t"}\n')
    with pytest.raises(ValueError, match=r"keys\.jsonl:1"):
        ApiKeyStore(AuthConfig(api_keys_file=str(path)))
    with pytest.raises(ConfigError, match="sha256"):
        build(AuthConfig, None, {"PDMESH_API_KEYS": "not-a-hash:acme"})
    assert build(AuthConfig, None, {"PDMESH_API_KEYS": f"{hash_key('x')}:acme"}).enabled


def test_auth_is_off_without_keys():
    assert not AuthConfig().enabled


def test_bearer_key_reads_the_authorization_header_only():
    assert bearer_key([("authorization", "Bearer  abc ")]) == "abc"
    assert bearer_key([("x-request-id", "Bearer abc")]) == ""


def _lines_without(path, digest: str) -> str:
    return "".join(line for line in path.read_text().splitlines(keepends=True) if digest not in line)


def test_a_key_revoked_in_a_file_with_a_bad_line_is_revoked_at_once(tmp_path):
    """Issue 13 item 6: a malformed line once kept every previous entry, revoked keys included."""
    path = tmp_path / "keys.jsonl"
    keep, revoke = new_key(), new_key()
    append_entry(str(path), "acme", keep)
    append_entry(str(path), "zeta", revoke)
    failures = []
    store = ApiKeyStore(AuthConfig(api_keys_file=str(path)), on_reload_error=lambda: failures.append(1))
    assert store.authenticate(bearer(revoke)).tenant == "zeta"
    # One edit: revoke zeta's key and (by mistake) add a line that does not parse.
    path.write_text(_lines_without(path, hash_key(revoke)) + '{"key_sha256": "oops"\n')
    with pytest.raises(Unauthenticated):
        store.authenticate(bearer(revoke))
    assert store.authenticate(bearer(keep)).tenant == "acme"  # the valid part stays in force
    assert store.reload_errors == 1 and failures == [1]


def test_a_bad_reload_never_resurrects_a_key_removed_earlier(tmp_path):
    path = tmp_path / "keys.jsonl"
    a, b = new_key(), new_key()
    append_entry(str(path), "acme", a)
    append_entry(str(path), "beta", b)
    store = ApiKeyStore(AuthConfig(api_keys_file=str(path)))
    path.write_text(_lines_without(path, hash_key(b)))  # a clean revocation of b
    with pytest.raises(Unauthenticated):
        store.authenticate(bearer(b))
    path.write_text(path.read_text() + "[1, 2]\n")  # then a bad edit: b must stay revoked
    with pytest.raises(Unauthenticated):
        store.authenticate(bearer(b))
    assert store.authenticate(bearer(a)).tenant == "acme"
    # A line for the same key that no longer parses drops that key too (fail closed).
    line = path.read_text().splitlines()[0].replace('"tenant"', '"tenant_typo"')
    path.write_text(line + "\n")
    with pytest.raises(Unauthenticated):
        store.authenticate(bearer(a))
    assert store.reload_errors == 2


def test_an_unreadable_keys_file_leaves_no_file_key_in_force(tmp_path):
    path = tmp_path / "keys.jsonl"
    key = new_key()
    append_entry(str(path), "acme", key)
    store = ApiKeyStore(AuthConfig(api_keys_file=str(path), api_keys=(f"{hash_key('inline')}:ops",)))
    path.unlink()
    with pytest.raises(Unauthenticated):
        store.authenticate(bearer(key))
    assert store.authenticate(bearer("inline")).tenant == "ops" and store.reload_errors == 1
    append_entry(str(path), "acme", key)  # the file comes back: so does the key
    assert store.authenticate(bearer(key)).tenant == "acme"


def test_admin_keys_are_marked_in_the_file(tmp_path):
    path = tmp_path / "keys.jsonl"
    ops, tenant = new_key(), new_key()
    append_entry(str(path), "ops", ops, admin=True)
    append_entry(str(path), "acme", tenant)
    store = ApiKeyStore(AuthConfig(api_keys_file=str(path)))
    assert store.authenticate(bearer(ops)).admin and not store.authenticate(bearer(tenant)).admin
    with pytest.raises(ValueError, match="admin"):
        parse_entry({"key_sha256": "a" * 64, "tenant": "t", "admin": "yes"})

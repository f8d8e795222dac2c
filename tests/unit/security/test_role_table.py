"""The per-RPC role table (services/common/call_guards.py, issue 13 item 7): every RPC of
pdmesh.v1 names the roles that may call it, and each certificate reaches only what its
role needs in the mesh's data flow."""

from __future__ import annotations

import pytest

from pdmesh.v1 import (
    decode_pb2,
    kvtransfer_pb2,
    prefill_pb2,
    router_pb2,
)
from services.common.call_guards import POLICY, ROLES, allowed_roles

_FILES = (decode_pb2, kvtransfer_pb2, prefill_pb2, router_pb2)


def every_rpc() -> list[str]:
    return [
        f"/{svc.full_name}/{m.name}"
        for mod in _FILES
        for svc in mod.DESCRIPTOR.services_by_name.values()
        for m in svc.methods
    ]


def test_every_rpc_of_the_contract_has_a_row():
    named = [m for m in every_rpc() if any(m.startswith(prefix) for prefix, _ in POLICY)]
    assert named == every_rpc()
    assert all(allowed_roles(m) for m in every_rpc())  # none left closed by accident


@pytest.mark.parametrize(
    ("method", "roles"),
    [
        ("/pdmesh.v1.DecodeService/Generate", {"router"}),
        ("/pdmesh.v1.DecodeService/Link", {"router"}),
        ("/pdmesh.v1.DecodeService/SubscribeKvEvents", {"router"}),
        ("/pdmesh.v1.PrefillService/Prefill", {"decode"}),
        ("/pdmesh.v1.PrefillService/Release", {"decode"}),
        ("/pdmesh.v1.PrefillService/SubscribeKvEvents", {"router"}),
        ("/pdmesh.v1.KvSourceService/ReadBlocks", {"decode"}),
        ("/pdmesh.v1.PrefixSourceService/LeasePrefix", {"decode"}),
        ("/pdmesh.v1.PrefixSourceService/ReleasePrefix", {"decode"}),
        ("/pdmesh.v1.KvTransferService/RegisterAgent", {"decode", "prefill"}),
        ("/pdmesh.v1.KvTransferService/DeregisterAgent", {"decode", "prefill"}),
        ("/pdmesh.v1.RouterService/RegisterWorker", {"decode", "prefill"}),
        ("/pdmesh.v1.RouterService/Heartbeat", {"decode", "prefill"}),
        ("/pdmesh.v1.RouterService/DeregisterWorker", {"decode", "prefill"}),
        ("/pdmesh.v1.RouterService/Stats", {"admin", "router"}),
        ("/pdmesh.v1.RouterService/Generate", ROLES),
    ],
)
def test_each_internal_rpc_lists_only_its_callers(method, roles):
    assert allowed_roles(method) == roles


@pytest.mark.parametrize("role", ["prefill", "kvtransfer", "decode", "client", "gateway"])
def test_decode_generate_is_the_routers_alone(role):
    """Issue 13 item 7: prefill and kvtransfer certificates reached decode Generate (no key, no quota)."""
    assert role not in allowed_roles("/pdmesh.v1.DecodeService/Generate")
    assert role not in allowed_roles("/pdmesh.v1.DecodeService/Link")

"""One factory picks the transport (falling back to gRPC without NIXL); NIXL done-notifications release leases."""

import sys

import pytest

from kvtransfer.factory import create_transport
from kvtransfer.grpc_transport import GrpcTransport
from kvtransfer.layout import KvLayout
from kvtransfer.leases import LeaseManager
from kvtransfer.nixl_transport import NOTIF_PREFIX, NixlConfig, NixlTransport
from kvtransfer.pool import PoolView
from kvtransfer.testing import BlockPool

LAYOUT = KvLayout(1, 1, 4, "float32", 2)


class NoDirectory:
    """Never called: these tests do not start the transport."""


def pool():
    return PoolView(LAYOUT.allocate_pool(4), LAYOUT)


def test_factory_builds_each_kind_and_refuses_others():
    args = {"agent_name": "a", "pool": pool(), "worker_id": "w", "directory": NoDirectory()}
    assert isinstance(create_transport("grpc", **args), GrpcTransport)
    assert isinstance(create_transport("nixl", **args), NixlTransport)
    with pytest.raises(ValueError, match="one of"):
        create_transport("rdma", **args)
    with pytest.raises(ValueError, match="AgentDirectory"):
        create_transport("nixl", **{**args, "directory": None})


def test_nixl_falls_back_to_grpc_when_it_cannot_be_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)  # `import nixl_cu12` now raises ImportError
    t = create_transport("nixl", agent_name="a", pool=pool(), worker_id="w", directory=NoDirectory())
    assert isinstance(t, GrpcTransport) and t.kind == "grpc"


def test_nixl_config_is_validated():
    with pytest.raises(ValueError):
        NixlConfig(notif_poll_s=0)
    with pytest.raises(ValueError):
        NixlConfig(backends=())
    assert NixlConfig().progress_thread is False  # it busy-polls a core


def test_done_notifications_release_only_matching_leases():
    blocks = BlockPool(4)
    leases = LeaseManager()
    for h, agent in (("mine", "dec-a"), ("anyones", "")):
        ids = blocks.alloc(1)
        leases.issue(h, ids, "w", agent, on_free=lambda ids=ids: blocks.free(ids))
    t = NixlTransport("holder", pool(), NoDirectory())  # not started: no agent is created
    t._leases = leases  # what attach_source sets, without starting the poll loop
    t._on_notif("dec-b", NOTIF_PREFIX + b"mine")  # another agent's READ: not its lease to end
    t._on_notif("dec-a", b"unrelated message")
    t._on_notif("dec-a", NOTIF_PREFIX + b"gone-already")
    assert leases.held == 2
    t._on_notif("dec-a", NOTIF_PREFIX + b"mine")
    t._on_notif("dec-z", NOTIF_PREFIX + b"anyones")
    c = leases.counters
    assert (c.held, c.pulled, c.released) == (0, 2, 2) and blocks.num_free == 4

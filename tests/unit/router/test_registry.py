import pytest

from services.common.config import ConfigError
from services.router.policy import WorkerLoad
from services.router.registry import (
    JoinRefused,
    RegistryConfig,
    WorkerInfo,
    WorkerRegistry,
    WorkerRole,
    WorkerSource,
    expand_targets,
    parse_target,
)
from tests.unit.router.fakes import FakeClock

DECODE, PREFILL = WorkerRole.DECODE, WorkerRole.PREFILL


def info(worker_id="d1", role=DECODE, address=None, model_id="tiny", block_size=16) -> WorkerInfo:
    return WorkerInfo(worker_id, address or f"{worker_id}:5000", role, model_id, block_size)


def registry(available=lambda w: True, **cfg) -> tuple[WorkerRegistry, FakeClock]:
    clock = FakeClock()
    cfg = {"model_id": "tiny", "block_size": 16, **cfg}
    return WorkerRegistry(RegistryConfig(**cfg), clock, available), clock


# ---- joining ---------------------------------------------------------------------


def test_join_grants_a_lease_and_a_heartbeat_interval():
    reg, clock = registry()
    result = reg.join(info())
    assert result.record.lease_s == 10.0 and result.record.lease_expires_at == clock() + 10.0
    assert result.heartbeat_interval_s == pytest.approx(10.0 / 3)
    assert "d1" in reg and len(reg) == 1
    assert reg.join(info("d2"), lease_s=0.01).record.lease_s == 1.0  # clamped to min_lease_s
    assert reg.join(info("d3"), lease_s=1e6).record.lease_s == 300.0  # and to max_lease_s


def test_join_refuses_a_different_block_size_with_a_clear_reason():
    reg, _ = registry()
    with pytest.raises(JoinRefused, match="block_size 32 differs from the router's 16"):
        reg.join(info(block_size=32))
    assert len(reg) == 0


def test_join_refuses_a_different_model():
    reg, _ = registry()
    with pytest.raises(JoinRefused, match="model_id 'other' differs"):
        reg.join(info(model_id="other"))


def test_join_refuses_an_unspecified_role_and_empty_ids():
    reg, _ = registry()
    with pytest.raises(JoinRefused, match="role must be decode or prefill"):
        reg.join(info(role=None))
    with pytest.raises(JoinRefused, match="worker_id"):
        reg.join(info(worker_id=""))


def test_a_new_worker_id_at_a_known_address_replaces_the_old_one():
    reg, _ = registry()
    reg.join(info("old", address="10.0.0.1:5000"))
    result = reg.join(info("new", address="10.0.0.1:5000"))
    assert result.replaced == ("old",)
    assert "old" not in reg and "new" in reg


def test_rejoining_keeps_the_routers_inflight_count():
    reg, _ = registry()
    reg.join(info())
    reg.begin_request("d1")
    reg.join(info())
    assert reg.get("d1").inflight == 1


def test_the_registry_is_bounded():
    reg, _ = registry(max_workers=2)
    reg.join(info("a"))
    reg.join(info("b"))
    with pytest.raises(JoinRefused, match="full"):
        reg.join(info("c"))
    reg.join(info("a"))  # a known worker may always re-join


def test_config_is_validated():
    with pytest.raises(ConfigError):
        RegistryConfig(block_size=0)
    with pytest.raises(ConfigError):
        RegistryConfig(min_lease_s=20, default_lease_s=10)


# ---- leases ---------------------------------------------------------------------


def test_heartbeats_keep_a_worker_and_its_lease_runs_out_without_them():
    reg, clock = registry()
    reg.join(info("d1"))
    reg.join(info("d2"))
    clock.advance(9.0)
    assert reg.heartbeat("d1", WorkerLoad(running=2)) is True
    clock.advance(1.0)
    assert reg.expire() == ["d2"]
    assert reg.get("d1").load.running == 2
    clock.advance(9.0)
    assert reg.expire() == ["d1"]
    assert reg.heartbeat("d1", WorkerLoad()) is False  # unknown now: must register again
    assert len(reg) == 0


def test_static_workers_never_expire_and_leave_when_dns_drops_them():
    reg, clock = registry()
    result = reg.join(info("s1", address="10.0.0.1:5000"), source=WorkerSource.STATIC)
    assert result.heartbeat_interval_s is None and result.record.lease_expires_at is None
    reg.join(info("s2", address="10.0.0.2:5000"), source=WorkerSource.STATIC)
    reg.join(info("r1", address="10.0.0.3:5000"))
    clock.advance(1e6)
    assert reg.expire() == ["r1"]
    assert reg.retain_static(["10.0.0.2:5000"]) == ["s1"]
    assert [r.worker_id for r in reg.workers()] == ["s2"]


def test_deregister_removes_a_worker():
    reg, _ = registry()
    reg.join(info())
    assert reg.deregister("d1") is True
    assert reg.deregister("d1") is False


# ---- eligibility and load -----------------------------------------------------


def test_eligible_workers_are_healthy_allowed_by_their_breaker_and_of_the_role():
    open_breakers = {"d2"}
    reg, _ = registry(available=lambda w: w not in open_breakers)
    for w in ("d1", "d2", "d3"):
        reg.join(info(w))
    reg.join(info("p1", role=PREFILL))
    assert reg.set_health("d3", False) is True
    assert reg.set_health("ghost", False) is False
    assert [c.worker_id for c in reg.eligible(DECODE)] == ["d1"]
    assert [c.worker_id for c in reg.eligible(PREFILL)] == ["p1"]
    reg.set_health("d3", True)
    open_breakers.clear()
    assert [c.worker_id for c in reg.eligible(DECODE)] == ["d1", "d2", "d3"]


def test_dispatched_blocks_count_as_load_until_the_next_report():
    reg, _ = registry()
    reg.join(info())
    reg.heartbeat("d1", WorkerLoad(active_decode_blocks=5))
    reg.begin_request("d1", blocks=3)
    reg.begin_request("d1", blocks=4)
    (c,) = reg.eligible(DECODE)
    assert (c.load.active_decode_blocks, c.inflight) == (12, 2)
    reg.heartbeat("d1", WorkerLoad(active_decode_blocks=11))  # the report now includes them
    reg.end_request("d1")
    (c,) = reg.eligible(DECODE)
    assert (c.load.active_decode_blocks, c.inflight) == (11, 1)


# ---- static targets -------------------------------------------------------------


def test_a_dns_name_with_several_records_becomes_several_workers():
    records = {"decode.svc": ["10.0.0.1", "10.0.0.2", "10.0.0.1"], "v6.svc": ["fd00::1"]}
    asked = []

    def resolve(host):
        asked.append(host)
        return records[host]

    addrs = expand_targets(["decode.svc:50051", "192.168.1.9:7000", "[fd00::2]:1", "v6.svc:9"], resolve)
    assert addrs == ["10.0.0.1:50051", "10.0.0.2:50051", "192.168.1.9:7000", "[fd00::2]:1", "[fd00::1]:9"]
    assert asked == ["decode.svc", "v6.svc"]  # IP literals are not resolved


def test_targets_must_name_a_port():
    assert parse_target("[::1]:80") == ("::1", 80)
    for bad in ("host", "host:", "host:0", "host:99999", "::1:80"):
        with pytest.raises(ValueError):
            parse_target(bad)


def test_each_load_report_tells_on_load_which_worker_reported():
    reg, _ = registry()
    reg.join(info("d1"))
    reg.join(info("d2"), WorkerSource.STATIC)
    seen = []
    reg.on_load = seen.append
    assert reg.heartbeat("d1", WorkerLoad(running=1))
    assert reg.update_load("d2", WorkerLoad(running=2))
    assert not reg.heartbeat("gone", WorkerLoad())  # unknown: no report taken
    reg.join(info("d3"), load=WorkerLoad(running=3))  # a join that carries a load report
    reg.join(info("d4"))  # one that does not
    assert seen == ["d1", "d2", "d3"]


def test_mixed_says_whether_a_roles_workers_registered_different_hardware():
    import dataclasses as dc

    reg = WorkerRegistry(RegistryConfig(model_id="m"), lambda: 0.0)
    base = WorkerInfo("a", "h:1", WorkerRole.DECODE, "m", 16, accelerator="cuda")
    reg.join(dc.replace(base, accelerator_generation="h100"), WorkerSource.REGISTERED, 10.0)
    reg.join(
        dc.replace(base, worker_id="b", address="h:2", accelerator_generation="h100"),
        WorkerSource.REGISTERED,
        10.0,
    )
    assert not reg.mixed(WorkerRole.DECODE)
    # A prefill worker of another generation does not make the decode pool mixed.
    reg.join(
        dc.replace(
            base, worker_id="p", address="h:3", role=WorkerRole.PREFILL, accelerator_generation="a100"
        ),
        WorkerSource.REGISTERED,
        10.0,
    )
    assert not reg.mixed(WorkerRole.DECODE)
    reg.join(
        dc.replace(base, worker_id="c", address="h:4", accelerator_generation="a100"),
        WorkerSource.REGISTERED,
        10.0,
    )
    assert reg.mixed(WorkerRole.DECODE)
    reg.deregister("c")  # the cache follows the membership
    assert not reg.mixed(WorkerRole.DECODE)

"""The local actuator (pdmesh up --planner) with fake processes: the order of a drain, starts
that count only once routed, and the supervisor's view of what the planner stops."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from pdmesh.local_actuator import LocalActuator, set_flag


@dataclass
class FakeProc:
    name: str
    alive: bool = True
    serving: bool = False  # health
    routed: bool = False  # the router lists it SERVING
    draining: bool = False


@dataclass
class FakeProcesses:
    """Records every call in order; the router notices a drain one `routed` look later."""

    events: list[tuple[str, str]] = field(default_factory=list)
    procs: list[FakeProc] = field(default_factory=list)
    fail_launch: bool = False
    exit_codes: dict[str, int] = field(default_factory=dict)

    def launch(self, role):
        if self.fail_launch:
            raise RuntimeError("engine did not load")
        p = FakeProc(f"{role}-new{len(self.procs)}")
        self.procs.append(p)
        self.events.append(("launch", p.name))
        return p

    def wait_ready(self, p):
        p.serving = True
        self.events.append(("ready", p.name))

    def routed(self, p):
        if p.draining and p.routed:
            p.routed = False  # this look: the router's probe saw NOT_SERVING
            return True
        if p.serving and not p.draining and not p.routed:
            p.routed = True
            self.events.append(("routed", p.name))
        return p.routed

    def alive(self, p):
        return p.alive

    def terminate(self, p):
        p.draining, p.serving = True, False
        self.events.append(("sigterm", p.name))

    def wait_exit(self, p, timeout_s):
        assert not p.routed, "the process must not exit while the router still routes to it"
        p.alive = False
        self.events.append(("exited", p.name))
        return self.exit_codes.get(p.name, 0)

    def forget(self, p):
        self.events.append(("forget", p.name))

    def abort_waits(self):
        self.events.append(("abort_waits", ""))


def static(name):
    return FakeProc(name, serving=True, routed=True)


async def settle(act):
    while act.tasks:
        await asyncio.gather(*list(act.tasks))


async def test_scale_up_counts_at_once_and_reports_startup_once_routed():
    procs = FakeProcesses()
    seen = []
    act = LocalActuator(procs, {"decode": [static("decode-0")]}, on_startup=seen.append, poll_s=0.001)
    await act.scale("decode", 3)
    assert await act.replicas() == {"prefill": 0, "decode": 3}  # desired, as k8s' spec.replicas
    await settle(act)
    names = [n for _, n in procs.events if _ == "launch"]
    assert len(names) == 2
    for n in names:  # launched, ready, then routed: only then is it started
        order = [e for e, m in procs.events if m == n]
        assert order == ["launch", "ready", "routed"]
    assert len(seen) == 2 and all(s >= 0 for s in seen)


async def test_scale_down_drains_newest_first_in_order_and_keeps_the_static_worker():
    procs = FakeProcesses()
    s0 = static("decode-0")
    act = LocalActuator(procs, {"decode": [s0]}, poll_s=0.001)
    await act.scale("decode", 3)
    await settle(act)
    started = [p.name for p in procs.procs]
    procs.events.clear()
    await act.scale("decode", 1)
    assert await act.replicas() == {"prefill": 0, "decode": 1}
    # while draining, the supervisor is told these are the planner's to stop
    assert all(act.retiring.get(id(p)) is p for p in procs.procs)
    await settle(act)
    for n in started:
        assert [e for e, m in procs.events if m == n] == ["sigterm", "exited", "forget"]
    assert s0.alive and ("sigterm", "decode-0") not in procs.events
    assert act.workers["decode"][0].handle is s0


async def test_exit_waits_until_the_router_stopped_routing():
    """FakeProcesses.wait_exit fails the test if the worker were still routed."""
    procs = FakeProcesses()
    act = LocalActuator(procs, {"decode": [static("decode-0"), static("decode-1")]}, poll_s=0.001)
    await act.scale("decode", 1)
    await settle(act)
    assert ("exited", "decode-1") in procs.events


async def test_a_failed_start_is_dropped_and_counted():
    procs = FakeProcesses(fail_launch=True)
    act = LocalActuator(procs, {"decode": [static("decode-0")]}, poll_s=0.001)
    await act.scale("decode", 2)
    await settle(act)
    assert act.failed_starts == 1
    assert await act.replicas() == {"prefill": 0, "decode": 1}


async def test_a_dead_worker_no_longer_counts():
    procs = FakeProcesses()
    dead = static("decode-1")
    act = LocalActuator(procs, {"decode": [static("decode-0"), dead]}, poll_s=0.001)
    dead.alive = False
    assert (await act.replicas())["decode"] == 1


async def test_scale_refuses_an_unknown_role():
    act = LocalActuator(FakeProcesses(), {})
    with pytest.raises(ValueError, match="unknown role"):
        await act.scale("gateway", 1)


def test_set_flag_replaces_or_appends():
    assert set_flag(("--worker-id", "decode-0", "--host", "h"), "--worker-id", "decode-3") == (
        "--worker-id",
        "decode-3",
        "--host",
        "h",
    )
    assert set_flag(("--host", "h"), "--router-address", "r:1") == ("--host", "h", "--router-address", "r:1")


async def test_close_abandons_starts_and_lets_drains_finish():
    procs = FakeProcesses()
    act = LocalActuator(procs, {"decode": [static("decode-0"), static("decode-1")]}, poll_s=0.001)
    await act.scale("decode", 1)
    await act.close()
    assert ("abort_waits", "") in procs.events and ("forget", "decode-1") in procs.events
    assert not act.tasks

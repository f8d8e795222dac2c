"""Heterogeneous decode workers: the router learns each one's speed and routes on predicted time
(issue 21 item 3; services/router/worker_profile.py), with real sim decode workers on loopback.

"fast" runs the sim engine 20x faster than "slow" (sim speedups 10 and 0.5: an older
accelerator generation, not a faulty one). Both are idle when a request arrives, so
kv_aware's cost in blocks ties and the router's seeded RNG picks; with speed routing
the slow worker's blocks cost its measured factor more. The outlier detector is off:
what moves traffic here is the measured speed alone.
"""

from __future__ import annotations

import asyncio

import pytest

from pdmesh.v1 import router_pb2
from services.router.outlier import OutlierConfig
from services.router.worker_profile import WorkerProfileConfig
from tests.service.router.test_link import SimDecode, prompt, run_flow
from tests.support.poll import eventually

OUTLIER_OFF = OutlierConfig(enabled=False)


async def _fleet(mesh, *, speed: WorkerProfileConfig, slow_generation: str = ""):
    fast = await SimDecode("fast", speedup=10.0).start()
    slow = await SimDecode("slow", speedup=0.5, generation=slow_generation).start()
    h = await mesh.router(decode=[fast, slow], policy="kv_aware", outlier=OUTLIER_OFF, speed=speed)
    return fast, slow, h


async def _warm_both(h) -> None:
    """Concurrent requests: the router's own load view sends every other one to the other
    worker, so each gets samples whatever its speed. Then both workers' reports say idle
    (a report from mid-warm-up would make slow look loaded and decide the ties)."""
    # 32 tokens each: a decode sample needs tokens after the first message, and a fast worker's
    # first frame can carry all of a short output (a CPU hog beside the suite made 6 arrive as one).
    await asyncio.gather(*(run_flow(h.router, f"warm{i}", prompt(100 + i), 32) for i in range(8)))

    def idle() -> bool:
        loads = [r.load for r in h.router.registry.workers()]
        return len(loads) == 2 and not any(x.running or x.waiting or x.active_decode_blocks for x in loads)

    await eventually(idle, what="both workers report idle", timeout=30)


@pytest.mark.parametrize(
    "route, slow_generation",
    [("true", ""), ("auto", "sim-older")],  # auto: the slow one registered other hardware
)
async def test_the_slower_worker_is_measured_and_idle_ties_go_to_the_faster(mesh, route, slow_generation):
    fast, slow, h = await _fleet(
        mesh, speed=WorkerProfileConfig(min_samples=2, route=route), slow_generation=slow_generation
    )
    try:
        # What each worker would register (services/worker/hardware.py): measured, not declared.
        info = slow.rt.info()
        assert info.accelerator_generation == (slow_generation or "sim") and list(info.warm_models) == [
            info.model_id
        ]
        assert info.model_load_s > 0 and info.memory_headroom_bytes > 0
        free_fast, free_slow = fast.free(), slow.free()
        await _warm_both(h)
        prof = h.router.profiles
        for w in ("fast", "slow"):
            p = prof.get(w)
            assert p is not None and p.prefill_samples >= 2 and p.decode_samples >= 2, w
        pf_fast, df_fast = prof.speeds()["fast"]
        pf_slow, df_slow = prof.speeds()["slow"]
        # Measured, loosely: fast's times are mostly the mesh's own overhead (a loaded machine
        # inflates them), slow's mostly the engine's compute.
        assert pf_slow > 1.5 * pf_fast and df_slow > 2 * df_fast
        # Distinct prompts, one at a time: both idle, no cached prefix to prefer.
        works: list[int] = []
        observe = prof.observe_prefill
        prof.observe_prefill = lambda w, tokens, s: (works.append(tokens), observe(w, tokens, s))  # type: ignore[method-assign]
        finals = [(await run_flow(h.router, f"r{i}", prompt(i), 4))[1] for i in range(8)]
        assert [f.worker_id for f in finals] == ["fast"] * 8  # a tie would split them
        # Each prefill sample's work: nothing queued ahead (idle), the prompt's blocks plus one.
        bs = h.router.config.block_size
        assert works == [(-(-len(prompt(i)) // bs) + 1) * bs for i in range(8)]
        # Operators see the same measurements (ListWorkers, the per-worker gauges).
        listed = await h.internal.ListWorkers(router_pb2.ListWorkersRequest())
        by_id = {w.info.worker_id: w for w in listed.workers}
        assert by_id["slow"].decode_speed_factor > by_id["fast"].decode_speed_factor
        assert by_id["slow"].measured_decode_s_per_token > by_id["fast"].measured_decode_s_per_token > 0
        h.router._export_worker_gauges()
        gauge = h.router.metrics.registry.get_sample_value(
            "pdmesh_router_worker_decode_speed_factor", {"worker": "slow", "role": "decode"}
        )
        assert gauge == by_id["slow"].decode_speed_factor
        await eventually(
            lambda: fast.free() == free_fast and slow.free() == free_slow, what="both pools free", timeout=30
        )
    finally:
        await fast.close()
        await slow.close()


@pytest.mark.parametrize("route", ["false", "auto"])
async def test_without_speed_ranking_the_speeds_are_measured_and_idle_ties_split(mesh, route):
    """The control: the same fleet and requests, ranked without speeds (false; or auto, the
    default, while both workers registered the same hardware). The router still measures and
    shows the speeds, and some requests go to slow."""
    fast, slow, h = await _fleet(mesh, speed=WorkerProfileConfig(min_samples=2, route=route))
    try:
        free_fast, free_slow = fast.free(), slow.free()
        await _warm_both(h)
        finals = [(await run_flow(h.router, f"r{i}", prompt(i), 4))[1] for i in range(8)]
        assert "slow" in {f.worker_id for f in finals}  # seed 0's tie-breaks (fixed RNG)
        listed = await h.internal.ListWorkers(router_pb2.ListWorkersRequest())
        by_id = {w.info.worker_id: w for w in listed.workers}
        assert by_id["slow"].decode_speed_factor > by_id["fast"].decode_speed_factor
        await eventually(
            lambda: fast.free() == free_fast and slow.free() == free_slow, what="both pools free", timeout=30
        )
    finally:
        await fast.close()
        await slow.close()

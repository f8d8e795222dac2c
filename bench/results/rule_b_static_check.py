"""Scratch (session 22): fixed (prefill, decode) fleets on the planner's quick day (bench/planner.py
--quick, seed 0), decode-local prefill off and on: the check behind the session-21 rule change (a
decode already past its slack is priced against its whole TPOT budget, not at nothing). Run from the
repo root, at each commit to compare: .venv/bin/python -m bench.results.rule_b_static_check"""

import os

from bench.fleet_sim import FleetSim
from bench.machine import cpu_model
from bench.planner import FULL_DAY_S, FULL_INTERVAL_S, FULL_STARTUP_S, PROFILE, workload
from services.model.timing import load_profile

DAY_S = 1200.0
scale = DAY_S / FULL_DAY_S
prof = load_profile(PROFILE)
print(
    f"cpu: {cpu_model()} x{os.cpu_count()} (a simulation: the CPU sets only how long it takes); profile {PROFILE}"
)
found = {}
for kind in ("diurnal", "bursty"):
    reqs = workload(kind, DAY_S, 40.0, 0)
    for p, d in ((7, 5), (6, 6), (6, 7), (5, 7)):
        row = []
        for local in (False, True):
            sim = FleetSim(
                prof,
                initial=(p, d),
                startup_s=FULL_STARTUP_S * scale,
                interval_s=FULL_INTERVAL_S * scale,
                local_prefill=local,
                ttft_slo_s=1.0,
                itl_slo_s=0.05,
            )
            r = sim.run(reqs, lambda obs, now, pd=(p, d): pd)
            row.append(r.attainment(1.0, 0.05))
        found[(kind, p, d)] = row
        print(
            f"{kind:8} static ({p}, {d}): attainment without decode-local prefill {row[0]:.3f}, with {row[1]:.3f}"
        )
off, on = found[("diurnal", 7, 5)]
print(f"rule_b_static_check diurnal_7_5_off={off:.3f} diurnal_7_5_on={on:.3f}")

"""One (profile, link, workload, P:D split) row of the GPU-regime study, disagg vs cond, at given
rates with attainment pooled over arrival seeds: how the rows where cond lost were examined (issue 19).

    python bench/disagg_rows.py splitwise-h100-llama70b rdma mix 5 3.0,3.2,3.4,3.6 1,2,3

prints, per rate and mode: attainment (mean over seeds) and, per seed, local prefills, locals that
missed, TTFT and TPOT misses. Run it with PYTHONPATH at another tree to compare another rule.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.disagg_gpu import GPUS, LINKS, SPECS
from bench.disagg_sim import Sim, attainment, make_requests
from services.model.timing import load_profile


def main(argv: list[str]) -> int:
    pname, link, w, p = argv[0], argv[1], argv[2], int(argv[3])
    rates = [float(x) for x in argv[4].split(",")]
    seeds = [int(s) for s in (argv[5] if len(argv) > 5 else "1").split(",")]
    prof = replace(load_profile(pname), kv_bandwidth_gbps=LINKS[link])
    specs = SPECS[w](300, 0)
    for rate in rates:
        for mode in ("disagg", "cond"):
            atts, info = [], []
            for s in seeds:
                reqs = Sim(prof, p, GPUS - p, mode, s).run(make_requests(prof, specs, rate * GPUS, s))
                atts.append(attainment(reqs))
                local = [r for r in reqs if r.path == "local"]
                ttft = sum(r.first_at - r.arrival > r.ttft_slo for r in reqs)
                tpot = sum(
                    r.spec.output > 1 and (r.done_at - r.first_at) / (r.spec.output - 1) > r.tpot_slo
                    for r in reqs
                )
                info.append(
                    f"local={len(local)} local_missed={sum(not r.ok for r in local)} ttft={ttft} tpot={tpot}"
                )
            print(
                f"{w} {pname} {link} {p}:{GPUS - p} rate/inst={rate} {mode:6} att={sum(atts) / len(atts):.3f} "
                f"misses per seed: {'; '.join(info)}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

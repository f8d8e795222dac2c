"""A pool's measured capacity per size: the most demand c workers of a role carry within the SLO.

The queueing formulas in `sizing` are a model of a pool; this is a measurement of one. For
each role and each pool size c it holds the highest demand a pool of c workers served at
a stationary load with at least `goal` of the requests within the SLO:

- prefill: uncached prompt tokens per second (TTFT <= the TTFT SLO);
- decode: output tokens per second (mean ITL <= the ITL SLO).

Demand, not requests/s, so that a table measured at one length mix still sizes a mix with
longer or shorter prompts (to first order: the tail of the lengths is the table's own).
It is what an offline profile of a deployment gives (AIBrix's per-GPU profiles, Dynamo's
pre-deployment SLA profiling), pooled: c workers behind one router carry more than c times
one, and the table says by how much instead of a formula guessing it. `bench/planner.py`
measures one on the fleet simulation (a stationary Poisson load, the workload's lengths)
and writes it as JSON; `Planner` sizes from it when given one, and from the formulas when
not or beyond its largest pool (extrapolated at the largest pool's per-worker rate).

Plain: no engine, no process, no network.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

ROLES = ("prefill", "decode")


class CapacityTableError(ValueError):
    """The table file is malformed or its capacities are impossible."""


@dataclass(frozen=True)
class CapacityTable:
    prefill: tuple[
        float, ...
    ]  # [c - 1]: uncached prompt tokens/s c prefill workers carry within the TTFT SLO
    decode: tuple[float, ...]  # [c - 1]: output tokens/s c decode workers carry within the ITL SLO
    goal: float = 0.95  # the share of requests within the SLO each capacity was measured at
    source: str = ""

    def __post_init__(self) -> None:
        for role in ROLES:
            caps = getattr(self, role)
            if not caps or any(not (c > 0 and math.isfinite(c)) for c in caps):
                raise CapacityTableError(
                    f"capacity table: {role} needs positive finite capacities, got {caps}"
                )
            if any(b < a for a, b in itertools.pairwise(caps)):
                raise CapacityTableError(f"capacity table: {role} capacities must not fall with more workers")
        if not 0 < self.goal < 1:
            raise CapacityTableError(f"capacity table: goal must be in (0, 1), got {self.goal}")

    def workers(self, role: str, demand: float) -> int:
        """The fewest workers of `role` whose measured capacity covers `demand` (0 for no demand)."""
        if demand <= 0:
            return 0
        caps = getattr(self, role)
        for c, cap in enumerate(caps, start=1):
            if cap >= demand:
                return c
        # beyond the largest pool measured: more of them at its per-worker rate (a big pool is
        # at least as efficient per worker as a smaller one, so this errs on the side of more)
        per_worker = caps[-1] / len(caps)
        return max(len(caps) + 1, math.ceil(demand / per_worker - 1e-9))

    def capacity(self, role: str, workers: int) -> float:
        """The demand `workers` of `role` carry (beyond the table: at its largest pool's per-worker rate)."""
        caps = getattr(self, role)
        if workers <= 0:
            return 0.0
        if workers <= len(caps):
            return caps[workers - 1]
        return caps[-1] / len(caps) * workers

    def to_doc(self) -> dict:
        return {
            "source": self.source,
            "goal": self.goal,
            "prefill": list(self.prefill),
            "decode": list(self.decode),
        }

    @classmethod
    def from_doc(cls, doc: dict) -> CapacityTable:
        try:
            return cls(
                tuple(float(x) for x in doc["prefill"]),
                tuple(float(x) for x in doc["decode"]),
                float(doc.get("goal", 0.95)),
                str(doc.get("source", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CapacityTableError):
                raise
            raise CapacityTableError(f"capacity table: missing or malformed field {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> CapacityTable:
        return cls.from_doc(json.loads(Path(path).read_text()))

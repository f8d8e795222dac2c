"""The best prefill:decode split per workload, as the GPU-regime disaggregation
study measured it (issue 19 item 3), for the planner to start from.

`bench/disagg.py --engine sim` sweeps every P:D split of 8 instances for each
timing profile, KV link and workload, in three deployments (aggregated,
disaggregated, conditional), and writes the winners to `split_table.json` beside
this module (the full sweep, every split's goodput, is
bench/results/disagg_gpu_splits.json). The table is data, not a rule: it says
which share of a fixed fleet prefill should get for a workload like one of the
study's, on a profile like one of its; the planner sizes pools from measured
rates and uses the share where it has no measurement of its own yet.

Plain: no engine, no process, no network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("split_table.json")


class SplitTableError(ValueError):
    """The table file is missing a field or holds an impossible split."""


@dataclass(frozen=True)
class Split:
    """One row: the best split of `instances` for (profile, link, workload)."""

    profile: str
    link: str
    workload: str
    instances: int
    prefill: int  # prefill workers in the best conditional deployment
    decode: int
    disagg_prefill: int  # the best split of the always-remote deployment (it may differ)
    disagg_decode: int
    goodput_agg: float  # requests/s per instance at >= 90% SLO attainment
    goodput_disagg: float
    goodput_cond: float

    @property
    def prefill_share(self) -> float:
        """The prefill workers' share of the fleet."""
        return self.prefill / self.instances

    def scaled(self, workers: int) -> tuple[int, int]:
        """(prefill, decode) for a fleet of `workers` at this row's share, each at least 1."""
        if workers < 2:
            raise SplitTableError(f"a split needs at least 2 workers, got {workers}")
        p = min(max(1, round(workers * self.prefill_share)), workers - 1)
        return p, workers - p


def _ratio(text: str, instances: int, where: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise SplitTableError(f"{where}: split {text!r} is not P:D") from None
    if p < 1 or d < 1 or p + d != instances:
        raise SplitTableError(f"{where}: split {text!r} is not a split of {instances} instances")
    return p, d


@dataclass(frozen=True)
class SplitTable:
    rows: tuple[Split, ...]

    @classmethod
    def load(cls, path: Path = TABLE_PATH) -> SplitTable:
        doc = json.loads(Path(path).read_text())
        return cls.from_doc(doc)

    @classmethod
    def from_doc(cls, doc: dict) -> SplitTable:
        """From the study's JSON (`instances` and `best[profile][link][workload]`)."""
        try:
            instances = int(doc["instances"])
            rows = []
            for profile, links in doc["best"].items():
                for link, workloads in links.items():
                    for workload, row in workloads.items():
                        where = f"{profile}/{link}/{workload}"
                        p, d = _ratio(row["best_cond_split"], instances, where)
                        dp, dd = _ratio(row["best_disagg_split"], instances, where)
                        g = row["goodput_per_instance"]
                        rows.append(
                            Split(
                                profile, link, workload, instances, p, d, dp, dd,
                                float(g["agg"]), float(g["disagg"]), float(g["cond"]),
                            )
                        )  # fmt: skip
        except (KeyError, TypeError) as e:
            raise SplitTableError(f"split table: missing or malformed field {e}") from None
        return cls(tuple(rows))

    def best(self, profile: str, link: str, workload: str) -> Split:
        for r in self.rows:
            if (r.profile, r.link, r.workload) == (profile, link, workload):
                return r
        raise KeyError(f"no split measured for {profile}/{link}/{workload}")

    def render(self) -> str:
        """The table as text (what `bench/disagg.py --engine sim` prints and BENCHMARKS.md shows)."""
        lines = [
            f"{'profile':<24} {'link':<6} {'workload':<9} {'cond P:D':>8} {'disagg P:D':>10} "
            f"{'agg':>7} {'disagg':>7} {'cond':>7}  (goodput req/s per instance)"
        ]
        for r in self.rows:
            lines.append(
                f"{r.profile:<24} {r.link:<6} {r.workload:<9} {f'{r.prefill}:{r.decode}':>8} "
                f"{f'{r.disagg_prefill}:{r.disagg_decode}':>10} {r.goodput_agg:>7.3f} "
                f"{r.goodput_disagg:>7.3f} {r.goodput_cond:>7.3f}"
            )
        return "\n".join(lines)

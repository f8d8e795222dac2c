"""Two systems' records of one side-by-side run, compared request by request.

    .venv/bin/python bench/peers/dynamo/run.py --policies kv --rates 2 --records-dir DIR
    .venv/bin/python bench/peers/dynamo/records.py DIR/dynamo-kv-x2.jsonl DIR/pdmesh-kv-x2.jsonl

run.py's table compares each system's TTFT percentiles; two medians differ for
reasons that have nothing to do with either system (which requests land in a
burst, which prompts are long). Both systems got the same workload, so this
pairs the records by the load's index and prints, per prompt-length band, each
side's median TTFT and the median of the per-request difference (B - A), then
`records_compare n=.. a_p50_ms=.. b_p50_ms=.. diff_p50_ms=..`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.peers.dynamo.compare import paired_ttft
from bench.stats import read_run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="records of system A (JSONL from run.py --records-dir)")
    p.add_argument("b", help="records of system B")
    args = p.parse_args(argv)
    meta_a, recs_a = read_run(args.a)
    meta_b, recs_b = read_run(args.b)
    name_a, name_b = meta_a.get("system", "A"), meta_b.get("system", "B")
    bands, total = paired_ttft(recs_a, recs_b)
    print(f"A = {name_a} ({args.a}), B = {name_b} ({args.b}); TTFT in ms, paired by the load's index")
    print(f"{'prompt tokens':>16} {'n':>5} {name_a + ' p50':>12} {name_b + ' p50':>12} {'B - A p50':>10}")
    for b in [*bands, total]:
        label = "all" if b is total else f"{b.lo}-{b.hi if b.hi is not None else ''}"
        print(f"{label:>16} {b.n:>5} {b.a_p50_ms:>12.1f} {b.b_p50_ms:>12.1f} {b.diff_p50_ms:>10.1f}")
    print(
        f"records_compare n={total.n} a_p50_ms={total.a_p50_ms:.1f} b_p50_ms={total.b_p50_ms:.1f} "
        f"diff_p50_ms={total.diff_p50_ms:.1f}"
    )
    return 0 if total.n else 1


if __name__ == "__main__":
    sys.exit(main())

"""A/B of `bench/routing.py --part 2` between two checkouts, alternating, with ratios.

The router's own cost (part 2) swings 2x run to run on a shared machine, so a
before/after pair means little unless both ran under the same load. This runs
part 2 of checkout A (`--base`, e.g. `git archive <commit> | tar -x -C DIR`)
and of this checkout in turn, `--rounds` times, each as its own processes
(router, fake worker, client) with PYTHONPATH set to that checkout, and prints
per key of part 2's last line the median of each side and the ratio
(this / base; for latencies and CPU per message lower is better, for rates
higher). The router's CPU microseconds per relayed message (from part 2's
lines: us_per_msg_1, us_per_tok_8, us_per_msg_64, us_per_event_http) move less
with the machine's load than the rates do.

Run: `python bench/part2_ab.py --base /tmp/base [--this DIR] [--rounds 3] [--no-link]`.
The last line is `part2_ab rounds=.. router_msgs_per_s=<ratio> router_tokens_per_s=<ratio>
http_msgs_per_s=<ratio> router_overhead_ms_p50=<ratio> ttft_p50_ms=<ratio> ttft_p99_ms=<ratio>
scale_2proc=<ratio> us_per_msg_1=.. us_per_tok_8=.. us_per_msg_64=.. us_per_event_http=..`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
KEYS = (
    "router_msgs_per_s",
    "router_tokens_per_s",
    "http_msgs_per_s",
    "router_overhead_ms_p50",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "scale_2proc",
    "us_per_msg_1",
    "us_per_tok_8",
    "us_per_msg_64",
    "us_per_event_http",
)
# The router's CPU per relayed message in part 2's lines: steadier than the rates under load.
CPU_LINES = {
    "1 stream": "us_per_msg_1",
    "8 streams": "us_per_tok_8",
    "64 streams": "us_per_msg_64",
    "HTTP door": "us_per_event_http",
}


def run_part2(root: Path, extra: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, str(root / "bench" / "routing.py"), "--part", "2", "--quick", *extra]
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("routing ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"part 2 in {root} failed ({out.returncode}): {out.stderr[-2000:]}")
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    r = {k: float(fields[k]) for k in KEYS if k in fields}
    for ln in out.stdout.splitlines():
        for prefix, key in CPU_LINES.items():
            m = re.search(r"router CPU (\d+) us", ln)
            if ln.startswith(prefix) and m:
                r[key] = float(m.group(1))
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the other checkout (A)")
    p.add_argument("--this", default=str(HERE), help="checkout B (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-link", action="store_true")
    a = p.parse_args(argv)
    base, this = Path(a.base).resolve(), Path(a.this).resolve()
    extra = ["--no-link"] if a.no_link else []
    runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    for i in range(a.rounds):
        for side, root in (
            (("base", base), ("this", this)) if i % 2 == 0 else (("this", this), ("base", base))
        ):
            print(f"round {i + 1} {side} ({root}), load {os.getloadavg()[0]:.1f}", flush=True)
            try:
                r = run_part2(root, extra)
            except SystemExit as e:  # on a saturated machine the router may call the fake unhealthy
                print(f"  round failed, left out: {str(e)[-300:]}", flush=True)
                continue
            runs[side].append(r)
            print("  " + " ".join(f"{k}={v:g}" for k, v in r.items()), flush=True)
    ratios = {}
    print(f"\n{'key':24} {'base median':>12} {'this median':>12} {'this/base':>10}")
    for k in KEYS:
        b = [r[k] for r in runs["base"] if k in r]
        t = [r[k] for r in runs["this"] if k in r]
        if not b or not t:
            continue
        mb, mt = statistics.median(b), statistics.median(t)
        ratios[k] = mt / mb if mb else float("nan")
        print(f"{k:24} {mb:12.3f} {mt:12.3f} {ratios[k]:10.2f}")
    print(f"part2_ab rounds={a.rounds} " + " ".join(f"{k}={v:.2f}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

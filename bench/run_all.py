"""`make bench`: the quick version of every benchmark, one after another.

Each script runs in its own process (they start their own services) and must
end with one `name key=value ...` summary line; this prints those lines again
at the end, in order, with each script's wall time. A script that fails or
prints no summary line makes the whole run fail.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHES = [
    ("engine", ["bench/engine.py", "--quick"]),
    ("kv_transfer", ["bench/kv_transfer.py", "--quick"]),
    ("calibrate", ["bench/calibrate.py", "--quick"]),
    ("routing", ["bench/routing.py", "--quick"]),
    ("disagg", ["bench/disagg.py", "--quick"]),
    ("disagg_gpu", ["bench/disagg.py", "--engine", "sim", "--quick"]),
    ("routing_decision", ["bench/routing.py", "--decision"]),
    ("planner", ["bench/planner.py", "--quick"]),
    ("workflows", ["bench/workflows.py", "--quick"]),
    ("kv_tiers", ["bench/kv_tiers.py", "--quick"]),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="quick versions (the only mode for now)")
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(n for n, _ in BENCHES))
    args = ap.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    summaries: list[str] = []
    failed: list[str] = []
    for name, cmd in BENCHES:
        if only and name not in only:
            continue
        if not (ROOT / cmd[0]).exists():
            print(f"== {name}: {cmd[0]} missing", flush=True)
            failed.append(name)
            continue
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, *cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        wall = time.monotonic() - t0
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        print("\n".join(line for line in lines if not line.startswith("{")), flush=True)
        last = lines[-1] if lines else ""
        if proc.returncode != 0 or "=" not in last or " " not in last:
            failed.append(name)
            print(f"== {name}: FAILED (exit {proc.returncode})", flush=True)
        else:
            summaries.append(f"{last}  [{wall:.0f} s]")
    print("\n== summary")
    print("\n".join(summaries))
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

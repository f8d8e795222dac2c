"""Calibrate a sim timing profile from the torch engine on this machine.

Runs the real torch engine (built-in `small` preset, one thread, bfloat16 by
default: the engine's fastest CPU dtype here, see bench/results/engine.txt) and
times every `ModelRunner.run` call (the forward pass and sampling; not the
scheduler, which the sim engine runs for real). Each pass is described by
the same quantities the sim engine prices (`services.engine.sim.runner.pass_shape`):

- prefill: T new tokens with C tokens of cached context (C = 0, and a prefix
  made cached by an earlier request), one pass each;
- decode: steps of B sequences with K total context (the B sequences share
  one prompt through the prefix cache, so building a batch costs one prefill).

It fits the profile's forms by non-negative least squares on relative
residuals (each point weighted by 1/measured; `fit`)

    prefill_ms = p0 + p1*T + p2*T^2 + p3*T*C/1000
    decode_ms  = d0 + d1*B + d2*K/1000 + d3*(K/1000)^2        (form "quadratic")

(the K^2 term because decode steps here grow faster than linearly once the
batch's KV outgrows the CPU caches; measured, not assumed: see the residuals),
prints every point with its fit and residual and R^2, and writes (or
replaces) the profile `cpu-small-<dtype>` in services/model/profiles.json
with a `source` naming the command, machine and date. The KV bandwidth is not
measured here: it is taken from bench/results/kv_transfer.txt (NIXL, DRAM,
two processes; `--kv-bandwidth-gbps`).

Run: `python bench/calibrate.py` (full, ~2 min; writes the profile) or
`--quick` (~30 s; prints the fit, writes only with `--write`, so `make bench`
leaves the checked-in profile alone).
Last line: `calibrate p0=.. p1=.. p2=.. p3=.. d0=.. d1=.. d2=.. d3=.. r2_prefill=.. r2_decode=..`.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/calibrate.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from services.engine.api import EngineRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine_spec import EngineSpec
from services.engine.llm_engine import LLMEngine
from services.engine.model_runner import ModelRunner
from services.engine.sim.runner import pass_shape
from services.model.timing import PROFILES_PATH, load_profiles

# NIXL between two processes on this machine, 64 MiB scattered blocks: 5.8-7.1 GB/s.
KV_BANDWIDTH_SOURCE = "bench/results/kv_transfer.txt (NIXL, DRAM, 2 processes)"


@dataclass(frozen=True)
class Plan:
    prefill_tokens: tuple[int, ...]  # T, with no cached context
    cached_context: tuple[int, ...]  # C (multiples of 16), each with `cached_tokens`
    cached_tokens: tuple[int, ...]  # T measured on top of each C
    batches: tuple[int, ...]  # B
    contexts: tuple[int, ...]  # per-sequence prompt length of the decode batches
    decode_steps: int  # steps timed per (B, context)
    trials: int  # repeats of each prefill point (median kept)


FULL = Plan((16, 32, 64, 128, 256, 512, 768, 1024, 1536), (256, 1024), (16, 128, 512), (1, 2, 4, 8, 16, 32),
            (64, 512, 1024, 1536), 16, 5)  # fmt: skip
QUICK = Plan((16, 64, 128, 256, 512, 1024), (512,), (32, 256), (1, 4, 8, 16, 32), (64, 384, 768), 8, 3)


class TimedRunner:
    """ModelRunner with every `run` timed and described as (T, C, B, K, ms)."""

    def __init__(self, inner: ModelRunner):
        self.inner = inner
        self.samples: list[tuple[int, float, int, int, float]] = []

    def run(self, scheduled):
        shape = pass_shape(scheduled)
        t0 = time.perf_counter()
        out = self.inner.run(scheduled)
        self.samples.append((*shape, (time.perf_counter() - t0) * 1000))
        return out

    def __getattr__(self, name):  # kv_pool, import/export_blocks, chunk_logits
        return getattr(self.inner, name)


def make_engine(dtype: str) -> tuple[LLMEngine, TimedRunner]:
    config = EngineConfig(
        preset="small", dtype=dtype, num_threads=1, num_blocks=1024, max_num_batched_tokens=4096
    )
    timed: list[TimedRunner] = []

    def factory(spec: EngineSpec) -> TimedRunner:
        timed.append(TimedRunner(ModelRunner(spec)))
        return timed[-1]

    engine = LLMEngine(config, runner_factory=factory)
    return engine, timed[0]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def req(rid: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def measure_prefill(engine: LLMEngine, runner: TimedRunner, plan: Plan) -> list[tuple[int, float, float]]:
    """(T, C, median ms) per point; each trial is one pass of a fresh prompt."""
    points = [(t, 0) for t in plan.prefill_tokens]
    points += [(t, c) for c in plan.cached_context for t in plan.cached_tokens]
    out, seed = [], 0
    engine.generate([req("warmup", tokens(256, 10_000), 2)])
    for t, c in points:
        times = []
        for _ in range(plan.trials):
            seed += 1
            prefix = tokens(c, seed)
            if c:
                engine.generate([req(f"c{seed}", [*prefix, 255], 1)])  # cache the prefix
            runner.samples.clear()
            engine.generate([req(f"p{seed}", prefix + tokens(t, seed + 50_000), 1)])
            (shape,) = [s for s in runner.samples if s[0]]
            assert (shape[0], round(shape[1])) == (t, c), f"scheduled {shape[:2]}, wanted {(t, c)}"
            times.append(shape[4])
        engine.reset_prefix_cache()
        out.append((t, c, statistics.median(times)))
    return out


def measure_decode(engine: LLMEngine, runner: TimedRunner, plan: Plan) -> list[tuple[int, float, float]]:
    """(B, mean K, median ms) per (B, context): the decode-only steps of a batch of B,
    the first two dropped (new batch shapes are slower the first time)."""
    out, seed = [], 100_000
    for ctx in plan.contexts:
        for b in plan.batches:
            seed += 1
            shared = tokens(ctx - 1, seed)
            engine.generate([req(f"w{seed}", [*shared, 255], 1)])  # cache the shared prompt
            for i in range(b):  # one distinct last token each: B sequences, one prefill of the prefix
                engine.add_request(req(f"d{seed}-{i}", [*shared, i], plan.decode_steps + 4))
            steps = []
            while engine.has_unfinished_requests():
                runner.samples.clear()
                engine.step()
                steps += [(s[3], s[4]) for s in runner.samples if s[0] == 0 and s[2] == b]
            steps = steps[2:]
            out.append((b, statistics.mean(k for k, _ in steps), statistics.median(ms for _, ms in steps)))
            engine.reset_prefix_cache()
    return out


def fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Non-negative least squares on relative residuals: coefficients, fitted values, R^2.

    Every coefficient is a cost, so none may be negative (an exact NNLS by trying
    every subset of columns: at most 2^4 small solves). Rows are weighted by
    1/y so a 16-token pass counts as much as a 1,536-token one (times span two
    decades). R^2 is of the unweighted values.
    """
    xw, yw = x / y[:, None], np.ones_like(y)
    best, coef = math.inf, np.zeros(x.shape[1])
    for mask in itertools.product((False, True), repeat=x.shape[1]):
        cols = [i for i, keep in enumerate(mask) if keep]
        c = np.zeros(x.shape[1])
        if cols:
            c[cols] = np.linalg.lstsq(xw[:, cols], yw, rcond=None)[0]
        if (c < 0).any():
            continue
        err = float(((xw @ c - yw) ** 2).sum())
        if err < best:
            best, coef = err, c
    pred = x @ coef
    ss_res, ss_tot = float(((y - pred) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return coef, pred, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


def fit_prefill(points):
    t = np.array([p[0] for p in points], dtype=float)
    c = np.array([p[1] for p in points], dtype=float)
    x = np.stack([np.ones_like(t), t, t * t, t * c / 1000.0], axis=1)
    return fit(x, np.array([p[2] for p in points]))


def fit_decode(points):
    b = np.array([p[0] for p in points], dtype=float)
    k = np.array([p[1] for p in points], dtype=float)
    x = np.stack([np.ones_like(b), b, k / 1000.0, (k / 1000.0) ** 2], axis=1)
    return fit(x, np.array([p[2] for p in points]))


def write_profile(name: str, table: dict, path: Path = PROFILES_PATH) -> None:
    """Replace `name` in profiles.json, keeping the others; one line per field."""
    data = json.loads(path.read_text())
    data[name] = table
    lines = ["{"]
    for i, (key, value) in enumerate(data.items()):
        end = "," if i < len(data) - 1 else ""
        if not isinstance(value, dict):
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{end}")
            continue
        fields = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()]
        lines += [f"  {json.dumps(key)}: {{", ",\n".join(fields), f"  }}{end}"]
    path.write_text("\n".join([*lines, "}"]) + "\n")
    load_profiles(path)  # refuse to leave a table the sim engine cannot read


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
        cpu = model
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer points (< 2 min)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--kv-bandwidth-gbps", type=float, default=6.0, help=f"from {KV_BANDWIDTH_SOURCE}")
    p.add_argument("--no-write", action="store_true", help="print the fit only (full run)")
    p.add_argument("--write", action="store_true", help="write the profile after a --quick run too")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    torch.manual_seed(0)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    engine, runner = make_engine(args.dtype)
    prefill = measure_prefill(engine, runner, plan)
    decode = measure_decode(engine, runner, plan)
    wall = time.perf_counter() - t_start
    cpu_share = (time.process_time() - cpu_start) / wall
    pc, ppred, pr2 = fit_prefill(prefill)
    dc, dpred, dr2 = fit_decode(decode)

    print(f"calibrate: torch engine, small preset, {args.dtype}, 1 thread; {machine()}")
    print(f"{len(prefill)} prefill and {len(decode)} decode points in {wall:.0f} s (cpu {cpu_share:.0%})")
    print(
        f"prefill_ms = {pc[0]:.3f} + {pc[1]:.5f}*T + {pc[2]:.3e}*T^2 + {pc[3]:.5f}*T*C/1000   R^2 {pr2:.4f}"
    )
    print("       T      C   measured     fitted   residual")
    for (t, c, ms), f in zip(prefill, ppred, strict=True):
        print(f"  {t:6d} {c:6.0f} {ms:10.2f} {f:10.2f} {100 * (ms - f) / ms:+9.1f}%")
    print(
        f"decode_ms  = {dc[0]:.3f} + {dc[1]:.4f}*B + {dc[2]:.4f}*K/1000 + {dc[3]:.5f}*(K/1000)^2   "
        f"R^2 {dr2:.4f}"
    )
    print("       B       K   measured     fitted   residual")
    for (b, k, ms), f in zip(decode, dpred, strict=True):
        print(f"  {b:6d} {k:7.0f} {ms:10.2f} {f:10.2f} {100 * (ms - f) / ms:+9.1f}%")

    name = f"cpu-small-{args.dtype}"
    spec = engine.spec
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python bench/calibrate.py" + (" --quick" if args.quick else "")
    table = {
        "source": f"`{cmd}` on {machine()}, {date}: torch engine, small preset, {args.dtype}, "
        f"1 thread, ModelRunner.run timed; R^2 prefill {pr2:.3f}, decode {dr2:.3f}; "
        f"KV bandwidth from {KV_BANDWIDTH_SOURCE}",
        "prefill": [round(float(v), 9) for v in pc],
        "decode_form": "quadratic",
        "decode": [round(float(v), 6) for v in dc],
        "decode_min_ms": 0.0,  # coefficients are non-negative: d0 is the floor
        "kv_bytes_per_token": spec.layout.bytes_per_token(),
        "kv_bandwidth_gbps": args.kv_bandwidth_gbps,
        # What the torch engine sizes by default with EngineConfig's defaults.
        "num_blocks": EngineSpec.resolve(EngineConfig(preset="small", dtype=args.dtype)).num_blocks,
        "block_size": spec.config.block_size,
        "max_num_seqs": EngineConfig().max_num_seqs,
        "max_num_batched_tokens": EngineConfig().max_num_batched_tokens,
    }
    if args.write or not (args.quick or args.no_write):
        write_profile(name, table)
        print(f"wrote profile {name!r} to {PROFILES_PATH}")
    else:
        print(f"profile {name!r} not written (--quick without --write, or --no-write)")
    kv = {f"p{i}": f"{v:.6g}" for i, v in enumerate(pc)} | {f"d{i}": f"{v:.6g}" for i, v in enumerate(dc)}
    kv |= {"r2_prefill": f"{pr2:.4f}", "r2_decode": f"{dr2:.4f}", "profile": name, "cpu": f"{cpu_share:.2f}"}
    print("calibrate " + " ".join(f"{k}={v}" for k, v in kv.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pure helpers of the Dynamo side-by-side (run.py): metrics, rows, the table.

No processes, no Dynamo imports: run.py feeds it load-generator records and
/metrics text, and tests/unit/peers checks it without Dynamo's venv. Owns:

- `parse_prometheus` / `metric`: Prometheus text exposition -> values (sums
  over label sets matching a filter), for Dynamo's /metrics page;
- `balance`: how unevenly requests spread over the workers;
- `ideal_prefix_reuse`: the prefix reuse an infinite single cache would get on
  a workload (the ceiling any router can reach);
- `Row` / `make_row`: one (system, policy, rate) run reduced to the compared
  figures; `format_table` and `summary_line` print them;
- `paired_ttft`: two systems' records of the same load (run.py `--records-dir`)
  matched request by request, TTFT by prompt-length band (`records.py` prints it).
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bench.stats import RequestRecord, summarize

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line; comments and junk lines skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        out.append((m.group(1), labels, value))
    return out


def metric(samples: Iterable[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0.0 if none)."""
    return sum(
        v for n, lab, v in samples if n == name and all(lab.get(k) == want for k, want in labels.items())
    )


def mean_of(samples: Sequence[tuple[str, dict[str, str], float]], base: str, **labels: str) -> float:
    """`base`_sum / `base`_count (a histogram's or summary's mean), NaN when no observation."""
    count = metric(samples, base + "_count", **labels)
    return metric(samples, base + "_sum", **labels) / count if count else math.nan


def balance(requests_per_worker: Sequence[float], workers: int) -> dict[str, float]:
    """Requests of the busiest worker over the mean (1.0 = even), idle workers counted."""
    counts = list(requests_per_worker) + [0.0] * max(workers - len(requests_per_worker), 0)
    total = sum(counts)
    return {"busiest_over_mean": max(counts) / (total / len(counts)) if total else math.nan}


def ideal_prefix_reuse(prompts: Iterable[Sequence[int]], block_size: int) -> float:
    """Share of prompt tokens in full blocks whose whole prefix came earlier in `prompts`.

    What one worker with an infinite prefix cache would reuse (block-granular, as
    both engines cache): a ceiling for any router and cache size. Engines also
    keep the last prompt token to compute, so measured reuse sits slightly below.
    """
    seen: set[int] = set()
    hit = total = 0
    for prompt in prompts:
        total += len(prompt)
        h, matching = 0, True
        for start in range(0, len(prompt) - block_size + 1, block_size):
            h = hash((h, tuple(prompt[start : start + block_size])))
            if matching and h in seen:
                hit += block_size
            else:
                matching = False
            seen.add(h)
    return hit / total if total else math.nan


@dataclass
class Row:
    """The compared figures of one run (times in ms)."""

    system: str  # "dynamo" | "pdmesh"
    policy: str  # "kv" | "round_robin"
    rate: str  # label of the arrival rate: "x<multiplier> (<requests/s>/s)", e.g. "x4 (11.3/s)"
    requests: int
    ok: int
    ttft_p50: float
    ttft_p99: float
    ttft_mean: float
    itl_p50: float
    itl_p99: float
    tpot_p50: float
    output_tok_s: float
    prefix_reuse: float  # cached prompt tokens / prompt tokens, from the engines' usage
    cpu_s: float = math.nan  # CPU seconds of the system's own processes during the load
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return self.policy, self.rate


def make_row(system: str, policy: str, rate: str, records: Sequence[RequestRecord], cpu_s: float) -> Row:
    s = summarize(records)
    good = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in good)
    return Row(
        system=system,
        policy=policy,
        rate=rate,
        requests=s.requests,
        ok=s.ok,
        ttft_p50=s.ttft.p50 * 1e3,
        ttft_p99=s.ttft.p99 * 1e3,
        ttft_mean=s.ttft.mean * 1e3,
        itl_p50=s.itl.p50 * 1e3,
        itl_p99=s.itl.p99 * 1e3,
        tpot_p50=s.tpot.p50 * 1e3,
        output_tok_s=s.output_tok_s,
        prefix_reuse=sum(r.cached_tokens for r in good) / prompt if prompt else math.nan,
        cpu_s=cpu_s,
    )


COLUMNS = (
    ("system", "{:<7}", "system"),
    ("policy", "{:<11}", "policy"),
    ("rate", "{:<14}", "rate"),
    ("ok", "{:>7}", "ok/sent"),
    ("ttft_p50", "{:>8.1f}", "TTFT p50"),
    ("ttft_p99", "{:>8.1f}", "TTFT p99"),
    ("itl_p50", "{:>7.1f}", "ITL p50"),
    ("itl_p99", "{:>7.1f}", "ITL p99"),
    ("tpot_p50", "{:>8.1f}", "TPOT p50"),
    ("output_tok_s", "{:>7.0f}", "tok/s"),
    ("prefix_reuse", "{:>6.1%}", "reuse"),
    ("cpu_s", "{:>6.1f}", "CPU s"),
)


def format_table(rows: Sequence[Row]) -> str:
    """One line per run, times in ms; systems of the same (policy, rate) next to each other."""
    head = []
    for _, fmt, title in COLUMNS:
        width = int(re.search(r"(\d+)", fmt).group(1))
        head.append(title.rjust(width) if ">" in fmt else title.ljust(width))
    lines = ["  ".join(head)]
    order = {k: i for i, k in enumerate(dict.fromkeys(r.key for r in rows))}
    for r in sorted(rows, key=lambda r: (order[r.key], r.system)):
        cells = []
        for attr, fmt, _ in COLUMNS:
            v = f"{r.ok}/{r.requests}" if attr == "ok" else getattr(r, attr)
            cells.append(fmt.format(v) if not (isinstance(v, float) and math.isnan(v)) else "n/a".rjust(6))
        lines.append("  ".join(cells))
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return "n/a" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}"


def summary_line(rows: Sequence[Row], overhead: dict[str, float] | None = None) -> str:
    """`dynamo_vs_pdmesh key=value ...`: Dynamo / pdmesh ratios (< 1 = Dynamo lower) per
    (policy, rate) present for both systems, plus the measured overheads in ms."""
    by = {(r.system, r.policy, r.rate): r for r in rows}
    parts = []
    for policy, rate in dict.fromkeys(r.key for r in rows):
        d, p = by.get(("dynamo", policy, rate)), by.get(("pdmesh", policy, rate))
        if d is None or p is None:
            continue
        tag = f"{'kv' if policy == 'kv' else 'rr'}_{rate.split()[0]}"
        parts += [
            f"ttft_p50_{tag}={_ratio(d.ttft_p50, p.ttft_p50)}",
            f"ttft_p99_{tag}={_ratio(d.ttft_p99, p.ttft_p99)}",
            f"itl_p50_{tag}={_ratio(d.itl_p50, p.itl_p50)}",
            f"itl_p99_{tag}={_ratio(d.itl_p99, p.itl_p99)}",
            f"reuse_{tag}={d.prefix_reuse:.3f}/{p.prefix_reuse:.3f}",
        ]
    for k, v in (overhead or {}).items():
        parts.append(f"{k}={'n/a' if math.isnan(v) else f'{v:.2f}'}")
    return "dynamo_vs_pdmesh " + " ".join(parts)


# Prompt-length bands (tokens, lower bound inclusive) for `paired_ttft`.
BANDS = (0, 500, 1000, 2000, 4000)


@dataclass
class Band:
    lo: int
    hi: int | None  # None: no upper bound
    n: int
    a_p50_ms: float
    b_p50_ms: float
    diff_p50_ms: float  # median over requests of (b - a)


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def paired_ttft(
    a: Sequence[RequestRecord], b: Sequence[RequestRecord], bands: Sequence[int] = BANDS
) -> tuple[list[Band], Band]:
    """TTFT of the same requests under two systems, per prompt-length band and overall.

    Records pair by the load's index (the part of `request_id` after its last '-': bench.loadgen
    names them `lg-<run>-<i>`, the i-th item of the workload, which both systems were sent);
    a request with no first token on either side is left out. Medians in ms: each side's TTFT,
    and the median of the per-request difference b - a, which the load's own variation (long
    prompts, bursts) does not blur the way a difference of two medians is blurred."""

    def index(records: Sequence[RequestRecord]) -> dict[str, RequestRecord]:
        return {r.request_id.rsplit("-", 1)[-1]: r for r in records if r.ttft_s is not None}

    ia, ib = index(a), index(b)
    pairs = [(ia[k], ib[k]) for k in ia.keys() & ib.keys()]

    def band(lo: int, hi: int | None, sel: list[tuple[RequestRecord, RequestRecord]]) -> Band:
        ta = [x.ttft_s * 1e3 for x, _ in sel]  # type: ignore[operator]
        tb = [y.ttft_s * 1e3 for _, y in sel]  # type: ignore[operator]
        return Band(
            lo, hi, len(sel), _median(ta), _median(tb), _median([q - p for p, q in zip(ta, tb, strict=True)])
        )

    out = []
    edges = [*bands, None]
    for lo, hi in itertools.pairwise(edges):
        sel = [(x, y) for x, y in pairs if x.prompt_tokens >= lo and (hi is None or x.prompt_tokens < hi)]
        if sel:
            out.append(band(lo, hi, sel))  # type: ignore[arg-type]
    return out, band(0, None, pairs)

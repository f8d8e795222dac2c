"""Per-request records of a load run and the serving metrics derived from them.

Owns ``RequestRecord`` (what a client observed for one request, JSONL on disk)
and ``summarize`` (records -> ``Summary``). Definitions follow vLLM ``bench
serve`` and NVIDIA AIPerf, with DistServe's SLO attainment:

- TTFT = first token message - send.
- TPOT = (last token - first token) / (output_tokens - 1), per request;
  undefined for 1-token outputs, which are left out of the TPOT distribution
  and count as meeting the TPOT SLO (vLLM's goodput does the same).
- ITL = every gap between tokens. A message carrying k > 1 tokens contributes
  its gap for its first token and k - 1 zero gaps for the rest, so a request
  yields exactly output_tokens - 1 ITL samples whose mean is its TPOT. Upstream
  vLLM ``bench serve`` appends one gap per SSE chunk and no zeros (its
  ``endpoint_request_func.py``); some vLLM-derived benchmarks pad with k - 1
  zeros from continuous usage stats, which is what we do. AIPerf calls the
  un-padded per-message gaps "inter-chunk latency" and its "inter-token
  latency" is our TPOT; we report the un-padded gaps as ICL.
- E2E = last token - send.
- Throughput: output tokens and requests of successful requests per second
  of ``duration_s``.
- Goodput = successful requests meeting every SLO per second (DistServe).
- SLO attainment = share of ALL requests, failed ones counting as misses, with
  TTFT <= slo_ttft and TPOT <= slo_tpot (limits inclusive).

Percentiles: ``numpy.percentile`` with its default linear interpolation
(method "linear", numpy's type 7), as vLLM uses; an empty distribution is NaN.
"""

from __future__ import annotations

import gzip
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What a client saw of one request. Times are seconds on the run's
    monotonic clock, 0 = the start of the run."""

    request_id: str
    scheduled_s: float  # when the arrival process wanted it sent
    send_s: float  # when it was sent (>= scheduled_s; the gap is client lag)
    prompt_tokens: int
    max_tokens: int
    token_times_s: list[float] = field(default_factory=list)  # arrival of each token message
    token_counts: list[int] = field(default_factory=list)  # tokens in each message, each >= 1
    # Generated tokens: the server's usage count when it sent one, else sum(token_counts).
    output_tokens: int = 0
    ok: bool = False
    error_code: str = ""  # gRPC status name, "HTTP_<status>", or a client-side code
    error_detail: str = ""
    end_s: float | None = None  # when the stream ended (final message or error)
    worker_id: str = ""
    prefill_path: str = ""  # "local" / "remote" when the server says
    cached_tokens: int = 0  # prompt tokens served from a prefix cache, when the server says
    finish_reason: str = ""

    def add_message(self, t: float, n_tokens: int) -> None:
        if n_tokens < 1:
            raise ValueError(f"a token message carries >= 1 token, got {n_tokens}")
        self.token_times_s.append(t)
        self.token_counts.append(n_tokens)
        self.output_tokens += n_tokens

    @property
    def streamed_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.send_s if self.token_times_s else None

    @property
    def e2e_s(self) -> float | None:
        return self.token_times_s[-1] - self.send_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        if not self.token_times_s or self.output_tokens < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (self.output_tokens - 1)

    def itl_s(self) -> list[float]:
        """Per-token gaps: k - 1 zeros after each gap of a k-token message."""
        out: list[float] = [0.0] * (self.token_counts[0] - 1) if self.token_counts else []
        for i in range(1, len(self.token_times_s)):
            out.append(self.token_times_s[i] - self.token_times_s[i - 1])
            out.extend([0.0] * (self.token_counts[i] - 1))
        return out

    def icl_s(self) -> list[float]:
        """Per-message gaps (AIPerf's inter-chunk latency, vLLM's per-chunk ITL)."""
        t = self.token_times_s
        return [t[i] - t[i - 1] for i in range(1, len(t))]

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RequestRecord:
        data = json.loads(text)
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown RequestRecord fields {sorted(unknown)}")
        rec = cls(**data)
        if len(rec.token_times_s) != len(rec.token_counts):
            raise ValueError(f"{rec.request_id}: token_times_s and token_counts differ in length")
        return rec


def write_records(path: str | Path, records: Iterable[RequestRecord], meta: dict | None = None) -> None:
    """JSONL: an optional ``{"meta": {...}}`` first line, then one record a line."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with Path(path).open("w", encoding="utf-8") as f:
        if meta is not None:
            f.write(json.dumps({"meta": meta}) + "\n")
        for r in records:
            f.write(r.to_json() + "\n")


def read_run(path: str | Path) -> tuple[dict, list[RequestRecord]]:
    """(meta, records) of a file written by ``write_records`` (gzip-compressed when it ends in .gz)."""
    meta: dict = {}
    records: list[RequestRecord] = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            if line_no == 1 and text.startswith('{"meta"'):
                meta = json.loads(text)["meta"]
                continue
            try:
                records.append(RequestRecord.from_json(text))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: {e}") from e
    return meta, records


def read_records(path: str | Path) -> list[RequestRecord]:
    return read_run(path)[1]


@dataclass(frozen=True)
class Dist:
    """Percentiles and mean of one metric, in seconds; NaN when empty."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        arr = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(v) for v in np.percentile(arr, PERCENTILES, method="linear"))
        return cls(len(values), float(arr.mean()), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    requests: int
    ok: int
    failed: int
    errors_by_code: dict[str, int]
    duration_s: float
    ttft: Dist
    tpot: Dist
    itl: Dist
    icl: Dist
    e2e: Dist
    send_lag: Dist  # send - scheduled arrival, all requests: > ~ms means the client could not keep up
    output_tokens: int
    output_tok_s: float
    request_rps: float
    goodput_rps: float
    slo_attainment: float
    slo_ttft_s: float
    slo_tpot_s: float


def meets_slo(r: RequestRecord, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    """Successful, TTFT within limit, and TPOT within limit (1-token outputs pass TPOT)."""
    if not r.ok or r.ttft_s is None or r.ttft_s > slo_ttft_s:
        return False
    tpot = r.tpot_s
    return tpot is None or tpot <= slo_tpot_s


def summarize(
    records: Sequence[RequestRecord],
    slo_ttft_s: float = math.inf,
    slo_tpot_s: float = math.inf,
    duration_s: float | None = None,
) -> Summary:
    """Serving metrics of a run. ``duration_s`` defaults to first send -> last end."""
    if duration_s is None:
        ends = [r.end_s for r in records if r.end_s is not None]
        sends = [r.send_s for r in records]
        duration_s = (max(ends) - min(sends)) if ends and sends else 0.0
    good = [r for r in records if r.ok and r.token_times_s]
    errors = Counter(r.error_code or "UNKNOWN" for r in records if not r.ok)
    met = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records)
    out_tokens = sum(r.output_tokens for r in good)

    def per_s(x: float) -> float:
        return x / duration_s if duration_s > 0 else math.nan

    return Summary(
        requests=len(records),
        ok=sum(r.ok for r in records),
        failed=len(records) - sum(r.ok for r in records),
        errors_by_code=dict(sorted(errors.items())),
        duration_s=duration_s,
        ttft=Dist.of([r.ttft_s for r in good]),
        tpot=Dist.of([t for r in good if (t := r.tpot_s) is not None]),
        itl=Dist.of([g for r in good for g in r.itl_s()]),
        icl=Dist.of([g for r in good for g in r.icl_s()]),
        e2e=Dist.of([r.e2e_s for r in good]),
        send_lag=Dist.of([r.send_s - r.scheduled_s for r in records]),
        output_tokens=out_tokens,
        output_tok_s=per_s(out_tokens),
        request_rps=per_s(len(good)),
        goodput_rps=per_s(met),
        slo_attainment=met / len(records) if records else math.nan,
        slo_ttft_s=slo_ttft_s,
        slo_tpot_s=slo_tpot_s,
    )


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1e3:.2f}"


def format_summary(s: Summary, scaling: str) -> str:
    """Human-readable lines; each ends with ``scaling`` (the length and time
    factors the run used), so no line can be quoted without them."""
    lines = [
        f"requests={s.requests} ok={s.ok} failed={s.failed} duration_s={s.duration_s:.2f}",
        "errors " + (" ".join(f"{k}={v}" for k, v in s.errors_by_code.items()) or "none"),
    ]
    dists = {"ttft": s.ttft, "tpot": s.tpot, "itl": s.itl, "icl": s.icl, "e2e": s.e2e, "send_lag": s.send_lag}
    for name, d in dists.items():
        lines.append(
            f"{name}_ms n={d.count} mean={_ms(d.mean)} p50={_ms(d.p50)} p90={_ms(d.p90)} p99={_ms(d.p99)}"
        )
    lines.append(
        f"throughput output_tok_s={s.output_tok_s:.2f} request_rps={s.request_rps:.3f} "
        f"output_tokens={s.output_tokens}"
    )
    lines.append(
        f"slo ttft_ms<={_ms(s.slo_ttft_s)} tpot_ms<={_ms(s.slo_tpot_s)} "
        f"goodput_rps={s.goodput_rps:.3f} attainment={s.slo_attainment:.3f}"
    )
    return "\n".join(f"{line}  [{scaling}]" for line in lines)


def summary_kv(s: Summary) -> dict[str, str]:
    """The headline numbers as key=value pairs (for a one-line result)."""
    return {
        "ok": str(s.ok),
        "errors": str(s.failed),
        "ttft_p50_ms": _ms(s.ttft.p50),
        "ttft_p99_ms": _ms(s.ttft.p99),
        "tpot_p50_ms": _ms(s.tpot.p50),
        "tpot_p99_ms": _ms(s.tpot.p99),
        "itl_p99_ms": _ms(s.itl.p99),
        "output_tok_s": f"{s.output_tok_s:.2f}",
        "goodput_rps": f"{s.goodput_rps:.3f}",
        "slo_attainment": f"{s.slo_attainment:.3f}",
    }

"""Serving traces: parse, scale, and synthesise prompts for replay.

Owns the two trace formats of /work/shared/traces (see its README):

- Mooncake conversation JSONL: ``timestamp`` (ms from trace start),
  ``input_length``, ``output_length``, ``hash_ids`` (one id per 512-token prompt
  block; an id stands for its block *and everything before it*).
- Azure LLM inference CSV: ``TIMESTAMP`` (wall clock), ``ContextTokens``,
  ``GeneratedTokens``; no prefix-sharing information.

Both parse to a list of ``TraceRequest``. ``scale`` shrinks lengths and
stretches or compresses time so a fleet-sized trace fits a small CPU model;
``PromptSynthesizer`` turns a request into token ids with the trace's sharing
structure. Data flows next to ``bench.loadgen``, which replays the requests.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from fractions import Fraction
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
TRACE_FILES = {"mooncake": "mooncake_conversation.jsonl", "azure": "azure_conv_2023.csv"}


class TraceError(ValueError):
    """A trace file (or one line of it) is malformed."""

    def __init__(self, path: str | Path, line: int, reason: str):
        self.path = str(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{path}:{line}: {reason}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrives and how long it is."""

    arrival_s: float  # seconds from the first request of the trace
    input_len: int  # prompt tokens, >= 1
    output_len: int  # tokens to generate (max_tokens, EOS ignored), >= 1
    hash_ids: tuple[int, ...] = ()  # Mooncake prompt block ids; () = no sharing info


def _int_field(row: dict, key: str, minimum: int, path: Path, line: int) -> int:
    value = row.get(key)
    # bool is an int subclass; a JSON true is not a length.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(path, line, f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def load_mooncake(path: str | Path) -> list[TraceRequest]:
    """Parse a Mooncake JSONL trace; raise ``TraceError`` at the first bad line."""
    path = Path(path)
    out: list[TraceRequest] = []
    prev_ms = 0.0
    with path.open(encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceError(path, line_no, f"not JSON: {e.msg}") from e
            if not isinstance(row, dict):
                raise TraceError(path, line_no, "not a JSON object")
            ts = row.get("timestamp")
            if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
                raise TraceError(path, line_no, f"timestamp must be a number >= 0 (ms), got {ts!r}")
            if ts < prev_ms:
                raise TraceError(path, line_no, f"timestamp {ts} goes back in time (previous {prev_ms})")
            prev_ms = ts
            input_len = _int_field(row, "input_length", 1, path, line_no)
            output_len = _int_field(row, "output_length", 1, path, line_no)
            ids = row.get("hash_ids")
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
            ):
                raise TraceError(path, line_no, "hash_ids must be a list of integers >= 0")
            want = math.ceil(input_len / MOONCAKE_BLOCK_TOKENS)
            if len(ids) != want:
                raise TraceError(path, line_no, f"{len(ids)} hash_ids for {input_len} tokens (want {want})")
            out.append(TraceRequest(ts / 1000.0, input_len, output_len, tuple(ids)))
    if not out:
        raise TraceError(path, 0, "no requests")
    first = out[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - first) for r in out]


def load_azure(path: str | Path) -> list[TraceRequest]:
    """Parse an Azure LLM inference CSV; arrivals are seconds after the first row."""
    path = Path(path)
    out: list[TraceRequest] = []
    t0: datetime | None = None
    prev: datetime | None = None
    # newline="" lets csv handle the file's CRLF line ends itself.
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != AZURE_HEADER:
            raise TraceError(path, 1, f"header must be {','.join(AZURE_HEADER)}, got {header!r}")
        for row in reader:
            line_no = reader.line_num
            if not row:
                continue
            if len(row) != 3:
                raise TraceError(path, line_no, f"want 3 fields, got {len(row)}")
            try:
                # 3.11's fromisoformat takes the trace's 7 fractional digits (truncated to us).
                ts = datetime.fromisoformat(row[0].strip())
            except ValueError as e:
                raise TraceError(path, line_no, f"bad TIMESTAMP {row[0]!r}") from e
            lengths = []
            for name, text in zip(AZURE_HEADER[1:], row[1:], strict=True):
                if not text.strip().isdigit() or int(text) < 1:
                    raise TraceError(path, line_no, f"{name} must be an integer >= 1, got {text!r}")
                lengths.append(int(text))
            if prev is not None and ts < prev:
                raise TraceError(path, line_no, f"TIMESTAMP {row[0]} goes back in time")
            t0 = t0 or ts
            prev = ts
            out.append(TraceRequest((ts - t0).total_seconds(), lengths[0], lengths[1]))
    if not out:
        raise TraceError(path, 1, "no requests")
    return out


def load_trace(kind: str, path: str | Path) -> list[TraceRequest]:
    """``kind`` is "mooncake" or "azure"."""
    loaders = {"mooncake": load_mooncake, "azure": load_azure}
    if kind not in loaders:
        raise ValueError(f"unknown trace kind {kind!r}; want one of {sorted(loaders)}")
    return loaders[kind](path)


def default_trace_path(trace: str) -> Path:
    """bench/traces/<file> (vendored with their licences), else shared/traces next to the checkout."""
    if trace not in TRACE_FILES:
        raise ValueError(f"unknown trace kind {trace!r}; want one of {sorted(TRACE_FILES)}")
    root = Path(__file__).resolve().parent.parent
    for folder in (root / "bench" / "traces", root / "shared" / "traces", root.parent / "shared" / "traces"):
        if (folder / TRACE_FILES[trace]).exists():
            return folder / TRACE_FILES[trace]
    raise FileNotFoundError(
        f"no {TRACE_FILES[trace]} under {root}/shared or {root.parent}/shared; pass a path"
    )


def scale_len(n: int, length_factor: float) -> int:
    """A length divided by the factor, rounded up, at least 1.

    Rounding up (not to nearest) keeps ``ceil(scaled input / scaled block)`` at
    most the number of hash ids, so a scaled prompt never needs a block its
    trace row has no id for.
    """
    # Exact rational arithmetic: float division could round 512/f and n/f apart
    # and break that bound at an unlucky factor.
    return max(1, math.ceil(Fraction(n) / Fraction(length_factor)))


def scale(
    requests: Sequence[TraceRequest],
    length_factor: float = 1.0,
    time_factor: float = 1.0,
    max_requests: int | None = None,
    max_duration_s: float | None = None,
) -> list[TraceRequest]:
    """Scale a trace for a small model and bound it.

    Lengths are divided by ``length_factor`` (``scale_len``); inter-arrival
    times are *multiplied* by ``time_factor`` (2 = half the request rate, 0.5 =
    twice it), with the first request at 0. Then the first ``max_requests``
    requests arriving before ``max_duration_s`` (scaled time) are kept.
    """
    if not (length_factor > 0 and math.isfinite(length_factor)):
        raise ValueError(f"length_factor must be > 0, got {length_factor}")
    if not (time_factor > 0 and math.isfinite(time_factor)):
        raise ValueError(f"time_factor must be > 0, got {time_factor}")
    if not requests:
        return []
    t0 = requests[0].arrival_s
    out: list[TraceRequest] = []
    for r in requests:
        arrival = (r.arrival_s - t0) * time_factor
        if max_requests is not None and len(out) >= max_requests:
            break
        if max_duration_s is not None and arrival >= max_duration_s:
            break
        out.append(
            TraceRequest(
                arrival,
                scale_len(r.input_len, length_factor),
                scale_len(r.output_len, length_factor),
                r.hash_ids,
            )
        )
    return out


@dataclass(frozen=True)
class VocabRange:
    """Token ids prompts may use: ``[low, high)`` minus ``exclude``.

    The built-in model's byte tokenizer has ids 0..255 for bytes and a few
    specials above; callers pass the served vocabulary and its special ids
    (EOS, BOS, ...) so a prompt never contains one.
    """

    low: int = 0
    high: int = 256
    exclude: frozenset[int] = frozenset()

    def allowed(self) -> np.ndarray:
        ids = np.arange(self.low, self.high, dtype=np.int64)
        ids = ids[~np.isin(ids, np.fromiter(self.exclude, dtype=np.int64, count=len(self.exclude)))]
        if ids.size == 0:
            raise ValueError(f"no token ids left in [{self.low}, {self.high}) minus {sorted(self.exclude)}")
        return ids


class PromptSynthesizer:
    """Token-id prompts with a trace's lengths and prefix sharing.

    Mooncake rows (with ``hash_ids``): block ``i`` is a fixed sequence of
    ``block_tokens`` ids drawn by an RNG seeded with ``(seed, hash_ids[i])``,
    and the last block is cut to length. Equal id prefixes therefore give
    identical token prefixes, and a different id gives a different block (up to
    a collision chance of ``|vocab|^-block_tokens``). Rows without ``hash_ids``
    (Azure, Poisson) get an independent random prompt seeded by
    ``(seed, index)``: reproducible, and unique for any prompt longer than a
    few tokens.
    """

    def __init__(self, vocab: VocabRange, length_factor: float = 1.0, seed: int = 0):
        self._allowed = vocab.allowed()
        self._seed = seed
        # Scaled like the lengths (rounded up) so ceil(scaled input / block) <= len(hash_ids).
        self.block_tokens = scale_len(MOONCAKE_BLOCK_TOKENS, length_factor)
        self._blocks: dict[int, np.ndarray] = {}  # hash id -> its block, shared by every request

    def _draw(self, key: Iterable[int], n: int) -> np.ndarray:
        rng = np.random.default_rng([self._seed, *key])
        return self._allowed[rng.integers(0, self._allowed.size, size=n)]

    def block(self, hash_id: int) -> np.ndarray:
        blk = self._blocks.get(hash_id)
        if blk is None:
            # Tag 1 keeps block draws apart from the tag-0 random-prompt draws.
            blk = self._blocks[hash_id] = self._draw((1, hash_id), self.block_tokens)
        return blk

    def prompt(self, request: TraceRequest, index: int) -> list[int]:
        """Prompt token ids for ``request`` (the ``index``-th of its trace)."""
        n = request.input_len
        if not request.hash_ids:
            return self._draw((0, index), n).tolist()
        n_blocks = math.ceil(n / self.block_tokens)
        if n_blocks > len(request.hash_ids):
            raise ValueError(
                f"request {index}: {n} tokens need {n_blocks} blocks of {self.block_tokens} "
                f"but it has {len(request.hash_ids)} hash ids (lengths scaled with another factor?)"
            )
        blocks = [self.block(h) for h in request.hash_ids[:n_blocks]]
        return np.concatenate(blocks)[:n].tolist()

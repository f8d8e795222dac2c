"""What one worker can do: prefill time of a prompt and decode step time of a batch.

`WorkerModel` is the planner's view of a worker's speed. `ProfileModel` reads it
from a sim timing profile (services/model/profiles.json: published GPU
profiles and ones calibrated here); `MeasuredModel` learns it online from the
rates workers report (every local prefill: tokens and seconds; every decode
step: batch, context and seconds) and answers from the profile until it has
seen enough.

Two derived quantities drive the sizing:
- `prefill_rate(isl)`: prompts per second one worker sustains at that prompt
  length (several short prompts share a pass up to the batch token budget);
- `decode_batch(ctx, itl_s)`: the most sequences one worker can decode at once
  with a step no longer than the ITL target, within its KV pool and batch cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.model.timing import PROFILES_PATH, TimingProfile, load_profile


class WorkerModel(Protocol):
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill `tokens` uncached prompt tokens in one pass."""
        ...

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step of `batch` sequences holding `context_tokens` in all."""
        ...

    def transfer_s(self, tokens: int) -> float:
        """Seconds to move the KV of `tokens` tokens from a prefill to a decode worker."""
        ...


@dataclass(frozen=True)
class ProfileModel:
    profile: TimingProfile

    @property
    def kv_capacity_tokens(self) -> int:
        return self.profile.capacity_tokens

    @property
    def max_num_seqs(self) -> int:
        return self.profile.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.profile.max_num_batched_tokens

    def prefill_s(self, tokens: int) -> float:
        return self.profile.prefill_ms(tokens) / 1000.0

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.profile.decode_ms(batch, context_tokens) / 1000.0

    def transfer_s(self, tokens: int) -> float:
        return self.profile.transfer_s(tokens)


def profile_model(name: str, path: str | None = None) -> ProfileModel:
    """The named sim profile (services/model/profiles.json, or the JSON file at `path`)."""
    return ProfileModel(load_profile(name, Path(path) if path else PROFILES_PATH))


class MeasuredModel:
    """A `WorkerModel` from measured rates, falling back to `prior` until `min_samples` are seen.

    Prefill: an exponentially weighted tokens-per-second rate. Decode: an
    exponentially weighted least-squares fit of step seconds = a + b*batch +
    c*context/1000 (the sim profiles' linear form), refit on every sample.
    """

    def __init__(self, prior: WorkerModel, *, weight: float = 0.1, min_samples: int = 8):
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.prior, self.weight, self.min_samples = prior, weight, min_samples
        self.kv_capacity_tokens = prior.kv_capacity_tokens
        self.max_num_seqs = prior.max_num_seqs
        self.max_num_batched_tokens = prior.max_num_batched_tokens
        self._prefill_tps: float | None = None
        self._prefill_n = 0
        # weighted normal equations of the decode fit, features (1, batch, context/1000)
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._decode_n = 0
        self._coef: tuple[float, float, float] | None = None

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        w = self.weight
        self._prefill_tps = rate if self._prefill_tps is None else (1 - w) * self._prefill_tps + w * rate
        self._prefill_n += 1

    def observe_decode(self, batch: int, context_tokens: int, seconds: float) -> None:
        if batch <= 0 or seconds <= 0:
            return
        x = (1.0, float(batch), context_tokens / 1000.0)
        keep = 1 - self.weight
        for i in range(3):
            self._xty[i] = keep * self._xty[i] + x[i] * seconds
            for j in range(3):
                self._xtx[i][j] = keep * self._xtx[i][j] + x[i] * x[j]
        self._decode_n += 1
        # a small ridge keeps the fit defined when batch and context move together (they often do)
        ridge = 1e-6 * (self._xtx[0][0] + self._xtx[1][1] + self._xtx[2][2])
        xtx = [
            [v + (ridge if i == j and i else 0.0) for j, v in enumerate(row)]
            for i, row in enumerate(self._xtx)
        ]
        self._coef = _solve3(xtx, self._xty)

    @property
    def measured(self) -> bool:
        """Both roles' rates are measured (not the prior's)."""
        return self._prefill_n >= self.min_samples and self._decode_n >= self.min_samples

    def prefill_s(self, tokens: int) -> float:
        if self._prefill_n < self.min_samples or not self._prefill_tps:
            return self.prior.prefill_s(tokens)
        return tokens / self._prefill_tps if tokens > 0 else 0.0

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        if self._decode_n < self.min_samples or self._coef is None:
            return self.prior.decode_step_s(batch, context_tokens)
        a, b, c = self._coef
        return max(a + b * batch + c * context_tokens / 1000.0, 1e-6)

    def transfer_s(self, tokens: int) -> float:
        return self.prior.transfer_s(tokens)


def _solve3(a: list[list[float]], y: list[float]) -> tuple[float, float, float] | None:
    """Solve the 3x3 system a.x = y (Gaussian elimination); None when it is singular."""
    m = [[*row[:], y[i]] for i, row in enumerate(a)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                for k in range(col, 4):
                    m[r][k] -= f * m[col][k]
    return (m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2])


def prefill_rate(model: WorkerModel, isl: float) -> float:
    """Prompts per second one worker sustains at `isl` uncached tokens a prompt."""
    tokens = max(math.ceil(isl), 1)
    per_pass = max(model.max_num_batched_tokens // tokens, 1)
    return per_pass / max(model.prefill_s(tokens * per_pass), 1e-9)


def decode_batch(model: WorkerModel, ctx: float, itl_s: float) -> int:
    """Most sequences of mean context `ctx` one worker decodes with steps <= `itl_s` (0 if none)."""
    kv_cap = int(model.kv_capacity_tokens // max(ctx, 1.0))
    hi = min(model.max_num_seqs, kv_cap)
    lo, best = 1, 0
    while lo <= hi:  # step time grows with the batch: binary search the largest batch within the ITL
        mid = (lo + hi) // 2
        if model.decode_step_s(mid, int(mid * ctx)) <= itl_s:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best

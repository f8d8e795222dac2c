"""SimRunner: stands in for ModelRunner in the sim engine. No tensors computed.

LLMEngine calls `run(scheduled)` once per step, exactly as it calls
ModelRunner.run: the real Scheduler and BlockManager decided what runs, with
the real prefix cache. SimRunner prices that pass with a `TimingProfile`
(prefill of the new prompt tokens and the context they attend to, decode of
the batch and its total context), waits it out on the step thread (wall time =
modeled time / speedup: this sleep IS the simulated GPU), and returns a token
for every sequence that reaches its end.

Tokens are a pure function of (prompt hash [mixed with the seed when
sampling], output position), so a prefill worker's first token, a decode
worker's continuation and a migrated request's resumption agree token for
token. They are byte tokens < 256 and never EOS: max_tokens decides the
length (sampling parameters other than the seed do not matter).

The KV pool is a tiny real tensor (spec.py's layout) so transports move real
bytes; `import_blocks` / `export_blocks` copy them as ModelRunner does.
"""

from __future__ import annotations

import hashlib
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from services.engine.api import EngineError
from services.engine.engine_spec import EngineSpec
from services.engine.sequence import Sequence, SequenceStatus
from services.model.timing import TimingProfile

_MASK64 = (1 << 64) - 1
_RUNNING = (SequenceStatus.PREFILLING, SequenceStatus.DECODING)


@dataclass(frozen=True)
class PassCost:
    """The modeled cost of one scheduler pass and what it was priced from."""

    new_tokens: int  # prompt (or recompute) tokens computed this pass
    context_tokens: float  # mean context those tokens attend to, weighted by chunk size
    batch: int  # sequences that decode a token this pass
    decode_context_tokens: int  # total context of those sequences
    prefill_ms: float
    decode_ms: float
    restore_ms: float = 0.0  # host-tier restores since the last pass (copied in before it runs)

    @property
    def ms(self) -> float:
        return self.prefill_ms + self.decode_ms + self.restore_ms


class SlowdownFile:
    """A factor read from a file, at most every `every_s`: how much slower than modeled the
    simulated accelerator runs now (a degraded GPU). A fault study writes 5 into it for a
    minute, then 1; the worker process keeps running (its probes, Stats and streams answer),
    only its passes take longer. A missing, empty or unparsable file, or a factor that is not
    a finite number > 0, reads as 1."""

    def __init__(self, path: str, every_s: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self.path, self.every_s, self._clock = path, every_s, clock
        self._factor, self._read_at = 1.0, -math.inf

    def __call__(self) -> float:
        now = self._clock()
        if now - self._read_at >= self.every_s:
            self._read_at = now
            self._factor = self._read()
        return self._factor

    def _read(self) -> float:
        try:
            with open(self.path, encoding="ascii") as f:
                value = float(f.read().strip() or 1.0)
        except (OSError, ValueError):
            return 1.0
        return value if math.isfinite(value) and value > 0 else 1.0


class SimRunner:
    def __init__(
        self,
        spec: EngineSpec,
        profile: TimingProfile,
        speedup: float = 1.0,
        *,
        slowdown: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        self.profile = profile
        self.speedup = speedup
        self._slowdown = slowdown  # the wall-time multiplier now (SlowdownFile), None: 1
        self._sleep, self._clock = sleep, clock
        self.kv_pool = spec.layout.allocate_pool(spec.num_blocks)
        # Tokens a sequence may emit: bytes, minus any EOS id of the vocabulary.
        eos = set(spec.info.eos_token_ids)
        self._alphabet = [t for t in range(min(256, spec.info.vocab_size)) if t not in eos]
        self._keys: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        # Totals since start, read by tests and benchmarks (step thread only).
        self.passes = 0
        self.modeled_s = 0.0
        self.late_s = 0.0  # wall time passes ran beyond their modeled time (Python work)
        self.last_pass: PassCost | None = None
        # The last pass: its sequences and when its modeled time ends (wall clock).
        self._previous: list[Sequence] = []
        self._deadline = 0.0
        # Modeled time of host-tier restores not yet charged to a pass.
        self._pending_restore_ms = 0.0

    def pass_cost(self, scheduled: list[tuple[Sequence, int]]) -> PassCost:
        """Price one pass (see `pass_shape` for what is counted)."""
        new, context, batch, decode_ctx = pass_shape(scheduled)
        return PassCost(
            new_tokens=new,
            context_tokens=context,
            batch=batch,
            decode_context_tokens=decode_ctx,
            prefill_ms=self.profile.prefill_ms(new, context),
            decode_ms=self.profile.decode_ms(batch, decode_ctx),
        )

    def run(self, scheduled: list[tuple[Sequence, int]]) -> list[int | None]:
        """Wait the pass's modeled time / speedup; the sampled token per entry (None mid-prompt).

        While the engine steps on without a pause (a sequence of the last pass is
        still running), the Python work between passes (scheduler, outputs,
        queues; this process's cost, not the modeled engine's) counts against
        this pass's wait: a pass lasts max(modeled, Python) in wall time, not
        their sum. After a pause the pass starts now.
        """
        now = self._clock()
        cost = self.pass_cost(scheduled)
        if self._pending_restore_ms:
            cost = replace(cost, restore_ms=self._pending_restore_ms)
            self._pending_restore_ms = 0.0
        out = [
            self.token_for(seq, seq.num_output_tokens)
            if seq.num_computed_tokens + n == seq.num_tokens
            else None
            for seq, n in scheduled
        ]
        self.passes += 1
        self.modeled_s += cost.ms / 1000.0
        self.last_pass = cost
        wall = cost.ms / 1000.0 / self.speedup
        if self._slowdown is not None:
            wall *= self._slowdown()
        start = now
        if any(seq.status in _RUNNING for seq in self._previous):
            start = max(self._deadline, now - wall)
            self.late_s += max(0.0, now - wall - self._deadline)
        self._deadline = start + wall
        remaining = self._deadline - self._clock()
        if remaining > 0:
            self._sleep(remaining)
        else:
            self.late_s -= remaining
            self._deadline -= remaining  # the next pass cannot start before this one ended
        self._previous = [seq for seq, _ in scheduled]
        return out

    def token_for(self, seq: Sequence, position: int) -> int:
        """The token at output `position` of `seq`: a hash of its key and the position."""
        key = self._keys.get(seq)
        if key is None:
            key = self._keys[seq] = sequence_key(seq)
        return self._alphabet[_mix(key ^ _mix(position + 1)) % len(self._alphabet)]

    def chunk_logits(self, seq: Sequence, n: int) -> torch.Tensor:
        raise EngineError("the sim engine computes no logits")

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        # index_select, not pool[idx]: advanced indexing of this 6-dim tensor is ~500x slower
        return self.kv_pool.index_select(0, torch.tensor(block_ids, dtype=torch.long))

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        self.kv_pool.index_copy_(0, torch.tensor(block_ids, dtype=torch.long), blocks.to(self.kv_pool.dtype))

    def restore_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """A host-tier restore: the copy, and its modeled time charged to the next pass."""
        self.import_blocks(block_ids, blocks)
        self._pending_restore_ms += self.profile.restore_s(len(block_ids) * self.profile.block_size) * 1000.0


def pass_shape(scheduled: list[tuple[Sequence, int]]) -> tuple[int, float, int, int]:
    """(new prompt tokens T, their mean context C, decode batch B, decode context K) of a pass.

    Entries are (sequence, tokens to compute), before LLMEngine advances
    `num_computed_tokens` (as ModelRunner.run sees them). Tokens below a
    sequence's `prefill_target` are prompt (or recompute) work attending to the
    `num_computed_tokens` before them; C is their mean weighted by chunk size,
    so T * C sums each chunk's T_i * C_i. A token past the prompt is a decode
    token of a sequence whose context (K's share) is everything computed plus it.
    bench/calibrate.py measures the torch engine against the same quantities.
    """
    new = weighted_ctx = batch = decode_ctx = 0
    for seq, n in scheduled:
        c = seq.num_computed_tokens
        prompt = max(0, min(c + n, seq.prefill_target) - c)
        if prompt:
            new += prompt
            weighted_ctx += prompt * c
        if n > prompt:
            batch += 1
            decode_ctx += c + n
    return new, (weighted_ctx / new if new else 0.0), batch, decode_ctx


def sequence_key(seq: Sequence) -> int:
    """Hash of the prompt (not resumed outputs), mixed with the seed when sampling."""
    prompt = np.asarray(seq.token_ids[: seq.num_prompt_tokens], dtype="<u4").tobytes()
    key = int.from_bytes(hashlib.blake2b(prompt, digest_size=8).digest(), "little")
    if not seq.sampling.greedy and seq.seed is not None:
        key = _mix(key ^ seq.seed)
    return key


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash of an int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)

"""Sampler: next tokens from last-position logits, position-deterministic.

Greedy rows take the argmax. Sampled rows apply temperature, top-k and top-p,
then draw with the exponential race (argmax of p / E, E ~ Exp(1)), where the
noise of row r comes from a generator seeded by mix(seed_r, position_r). So the
token at output position i depends only on the logits, the sampling values and
(seed, i): not on the batch, the step, or which worker computed it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.api import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """A well-spread 63-bit generator seed from (seed, position) (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    seed: int | None  # required unless greedy
    position: int  # output position of the token being drawn


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
        """logits: [B, V] float32, one row per entry of `rows`."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            tokens[idx] = self._sample(logits[idx], [rows[i] for i in sampled])
        return tokens.tolist()

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
        logits = logits / temps[:, None]
        logits = _top_k_top_p(logits, rows)
        probs = logits.softmax(dim=-1)
        # Drawn on the CPU whatever the device, so CPU and CUDA workers draw alike.
        noise = torch.empty(probs.shape, dtype=torch.float32)
        for i, r in enumerate(rows):
            g = torch.Generator().manual_seed(mix_seed(r.seed, r.position))
            noise[i].exponential_(generator=g)
        return (probs / noise.to(probs.device)).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude, row by row. logits: [B, V]."""
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    use_k, use_p = any(top_k), any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if use_k:
        # Keep the k largest: everything below the k-th largest value goes (ties kept).
        k = torch.tensor([t if t > 0 else vocab for t in top_k], device=logits.device)
        kth = sorted_logits.gather(-1, (vocab - k).unsqueeze(-1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if use_p:
        p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - p).unsqueeze(-1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

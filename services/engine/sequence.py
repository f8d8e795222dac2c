"""Sequence: one request's tokens, progress, blocks and lifecycle inside the engine.

There is no prefill or decode phase, only `num_computed_tokens` catching up to
`num_tokens` (vLLM v1): a sequence whose KV arrived from outside simply starts
with computed tokens > 0. The Scheduler owns the transitions of `status` and the
`block_table` (through its BlockManager); LLMEngine appends sampled tokens.
"""

from __future__ import annotations

import enum

from services.engine.api import EngineRequest, FinishReason, SamplingParams
from services.model.hashing import ROOT_HASH, block_hashes
from services.model.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.IntEnum):
    """Ordered lifecycle; every state >= FINISHED is terminal."""

    WAITING = 1
    WAITING_FOR_REMOTE_KV = 2
    PREFILLING = 3
    DECODING = 4
    HELD = 5
    FINISHED = 6
    ABORTED = 7

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED


class Sequence:
    def __init__(
        self,
        request: EngineRequest,
        block_size: int,
        seed: int | None,
        *,
        prefill_only: bool = False,
        detokenizer: IncrementalDetokenizer | None = None,
    ):
        self.request_id = request.request_id
        self.sampling: SamplingParams = request.sampling
        self.priority = request.priority
        self.workflow_id = request.workflow_id
        self.workflow_final = request.workflow_final
        # Resolved seed: the request's, or one drawn at admission for unseeded sampling.
        self.seed = seed
        self.block_size = block_size
        self.prefill_only = prefill_only
        self.num_prompt_tokens = len(request.prompt_token_ids)
        # Context = prompt + resumed outputs + outputs sampled here.
        self.token_ids: list[int] = [*request.prompt_token_ids, *request.resume_token_ids]
        # Output tokens already sent out (resumed ones were sent by an earlier attempt).
        self.num_emitted = len(request.resume_token_ids)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        # Prefix-cache hit at the last admission, and tokens that came from outside.
        self.num_cached_tokens = 0
        # Tokens below this index are prefill work (prompt, or everything when recomputing).
        self.prefill_target = len(self.token_ids)
        self.num_computed_prompt_tokens = 0
        self.num_preemptions = 0
        self.queued_at = 0.0  # when its wait for a first token began (Scheduler's clock)
        self.waited_s = request.waited_s  # of that wait, spent before it reached this engine
        self.front = request.front  # moved off another worker: queued ahead (Scheduler.add)
        self.block_table: list[int] = []
        # Chained hashes of the full blocks of token_ids, extended lazily.
        self._block_hashes: list[int] = []
        # Leading blocks of block_table already offered to the prefix cache.
        self.num_registered_blocks = 0
        self.detokenizer = detokenizer
        self._stop_scan_from = 0
        if detokenizer is not None:
            # Resumed outputs are context for stop strings that span the resume point.
            for t in request.resume_token_ids:
                detokenizer.push(t)
            self._stop_scan_from = len(detokenizer.text)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Outputs so far, resumed ones included: the position of the next sample."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def take_new_output(self) -> list[int]:
        """Output tokens not yet emitted; marks them emitted."""
        new = self.token_ids[self.num_prompt_tokens + self.num_emitted :]
        self.num_emitted += len(new)
        return new

    def block_hashes(self, num_blocks: int) -> list[int]:
        """Hashes of the first `num_blocks` full blocks (they must be full)."""
        hashes = self._block_hashes
        done = len(hashes)
        if done < num_blocks:  # all missing blocks in one call: one conversion, one hashlib call each
            bs = self.block_size
            parent = hashes[-1] if done else ROOT_HASH
            hashes += block_hashes(self.token_ids[done * bs : num_blocks * bs], bs, parent)
        return hashes[:num_blocks]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.detokenizer is not None:
            self.detokenizer.push(token_id)

    def check_stop(
        self, token_id: int, eos_token_ids: tuple[int, ...], max_model_len: int
    ) -> FinishReason | None:
        """Why the sequence ends after `token_id` was appended, or None to continue."""
        sp = self.sampling
        if token_id in sp.stop_token_ids or (not sp.ignore_eos and token_id in eos_token_ids):
            return FinishReason.STOP
        if self.detokenizer is not None and self._stop_string_seen():
            return FinishReason.STOP
        if self.num_output_tokens >= sp.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def _stop_string_seen(self) -> bool:
        text = self.detokenizer.text
        # A new match must end in text added since the last scan.
        start = max(0, self._stop_scan_from - max(len(s) for s in self.sampling.stop) + 1)
        self._stop_scan_from = len(text)
        return any(s in text[start:] for s in self.sampling.stop)

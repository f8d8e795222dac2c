"""Incremental detokenization for the client stream: text of each token delta.

The router owns one detokenizer per request; it lives across attempts, so a
migrated stream reads as one text. A multi-byte UTF-8 character split over
tokens (or over deltas) comes out whole in the delta that completes it.

- `ByteDetokenizer`: the built-in byte-level tokenizer (token i < 256 is byte i,
  specials have no text); a stdlib incremental UTF-8 decoder, O(1) per token.
- `StreamDetokenizer`: a Hugging Face tokenizer (`HfTokenizer`), through
  `tokenizers`' own DecodeStream: one call into Rust per delta.
- `WindowDetokenizer`: any other tokenizer with `decode`, through the engine's
  `IncrementalDetokenizer` (decodes a short window per token, as vLLM does).
  For an `HfTokenizer` both give the same pieces (tests/unit/model).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any, Protocol

from services.model.tokenizer import ByteTokenizer, HfTokenizer, IncrementalDetokenizer


class Detokenizer(Protocol):
    def push_many(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they completed (possibly "")."""
        ...


class ByteDetokenizer:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push_many(self, token_ids: Sequence[int]) -> str:
        try:
            data = bytes(token_ids)
        except ValueError:  # specials (>= 256) have no text
            data = bytes(t for t in token_ids if t < 256)
        return self._decoder.decode(data)


class WindowDetokenizer:
    def __init__(self, tokenizer: Any):
        self._inner = IncrementalDetokenizer(tokenizer)

    def push_many(self, token_ids: Sequence[int]) -> str:
        push = self._inner.push
        return "".join([push(t) for t in token_ids])


class StreamDetokenizer:
    # Per token the window decode was ~8-11 us of the router's CPU (two decodes and the
    # bookkeeping around them); DecodeStream is ~0.5-1 us (BENCHMARKS.md, issue 16 session 13).
    def __init__(self, tokenizer: HfTokenizer):
        stream, self._tok = tokenizer.decode_stream()
        self._step = stream.step

    def push_many(self, token_ids: Sequence[int]) -> str:
        # A step per token, not one for the list: a list whose last token ends inside a
        # character would hold back the complete text before it too (lost if it ends there).
        step, tok = self._step, self._tok
        if len(token_ids) == 1:
            return step(tok, token_ids[0]) or ""
        return "".join([step(tok, t) or "" for t in token_ids])


def make_detokenizer(tokenizer: Any) -> Detokenizer:
    if isinstance(tokenizer, ByteTokenizer):
        return ByteDetokenizer()
    if isinstance(tokenizer, HfTokenizer):
        return StreamDetokenizer(tokenizer)
    return WindowDetokenizer(tokenizer)

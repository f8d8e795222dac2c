"""Tokenizers: the built-in byte-level one and a wrapper of HF `tokenizer.json`.

Workers see token ids only (the router tokenizes); the engine needs a tokenizer
for two things: EOS ids and stop strings, which it checks on text produced by
`IncrementalDetokenizer` as tokens are sampled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.model.gguf import is_gguf, read_gguf
from services.model.model_config import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE


class ByteTokenizer:
    """Token i < 256 is byte i; 256 = BOS, 257 = EOS. `encode` adds no specials."""

    vocab_size = BYTE_VOCAB_SIZE
    bos_token_id = BYTE_BOS_ID
    eos_token_ids = (BYTE_EOS_ID,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class HfTokenizer:
    """A Hugging Face `tokenizers` tokenizer: `tokenizer.json` of a folder, or rebuilt from a GGUF file."""

    def __init__(self, folder: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        if is_gguf(folder):
            # The GGUF's vocabulary, merges and special tokens (services/model/gguf.py).
            self._tok = read_gguf(folder).build_tokenizer()
        else:
            from tokenizers import Tokenizer as _Tokenizer

            path = Path(folder) / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(f"no tokenizer.json in model folder {folder}")
            self._tok = _Tokenizer.from_file(str(path))
            eos_token_ids = eos_token_ids or _eos_from_tokenizer_config(Path(folder), self._tok)
        # The model's vocabulary (embedding rows) may be padded beyond the tokenizer's.
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def decode_stream(self) -> tuple[Any, Any]:
        """A `tokenizers` DecodeStream for one generated text and the tokenizer it steps
        with: the text a token completes, in one call into Rust (the window decode below
        costs two decodes per token). It starts after the same one-token anchor as
        `IncrementalDetokenizer`, so a continuation's first piece keeps its leading space."""
        from tokenizers.decoders import DecodeStream

        return DecodeStream(self._tok.encode("a", add_special_tokens=False).ids[-1:], True), self._tok


def _eos_from_tokenizer_config(folder: Path, tok) -> tuple[int, ...]:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    token_id = tok.token_to_id(eos) if isinstance(eos, str) else None
    return () if token_id is None else (token_id,)


class IncrementalDetokenizer:
    """Text of a growing token list, produced a token at a time.

    Decodes a short window of tokens (as vLLM does) so that multi-byte characters
    split over tokens come out whole: text is released only once it no longer
    ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        # Every window is decoded after one fixed ordinary token: SentencePiece decoders strip the
        # leading space of a decoded text, which would drop the space of a continuation's first
        # token ("▁Paris" -> "Paris"); vLLM avoids it by starting the window inside the prompt.
        # Both decodes of a window start with the anchor, so it cancels out of the difference.
        self._anchor = tokenizer.encode("a")[-1:]

    def push(self, token_id: int) -> str:
        """Add a token; return the text it completed (possibly "")."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._anchor + self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._anchor + self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += new
        return new

"""GGUF files (llama.cpp's format): model config, tokenizer and chat template from the metadata.

Parsed with the `gguf` package's constants (no torch, no numpy views per token), so
the router and the gateway can use it; the weights are read by
`services/engine/gguf_loader.py`. Only what the engine can run is accepted: the
`llama` architecture (Llama, Mistral-style, SmolLM) with default or linear RoPE;
anything else is an `UnsupportedModelError` naming what is missing.

The tokenizer is rebuilt as a `tokenizers` BPE from the vocabulary, merges and
token types in the metadata, the way llama.cpp reads them:
- `gpt2` (byte-level BPE: SmolLM, Llama 3, Qwen): tokens are spelled in GPT-2's
  byte alphabet; the pre-tokenizer split follows `tokenizer.ggml.pre`.
- `llama` (SentencePiece BPE: Llama 2, Mistral): `▁` for spaces, `<0xNN>` byte
  fallback tokens; merges come from the file or, when absent, from the scores.
Tokens typed CONTROL (3) are special (kept whole, hidden by `decode`), USER_DEFINED
(4) are added tokens.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.model.model_config import ModelConfig, RopeScaling, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama",)
# Token types of `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6

# GPT-2 split regex (the default of `pre_tokenizers.ByteLevel(use_regex=True)`) and the ones
# llama.cpp uses for the `tokenizer.ggml.pre` names below (llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
# GPT-2 regex with every digit on its own (SmolLM's tokenizer.json: Digits(individual) + ByteLevel).
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact")


def is_gguf(path: str | Path | None) -> bool:
    return path is not None and str(path).lower().endswith(".gguf")


@dataclass(frozen=True)
class GgufTokenizerData:
    model: str  # "gpt2" | "llama"
    pre: str | None
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    scores: tuple[float, ...]
    merges: tuple[str, ...]
    add_bos: bool
    add_space_prefix: bool


@dataclass(frozen=True)
class GgufModel:
    """What a GGUF file says about its model, tokenizer and chat format (no weights)."""

    path: Path
    architecture: str
    name: str
    config: ModelConfig
    tokenizer_data: GgufTokenizerData
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    def build_tokenizer(self) -> Any:
        """A `tokenizers.Tokenizer` equivalent to the file's tokenizer."""
        return build_tokenizer(self.tokenizer_data, self.config.bos_token_id)

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos/eos token texts, for a chat template's context."""
        return {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}


class _Metadata:
    """A GGUF file's key/value metadata and tensor directory, parsed directly.

    `gguf.GGUFReader` makes a numpy view per array element (~100k for a 49k-token vocabulary:
    seconds per process, and every service reads the file); the header layout is small and
    fixed (llama.cpp's gguf.md), so it is parsed here with the `gguf` package's type codes.
    """

    def __init__(self, path: Path):
        import mmap

        from gguf import GGUF_MAGIC, GGUFValueType

        scalar = {
            GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
        }  # fmt: skip
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            magic, version = struct.unpack_from("<II", buf, 0)
            if magic != GGUF_MAGIC or version < 2:
                raise ValueError(f"bad magic/version {magic:#x}/{version}")
            n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
            pos = 24

            def string() -> str:
                nonlocal pos
                (n,) = struct.unpack_from("<Q", buf, pos)
                pos += 8 + n
                return buf[pos - n : pos].decode("utf-8", errors="replace")

            def value(kind: int) -> Any:
                nonlocal pos
                if kind == GGUFValueType.STRING:
                    return string()
                if kind == GGUFValueType.ARRAY:
                    item, count = struct.unpack_from("<IQ", buf, pos)
                    pos += 12
                    if item in scalar:
                        fmt = f"<{count}{scalar[item]}"
                        out = list(struct.unpack_from(fmt, buf, pos))
                        pos += struct.calcsize(fmt)
                        return out
                    return [value(item) for _ in range(count)]
                fmt = "<" + scalar[kind]
                (v,) = struct.unpack_from(fmt, buf, pos)
                pos += struct.calcsize(fmt)
                return v

            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = string()
                (kind,) = struct.unpack_from("<I", buf, pos)
                pos += 4
                self.fields[key] = value(kind)
            self.tensors: set[str] = set()
            # name -> (dims fastest-first, ggml type code, byte offset from the data section)
            self.tensor_infos: dict[str, tuple[tuple[int, ...], int, int]] = {}
            for _ in range(n_tensors):
                name = string()
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
                kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 4 + 8
                self.tensors.add(name)
                self.tensor_infos[name] = (tuple(int(d) for d in dims), int(kind), int(offset))
            align = int(self.fields.get("general.alignment", 32))
            self.data_offset = -(-pos // align) * align

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def read_tensor_directory(path: str | Path) -> tuple[dict[str, tuple[tuple[int, ...], int, int]], int]:
    """(name -> (dims fastest-first, ggml type code, offset), start of the data section)."""
    meta = _Metadata(Path(path))
    return meta.tensor_infos, meta.data_offset


@functools.lru_cache(maxsize=4)
def read_gguf(path: str | Path) -> GgufModel:
    """Parse a GGUF file's metadata (memory-mapped; tensors are not read)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        meta = _Metadata(path)
    except (ValueError, OSError, KeyError, struct.error) as e:
        raise UnsupportedModelError(f"{path}: not a readable GGUF file ({e})") from e
    arch = meta.get("general.architecture", "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; one of {SUPPORTED_ARCHITECTURES}"
        )
    return GgufModel(
        path=path,
        architecture=arch,
        name=str(meta.get("general.name", path.stem)),
        config=_model_config(meta, arch, meta.tensors, path),
        tokenizer_data=_tokenizer_data(meta, path),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=_token_text(meta, "tokenizer.ggml.bos_token_id"),
        eos_token=_token_text(meta, "tokenizer.ggml.eos_token_id"),
    )


def _token_text(meta: _Metadata, key: str) -> str | None:
    token_id = meta.get(key)
    tokens = meta.get("tokenizer.ggml.tokens")
    if token_id is None or not tokens or not 0 <= int(token_id) < len(tokens):
        return None
    return str(tokens[int(token_id)])


def _model_config(meta: _Metadata, arch: str, tensor_names: set[str], path: Path) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style scaling stored as per-frequency factors: not implemented from GGUF.
        raise UnsupportedModelError(f"{path}: RoPE frequency factors (rope_freqs.weight) are not supported")
    if get("expert_count"):
        raise UnsupportedModelError(f"{path}: mixture-of-experts GGUF models are not supported")
    scaling = _rope_scaling(get, path)
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts (hybrid models)
        raise UnsupportedModelError(f"{path}: per-layer KV head counts are not supported")
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", 0) or get("rope.dimension_count", 0) or hidden // heads)
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{path}: key and value head sizes differ")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{path}: partial rotary embeddings are not supported")
    vocab = int(get("vocab_size", 0) or len(meta.get("tokenizer.ggml.tokens", ())))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_down.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        model_type=arch,
    )


def _rope_scaling(get: Any, path: Path) -> RopeScaling:
    kind = get("rope.scaling.type", "none")
    factor = get("rope.scaling.factor", 0.0) or 0.0
    if kind == "none" or (kind == "linear" and factor in (0.0, 1.0)):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=float(factor))
    raise UnsupportedModelError(f"{path}: RoPE scaling {kind!r} is not supported (none or linear)")


def _tokenizer_data(meta: _Metadata, path: Path) -> GgufTokenizerData:
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise UnsupportedModelError(f"{path}: GGUF tokenizer {model!r} is not supported (gpt2 or llama)")
    tokens = tuple(meta.get("tokenizer.ggml.tokens", ()))
    return GgufTokenizerData(
        model=model,
        pre=meta.get("tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=tuple(meta.get("tokenizer.ggml.token_type", ()) or (1,) * len(tokens)),
        scores=tuple(meta.get("tokenizer.ggml.scores", ()) or ()),
        merges=tuple(meta.get("tokenizer.ggml.merges", ()) or ()),
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", model == "llama")),
    )


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (as in its encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_tokenizer(data: GgufTokenizerData, bos_token_id: int | None) -> Any:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's (see the module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(data.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in data.merges] if data.merges else _merges_from_scores(data)
    if data.model == "gpt2":
        tok = Tokenizer(BPE(vocab, merges, ignore_merges=False))
        tok.decoder = decoders.ByteLevel()
        split = _PRE_SPLITS.get(data.pre or "")
        if split is not None:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        elif data.pre in _DIGIT_SPLIT_PRES:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        alphabet = set(_byte_alphabet().values())
    else:
        unk = next((t for t in ("<unk>",) if t in vocab), None)
        tok = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        steps = [normalizers.Replace(" ", "▁")]
        if data.add_space_prefix:
            steps.insert(0, normalizers.Prepend("▁"))
        tok.normalizer = normalizers.Sequence(steps)
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if data.add_space_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(dec)
        alphabet = None
    types = data.token_types
    # A CONTROL token outside the byte alphabet of a byte-level vocabulary is a llama.cpp mislabel
    # (transformers skips them too): adding it would grow the vocabulary past the model's.
    specials = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(data.tokens, types, strict=False)
        if ty == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(data.tokens, types, strict=False)
        if ty == _USER_DEFINED
    ]
    if specials:
        tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)
    if data.add_bos and bos_token_id is not None:
        bos = data.tokens[bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)]
        )
    return tok


def _merges_from_scores(data: GgufTokenizerData) -> list[tuple[str, str]]:
    """SentencePiece files carry no merges: every split of a token into two vocabulary tokens,
    ranked by the merged token's score (what transformers' `generate_merges` does)."""
    vocab = {t: i for i, t in enumerate(data.tokens)}
    scores = data.scores or tuple(-float(i) for i in range(len(data.tokens)))
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for token, score in zip(data.tokens, scores, strict=False):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], (left, right)))
    ranked.sort()
    return [m for *_, m in ranked]

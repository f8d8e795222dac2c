"""The real default model's tokenizer, rebuilt from its GGUF (no torch): encoding as the
reference does, and incremental detokenization as the router streams it."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from services.model.catalog import ModelNotFoundError, resolve_model, smollm2_path
from services.model.model_config import ModelConfig
from services.model.tokenizer import HfTokenizer
from services.router.detokenizer import StreamDetokenizer, WindowDetokenizer, make_detokenizer

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def path() -> Path:
    try:
        return smollm2_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok(path) -> HfTokenizer:
    cfg = ModelConfig.from_hf_folder(path)
    return HfTokenizer(path, cfg.vocab_size, cfg.eos_token_ids)


@pytest.fixture(scope="module")
def ref(path):
    """transformers' own tokenizer from the same GGUF (its GGUF loading)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


TEXTS = [
    "The capital of France is",
    "Café, naïve, señor: über 東京 and 🙂 emoji.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
]


def test_encoding_matches_transformers_gguf_tokenizer(tok, ref):
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
    assert tok.eos_token_ids == (ref.convert_tokens_to_ids("<|im_end|>"),)


def test_digits_are_split_one_by_one(tok):
    # SmolLM2's own tokenizer.json pre-tokenizes with Digits(individual_digits=True), as
    # llama.cpp's "smollm" pre-tokenizer does (transformers' GGUF builder does not).
    assert len(tok.encode("1234")) == 4


@pytest.mark.parametrize("text", TEXTS)
def test_router_detokenizer_streams_whole_characters_and_hides_specials(tok, text):
    ids = tok.encode(text)
    detok = make_detokenizer(tok)
    pieces = [detok.push_many([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_multibyte_character_split_over_tokens_comes_out_once(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1  # byte-level pieces of one character
    detok = make_detokenizer(tok)
    assert [detok.push_many([t]) for t in ids] == [""] * (len(ids) - 1) + ["🙂"]


def test_stream_detokenizer_gives_the_window_detokenizers_pieces(tok):
    """The router streams with tokenizers' DecodeStream (one Rust call per delta); the text of
    every delta is the one the window decode gives, for texts and for arbitrary token ids
    (byte-fallback runs, specials, pieces that are not valid UTF-8 alone)."""
    assert isinstance(make_detokenizer(tok), StreamDetokenizer)
    rng = random.Random(0)
    vocab = tok._tok.get_vocab_size()
    runs = [tok.encode(t) for t in TEXTS] + [[rng.randrange(vocab) for _ in range(300)] for _ in range(20)]
    for ids in runs:
        stream, window = StreamDetokenizer(tok), WindowDetokenizer(tok)
        assert [stream.push_many([t]) for t in ids] == [window.push_many([t]) for t in ids]
        # Deltas of several tokens (a coalesced frame, a migration's catch-up) and empty ones.
        stream, window, i = StreamDetokenizer(tok), WindowDetokenizer(tok), 0
        while i < len(ids):
            n = rng.randrange(0, 5)
            delta = ids[i : i + n]
            assert stream.push_many(delta) == window.push_many(delta), (i, delta)
            i += n


def test_catalog_names(path):
    assert resolve_model("smollm2-135m-instruct").model_path == str(path)
    assert resolve_model("builtin-tiny").preset == "tiny"
    with pytest.raises(ModelNotFoundError, match="no such file"):
        resolve_model("/nonexistent/model.gguf")


def test_router_loads_the_gguf_tokenizer_without_torch(path):
    code = (
        "import sys\n"
        "from services.router.config import ModelSpec, RouterConfig\n"
        f"spec = ModelSpec.load(RouterConfig(model_path={str(path)!r}))\n"
        "assert spec.vocab_size == 49152 and spec.max_model_len == 8192, spec\n"
        "assert spec.tokenizer.encode('The capital of France is') == [504, 3575, 282, 4649, 314]\n"
        "assert 'torch' not in sys.modules, 'the router imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_gateway_renders_the_gguf_chat_template_as_transformers_does(path, ref):
    from services.gateway.chat_template import load_chat_template

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = load_chat_template(str(path)).render(messages)
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.text == want
    assert prompt.text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert list(prompt.token_ids) == ref.encode(want, add_special_tokens=False)

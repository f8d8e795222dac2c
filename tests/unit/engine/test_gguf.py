"""GGUF models against transformers' own GGUF loading, on a small file written here.

The file is written with the `gguf` package the way llama.cpp's converter writes a
Llama: Q/K rows permuted, tensors quantized (every type the loader supports appears),
a byte-level BPE vocabulary with merges, token types and a chat template.
`transformers` (`from_pretrained(dir, gguf_file=...)`) is the reference, token for
token (greedy) and by logits, and for the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.loader import WeightLoadError
from services.model.gguf import read_gguf
from services.model.model_config import ModelConfig, UnsupportedModelError
from services.model.tokenizer import HfTokenizer, IncrementalDetokenizer
from tests.unit.engine.conftest import assert_pool_restored, prompt_of, request

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SIZES = {"hidden": 64, "ffn": 128, "layers": 2, "heads": 4, "kv_heads": 2, "ctx": 256}
# Which quantization each kind of tensor gets: every supported type is exercised.
TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q4_0,
    "attn_q": Q.Q4_1,
    "attn_k": Q.Q5_0,
    "attn_v": Q.Q5_1,
    "attn_output": Q.F16,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.BF16,
    "ffn_down": Q.Q8_0,
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab(tokenizer_json: Path) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of the test's byte-level BPE, plus chat specials."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    # The trained vocabulary's last two slots become the chat markers (control tokens).
    tokens[-2:] = ["<|im_start|>", "<|im_end|>"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    merges = [m for m in merges if "".join(m.split(" ")) in set(tokens)]
    types = [3 if t in ("<s>", "</s>", "<|im_start|>", "<|im_end|>") else 1 for t in tokens]
    return tokens, types, merges


def write_gguf(
    path: Path,
    tokenizer_json: Path,
    *,
    arch: str = "llama",
    tied: bool = False,
    types=TYPES,
    spm: bool = False,
) -> Path:
    s = SIZES
    tokens, token_types, merges = _vocab(tokenizer_json)
    scores: list[float] = []
    if spm:
        tokens, token_types, scores = _spm_vocab()
        merges = []
    head_dim = s["hidden"] // s["heads"]
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_block_count(s["layers"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    if spm:  # SentencePiece: scores instead of merges, llama.cpp adds BOS and a space prefix
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, shape: tuple[int, ...], kind: str | None, scale: float = 0.08) -> None:
        if kind is None:  # norms: randomised around 1 so a swapped or missing norm shows
            arr = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(name, arr)
            return
        arr = (scale * rng.standard_normal(shape)).astype(np.float32)
        if kind == "attn_q":
            arr = _permute(arr, s["heads"])
        elif kind == "attn_k":
            arr = _permute(arr, s["kv_heads"])
        qtype = types[kind]
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        elif qtype == Q.I8:  # a type the engine does not load
            w.add_tensor(name, (arr * 100).astype(np.int8))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    v, d, f, kv = len(tokens), s["hidden"], s["ffn"], s["kv_heads"] * head_dim
    add("token_embd.weight", (v, d), "token_embd")
    for i in range(s["layers"]):
        add(f"blk.{i}.attn_norm.weight", (d,), None)
        add(f"blk.{i}.attn_q.weight", (d, d), "attn_q")
        add(f"blk.{i}.attn_k.weight", (kv, d), "attn_k")
        add(f"blk.{i}.attn_v.weight", (kv, d), "attn_v")
        add(f"blk.{i}.attn_output.weight", (d, d), "attn_output")
        add(f"blk.{i}.ffn_norm.weight", (d,), None)
        add(f"blk.{i}.ffn_gate.weight", (f, d), "ffn_gate")
        add(f"blk.{i}.ffn_up.weight", (f, d), "ffn_up")
        add(f"blk.{i}.ffn_down.weight", (d, f), "ffn_down")
    add("output_norm.weight", (d,), None)
    if not tied:
        add("output.weight", (v, d), "output")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """A small SentencePiece BPE vocabulary: <unk>, <s>, </s>, 256 byte-fallback tokens, pieces."""
    pieces = [
        "▁",
        "t",
        "h",
        "e",
        "c",
        "a",
        "f",
        "é",
        "o",
        "x",
        "▁t",
        "he",
        "▁the",
        "▁c",
        "af",
        "▁caf",
        "▁café",
    ]
    pieces += ["▁f", "ox", "▁fox"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    # Longer pieces score higher: merges derived from scores apply them (as SentencePiece would).
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-100.0 + 10 * len(p) for p in pieces]
    return tokens, types, scores


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, tokenizer_json) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tokenizer_json)


@pytest.fixture(scope="module")
def hf_from_gguf(gguf_file):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()


def test_generation_and_logits_match_transformers_gguf_loading(gguf_file, hf_from_gguf):
    engine = LLMEngine(EngineConfig(model_path=str(gguf_file), num_threads=1, num_blocks=64))
    cfg = engine.spec.model
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (4, 2, False)
    vocab = engine.info.vocab_size
    prompts = [prompt_of(n, seed=n, vocab=vocab) for n in (3, 17, 40)]
    ours = engine.generate([request(f"p{i}", p, max_tokens=24) for i, p in enumerate(prompts)])
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p])
            out = hf_from_gguf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
            )
            assert ours[f"p{i}"] == out[0, len(p) :].tolist(), f"prompt of {len(p)} tokens"
            want = hf_from_gguf(ids).logits[0].float()
            torch.testing.assert_close(engine.prompt_logits(p), want, atol=2e-4, rtol=1e-4)
    assert_pool_restored(engine)


def test_tokenizer_matches_transformers_gguf_tokenizer(gguf_file):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    cfg = ModelConfig.from_hf_folder(gguf_file)
    ours = HfTokenizer(gguf_file, cfg.vocab_size, cfg.eos_token_ids)
    assert ours.eos_token_ids == (ref.convert_tokens_to_ids("<|im_end|>"),)
    for text in ["the quick brown fox", "señor café über naïve 東京", "<|im_start|>user\nhi<|im_end|>"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_sentencepiece_byte_fallback_tokenizer_matches_transformers(tmp_path, tokenizer_json):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "spm.gguf", tokenizer_json, spm=True)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    cfg = ModelConfig.from_hf_folder(path)
    ours = HfTokenizer(path, cfg.vocab_size, cfg.eos_token_ids)
    for text in ["the café fox", "東 the fox", "café 京"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text  # BOS included: llama.cpp adds it for SentencePiece
        assert ids[0] == 1 and ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
        # Streamed as a continuation (no BOS): the first piece keeps its space, as vLLM's does.
        detok = IncrementalDetokenizer(ours)
        pieces = [detok.push(t) for t in ids[1:]]
        assert "".join(pieces) == " " + text and all("\ufffd" not in p for p in pieces)
        assert next(p for p in pieces if p).startswith(" ")
    # "東" has no piece: three byte-fallback tokens, text only once all three arrived.
    ids = ours.encode("東")[1:]
    assert [ours._tok.id_to_token(t) for t in ids][-3:] == ["<0xE6>", "<0x9D>", "<0xB1>"]


def test_metadata_gives_config_and_chat_template(gguf_file):
    meta = read_gguf(gguf_file)
    assert meta.chat_template == CHAT_TEMPLATE
    assert meta.special_tokens == {"bos_token": "<s>", "eos_token": "<|im_end|>"}
    assert meta.config.max_position_embeddings == SIZES["ctx"]
    assert meta.config.head_dim == SIZES["hidden"] // SIZES["heads"]


def test_incremental_detokenizer_hides_specials_and_joins_split_characters(gguf_file):
    cfg = ModelConfig.from_hf_folder(gguf_file)
    tok = HfTokenizer(gguf_file, cfg.vocab_size, cfg.eos_token_ids)
    text = "<|im_start|>señor 東京 café<|im_end|>"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == "señor 東京 café"
    assert all("\ufffd" not in p for p in pieces)


def test_unsupported_architecture_is_refused(tmp_path, tokenizer_json):
    path = write_gguf(tmp_path / "gpt2.gguf", tokenizer_json, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'"):
        LLMEngine(EngineConfig(model_path=str(path), num_blocks=8))


def test_unsupported_tensor_type_is_refused(tmp_path, tokenizer_json):
    path = write_gguf(tmp_path / "q.gguf", tokenizer_json, types={**TYPES, "ffn_up": Q.I8})
    with pytest.raises(UnsupportedModelError, match="tensor types \\['I8'\\]"):
        LLMEngine(EngineConfig(model_path=str(path), num_blocks=8))


def test_unexpected_tensor_is_a_weight_load_error(tmp_path, tokenizer_json, gguf_file):
    # A tied file (no output.weight) read as a model that expects one would be missing it;
    # the reverse, a stray tensor, must not be silently ignored.
    path = tmp_path / "extra.gguf"
    reader = gguf.GGUFReader(str(gguf_file))
    w = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.add_tensor("blk.0.attn_extra.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightLoadError, match="attn_extra"):
        LLMEngine(EngineConfig(model_path=str(path), num_blocks=8))

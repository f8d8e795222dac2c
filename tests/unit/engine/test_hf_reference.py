"""The engine against `transformers` on the same tiny checkpoints, loaded from disk."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.unit.engine.conftest import assert_pool_restored, make_hf_checkpoint, prompt_of, request

PROMPT_LENGTHS = (1, 7, 16, 33, 70)
NEW_TOKENS = 40

CHECKPOINTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "llama-tied-bias": ("llama", {"tie_word_embeddings": True, "attention_bias": True}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-rope-dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory, tokenizer_json):
    model_type, overrides = CHECKPOINTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(folder, model_type, tokenizer_json, **overrides)
    return request.param, folder, hf


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_greedy_generation_and_logits_match_transformers(checkpoint):
    name, folder, hf = checkpoint
    engine = LLMEngine(
        EngineConfig(model_path=str(folder), num_threads=1, num_blocks=64, max_num_batched_tokens=64)
    )
    assert engine.info.vocab_size == 512 and engine.info.model_id == folder.name
    prompts = [prompt_of(n, seed=n, vocab=512) for n in PROMPT_LENGTHS]

    # Batched (with chunked prefill: the 70-token prompt spans two steps).
    ours = engine.generate([request(f"p{i}", p, max_tokens=NEW_TOKENS) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert ours[f"p{i}"] == hf_greedy(hf, p, NEW_TOKENS), f"{name}: prompt of {len(p)} tokens"

    with torch.no_grad():
        for p in prompts[1:]:
            want = hf(torch.tensor([p])).logits[0].float()
            got = engine.prompt_logits(p)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert_pool_restored(engine)


def test_bfloat16_logits_close_to_transformers(tmp_path, tokenizer_json):
    hf = make_hf_checkpoint(tmp_path, "qwen2", tokenizer_json).to(torch.bfloat16)
    engine = LLMEngine(EngineConfig(model_path=str(tmp_path), num_threads=1, dtype="bfloat16", num_blocks=32))
    prompt = prompt_of(40, seed=3, vocab=512)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float()
    got = engine.prompt_logits(prompt)
    # bf16 keeps ~3 significant digits; logits here are O(1).
    torch.testing.assert_close(got, want, atol=0.06, rtol=0.02)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    assert_pool_restored(engine)


def test_engine_tokenizer_is_the_folders(checkpoint):
    _, folder, _ = checkpoint
    engine = LLMEngine(EngineConfig(model_path=str(folder), num_threads=1, num_blocks=8))
    text = "the lazy fox: café"
    ids = engine.tokenizer.encode(text)
    assert max(ids) < 512 and engine.tokenizer.decode(ids) == text

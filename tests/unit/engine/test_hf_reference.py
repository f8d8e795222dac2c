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
    # GQA ratio 4 with a head_dim that is not hidden / heads (q is 256 wide, hidden 64).
    "llama-gqa4-head-dim": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}),
    # Every prompt but the shortest crosses the original 16 positions.
    "llama-rope-llama3-past-original": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    # Norm weights around 1 and every bias present (q/k/v/o and MLP).
    "llama-random-norms-biases": (
        "llama",
        {"random_norms": True, "attention_bias": True, "mlp_bias": True},
    ),
    # Multi-query (one KV head) Qwen2 with tied embeddings.
    "qwen2-mqa-tied": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory, tokenizer_json):
    model_type, overrides = CHECKPOINTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(folder, model_type, tokenizer_json, **overrides)
    if overrides.get("random_norms"):
        norms = [p for n, p in hf.named_parameters() if n.endswith("norm.weight")]
        assert norms and all((p - 1).abs().max() > 0.1 for p in norms)
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


def test_prompt_of_300_tokens_matches_transformers(tmp_path, tokenizer_json):
    hf = make_hf_checkpoint(tmp_path, "llama", tokenizer_json, random_norms=True, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=32)  # fmt: skip
    engine = LLMEngine(
        EngineConfig(model_path=str(tmp_path), num_threads=1, num_blocks=64, max_num_batched_tokens=64)
    )
    prompt = prompt_of(320, seed=11, vocab=512)  # five chunks of 64
    assert engine.generate([request("long", prompt, max_tokens=24)])["long"] == hf_greedy(hf, prompt, 24)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(prompt), want, atol=2e-4, rtol=1e-4)
    assert_pool_restored(engine)


def _dynamic_checkpoint(folder, tokenizer_json):
    # Original context 64, factor 2: the engine may extend to 128 positions.
    return make_hf_checkpoint(
        folder,
        "llama",
        tokenizer_json,
        max_position_embeddings=64,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )


def test_dynamic_ntk_within_the_original_context_is_plain_rope(tmp_path, tokenizer_json):
    hf = _dynamic_checkpoint(tmp_path, tokenizer_json)
    engine = LLMEngine(EngineConfig(model_path=str(tmp_path), num_threads=1, num_blocks=16))
    assert engine.info.max_model_len == 64
    prompt = prompt_of(40, seed=5, vocab=512)  # + 20 new tokens stays within 64
    assert engine.generate([request("a", prompt, max_tokens=20)])["a"] == hf_greedy(hf, prompt, 20)
    assert_pool_restored(engine)


def test_dynamic_ntk_past_the_original_context_is_scaled_for_original_times_factor(tmp_path, tokenizer_json):
    """As vLLM does: the base scaled once for 64 x 2 positions, whatever the pool or context limit.

    The reference is the same weights in transformers with plain RoPE at that base (transformers'
    own dynamic NTK rescales per forward pass with the current length; vLLM and this engine do not).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.engine.rope import dynamic_ntk_theta
    from services.model.model_config import RopeScaling
    from tests.unit.engine.conftest import HF_SIZES

    hf = _dynamic_checkpoint(tmp_path, tokenizer_json)
    head_dim = HF_SIZES["hidden_size"] // HF_SIZES["num_attention_heads"]
    theta = dynamic_ntk_theta(
        head_dim, 10000.0, RopeScaling("dynamic", 2.0, original_max_position_embeddings=64)
    )
    ref = LlamaForCausalLM(
        LlamaConfig(**{**HF_SIZES, "max_position_embeddings": 128, "rope_theta": theta})
    ).eval()
    ref.load_state_dict(hf.state_dict())
    crossing = prompt_of(90, seed=6, vocab=512)  # crosses the original 64 positions
    short = prompt_of(20, seed=7, vocab=512)
    with torch.no_grad():
        want = {len(p): ref(torch.tensor([p])).logits[0].float() for p in (crossing, short)}
    # Two context limits and pool sizes: the same frequencies, so the same logits.
    for max_len, blocks in ((128, 16), (100, 9)):
        engine = LLMEngine(
            EngineConfig(model_path=str(tmp_path), num_threads=1, num_blocks=blocks, max_model_len=max_len)
        )
        for p in (crossing, short):
            torch.testing.assert_close(engine.prompt_logits(p), want[len(p)], atol=2e-4, rtol=1e-4)
        assert_pool_restored(engine)
    with pytest.raises(ValueError, match="exceeds the model's context of 128"):
        LLMEngine(EngineConfig(model_path=str(tmp_path), num_threads=1, num_blocks=16, max_model_len=129))


def test_prompt_logits_past_the_context_is_an_invalid_request(tmp_path, tokenizer_json):
    from services.engine.api import InvalidRequestError

    make_hf_checkpoint(tmp_path, "llama", tokenizer_json, max_position_embeddings=32)
    engine = LLMEngine(EngineConfig(model_path=str(tmp_path), num_threads=1, num_blocks=16))
    with pytest.raises(InvalidRequestError, match="exceed the context limit of 32"):
        engine.prompt_logits(prompt_of(40, seed=1, vocab=512))
    assert_pool_restored(engine)


def test_quantization_config_is_refused(tmp_path, tokenizer_json):
    import json

    from services.model.model_config import UnsupportedModelError

    make_hf_checkpoint(tmp_path, "llama", tokenizer_json)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quant_method 'fp8'"):
        LLMEngine(EngineConfig(model_path=str(tmp_path), num_threads=1, num_blocks=8))


def _rewrite_tensors(folder, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_float8_weights_with_scales_are_refused(tmp_path, tokenizer_json):
    from services.model.model_config import UnsupportedModelError

    make_hf_checkpoint(tmp_path, "llama", tokenizer_json)
    name = "model.layers.0.mlp.down_proj"

    def to_fp8(t):
        t[f"{name}.weight"] = t[f"{name}.weight"].to(torch.float8_e4m3fn)
        t[f"{name}.weight_scale"] = torch.ones(1)

    _rewrite_tensors(tmp_path, to_fp8)
    with pytest.raises(UnsupportedModelError, match="weight_scale"):
        LLMEngine(EngineConfig(model_path=str(tmp_path), num_threads=1, num_blocks=8))

    _rewrite_tensors(tmp_path, lambda t: t.pop(f"{name}.weight_scale"))  # fp8 without its scale
    with pytest.raises(UnsupportedModelError, match="float8"):
        LLMEngine(EngineConfig(model_path=str(tmp_path), num_threads=1, num_blocks=8))


def test_unexpected_tensor_is_a_weight_load_error(tmp_path, tokenizer_json):
    from services.engine.loader import WeightLoadError

    make_hf_checkpoint(tmp_path, "llama", tokenizer_json)
    _rewrite_tensors(
        tmp_path, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2, 2)})
    )
    with pytest.raises(WeightLoadError, match="unexpected tensors"):
        LLMEngine(EngineConfig(model_path=str(tmp_path), num_threads=1, num_blocks=8))

"""Engine test helpers: tiny engines that must give back every block, tiny HF checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.api import EngineRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine


def tiny_config(**overrides) -> EngineConfig:
    values = {"preset": "tiny", "num_blocks": 128, "max_num_batched_tokens": 256, "num_threads": 1}
    values.update(overrides)
    return EngineConfig(**values)


def assert_pool_restored(engine: LLMEngine) -> None:
    """No request left and every block free again (cached blocks count as free)."""
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.held_blocks) == (0, 0, 0)
    assert stats.free_blocks == stats.total_blocks == engine.info.num_blocks
    assert not engine.scheduler.remote and not engine.scheduler.held


@pytest.fixture
def make_engine():
    """Factory of LLMEngines; each one must have its pool back when the test ends."""
    engines: list[LLMEngine] = []

    def make(**overrides) -> LLMEngine:
        engine = LLMEngine(tiny_config(**overrides))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_pool_restored(engine)


def request(rid: str, prompt, max_tokens: int = 16, **sampling) -> EngineRequest:
    sampling.setdefault("ignore_eos", True)
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling))


def prompt_of(length: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


# ---- tiny Hugging Face checkpoints --------------------------------------------------

HF_SIZES = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def train_tokenizer_json(path: Path) -> None:
    """A byte-level BPE with 512 tokens (<s>=0, </s>=1), trained on a little text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs"] * 50
    text += ["prefill and decode are disaggregated; señor café über naïve 東京"] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(path))


def make_hf_checkpoint(
    folder: Path, model_type: str, tokenizer_json: Path, random_norms: bool = False, **overrides
):
    """Save a random tiny Llama / Qwen2 with save_pretrained; return the HF model (eval, fp32).

    `random_norms`: RMSNorm weights drawn around 1 instead of all ones (which would hide a
    swapped or missing norm).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_cls, model_cls = classes[model_type]
    torch.manual_seed(1234)
    model = model_cls(config_cls(**{**HF_SIZES, **overrides})).eval()
    # Larger-than-default weights make the logits peaked, so greedy ties are unlikely.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            elif random_norms and name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return model


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer_json(path)
    return path

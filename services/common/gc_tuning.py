"""A serving process's garbage-collector settings, applied once it has started.

A sim decode worker in the Dynamo side by side's configuration allocates a few
objects per token per request (outputs, events, futures, frames) and lives on a
heap of ~200k objects from start-up (torch, the tokenizer, the block pool of
16,384 blocks, gRPC). CPython's default gen0 threshold of 700 ran a young
collection every ~100 tokens, and the older collections it triggers walk that
start-up heap: in-process (bench/worker_core.py: the core path, sim x1000,
32 streams) 57-66 collections per 16k tokens, with the loop and the engine
thread stopped for each. Almost nothing a request makes is a cycle (reference
counting frees it), so collecting rarely costs little memory:

- `gc.freeze()` moves what start-up made to the permanent generation: no
  collection walks it again;
- gen0 at 20,000 allocations, older generations after 20 of the one below.

The router applies the same settings for the same reason: profiled in the same
configuration (bench/profile_front_dynamo.py: HTTP door, kv_aware, ~1,800-token
prompts), the collector took 7-12% of its CPU, since every prompt adds ~110
prefix-index nodes with their sets and a full collection walked the whole index
every few seconds.
"""

from __future__ import annotations

import gc

THRESHOLDS = (20_000, 20, 20)


def tune_gc() -> None:
    """Collect what start-up left, freeze the survivors, raise the thresholds."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)

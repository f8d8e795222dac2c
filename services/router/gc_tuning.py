"""The router process's garbage-collector settings, applied once it is serving.

Profiled in the Dynamo side by side's configuration (bench/profile_front_dynamo.py:
HTTP door, kv_aware, Mooncake prompts of ~1,800 tokens), the
cyclic collector took 7-12% of the router's CPU: every prompt adds ~110 prefix-index
nodes (each with its sets), KV events, protobufs and per-request objects, so
CPython's default gen0 threshold of 700 ran a young collection every few
hundred of them and a full one, walking the whole index, every few seconds.
Almost nothing the router makes is a cycle (it is freed by reference
counting), so collecting rarely costs little memory:

- `gc.freeze()` after start-up moves the imported modules, settings and
  gRPC/HTTP machinery to the permanent generation: no collection walks them
  again;
- gen0 at 20,000 allocations (x28 fewer young collections), and older
  generations after 20 of the one below.
"""

from __future__ import annotations

import gc

THRESHOLDS = (20_000, 20, 20)


def tune_gc() -> None:
    """Collect what start-up left, freeze the survivors, raise the thresholds."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)

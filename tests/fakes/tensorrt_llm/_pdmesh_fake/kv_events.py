"""The fake's KV cache events, in the dict format of `LLM.get_kv_cache_events`.

Real format (tensorrt_llm/_utils.py KVCacheEventSerializer, 1.3.0rc13):

    {"event_id": int, "window_size": int, "data": DATA}
    DATA = {"type": "created", "num_blocks_per_cache_level": [gpu, host]}
         | {"type": "stored", "parent_hash": int | None, "blocks": [
               {"type": "stored_block", "block_hash": int, "cache_level": 0, "priority": int,
                "tokens": [{"type": "unique_token", "token_id": int, "token_extra_id": 0}, ...]}]}
         | {"type": "removed", "block_hashes": [int, ...]}

Events come from the torch engine's own prefix-cache events. Block hashes are
deliberately *not* pdmesh's (TensorRT-LLM hashes differently), so a consumer
must rebuild pdmesh hashes from the tokens, as it must against the real thing.
The tokens of each block are known because the fake records every sequence it
runs (prompt and output) and keys its full blocks by pdmesh hash.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence

from services.engine.api import KvEvent, KvEventKind
from services.model.hashing import block_hashes

PRIORITY_DEFAULT = 35  # the real default retention priority
_GIVE_UP_AFTER = 50  # drains a stored event may wait for its tokens


def trt_hash(pdmesh_hash: int) -> int:
    """A stable stand-in for TensorRT-LLM's block hash of the same block."""
    digest = hashlib.sha256(b"trtllm-fake" + pdmesh_hash.to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class KvEventFeed:
    """Converts the torch engine's event log into TensorRT-LLM event dicts. Thread-safe."""

    def __init__(self, engine, block_size: int, num_blocks: int, window_size: int):
        self._engine = engine
        self._block_size = block_size
        self._lock = threading.Lock()
        self._tokens: dict[int, tuple[int, ...]] = {}  # pdmesh hash -> the block's tokens
        self._seq = 0  # last torch event converted
        self._next_id = 1
        self._stalls = 0
        self._window = window_size
        self._pending = [self._wrap(0, {"type": "created", "num_blocks_per_cache_level": [num_blocks, 0]})]

    def note(self, token_ids: Sequence[int]) -> None:
        """Record the blocks of a sequence the engine runs (called as it grows)."""
        full = len(token_ids) // self._block_size * self._block_size
        if not full:
            return
        hashes = block_hashes(token_ids[:full], self._block_size)
        with self._lock:
            for i, h in enumerate(hashes):
                self._tokens.setdefault(
                    h, tuple(token_ids[i * self._block_size : (i + 1) * self._block_size])
                )

    def take(self, timeout: float | None) -> list[dict]:
        """Events since the last call; waits up to `timeout` seconds for one."""
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            events = self._drain()
            if events or time.monotonic() >= deadline:
                return events
            time.sleep(0.01)  # the fake's stand-in for the real queue's blocking get

    def _drain(self) -> list[dict]:
        with self._lock:
            out, self._pending = self._pending, []
            for ev in self._engine.kv_events_since(self._seq):
                data = self._convert(ev)
                if data is None:  # tokens not recorded yet: retry on the next drain
                    self._stalls += 1
                    if self._stalls < _GIVE_UP_AFTER:
                        break
                    data = self._convert(ev, partial=True)
                self._stalls = 0
                self._seq = ev.seq
                if data is not None:
                    out.append(self._wrap(self._next_id, data))
                    self._next_id += 1
            return out

    def _convert(self, ev: KvEvent, partial: bool = False) -> dict | None:
        if ev.kind is KvEventKind.STORED:
            blocks = []
            for h in ev.block_hashes:
                tokens = self._tokens.get(h)
                if tokens is None:
                    if not partial:
                        return None
                    break
                blocks.append(
                    {
                        "type": "stored_block",
                        "block_hash": trt_hash(h),
                        "tokens": [
                            {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens
                        ],
                        "cache_level": 0,
                        "priority": PRIORITY_DEFAULT,
                    }
                )
            parent = None if ev.parent_hash is None else trt_hash(ev.parent_hash)
            return {"type": "stored", "parent_hash": parent, "blocks": blocks} if blocks else None
        if ev.kind is KvEventKind.REMOVED:
            for h in ev.block_hashes:
                self._tokens.pop(h, None)
            return {"type": "removed", "block_hashes": [trt_hash(h) for h in ev.block_hashes]}
        # CLEARED has no TensorRT-LLM counterpart: report every known block removed.
        hashes, self._tokens = list(self._tokens), {}
        return {"type": "removed", "block_hashes": [trt_hash(h) for h in hashes]}

    def _wrap(self, event_id: int, data: dict) -> dict:
        return {"event_id": event_id, "data": data, "window_size": self._window}

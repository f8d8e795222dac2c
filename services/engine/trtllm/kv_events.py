"""KvEventMapper: TensorRT-LLM KV cache events -> pdmesh prefix-cache events.

TensorRT-LLM reports its cache as dicts from `LLM.get_kv_cache_events`
(tensorrt_llm/llmapi/llm.py; format of tensorrt_llm/_utils.py KVCacheEventSerializer):

    {"event_id", "window_size", "data": {"type": "created", "num_blocks_per_cache_level": [...]}
                                      | {"type": "stored", "parent_hash", "blocks": [{"block_hash", "tokens":
                                          [{"token_id", ...}], "cache_level", "priority"}]}
                                      | {"type": "removed", "block_hashes": [...]}
                                      | {"type": "updated", ...}}

Its block hashes are its own, so the router cannot use them. The mapper rebuilds
pdmesh's chained hashes (services/model/hashing.py) from the tokens of each
stored block, remembers TensorRT-LLM hash -> pdmesh hash so `removed` events can
be translated, and appends the result to a KvEventLog the worker streams. A
stored chain whose parent it never saw (events lost before subscription) and
partial blocks are skipped: pdmesh hashes full blocks from the prompt start only.

The mapper's cached set also answers `prefix_lookup` and `kv_snapshot`: it is
the engine's prefix cache as seen through its events. Plain Python, one owner
(the engine's event loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.engine.kv_events import KvEventLog
from services.model.hashing import ROOT_HASH, block_hashes, hash_block


class KvEventMapper:
    def __init__(self, block_size: int, capacity: int):
        self.block_size = block_size
        self.log = KvEventLog(capacity)
        self.num_blocks: int | None = None  # from the "created" event
        self.skipped = 0  # stored chains / blocks that could not be mapped
        self._by_trt: dict[int, int] = {}  # TensorRT-LLM block hash -> pdmesh block hash
        self._cached: dict[int, tuple[int, int | None]] = {}  # pdmesh hash -> (refs, parent)

    def apply(self, event: dict[str, Any]) -> None:
        data = event.get("data") or {}
        kind = data.get("type")
        if kind == "stored":
            self._stored(data.get("parent_hash"), data.get("blocks") or [])
        elif kind == "removed":
            self._removed(data.get("block_hashes") or [])
        elif kind == "created":
            levels = data.get("num_blocks_per_cache_level") or [0]
            self.num_blocks = int(levels[0])
        # "updated" (priority / cache level) changes nothing that routing uses.

    def _stored(self, trt_parent: int | None, blocks: list[dict[str, Any]]) -> None:
        if trt_parent is None:
            parent = None
        elif trt_parent in self._by_trt:
            parent = self._by_trt[trt_parent]
        else:
            self.skipped += 1
            return
        first_parent, run = parent, []
        for block in blocks:
            tokens = [int(t["token_id"]) for t in block.get("tokens") or []]
            if len(tokens) != self.block_size:
                self.skipped += 1
                break
            h = hash_block(ROOT_HASH if parent is None else parent, tokens)
            trt_hash = int(block["block_hash"])
            if self._by_trt.get(trt_hash) != h:
                self._by_trt[trt_hash] = h
                refs, _ = self._cached.get(h, (0, parent))
                self._cached[h] = (refs + 1, parent)
            run.append(h)
            parent = h
        self.log.stored(first_parent, run)

    def _removed(self, trt_hashes: list[int]) -> None:
        gone = []
        for trt_hash in trt_hashes:
            h = self._by_trt.pop(int(trt_hash), None)
            if h is None:
                continue
            refs, parent = self._cached[h]
            if refs > 1:
                self._cached[h] = (refs - 1, parent)
            else:
                del self._cached[h]
                gone.append(h)
        self.log.removed(gone)

    # -- views --------------------------------------------------------------------------
    def prefix_lookup(self, token_ids: Sequence[int]) -> int:
        """Leading tokens whose blocks the events say are cached (a multiple of block_size)."""
        n = 0
        for h in block_hashes(token_ids, self.block_size):
            if h not in self._cached:
                break
            n += 1
        return n * self.block_size

    def snapshot(self) -> tuple[int, list[tuple[int | None, int]]]:
        return self.log.last_seq, [(parent, h) for h, (_, parent) in self._cached.items()]

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

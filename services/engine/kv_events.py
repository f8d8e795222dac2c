"""KvEventLog: numbered prefix-cache events in a bounded buffer.

The BlockManager appends (stored / removed / cleared) as its cache changes; the
worker's SubscribeKvEvents stream reads them with `since(seq)` from another
thread. When a subscriber falls behind by more than the buffer, the first event
it gets has seq > its seq + 1: the gap tells it to resync from a snapshot.
"""

from __future__ import annotations

import threading
from collections import deque

from services.engine.api import KvEvent, KvEventKind, KvTier


class KvEventLog:
    def __init__(self, capacity: int):
        self._events: deque[KvEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        # Seq of the last event appended; the first event has seq 1.
        self.last_seq = 0

    def stored(self, parent_hash: int | None, block_hashes: list[int], tier: KvTier = KvTier.DEVICE) -> None:
        if block_hashes:
            self._append(KvEventKind.STORED, tuple(block_hashes), parent_hash, tier)

    def removed(self, block_hashes: list[int], tier: KvTier = KvTier.DEVICE) -> None:
        if block_hashes:
            self._append(KvEventKind.REMOVED, tuple(block_hashes), None, tier)

    def cleared(self) -> None:
        self._append(KvEventKind.CLEARED, (), None)

    def since(self, seq: int) -> list[KvEvent]:
        """Buffered events with seq > `seq`, oldest first."""
        with self._lock:
            if seq >= self.last_seq:
                return []
            first = self.last_seq - len(self._events) + 1
            skip = max(0, seq - first + 1)
            return list(self._events)[skip:]

    def _append(
        self, kind: KvEventKind, hashes: tuple[int, ...], parent: int | None, tier: KvTier = KvTier.DEVICE
    ) -> None:
        with self._lock:
            seq = self.last_seq + 1
            self._events.append(
                KvEvent(seq=seq, kind=kind, block_hashes=hashes, parent_hash=parent, tier=tier)
            )
            self.last_seq = seq

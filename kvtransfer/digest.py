"""Per-block digests of KV bytes: what makes a pulled block trustworthy.

The holder (prefill worker) computes one digest per block from the bytes it
holds when it issues a handle (`digest_blocks`); the handle carries them
(`NixlBlockDescriptors.block_digests`). The receiver checks the bytes that
landed in its own blocks against them (`verify_blocks`) before the blocks are
committed to a sequence or offered to its prefix cache. Whatever went wrong in
between (a hostile or stale agent record that points a NIXL READ at other
memory, a holder that reused the blocks, a bug in a transport) shows up as
`KvTransferFailed(INTEGRITY)`, and the caller recomputes locally.

xxh3-128 (the `xxhash` package): ~20 GB/s on one core, which is close to
memory bandwidth, so the check costs about what reading the bytes once costs.
It is not a MAC: it detects misdirected or corrupted bytes; it does not stop a
party that can read the handle (the digests) and write the bytes the receiver
reads. The handle travels on the decode <-> prefill connection (mTLS when TLS
is on), which such a party would already have to control.

Hashing reads the pool through `PoolView.read` (views, no copy, on CPU; a VRAM
pool is staged through host memory a range at a time). xxhash releases the GIL,
so `BlockHasher` spreads a long block list over a few threads (contiguous
slices, one per thread) and its async methods keep the event loop free.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.pool import PoolView

ALGORITHM = "xxh3-128"
DIGEST_BYTES = 16
# Below this many bytes a list is hashed on the calling thread: a thread hop costs more.
THREADED_MIN_BYTES = 4 * 1024 * 1024


def default_threads() -> int:
    """Hashing threads when none are configured: up to 4, never more than the CPUs."""
    return max(1, min(4, os.cpu_count() or 1))


def block_digest(pool: PoolView, block_id: int) -> bytes:
    """xxh3-128 of one block's bytes."""
    views = pool.read((block_id,), 0, pool.block_bytes)
    if len(views) == 1:  # always, on CPU: one range, hashed in place
        return xxhash.xxh3_128_digest(views[0])
    h = xxhash.xxh3_128()
    for view in views:
        h.update(view)
    return h.digest()


def digest_blocks(pool: PoolView, block_ids: Sequence[int]) -> bytes:
    """The concatenated digests of `block_ids`, in order (DIGEST_BYTES each)."""
    return b"".join(block_digest(pool, b) for b in block_ids)


def split_digests(blob: bytes, algorithm: str, num_blocks: int, handle_id: str) -> list[bytes]:
    """The per-block digests of a handle; KvTransferFailed(INTEGRITY) when malformed."""
    if algorithm != ALGORITHM:
        raise KvTransferFailed(
            FailureKind.INTEGRITY,
            f"handle {handle_id!r}: digest algorithm {algorithm!r} is not {ALGORITHM!r}",
        )
    if len(blob) != num_blocks * DIGEST_BYTES:
        raise KvTransferFailed(
            FailureKind.INTEGRITY,
            f"handle {handle_id!r}: {len(blob)} digest bytes for {num_blocks} blocks "
            f"(want {DIGEST_BYTES} each)",
        )
    return [blob[i : i + DIGEST_BYTES] for i in range(0, len(blob), DIGEST_BYTES)]


def verify_blocks(
    pool: PoolView,
    expected: Sequence[bytes],
    dst_block_ids: Sequence[int],
    handle_id: str,
) -> None:
    """Check that our `dst_block_ids[i]` hashes to `expected[i]`; raise
    KvTransferFailed(INTEGRITY) naming how many did not."""
    _compare(digest_blocks(pool, dst_block_ids), expected, dst_block_ids, handle_id)


def _slices(block_ids: Sequence[int], n: int) -> list[Sequence[int]]:
    step = -(-len(block_ids) // n)
    return [block_ids[i : i + step] for i in range(0, len(block_ids), step)]


class BlockHasher:
    """Digests and checks of one pool's blocks on up to `threads` threads.

    The one owner (a transport's integrity check, the prefill servicer) makes it
    and `close`s it; its threads start on first use."""

    def __init__(self, pool: PoolView, threads: int | None = None):
        self.pool = pool
        self.threads = threads or default_threads()
        self._executor: ThreadPoolExecutor | None = None

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="kv-digest")
        return self._executor

    def _parallel(self, block_ids: Sequence[int]) -> bool:
        return self.threads > 1 and len(block_ids) * self.pool.block_bytes >= THREADED_MIN_BYTES

    def digest_blocks(self, block_ids: Sequence[int]) -> bytes:
        """`digest_blocks` of the pool, sliced over the threads when worth it."""
        if not self._parallel(block_ids):
            return digest_blocks(self.pool, block_ids)
        parts = self._pool().map(lambda ids: digest_blocks(self.pool, ids), _slices(block_ids, self.threads))
        return b"".join(parts)

    async def digest_blocks_async(self, block_ids: Sequence[int]) -> bytes:
        if not self._parallel(block_ids):
            return digest_blocks(self.pool, block_ids)
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(
            *(
                loop.run_in_executor(self._pool(), digest_blocks, self.pool, ids)
                for ids in _slices(block_ids, self.threads)
            )
        )
        return b"".join(parts)

    def verify_blocks(self, expected: Sequence[bytes], dst_block_ids: Sequence[int], handle_id: str) -> None:
        """`verify_blocks`, with the digests computed over the threads when worth it."""
        got = self.digest_blocks(dst_block_ids)
        _compare(got, expected, dst_block_ids, handle_id)

    async def verify_blocks_async(
        self, expected: Sequence[bytes], dst_block_ids: Sequence[int], handle_id: str
    ) -> None:
        got = await self.digest_blocks_async(dst_block_ids)
        _compare(got, expected, dst_block_ids, handle_id)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


def _compare(got: bytes, expected: Sequence[bytes], dst_block_ids: Sequence[int], handle_id: str) -> None:
    bad = [
        i for i in range(len(dst_block_ids)) if got[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] != expected[i]
    ]
    if bad:
        raise KvTransferFailed(
            FailureKind.INTEGRITY,
            f"{len(bad)} of {len(dst_block_ids)} blocks pulled for handle {handle_id!r} do not match "
            f"the holder's digests (first at position {bad[0]})",
        )

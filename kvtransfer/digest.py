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
so callers may run it in a thread for large pulls.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.pool import PoolView

ALGORITHM = "xxh3-128"
DIGEST_BYTES = 16


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
    bad = [i for i, b in enumerate(dst_block_ids) if block_digest(pool, b) != expected[i]]
    if bad:
        raise KvTransferFailed(
            FailureKind.INTEGRITY,
            f"{len(bad)} of {len(dst_block_ids)} blocks pulled for handle {handle_id!r} do not match "
            f"the holder's digests (first at position {bad[0]})",
        )

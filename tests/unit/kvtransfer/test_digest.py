"""Per-block digests (issue 13): what the holder computes, what the receiver checks.

The pulls here go over the real gRPC transport against a KvSource on port 0:
a handle whose digests do not match the bytes that arrive fails with
KvTransferFailed(INTEGRITY) after the destination was freed (on_failure), and a
handle without digests is refused before any byte moves when they are required.
"""

from dataclasses import replace

import pytest
import torch

from kvtransfer import digest
from kvtransfer.errors import FailureKind, KvTransferFailed
from kvtransfer.factory import create_transport
from kvtransfer.pool import PoolView
from kvtransfer.testing import fill_blocks
from kvtransfer.transport import PulledBlockCheck
from tests.unit.kvtransfer.test_grpc_transport import LAYOUT, Holder, N, Receiver


def pool(seed=1, n=N, layout=LAYOUT):
    p = PoolView(layout.allocate_pool(n), layout)
    fill_blocks(p, seed)
    return p


def test_digests_are_per_block_and_see_one_flipped_byte():
    p = pool()
    blob = digest.digest_blocks(p, [3, 1, 2])
    assert len(blob) == 3 * digest.DIGEST_BYTES
    assert blob[: digest.DIGEST_BYTES] == digest.block_digest(p, 3)
    raw = p.pool.view(torch.uint8).reshape(-1).numpy()  # the pool's own bytes
    before = digest.block_digest(p, 1)
    raw[1 * p.block_bytes + 100] ^= 1
    assert digest.block_digest(p, 1) != before


def test_the_threaded_hasher_agrees_and_names_the_bad_position(monkeypatch):
    monkeypatch.setattr(digest, "THREADED_MIN_BYTES", 0)
    p = pool(n=32)
    ids = list(range(32))
    hasher = digest.BlockHasher(p, threads=3)
    try:
        assert hasher.digest_blocks(ids) == digest.digest_blocks(p, ids)
        expected = digest.split_digests(digest.digest_blocks(p, ids), digest.ALGORITHM, 32, "h")
        hasher.verify_blocks(expected, ids, "h")
        expected[17] = bytes(digest.DIGEST_BYTES)
        with pytest.raises(KvTransferFailed) as e:
            hasher.verify_blocks(expected, ids, "h")
        assert e.value.kind == FailureKind.INTEGRITY and "position 17" in e.value.message
    finally:
        hasher.close()


@pytest.mark.parametrize(
    ("blob", "algorithm", "why"),
    [
        (b"", "", "carries no block digests"),
        (b"x" * 16, "md5", "algorithm"),
        (b"x" * 15, "xxh3-128", "digest bytes"),
    ],
)
def test_a_handle_with_missing_or_malformed_digests_is_refused(blob, algorithm, why):
    from kvtransfer.transport import BlockHandle

    h = BlockHandle("h", "a", LAYOUT, (4,), 4, block_digests=blob, digest_algorithm=algorithm)
    check = PulledBlockCheck(pool(), require=True)
    with pytest.raises(KvTransferFailed) as e:
        check.expected(h, [4])
    assert e.value.kind == FailureKind.INTEGRITY and why in e.value.message and check.failures == 1
    assert (
        PulledBlockCheck(pool(), require=False).expected(
            replace(h, block_digests=b"", digest_algorithm=""), [4]
        )
        is None
    )


def test_the_digests_of_a_pulled_subset_are_picked_by_block():
    from kvtransfer.transport import BlockHandle

    p = pool()
    blob = digest.digest_blocks(p, [5, 9, 2])
    h = BlockHandle("h", "a", LAYOUT, (5, 9, 2), 12, block_digests=blob, digest_algorithm=digest.ALGORITHM)
    got = PulledBlockCheck(p, require=True).expected(h, [2, 9])
    assert got == [digest.block_digest(p, 2), digest.block_digest(p, 9)]


async def test_a_pull_whose_bytes_differ_fails_integrity_and_frees_the_destination():
    holder = Holder()
    await holder.server.start()
    receiver = Receiver()
    receiver.transport.integrity.require = True
    try:
        handle = holder.export("h1", [0, 1, 2])
        wrong = digest.digest_blocks(holder.pool, [0, 3, 2])  # block 1's digest is another block's
        bad = replace(handle, block_digests=wrong, digest_algorithm=digest.ALGORITHM)
        with pytest.raises(KvTransferFailed) as e:
            await receiver.pull(bad, [0, 1, 2], [4, 5, 6])
        assert e.value.kind == FailureKind.INTEGRITY and "1 of 3" in e.value.message
        assert receiver.blocks.num_free == N and receiver.transport.integrity.failures == 1
        good = replace(
            holder.export("h2", [7, 8]),
            block_digests=digest.digest_blocks(holder.pool, [7, 8]),
            digest_algorithm=digest.ALGORITHM,
        )
        dst, stats = await receiver.pull(good, [7, 8], [0, 1])
        assert stats.blocks == 2
        receiver.blocks.free(dst)
        # Required and absent: refused before a byte moves (the lease is still held, unread).
        bare = holder.export("h3", [9])
        with pytest.raises(KvTransferFailed) as e:
            await receiver.pull(bare, [9], [2])
        assert e.value.kind == FailureKind.INTEGRITY and holder.leases.get("h3").readers == 0
        assert not holder.leases.get("h3").pulled
    finally:
        await receiver.transport.close()
        await holder.server.stop()
        holder.leases.close()
    assert receiver.blocks.num_free == N


def test_transports_from_the_factory_require_digests():
    p = pool()
    t = create_transport("grpc", agent_name="a", pool=p, worker_id="w", directory=None)
    assert t.integrity.require is True


def test_int8_block_digests_cover_the_scales_inside_each_block():
    from kvtransfer.layout import KvLayout

    q = KvLayout(2, 2, 16, "float32", 4, quant="int8")
    p = pool(layout=q, n=4)
    _, scales = q.kv_views(p.pool)
    scales[2] = 0.5
    before = digest.block_digest(p, 2)
    scales[2, 1, 0, 1] = 1.0  # one scale of block 2: its values would dequantize to twice themselves
    assert digest.block_digest(p, 2) != before
    assert digest.block_digest(p, 1) == digest.block_digest(pool(layout=q, n=4), 1)

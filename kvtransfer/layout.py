"""The KV block layout every engine and transport agrees on.

A KV pool is one contiguous tensor shaped
    [num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]
so the KV of one block (all layers) is one contiguous region of `block_bytes`
bytes at `base + block_id * block_bytes`. A transfer moves whole blocks; block
lists need not be contiguous. Both sides check the layout before moving bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:  # torch is imported lazily so the router never loads it
    from collections.abc import Iterable

    import torch

    from pdmesh.v1 import common_pb2

# dtype name -> bytes per element
_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


class LayoutMismatch(ValueError):
    """Two KV layouts differ; moving bytes between them would give garbage."""

    # the gRPC status at a service's edge (services.common.errors.status_of reads it)
    status_code = grpc.StatusCode.FAILED_PRECONDITION


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; one of {sorted(_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KvLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.itemsize

    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def allocate_pool(self, num_blocks: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A zeroed pool tensor [num_blocks, *block_shape] in this layout."""
        import torch

        return torch.zeros((num_blocks, *self.block_shape), dtype=self.torch_dtype, device=device)

    def check_compatible(self, other: KvLayout) -> None:
        """Raise LayoutMismatch naming every field that differs."""
        diffs = [
            f"{name}: {getattr(self, name)} != {getattr(other, name)}"
            for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")
            if getattr(self, name) != getattr(other, name)
        ]
        if diffs:
            raise LayoutMismatch("KV layout mismatch (" + "; ".join(diffs) + ")")

    def check_pool(self, pool: torch.Tensor) -> None:
        """Raise LayoutMismatch unless `pool` is a contiguous pool in this layout."""
        if tuple(pool.shape[1:]) != self.block_shape or pool.dtype != self.torch_dtype:
            raise LayoutMismatch(
                f"pool {tuple(pool.shape)} {pool.dtype} is not in layout {self.block_shape} {self.dtype}"
            )
        if not pool.is_contiguous():
            raise LayoutMismatch("KV pool must be contiguous")


def layout_to_proto(layout: KvLayout) -> common_pb2.KvLayout:
    """The wire form of `layout`, with the derived block_bytes filled in."""
    from pdmesh.v1 import common_pb2

    return common_pb2.KvLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        block_size=layout.block_size,
        block_bytes=layout.block_bytes,
    )


def layout_from_proto(msg: common_pb2.KvLayout) -> KvLayout:
    """Parse a wire layout; LayoutMismatch when it is invalid or its block_bytes
    disagrees with the fields (a sender with another notion of a block)."""
    try:
        layout = KvLayout(
            num_layers=msg.num_layers,
            num_kv_heads=msg.num_kv_heads,
            head_dim=msg.head_dim,
            dtype=msg.dtype,
            block_size=msg.block_size,
        )
    except ValueError as e:
        raise LayoutMismatch(f"invalid KV layout: {e}") from e
    if msg.block_bytes and msg.block_bytes != layout.block_bytes:
        raise LayoutMismatch(
            f"KV layout block_bytes {msg.block_bytes} != {layout.block_bytes} derived from its fields"
        )
    return layout


def check_block_ids(block_ids: Iterable[int], num_blocks: int, what: str = "block_ids") -> None:
    """Raise ValueError unless every id is in [0, num_blocks) and none repeats."""
    seen = set()
    for b in block_ids:
        if not 0 <= b < num_blocks:
            raise ValueError(f"{what}: block {b} is not in [0, {num_blocks})")
        if b in seen:
            raise ValueError(f"{what}: block {b} appears twice")
        seen.add(b)

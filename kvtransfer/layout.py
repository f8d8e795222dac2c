"""The KV block layout every engine and transport agrees on.

A KV pool is one contiguous tensor shaped
    [num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]
so the KV of one block (all layers) is one contiguous region of `block_bytes`
bytes at `base + block_id * block_bytes`. A transfer moves whole blocks; block
lists need not be contiguous. Both sides check the layout before moving bytes.

Quantized KV (`quant="int8"` or `"fp8"`): a block is raw bytes, the int8 (or float8_e4m3fn) K/V
[num_layers, 2, block_size, num_kv_heads, head_dim] followed by their float32
scales [num_layers, 2, num_kv_heads] (one per block, layer, K/V and head:
`scale_layout`). The scales live inside the block, so every transport moves
them with it and the block digests cover them; the pool is uint8
[num_blocks, block_bytes] and `kv_views` gives the int8 and scale views.
`dtype` stays the dtype attention computes in. `fingerprint` names the model
(config + weights + weight quantization) whose KV this is: KV of another
model, or of the same one with other weights, has the right shape and is garbage.
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
# KV quantization scheme -> its scale layout (what one scale covers, and its type). fp8 is
# float8_e4m3fn values (torch 2.13 casts and indexes them on CPU) with the same scales as int8:
# the same bytes, another rounding (relative, not absolute: small values keep more precision).
KV_QUANT = {"none": "", "int8": "float32[layer,kv,head]/block", "fp8": "float32[layer,kv,head]/block"}
# The values' torch dtype name and the largest magnitude a scale maps to, per quantized scheme.
KV_QUANT_VALUES = {"int8": ("int8", 127.0), "fp8": ("float8_e4m3fn", 448.0)}


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
    quant: str = "none"  # KV_QUANT key
    # Model identity (services/engine/engine_spec.py model_fingerprint); "" = a raw pool that
    # holds no particular model's KV (transport tests, benchmarks): checked when both sides carry one.
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; one of {sorted(_DTYPES)}")
        if self.quant not in KV_QUANT:
            raise ValueError(f"unsupported KV quantization {self.quant!r}; one of {sorted(KV_QUANT)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KvLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype K/V are computed in (and stored in when not quantized)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def scale_layout(self) -> str:
        return KV_QUANT[self.quant]

    @property
    def storage_dtype(self) -> torch.dtype:
        """The pool tensor's dtype: torch_dtype, or uint8 bytes for a quantized layout."""
        import torch

        return self.torch_dtype if self.quant == "none" else torch.uint8

    @property
    def kv_shape(self) -> tuple[int, ...]:
        """Logical shape of one block's K/V: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Shape of one quantized block's scales: [num_layers, 2, num_kv_heads]."""
        return (self.num_layers, 2, self.num_kv_heads)

    @property
    def data_bytes(self) -> int:
        """Bytes of one block's K/V values (without scales)."""
        n = 1
        for d in self.kv_shape:
            n *= d
        return n * (self.itemsize if self.quant == "none" else 1)

    def kv_views(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(K/V [N, *kv_shape], scales [N, *scale_shape] float32 or None) viewing `pool`'s memory."""
        import torch

        if self.quant == "none":
            return pool, None
        n = pool.shape[0]
        values = getattr(torch, KV_QUANT_VALUES[self.quant][0])
        data = pool[:, : self.data_bytes].view(values).view(n, *self.kv_shape)
        scales = pool[:, self.data_bytes :].view(torch.float32).view(n, *self.scale_shape)
        return data, scales

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block in the pool tensor: kv_shape, or [block_bytes] when quantized."""
        return self.kv_shape if self.quant == "none" else (self.block_bytes,)

    @property
    def block_bytes(self) -> int:
        if self.quant == "none":
            return self.data_bytes
        n = 1
        for d in self.scale_shape:
            n *= d
        return self.data_bytes + 4 * n

    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def allocate_pool(self, num_blocks: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A zeroed pool tensor [num_blocks, *block_shape] in this layout."""
        import torch

        return torch.zeros((num_blocks, *self.block_shape), dtype=self.storage_dtype, device=device)

    def check_compatible(self, other: KvLayout) -> None:
        """Raise LayoutMismatch naming every field that differs."""
        diffs = [
            f"{name}: {getattr(self, name)} != {getattr(other, name)}"
            for name in (
                "num_layers",
                "num_kv_heads",
                "head_dim",
                "dtype",
                "block_size",
                "quant",
                "scale_layout",
            )
            if getattr(self, name) != getattr(other, name)
        ]
        if self.fingerprint and other.fingerprint and self.fingerprint != other.fingerprint:
            diffs.append(f"model fingerprint: {self.fingerprint} != {other.fingerprint}")
        if diffs:
            raise LayoutMismatch("KV layout mismatch (" + "; ".join(diffs) + ")")

    def check_pool(self, pool: torch.Tensor) -> None:
        """Raise LayoutMismatch unless `pool` is a contiguous pool in this layout."""
        if tuple(pool.shape[1:]) != self.block_shape or pool.dtype != self.storage_dtype:
            raise LayoutMismatch(
                f"pool {tuple(pool.shape)} {pool.dtype} is not in layout {self.block_shape} {self.storage_dtype}"
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
        kv_quant=layout.quant,
        kv_scale_layout=layout.scale_layout,
        model_fingerprint=layout.fingerprint,
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
            quant=msg.kv_quant or "none",  # a sender from before quantized KV
            fingerprint=msg.model_fingerprint,
        )
    except ValueError as e:
        raise LayoutMismatch(f"invalid KV layout: {e}") from e
    if msg.kv_scale_layout != layout.scale_layout:
        # The same scheme name with scales laid out otherwise would dequantize to garbage.
        raise LayoutMismatch(
            f"KV scale layout {msg.kv_scale_layout!r} != {layout.scale_layout!r} of scheme {layout.quant!r}"
        )
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

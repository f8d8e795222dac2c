"""Weight prepacking for CPU linears: a transform the model never mentions.

oneDNN can reorder a Linear's weight once into its blocked layout, so each
matmul skips re-packing the weight, which dominates at small batch (decode).
On the small preset, one thread, here: a bf16 decode step went 15.3 -> 10.5 ms
at batch 1 and 43 -> 35 ms at batch 32; fp32 87 -> 67 ms at batch 32.

Uses the internal mkldnn ops that torch's own inductor uses for this; applied
only on CPU, for float32 / bfloat16, when the build has them; otherwise a
no-op. Packed modules no longer hold the plain weight: export weights from an
unpacked model (`loader.load_model`).
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        # oneDNN's bf16 reorder needs avx512bw/vl/dq or avx_ne_convert: without them
        # (an AMD EPYC with avx2 only) it raises at start-up, so leave the weights plain.
        and (dtype != torch.bfloat16 or _bf16_supported())
    )


def _bf16_supported() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An opaque oneDNN tensor: kept as a plain attribute so .to() / state_dict leave it alone.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear; the number replaced."""
    count = 0
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child, batch_hint))
            count += 1
        else:
            count += pack_linears(child, batch_hint)
    return count

"""Weight-only quantization of the linears: a transform the model never mentions.

As gpt-fast does it: after the weights are loaded (safetensors, GGUF dequantized
at load, or the seeded built-in ones), every nn.Linear but the LM head is
replaced by a module that holds its weight packed for torch's CPU kernels:
- int8: one scale per output channel (absmax / 127), `torch._weight_int8pack_mm`;
- int4: asymmetric groups of `INT4_GROUP` input columns (scale + zero per group),
  `torch._weight_int4pack_mm_for_cpu` on `torch._convert_weight_to_int4pack_for_cpu`.
Both kernels are fast only with bfloat16 activations (one thread, [1,576]x[576,1536]:
57-58 us against 136 us for the dense fp32 matmul; fp32 input takes a slow path),
so the modules run their matmul in bfloat16 and hand back the caller's dtype.
A GGUF's Q4/Q8 tensors reach here dequantized to float by gguf_loader, so they are
requantized once, here, to the kernels' own format (the block shapes differ:
GGUF Q4_1 groups 32 with an fp16 min, tinygemm groups 32 with a bf16 zero).
The LM head is quantized too: on a small model it is a large share of the bytes a decode
step reads (SmolLM2-135M: 49,152 x 576, 57 MB in bf16 against 66 MB for all other linears in
int4; one thread, batch 1: 11-16 ms packed bf16, 10-12 ms int8, 5-6 ms int4, here, loaded).
Its error lands straight on the logits: bench/quant_accuracy.py prints what it costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

WEIGHT_SCHEMES = ("fp", "int8", "int4")
# The packed kernels are GEMV-shaped: their time grows with the rows (one thread, bf16,
# [M,576]x[576,3072]: int4 142 / 736 / 2,450 us at M = 1 / 8 / 32, the oneDNN-packed bf16
# matmul 271 / 228 / 259 us). Steps with more rows than this use a packed dense copy when the
# module has one (`dense=`): batch-1 decode reads int4 bytes, batched steps run at dense speed,
# at the price of holding both copies.
MAX_QUANT_ROWS = 2
INT4_GROUP = 32  # tinygemm's CPU kernel supports 32..256; 32 is Q4_1's group and the most accurate


@dataclass(frozen=True)
class QuantReport:
    """What `quantize_linears` did: how many linears, bytes before/after, worst relative error."""

    scheme: str
    num_linears: int
    fp_bytes: int  # the replaced weights in the model's dtype
    quant_bytes: int  # packed weights + scales/zeros
    max_rel_error: float  # max over linears of ||W - deq(Q(W))||_max / ||W||_max


def can_quantize(device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and hasattr(torch, "_weight_int8pack_mm")
        and hasattr(torch, "_weight_int4pack_mm_for_cpu")
        and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")
    )


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (int8 [N, K], float32 scales [N]) with w ~= q * scale[:, None]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_int4(
    w: torch.Tensor, group: int = INT4_GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (uint values 0..15 as int32 [N, K], scale [N, K/g], zero [N, K/g]) with
    w ~= (q - 8) * scale + zero per group (tinygemm's convention: zero is the group's midpoint)."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs in_features divisible by {group}, got {k}")
    wg = w.float().view(n, k // group, group)
    lo, hi = wg.amin(dim=-1, keepdim=True), wg.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((wg - lo) / scale).clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + scale * 8
    return q, scale.squeeze(-1), zero.squeeze(-1)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int = INT4_GROUP):
    n, k = q.shape
    qg = q.view(n, k // group, group).float()
    return ((qg - 8) * scale[..., None] + zero[..., None]).view(n, k)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, dense: nn.Module | None = None):
        super().__init__()
        self.dense = dense
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_int8(linear.weight.detach())
        self.register_buffer("weight", q)
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.error = _rel_error(linear.weight, dequantize_int8(q, scale))

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.dense is not None and x.numel() > MAX_QUANT_ROWS * shape[-1]:
            return self.dense(x)
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight, self.scales)
        if self.bias is not None:
            y = y.float() + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, dense: nn.Module | None = None, group: int = INT4_GROUP):
        super().__init__()
        self.dense = dense
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        q, scale, zero = quantize_int4(linear.weight.detach(), group)
        self.register_buffer("weight", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        # [K/g, N, 2] (scale, zero): the layout the kernel reads.
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.error = _rel_error(linear.weight, dequantize_int4(q, scale, zero, group))

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scales_and_zeros.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.dense is not None and x.numel() > MAX_QUANT_ROWS * shape[-1]:
            return self.dense(x)
        if self.bias is None and x.dtype == torch.bfloat16 and x.dim() == 2:
            # The decode step's common case: no reshape / cast / view around the kernel (a batch-1
            # SmolLM2 step calls this 121 times, and each dispatch is a microsecond or two).
            return torch._weight_int4pack_mm_for_cpu(x, self.weight, self.group, self.scales_and_zeros)
        y = torch._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight, self.group, self.scales_and_zeros
        )
        if self.bias is not None:
            y = y.float() + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group}"


def int4_fits(linear: nn.Linear) -> bool:
    """The int4 kernel's shape rules: out_features a multiple of 16, in_features of the group
    (a linear that does not fit falls back to int8)."""
    return linear.out_features % 16 == 0 and linear.in_features % INT4_GROUP == 0


def _rel_error(w: torch.Tensor, deq: torch.Tensor) -> float:
    w = w.detach().float()
    return float((w - deq).abs().max() / w.abs().max().clamp(min=1e-12))


def quantize_linears(
    model: nn.Module,
    scheme: str,
    int8_only: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
    dense: Callable[[nn.Linear], nn.Module] | None = None,
) -> QuantReport:
    """Replace the nn.Linear modules of `model` for `scheme`: those named in `int8_only` in int8
    whatever the scheme, those named in `skip` not at all. `dense(linear)`: a dense module each
    quantized one keeps for steps of more than MAX_QUANT_ROWS rows (e.g. a PackedLinear)."""
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"weight scheme must be one of {WEIGHT_SCHEMES}, got {scheme!r}")
    if scheme == "fp":
        return QuantReport(scheme, 0, 0, 0, 0.0)
    cls = Int8Linear if scheme == "int8" else Int4Linear
    count = fp_bytes = q_bytes = 0
    worst = 0.0
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in skip
    ]
    for name, linear in targets:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        int8 = name.rsplit(".", 1)[-1] in int8_only or not int4_fits(linear)
        keep = None if dense is None else dense(linear)
        new = Int8Linear(linear, keep) if int8 else cls(linear, keep)
        setattr(parent, name.rsplit(".", 1)[-1], new)
        count += 1
        fp_bytes += linear.weight.numel() * linear.weight.element_size()
        q_bytes += new.nbytes
        worst = max(worst, new.error)
    return QuantReport(scheme, count, fp_bytes, q_bytes, worst)

"""Paged attention over the block-major KV pool.

A step's tokens are one flat batch [T]: first the prompt chunks (one segment
per sequence), then one token per decoding sequence. Each layer writes the new
K/V into the pool at (block, offset) slots, then attends:
- a prompt chunk with nothing before it attends causally to its own K/V;
- a prompt chunk after cached / earlier tokens gathers its context from its blocks;
- decode tokens in groups of similar context length (`decode_groups`): per
  group, K/V gathered through the padded block tables once per layer, one
  batched matmul-softmax-matmul with a padding mask. Grouping bounds the
  padding: one 2,000-token context among short ones would otherwise pad every
  row of the batch to 2,000 (a step of 15 rows, one of them 2,200 tokens: 706 ms
  padded, 62 ms grouped; small preset, fp32, one thread). Query
  heads that share a KV head are folded into the query axis ([B, Hkv, G, D]),
  so GQA needs no copy of K/V per query head.
ModelRunner builds the AttentionMetadata; the model passes it to every layer.

With int8 or fp8 KV (KvLayout quant "int8" / "fp8") a layer's cache is a QuantKvLayer: 1-byte
values plus one float32 scale per (block, K/V, head). A write that raises a
block's absmax rescales what the block already holds (a block fills a token at
a time in decode), so a block's scale is always its own absmax / 127 (448 for fp8); a block
written from offset 0 starts afresh (a reused block keeps its old scale
otherwise). Gathers dequantize into the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSegment:
    start: int  # flat token index of the chunk's first token
    end: int
    num_context: int  # tokens before the chunk whose KV is already in the pool
    block_ids: torch.Tensor  # [ceil((num_context + n) / bs)] long; used when num_context > 0


@dataclass
class DecodeGroup:
    rows: torch.Tensor | None  # [b] long: this group's rows among the step's decodes; None = all, in order
    block_ids: torch.Tensor  # [b * M] long, padded block tables, flattened
    mask: torch.Tensor  # [b, 1, 1, M * bs] bool: True where the key is padding (position >= context)


@dataclass
class QuantKvLayer:
    data: torch.Tensor  # [N, 2, bs, Hkv, Dh] int8 or float8_e4m3fn
    scales: torch.Tensor  # [N, 2, Hkv] float32


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] long: block of each new token
    slot_offsets: torch.Tensor  # [T] long: offset within the block
    prefills: list[PrefillSegment]
    num_prefill_tokens: int
    num_decodes: int
    decode_groups: list[DecodeGroup]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, Hkv, D]; kv_layer: this layer's pool view [N, 2, bs, Hkv, D].
    Returns [T, H * D]."""
    if isinstance(kv_layer, QuantKvLayer):
        write_quantized(kv_layer, meta.slot_blocks, meta.slot_offsets, k, v)
    else:
        kv_layer[meta.slot_blocks, 0, meta.slot_offsets] = k
        kv_layer[meta.slot_blocks, 1, meta.slot_offsets] = v
    outs = [
        _prefill(q[s.start : s.end], k[s.start : s.end], v[s.start : s.end], kv_layer, s)
        for s in meta.prefills
    ]
    if meta.num_decodes:
        outs.append(_decode(q[meta.num_prefill_tokens :], kv_layer, meta))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.flatten(1)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, seg: PrefillSegment):
    n = q.shape[0]
    q = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, Dh]
    if seg.num_context == 0:
        k = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, Dh]
        v = v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        total = seg.num_context + n
        k, v = _gather_kv(kv_layer, seg.block_ids, 1, q.dtype)  # [1, Hkv, >= total, Dh]
        # Query i sits at position num_context + i and sees keys 0..num_context + i.
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=seg.num_context)
        out = F.scaled_dot_product_attention(
            q, k[:, :, :total], v[:, :, :total], attn_mask=mask, enable_gqa=True
        )
    return out.squeeze(0).transpose(0, 1)  # [n, H, Dh]


def _decode(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    if len(meta.decode_groups) == 1 and meta.decode_groups[0].rows is None:
        return _decode_group(q, kv_layer, meta.decode_groups[0])
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        out[g.rows] = _decode_group(q.index_select(0, g.rows), kv_layer, g)
    return out


def _decode_group(q: torch.Tensor, kv_layer: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
    # Plain bmm + softmax: with 1 query token the flash kernel's tiling costs more than it saves.
    # bmm on the folded [B * Hkv, ...] views is what matmul of the 4-d ones calls, without its
    # reshapes (a batch-1 step runs this 30 times; each dispatch is a microsecond or two).
    bsz, num_heads, head_dim = q.shape
    # In float32 whatever the model dtype: CPU bf16 bmm of these shapes takes a slow path
    # ([1, 3, 3, 64] x [1, 3, 64, 64], one thread: 264 us in bf16, 46 us in fp32).
    k, v = _gather_kv(kv_layer, group.block_ids, bsz, torch.float32)  # [B, Hkv, S, Dh]
    num_kv_heads, seq = k.shape[1], k.shape[2]
    folded = bsz * num_kv_heads
    qf = q.float().reshape(folded, num_heads // num_kv_heads, head_dim)  # [B * Hkv, G, Dh]
    scores = torch.bmm(qf, k.view(folded, seq, head_dim).transpose(1, 2)) * head_dim**-0.5
    scores.view(bsz, num_kv_heads, -1, seq).masked_fill_(group.mask, float("-inf"))
    probs = scores.softmax(dim=-1)  # [B * Hkv, G, S]
    return torch.bmm(probs, v.view(folded, seq, head_dim)).view(bsz, num_heads, head_dim).to(q.dtype)


def _gather_kv(
    kv_layer, block_ids: torch.Tensor, bsz: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `block_ids` ([bsz * M], bsz block tables of M) as two [bsz, Hkv, M * bs, Dh]."""
    if isinstance(kv_layer, QuantKvLayer):
        data, scales = kv_layer.data, kv_layer.scales
        bs, hkv, d = data.shape[2:]
        out = []
        for i in (0, 1):
            x = data[:, i].flatten(1).index_select(0, block_ids).view(-1, bs, hkv, d)
            s = scales[:, i].index_select(0, block_ids).view(-1, 1, hkv, 1)
            out.append((x.to(dtype) * s.to(dtype)).view(bsz, -1, hkv, d).transpose(1, 2).contiguous())
        return out[0], out[1]
    bs, hkv, d = kv_layer.shape[2:]
    # K and V together: rows of whole blocks (one copy), then into attention's head-major layout
    # [2, bsz, Hkv, M * bs, Dh] (a second): two ops a layer, where K and V apart took four.
    rows = kv_layer.flatten(1).index_select(0, block_ids).view(bsz, -1, 2, bs, hkv, d)
    kv = rows.permute(2, 0, 4, 1, 3, 5)
    # (`to` returns its input unchanged when the dtype already matches.)
    kv = kv.contiguous() if kv.dtype == dtype else kv.to(dtype, memory_format=torch.contiguous_format)
    kv = kv.view(2, bsz, hkv, -1, d)
    return kv[0], kv[1]


def kv_qmax(dtype: torch.dtype) -> float:
    """The magnitude a block's absmax maps to: 127 for int8, 448 (e4m3's largest) for fp8."""
    return 127.0 if dtype == torch.int8 else 448.0


def _to_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x already divided by its scale -> the stored values (int8 rounds, fp8 casts)."""
    if dtype == torch.int8:
        return torch.round(x).clamp(-127, 127).to(torch.int8)
    return x.clamp(-448.0, 448.0).to(dtype)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """x [..., Dh] float, scale broadcastable to x[..., :1] -> x / scale as int8 in [-127, 127]
    (rounded) or float8_e4m3fn in [-448, 448]."""
    return _to_values(x.float() / scale.clamp(min=1e-12), dtype)


def write_quantized(
    layer: QuantKvLayer, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write new K/V [T, Hkv, Dh] at (block, offset) slots, keeping each touched block's
    scale = max(its absmax so far, the new tokens' absmax) / 127 (int8) or / 448 (fp8)."""
    vdt = layer.data.dtype
    qmax = kv_qmax(vdt)
    new = torch.stack([k, v], dim=1).float()  # [T, 2, Hkv, Dh]
    amax = new.abs().amax(dim=-1)  # [T, 2, Hkv]
    touched, inv = torch.unique(blocks, return_inverse=True)
    fresh = torch.zeros(touched.shape[0], dtype=torch.bool, device=blocks.device)
    fresh[inv[offsets == 0]] = True
    old = layer.scales.index_select(0, touched)  # [U, 2, Hkv]
    old = torch.where(fresh[:, None, None], torch.zeros_like(old), old)
    need = torch.zeros_like(old).scatter_reduce_(0, inv[:, None, None].expand_as(amax), amax / qmax, "amax")
    scale = torch.maximum(old, need)
    grown = (scale > old) & (old > 0)
    if bool(grown.any()):
        # Requantize what the block already holds to the larger scale (at most half a step of error each time).
        ratio = torch.where(grown, old / scale, torch.ones_like(old))[:, :, None, :, None]
        held = layer.data.index_select(0, touched).float() * ratio
        layer.data[touched] = _to_values(held, vdt)
    layer.scales[touched] = scale
    q = quantize_kv(new, scale.index_select(0, inv)[..., None], vdt)  # [T, 2, Hkv, Dh]
    layer.data[blocks, 0, offsets] = q[:, 0]
    layer.data[blocks, 1, offsets] = q[:, 1]

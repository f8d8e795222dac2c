"""ModelRunner: owns the model weights and the KV pool tensor; runs one step.

Turns the Scheduler's (sequence, new tokens) list into flat input tensors and
AttentionMetadata (block tables -> slots, gather indices, masks), runs the
forward pass, and samples a token for every sequence whose computed tokens
reach its length. Results go back to LLMEngine. The pool is allocated once
with `KvLayout.allocate_pool` and never reallocated, so transports can
register its memory. On CPU the linear weights are prepacked (packing.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.engine.api import EngineRequest
from services.engine.attention import AttentionMetadata, DecodeGroup, PrefillSegment, QuantKvLayer
from services.engine.engine_spec import EngineSpec
from services.engine.loader import load_model
from services.engine.packing import PackedLinear, can_pack, pack_linears
from services.engine.quantize import MAX_QUANT_ROWS, quantize_linears
from services.engine.sampler import Sampler, SampleRow
from services.engine.sequence import Sequence
from services.engine.thread_tuner import StepThreadTuner


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [B'] flat index of each sampled row's last token
    sample_rows: list[SampleRow]
    sample_items: list[int]  # index into the ordered chunk list, per sampled row


class ModelRunner:
    def __init__(self, spec: EngineSpec):
        cfg = spec.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.block_size = cfg.block_size
        self.device = torch.device(cfg.device)
        self.model = load_model(spec)
        packs = cfg.pack_weights and can_pack(self.device, spec.layout.torch_dtype)
        # Quantized linears keep a packed dense copy for batched steps when the engine batches
        # (quantize.MAX_QUANT_ROWS); packing then takes what stays dense.
        dense = None
        if packs and cfg.max_num_seqs > MAX_QUANT_ROWS:
            dense = lambda linear: PackedLinear(linear, cfg.max_num_seqs)  # noqa: E731
        self.quant_report = quantize_linears(self.model, cfg.weights, dense=dense)
        if packs:
            pack_linears(self.model, batch_hint=cfg.max_num_seqs)
        self.kv_pool = spec.layout.allocate_pool(spec.num_blocks, self.device)
        # Per-layer views [N, 2, bs, Hkv, Dh] of the one pool tensor; with int8 KV, a
        # QuantKvLayer of the int8 values and their [N, 2, Hkv] scales (attention.py).
        data, scales = spec.layout.kv_views(self.kv_pool)
        if scales is None:
            self.kv_layers = [data[:, i] for i in range(spec.model.num_layers)]
        else:
            self.kv_layers = [QuantKvLayer(data[:, i], scales[:, i]) for i in range(spec.model.num_layers)]
        self.sampler = Sampler()
        # Threads per step (thread_tuner.py): on CPU only; a CUDA step's host threads do not matter.
        self._max_threads = cfg.num_threads or torch.get_num_threads()
        self._threads = self._max_threads
        self.thread_tuner = (
            StepThreadTuner(self._max_threads)
            if cfg.adapt_threads and self.device.type == "cpu" and self._max_threads > 1
            else None
        )

    @property
    def max_threads(self) -> int:
        return self._max_threads

    def _use_threads(self, n: int) -> None:
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> list[int | None]:
        """Compute the scheduled tokens; return the sampled token per entry (None mid-prompt)."""
        rows = sum(n for _, n in scheduled)
        tuner = self.thread_tuner
        threads = self._max_threads if tuner is None else tuner.threads_for(rows)
        self._use_threads(threads)
        start = time.perf_counter()
        # Prompt chunks first, then single-token (decode) entries: see attention.py.
        order = [i for i, (_, n) in enumerate(scheduled) if n > 1]
        order += [i for i, (_, n) in enumerate(scheduled) if n == 1]
        inputs = self._prepare([scheduled[i] for i in order])
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_layers)
        results: list[int | None] = [None] * len(scheduled)
        if inputs.sample_rows:
            logits = self.model.compute_logits(hidden[inputs.logits_index])
            tokens = self.sampler(logits, inputs.sample_rows)
            for item, token in zip(inputs.sample_items, tokens, strict=True):
                results[order[item]] = token
        if tuner is not None:
            tuner.record(rows, threads, time.perf_counter() - start)
        return results

    @torch.inference_mode()
    def chunk_logits(self, seq: Sequence, n: int, threads: int | None = None) -> torch.Tensor:
        """Compute `seq`'s next `n` tokens (blocks allocated); float32 logits [n, V] of each.
        On all the engine's threads unless `threads` says otherwise (the tuner's probe)."""
        self._use_threads(threads or self._max_threads)
        inputs = self._prepare([(seq, n)])
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_layers)
        return self.model.compute_logits(hidden)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy [len(block_ids), *block_shape] of the blocks."""
        # index_select, not pool[idx]: advanced indexing of this many-dim tensor is ~500x slower
        return self.kv_pool.index_select(0, torch.tensor(block_ids, dtype=torch.long, device=self.device))

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_pool.index_copy_(0, idx, blocks.to(self.device, self.kv_pool.dtype))

    def _prepare(self, chunks: list[tuple[Sequence, int]]) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        positions, slot_blocks, slot_offsets = [], [], []
        segments: list[PrefillSegment] = []
        decodes: list[Sequence] = []
        logits_index: list[int] = []
        rows: list[SampleRow] = []
        items: list[int] = []
        start = 0
        for j, (seq, n) in enumerate(chunks):
            c = seq.num_computed_tokens
            ids.extend(seq.token_ids[c : c + n])
            if n > 1:
                pos = torch.arange(c, c + n)
                table = torch.tensor(seq.block_table, dtype=torch.long)
                positions.append(pos)
                slot_blocks.append(table[pos // bs])
                slot_offsets.append(pos % bs)
                segments.append(PrefillSegment(start, start + n, c, table.to(self.device)))
            else:
                decodes.append(seq)
            start += n
            if c + n == seq.num_tokens:
                logits_index.append(start - 1)
                rows.append(SampleRow(seq.sampling, seq.seed, seq.num_output_tokens))
                items.append(j)
        num_prefill = start - len(decodes)
        groups: list[DecodeGroup] = []
        if decodes:
            pos, blocks, offsets, groups = self._decode_inputs(decodes)
            positions.append(pos)
            slot_blocks.append(blocks)
            slot_offsets.append(offsets)
        dev = self.device
        meta = AttentionMetadata(
            slot_blocks=torch.cat(slot_blocks).to(dev),
            slot_offsets=torch.cat(slot_offsets).to(dev),
            prefills=segments,
            num_prefill_tokens=num_prefill,
            num_decodes=len(decodes),
            decode_groups=[
                DecodeGroup(None if g.rows is None else g.rows.to(dev), g.block_ids.to(dev), g.mask.to(dev))
                for g in groups
            ],
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.cat(positions).to(dev),
            meta=meta,
            logits_index=torch.tensor(logits_index, dtype=torch.long, device=dev),
            sample_rows=rows,
            sample_items=items,
        )

    def _decode_inputs(self, seqs: list[Sequence]):
        """One new token per sequence: positions, slots, and per length group padded block tables + mask."""
        bs = self.block_size
        pos = [s.num_computed_tokens for s in seqs]
        blocks = [s.block_table[p // bs] for s, p in zip(seqs, pos, strict=True)]
        widths = [p // bs + 1 for p in pos]  # blocks in each context
        groups = []
        parts = group_by_length(widths)
        for rows in parts:
            width = max(widths[i] for i in rows)
            tables = [seqs[i].block_table[:width] + [0] * (width - widths[i]) for i in rows]
            ctx = torch.tensor([pos[i] + 1 for i in rows])
            mask = torch.arange(width * bs)[None, :] >= ctx[:, None]  # [b, S]: padding, masked out
            groups.append(
                DecodeGroup(
                    None if len(parts) == 1 else torch.tensor(rows, dtype=torch.long),
                    torch.tensor(tables, dtype=torch.long).flatten(),
                    mask[:, None, None, :],
                )
            )
        pos_t = torch.tensor(pos)
        return pos_t, torch.tensor(blocks, dtype=torch.long), pos_t % bs, groups


def group_by_length(widths: list[int], slack: float = 1.5, free_padding: int = 32) -> list[list[int]]:
    """Rows (indices into `widths`, each a context length in blocks) in groups whose padded size
    (rows x longest) stays within `slack` x their real size, or within `free_padding` blocks of it:
    a group is one gather + matmul per layer, so small batches stay one group. One group keeps
    the rows in order; several are longest first."""
    if len(widths) <= 1:
        return [list(range(len(widths)))]
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    groups, current, total = [], [order[0]], widths[order[0]]
    for i in order[1:]:
        padded, real = widths[current[0]] * (len(current) + 1), total + widths[i]
        if padded <= slack * real or padded - real <= free_padding:
            current.append(i)
            total += widths[i]
        else:
            groups.append(current)
            current, total = [i], widths[i]
    groups.append(current)
    return [list(range(len(widths)))] if len(groups) == 1 else groups


def scratch_sequence(token_ids: list[int], block_size: int) -> Sequence:
    """A throwaway sequence for `chunk_logits`."""
    return Sequence(EngineRequest("<prompt-logits>", token_ids), block_size, None)

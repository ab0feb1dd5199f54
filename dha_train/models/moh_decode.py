"""MoH decode planning (``modeling_moh``): which strided views of the KV cache cover the heads one new token uses.

Self-contained (torch only) like ``modeling_moh.py``, which imports it relatively, so ``save_pretrained`` copies it
next to the weights with the modeling file.
"""

from __future__ import annotations

from typing import Optional

import torch


def _runs(active: list[bool], max_gap: int = 0) -> list[tuple[int, int]]:
    """[start, stop) of every run of consecutive True entries, runs apart by at most ``max_gap`` False entries
    merged into one."""
    runs, start = [], None
    for index, flag in enumerate(active + [False]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            runs.append((start, index))
            start = None
    merged = runs[:1]
    for start, stop in runs[1:]:
        if start - merged[-1][1] <= max_gap:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return merged


def _decode_plan(active: list[bool], call_heads: float,
                 chain_runs: bool = True) -> Optional[list[tuple[int, int, int, int]]]:
    """The cheapest strided blocks (see ``_strided_blocks``) covering the ``active`` heads, or None when one call
    over every head costs less. A call costs ``call_heads`` heads of work on top of the heads it reads; the candidates
    are the exact runs of active heads and the runs merged across gaps of up to ``call_heads`` inactive heads."""
    if all(active):
        return None
    best, best_cost = None, len(active) + call_heads  # every head in one call
    for max_gap in sorted({0, int(call_heads)}):
        runs = _runs(active, max_gap=max_gap)
        blocks = _strided_blocks(runs, same_length_runs=chain_runs)
        cost = sum(stop - start for start, stop in runs) + len(blocks) * call_heads
        if cost < best_cost:
            best, best_cost = blocks, cost
    return best


def _strided_blocks(runs: list[tuple[int, int]], same_length_runs: bool = True,
                    single_call_heads: int = 4) -> list[tuple[int, int, int, int]]:
    """Cover ``runs`` ([start, stop) of active heads) with strided blocks ``(start, length, count, step)``: heads
    ``start + i * step + j`` for ``i < count``, ``j < length``. Lone heads are chained ``count`` at a time while
    they stay evenly spaced (any two are); with ``same_length_runs`` (batch size 1, where the block can use the batch
    dimension) runs of the same length shorter than ``single_call_heads`` chain likewise. Longer runs are one block
    each."""
    blocks, chains = [], {}
    for start, stop in runs:
        length = stop - start
        if length == 1 or (same_length_runs and length < single_call_heads):
            chains.setdefault(length, []).append(start)
        else:
            blocks.append((start, length, 1, 0))
    for length, starts in chains.items():
        index = 0
        while index < len(starts):
            count, step = 1, 0
            if index + 1 < len(starts):
                step = starts[index + 1] - starts[index]
                count = 2
                while index + count < len(starts) and starts[index + count] - starts[index + count - 1] == step:
                    count += 1
            blocks.append((starts[index], length, count, step))
            index += count
    return blocks


def _block_view(tensor: torch.Tensor, block: tuple[int, int, int, int]) -> torch.Tensor:
    """The heads of ``block`` (see ``_strided_blocks``) of a (B, H, S, D) tensor as a view: (B, length, S, D) for
    one run, (B, count, S, D) for lone heads spaced ``step`` apart, (count, length, S, D) for longer runs (B == 1)."""
    start, length, count, step = block
    if count == 1:
        return tensor[:, start:start + length]
    batch_stride, head_stride, row_stride, dim_stride = tensor.stride()
    offset = tensor.storage_offset() + start * head_stride
    if length == 1:
        return tensor.as_strided((tensor.shape[0], count, *tensor.shape[2:]),
                                 (batch_stride, step * head_stride, row_stride, dim_stride), offset)
    if tensor.shape[0] != 1:
        raise ValueError('MoH decode: runs of several heads chain only at batch size 1')
    return tensor.as_strided((count, length, *tensor.shape[2:]),
                             (step * head_stride, head_stride, row_stride, dim_stride), offset)


def _decode_mask(attention_mask: Optional[torch.Tensor], batch: int, length: int) -> Optional[torch.Tensor]:
    """The padding mask of one query position over ``length`` cached positions, broadcastable over heads."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:  # flash-attention-2 passes the (B, S) padding mask
        return attention_mask[:, None, None, :length].bool()
    return attention_mask[:, :, -1:, :length]

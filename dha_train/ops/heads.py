"""Head-level weight surgery on attention projections: mean-pooling K/V heads by a head map, and permuting heads.

Pure tensor maths (no Composer, no modules). Projection weights use the nn.Linear layout: ``q_proj``, ``k_proj``
and ``v_proj`` are (heads * head_dim, hidden) with head h in rows [h * head_dim, (h + 1) * head_dim); ``o_proj``
is (hidden, heads * head_dim) with head h in those columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def split_heads(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(heads * head_dim, ...) -> (heads, head_dim, ...)."""
    if rows.shape[0] % head_dim:
        raise ValueError(f'{rows.shape[0]} rows are not a whole number of {head_dim}-dim heads')
    return rows.reshape(rows.shape[0] // head_dim, head_dim, *rows.shape[1:])


def mean_pool_heads(rows: torch.Tensor, head_to_group: Sequence[int], head_dim: int) -> torch.Tensor:
    """Average the K (or V) heads of each group: the GQA baseline's conversion (Ainslie et al. 2023).

    ``rows`` is a k_proj/v_proj weight (or bias) with one head per query head (MHA) or per shared head (a GQA
    source, whose heads are each read by equally many query heads, so their plain mean is the mean over query
    heads); ``head_to_group[s]`` is the compact head that head s joins. Returns the compact projection with one head
    per group, in group order.
    """
    heads = split_heads(rows, head_dim)
    if heads.shape[0] != len(head_to_group):
        raise ValueError(f'projection has {heads.shape[0]} heads but the map covers {len(head_to_group)}')
    index = torch.as_tensor(head_to_group, dtype=torch.long, device=rows.device)
    num_groups = int(index.max()) + 1
    flat = heads.reshape(heads.shape[0], -1)
    sums = torch.zeros(num_groups, flat.shape[1], dtype=flat.dtype, device=flat.device).index_add_(0, index, flat)
    counts = torch.bincount(index, minlength=num_groups).to(flat.dtype).unsqueeze(1)
    return (sums / counts).reshape(num_groups * head_dim, *rows.shape[1:])


def gather_heads(rows: torch.Tensor, index: Sequence[int], head_dim: int) -> torch.Tensor:
    """New head i is old head ``index[i]`` (a permutation reorders heads; a head map expands compact heads)."""
    heads = split_heads(rows, head_dim)[torch.as_tensor(index, dtype=torch.long, device=rows.device)]
    return heads.reshape(len(index) * head_dim, *rows.shape[1:])


def permute_head_rows(rows: torch.Tensor, order: Sequence[int], head_dim: int) -> torch.Tensor:
    """Reorder the heads of a q/k/v projection weight or bias: new head i is old head ``order[i]``."""
    if sorted(order) != list(range(rows.shape[0] // head_dim)):
        raise ValueError(f'{list(order)} is not a permutation of the {rows.shape[0] // head_dim} heads')
    return gather_heads(rows, order, head_dim)


def permute_head_columns(o_weight: torch.Tensor, order: Sequence[int], head_dim: int) -> torch.Tensor:
    """Reorder the per-head input columns of an o_proj weight to match ``permute_head_rows``."""
    return permute_head_rows(o_weight.t(), order, head_dim).t().contiguous()


def _attention_key(layer: int, name: str) -> str:
    return f'model.layers.{layer}.self_attn.{name}'


def mean_pool_llama_state_dict(state_dict: dict[str, torch.Tensor], key_maps: Sequence[Sequence[int]],
                               value_maps: Sequence[Sequence[int]], head_dim: int) -> dict[str, torch.Tensor]:
    """LLaMA state dict -> compact K/V projections per layer (a new dict; the input is not modified).

    ``key_maps[l][s]`` / ``value_maps[l][s]`` give the compact key / value head of the model's K / V head s in layer
    l: for an MHA model the ``key`` and ``value`` tuples of a HeadMap layer (one K/V head per query head); for a GQA
    model, maps over its shared heads (``HeadMap.source_partitions``), so its K/V weights are never expanded.
    """
    converted = dict(state_dict)
    for layer, (key_map, value_map) in enumerate(zip(key_maps, value_maps)):
        for proj, mapping in (('k_proj', key_map), ('v_proj', value_map)):
            for param in ('weight', 'bias'):
                name = _attention_key(layer, f'{proj}.{param}')
                if param == 'weight' and name not in state_dict:
                    raise KeyError(f'{name} is missing: not a LLaMA state dict with {len(key_maps)} layers')
                if name in state_dict:
                    converted[name] = mean_pool_heads(state_dict[name], mapping, head_dim)
    return converted


def permute_llama_state_dict(state_dict: dict[str, torch.Tensor], orders: Sequence[Sequence[int]],
                             head_dim: int, kv_orders: Sequence[Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
    """Reorder the query heads of every layer (Q rows and O columns) and the K/V heads (rows) by ``kv_orders``,
    which default to ``orders`` (MHA: one K/V head per query head). For a GQA model, ``kv_orders`` must reorder its
    shared heads the way ``orders`` reorders their query heads. The model computes the same function."""
    kv_orders = orders if kv_orders is None else kv_orders
    permuted = dict(state_dict)
    for layer, (order, kv_order) in enumerate(zip(orders, kv_orders)):
        for proj, proj_order in (('q_proj', order), ('k_proj', kv_order), ('v_proj', kv_order)):
            for param in ('weight', 'bias'):
                name = _attention_key(layer, f'{proj}.{param}')
                if name in state_dict:
                    permuted[name] = permute_head_rows(state_dict[name], proj_order, head_dim)
        name = _attention_key(layer, 'o_proj.weight')
        permuted[name] = permute_head_columns(state_dict[name], order, head_dim)
    return permuted

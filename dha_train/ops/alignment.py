"""Procrustes alignment of attention heads (seed 001 sections 3.2-3.4, Alg. 1). Pure tensor maths.

Conventions: a head's cache is a row matrix X (tokens N, head dim d); head j is aligned onto head i by an orthogonal
map Q acting on rows, X_j Q ~ X_i. Everything is computed from cross-products C_ji = X_j^T X_i, which are blocks of
the layer Gram matrix that calibration accumulates (``RunningGram``), so no pair ever needs its token rows:

- Procrustes (Eq. 4-6): min_Q ||X_j Q - X_i||_F^2 = ||X_i||^2 + ||X_j||^2 - 2 max_Q tr(Q^T C_ji); the maximum is the
  nuclear norm of C_ji, at Q = U V^T for C_ji = U S V^T.
- Values take any orthogonal Q. Keys take a rotation that commutes with RoPE: HF ``rotate_half`` rotates the plane of
  dimensions (p, p + d/2) by position x theta_p, so the key map is one proper 2x2 rotation per such plane (Eq. 14).
  In plane p, tr(R(a)^T C_p) = cos a (C_p,aa + C_p,bb) + sin a (C_p,ba - C_p,ab), maximal at
  sqrt((C_aa + C_bb)^2 + (C_ba - C_ab)^2).
- Similarity after alignment (Eq. 18-22): ``cos`` = the mean row cosine, i.e. the maximum above over N on
  row-normalised caches (Eq. 7-8); ``dist`` = minus the mean squared row distance over N. (The paper writes the mean
  unsquared distance; the squared one is what the Procrustes map minimises and has this closed form.)
- Generalised Procrustes inside a group (Alg. 1): Q_i <- polar(sum_{k != i} C_ik Q_k) until the total agreement
  sum_ik tr(Q_i^T C_ik Q_k) stops rising; the rotations are per plane for keys.
- Folding into the weights leaves the model unchanged: values W_v,j <- Q_j^T W_v,j and W_o,j <- W_o,j Q_j; keys
  W_q,j <- R_j^T W_q,j and W_k,j <- R_j^T W_k,j (rotations in RoPE's planes commute with RoPE, Eq. 17).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Kind = Literal['key', 'value']
Criterion = Literal['cos', 'dist']


def cross_blocks(gram: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(H, H, d, d) blocks C[j, i] = X_j^T X_i of a layer Gram (H d, H d) of uncentred rows."""
    features = gram.shape[0]
    if gram.shape != (features, features) or features % num_heads:
        raise ValueError(f'a Gram of shape {tuple(gram.shape)} does not hold {num_heads} equal heads')
    head_dim = features // num_heads
    return gram.reshape(num_heads, head_dim, num_heads, head_dim).transpose(1, 2)


def _planes(head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if head_dim % 2:
        raise ValueError(f'key alignment needs an even head dim (RoPE planes), got {head_dim}')
    first = torch.arange(head_dim // 2, device=device)
    return first, first + head_dim // 2


def _plane_terms(cross: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For (..., d, d) cross-products: per RoPE plane, (C_aa + C_bb, C_ba - C_ab), each (..., d/2)."""
    a, b = _planes(cross.shape[-1], cross.device)
    return cross[..., a, a] + cross[..., b, b], cross[..., b, a] - cross[..., a, b]


def max_agreement(cross: torch.Tensor, kind: Kind) -> torch.Tensor:
    """max over the kind's maps Q of tr(Q^T C), for (..., d, d) cross-products C: the nuclear norm for values, the
    sum over RoPE planes of the best 2x2 rotation's agreement for keys."""
    if kind == 'value':
        return torch.linalg.svdvals(cross).sum(dim=-1)
    if kind == 'key':
        diagonal, antisymmetric = _plane_terms(cross)
        return torch.sqrt(diagonal.square() + antisymmetric.square()).sum(dim=-1)
    raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")


def best_map(cross: torch.Tensor, kind: Kind) -> torch.Tensor:
    """argmax over the kind's maps of tr(Q^T C): (..., d, d) orthogonal, block-rotation for keys (det +1 per plane)."""
    if kind == 'value':
        u, _, vh = torch.linalg.svd(cross)
        return u @ vh
    if kind == 'key':
        diagonal, antisymmetric = _plane_terms(cross)
        angle = torch.atan2(antisymmetric, diagonal)
        return plane_rotation(angle)
    raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")


def plane_rotation(angle: torch.Tensor) -> torch.Tensor:
    """(..., d, d) map rotating each RoPE plane (p, p + d/2) of a row vector by angle[..., p] (x -> x R)."""
    half = angle.shape[-1]
    rotation = angle.new_zeros(*angle.shape[:-1], 2 * half, 2 * half)
    a, b = _planes(2 * half, angle.device)
    cos, sin = torch.cos(angle), torch.sin(angle)
    rotation[..., a, a], rotation[..., b, b] = cos, cos
    rotation[..., a, b], rotation[..., b, a] = -sin, sin  # tr(R^T C) = cos (C_aa + C_bb) + sin (C_ba - C_ab)
    return rotation


def aligned_similarity(gram: torch.Tensor, num_heads: int, kind: Kind, criterion: Criterion,
                       tokens: int) -> torch.Tensor:
    """(H, H) similarity of every head pair after its optimal alignment, from one layer Gram over ``tokens`` rows.

    ``cos`` expects the Gram of row-normalised caches (every row of every head scaled to unit norm); ``dist`` the
    Gram of the raw caches. Symmetric, computed in float64; the diagonal is the self-similarity (1 for cos, 0 for
    dist)."""
    if tokens <= 0:
        raise ValueError(f'tokens must be positive, got {tokens}')
    cross = cross_blocks(gram.double(), num_heads)
    upper = torch.triu_indices(num_heads, num_heads, device=gram.device)
    agreement = torch.zeros(num_heads, num_heads, dtype=torch.float64, device=gram.device)
    agreement[upper[0], upper[1]] = max_agreement(cross[upper[0], upper[1]], kind)
    agreement = agreement + agreement.triu(1).T
    if criterion == 'cos':
        return agreement / tokens
    if criterion == 'dist':
        energy = torch.diagonal(cross, dim1=-2, dim2=-1).sum(dim=-1).diagonal()  # ||X_i||^2
        return -(energy[:, None] + energy[None, :] - 2.0 * agreement).clamp_min(0.0) / tokens
    raise ValueError(f"criterion must be 'cos' or 'dist', got {criterion!r}")


def explicit_aligned_similarity(caches: torch.Tensor, kind: Kind, criterion: Criterion) -> torch.Tensor:
    """Reference for ``aligned_similarity`` on token rows (H, N, d): align each pair with its Procrustes map, then
    measure the mean row cosine (on normalised rows) or minus the mean squared row distance. For tests."""
    caches = caches.double()
    if criterion == 'cos':
        caches = caches / caches.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    num_heads = caches.shape[0]
    similarity = torch.empty(num_heads, num_heads, dtype=torch.float64)
    for i in range(num_heads):
        for j in range(num_heads):
            mapped = caches[j] @ best_map(caches[j].T @ caches[i], kind)
            if criterion == 'cos':
                similarity[i, j] = torch.nn.functional.cosine_similarity(mapped, caches[i], dim=-1).mean()
            else:
                similarity[i, j] = -(mapped - caches[i]).square().sum(dim=-1).mean()
    return similarity


def _agreement(cross: torch.Tensor, maps: torch.Tensor) -> float:
    """sum_ik tr(Q_i^T C_ik Q_k) for a group's (g, g, d, d) cross-products C[i, k] = X_i^T X_k."""
    return float(torch.einsum('iab,ikac,kcb->', maps, cross, maps))


def generalized_procrustes(cross: torch.Tensor, kind: Kind, *, max_iterations: int = 100,
                           tolerance: float = 1e-10) -> torch.Tensor:
    """Alg. 1 inside one group from its (g, g, d, d) cross-products C[i, k] = X_i^T X_k: the maps Q_i (g, d, d) that
    make the mapped caches X_i Q_i agree (each Q_i the kind's best map onto the current mean shape, i.e. onto
    sum_k X_k Q_k); the first head's map fixes the common frame. Each sweep cannot lower the total agreement."""
    cross = cross.double()
    group, head_dim = cross.shape[0], cross.shape[-1]
    maps = torch.eye(head_dim, dtype=torch.float64, device=cross.device).repeat(group, 1, 1)
    if group == 1:
        return maps
    previous = _agreement(cross, maps)
    for _ in range(max_iterations):
        for i in range(group):
            # X_i^T sum_{k != i} X_k Q_k: leaving the head itself out of the mean shape makes each update an exact
            # maximisation (tr(Q^T C_ii Q) is the same for every orthogonal Q), so the agreement never falls.
            target = torch.einsum('kab,kbc->ac', cross[i], maps) - cross[i, i] @ maps[i]
            maps[i] = best_map(target, kind)
        current = _agreement(cross, maps)
        if current - previous <= tolerance * max(1.0, abs(current)):
            break
        previous = current
    # Express every map in the first head's frame (any common rotation leaves the agreement unchanged).
    return maps @ maps[0].T


def group_maps(gram: torch.Tensor, partition: Sequence[Sequence[int]], kind: Kind) -> torch.Tensor:
    """(H, d, d): each head's generalised-Procrustes map within its group of ``partition`` (one layer's Gram)."""
    num_heads = sum(len(group) for group in partition)
    cross = cross_blocks(gram.double(), num_heads)
    maps = torch.empty(num_heads, cross.shape[-1], cross.shape[-1], dtype=torch.float64, device=gram.device)
    for group in partition:
        index = torch.as_tensor(list(group), device=gram.device)
        maps[index] = generalized_procrustes(cross[index][:, index], kind)
    return maps


def within_group_cosine(gram: torch.Tensor, partition: Sequence[Sequence[int]], tokens: int,
                        maps: torch.Tensor | None = None) -> float:
    """Mean over within-group head pairs of the mean row cosine of their caches (Gram of normalised rows), after
    mapping every head by ``maps`` (H, d, d) when given: how alike a group's caches are before and after alignment."""
    num_heads = sum(len(group) for group in partition)
    cross = cross_blocks(gram.double(), num_heads)
    total, pairs = 0.0, 0
    for group in partition:
        for position, i in enumerate(group):
            for k in group[position + 1:]:
                block = cross[i, k] if maps is None else maps[i].T @ cross[i, k] @ maps[k]
                total += float(torch.diagonal(block).sum()) / tokens
                pairs += 1
    return total / max(pairs, 1)


def _per_query_head(maps: torch.Tensor, query_to_kv: Sequence[int] | None) -> torch.Tensor:
    """The map each query head's Q rows / O columns take: its K/V head's (MHA: its own)."""
    return maps if query_to_kv is None else maps[torch.as_tensor(list(query_to_kv), dtype=torch.long, device=maps.device)]


def fold_value_maps(v_weight: torch.Tensor, o_weight: torch.Tensor, maps: torch.Tensor,
                    query_to_kv: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W_v,j <- Q_j^T W_v,j (rows of V head j) and W_o,h <- W_o,h Q_j (the input columns of every query head h that
    reads V head j, ``query_to_kv[h] = j``; MHA: h = j): v_j Q_j enters o_proj through Q_j^T, so attention's
    output is unchanged. ``maps`` (K/V heads, d, d); weights as in nn.Linear."""
    num_kv, head_dim = maps.shape[0], maps.shape[-1]
    maps = maps.to(v_weight.dtype)
    v_heads = v_weight.reshape(num_kv, head_dim, -1)
    new_v = (maps.transpose(1, 2) @ v_heads).reshape(v_weight.shape)
    per_query = _per_query_head(maps, query_to_kv).to(o_weight.dtype)
    o_heads = o_weight.reshape(o_weight.shape[0], per_query.shape[0], head_dim).transpose(0, 1)  # (H, out, d)
    new_o = (o_heads @ per_query).transpose(0, 1).reshape(o_weight.shape)
    return new_v, new_o


def fold_key_maps(q_weight: torch.Tensor, k_weight: torch.Tensor, maps: torch.Tensor,
                  query_to_kv: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W_k,j <- R_j^T W_k,j for RoPE-plane rotations R_j (K heads, d, d), and W_q,h <- R_j^T W_q,h for every query
    head h that reads K head j (``query_to_kv[h] = j``; MHA: h = j): q and k rotate alike, the rotation commutes
    with RoPE, so every score q.k is unchanged (Eq. 15-17)."""
    head_dim = maps.shape[-1]
    maps = maps.to(q_weight.dtype)

    def rotate(weight: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        return (rotations.transpose(1, 2) @ weight.reshape(rotations.shape[0], head_dim, -1)).reshape(weight.shape)

    return rotate(q_weight, _per_query_head(maps, query_to_kv)), rotate(k_weight, maps)


def align_llama_state_dict(state_dict: dict[str, torch.Tensor], key_maps: Sequence[torch.Tensor | None],
                           value_maps: Sequence[torch.Tensor | None],
                           query_to_kv: Sequence[Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
    """A LLaMA state dict with every layer's key maps (RoPE-plane rotations, one per K head) folded into q_proj /
    k_proj and its value maps folded into v_proj / o_proj (None: leave that kind of the layer alone). For a GQA
    model ``query_to_kv[l][h]`` is the K/V head query head h reads (default: MHA). A new dict; the model it
    describes computes the same function. Folding is done in float64 and cast back to each weight's dtype."""
    aligned = dict(state_dict)
    for layer, (key_map, value_map) in enumerate(zip(key_maps, value_maps)):
        prefix = f'model.layers.{layer}.self_attn.'
        shared = None if query_to_kv is None else query_to_kv[layer]
        # A bias (Qwen2's q/k/v) is one more input column of its projection: it is folded with the weight.
        def with_bias(proj: str) -> torch.Tensor:
            weight = state_dict[prefix + f'{proj}.weight'].double()
            bias = state_dict.get(prefix + f'{proj}.bias')
            return weight if bias is None else torch.cat([weight, bias.double()[:, None]], dim=1)

        def store(proj: str, folded: torch.Tensor) -> None:
            name = prefix + f'{proj}.weight'
            if prefix + f'{proj}.bias' in state_dict:
                aligned[prefix + f'{proj}.bias'] = folded[:, -1].to(state_dict[prefix + f'{proj}.bias'].dtype)
                folded = folded[:, :-1]
            aligned[name] = folded.to(state_dict[name].dtype).contiguous()

        if key_map is not None:
            q, k = fold_key_maps(with_bias('q_proj'), with_bias('k_proj'), key_map.double(), shared)
            store('q_proj', q)
            store('k_proj', k)
        if value_map is not None:
            v, o = fold_value_maps(with_bias('v_proj'), state_dict[prefix + 'o_proj.weight'].double(),
                                   value_map.double(), shared)
            store('v_proj', v)
            aligned[prefix + 'o_proj.weight'] = o.to(state_dict[prefix + 'o_proj.weight'].dtype)
    return aligned

"""Conversion of MHA/GQA attention to multi-head latent attention (MLA): the maths, no modules.

The method follows MHA2MLA (Ji et al., ACL 2025, arXiv 2502.14837), with the activation-aware factorisation of
CARE and the K/V balance of TransMLA (arXiv 2502.07864):

1. **Partial RoPE.** LLaMA's RoPE (``rotate_half``) turns dimension ``i`` together with ``i + d/2`` at the frequency
   ``base ** (-2i / d)``, ``i < d/2``: call that a *pair*. Per K/V head, ``r`` pairs stay rotated and are cached as
   they are; the others become position-free. MHA2MLA's 2-norm criterion keeps the pairs that contribute most to
   the attention scores: pair ``i`` of K/V head ``g`` scores ``sum over the query heads h that read g of
   mean_t |q_{h,i}(t)| * mean_t |k_{g,i}(t)|``, with ``|.|`` the 2-norm of the pair. RoPE rotates inside each pair,
   so the scores are the same before and after it and are taken from the un-rotated projections. ``uniform`` (pairs
   evenly spread over the frequencies) and ``high_frequency`` (the first ``r`` pairs) are the position-only choices.
2. **Joint latent.** The position-free key rows and all value rows of a layer, ``W`` (m x hidden), are factored as
   ``up @ down`` with ``down`` (rank x hidden): the cache holds ``down @ x`` (``rank`` numbers per token) plus the
   kept rotated key dimensions. ``latent_factors`` minimises ``E ||(W - up @ down) x||^2`` over the calibration
   inputs (covariance ``C = E[x x^T]``): with ``U_r`` the top eigenvectors of ``W C W^T``, ``up = U_r`` and
   ``down = U_r^T W`` (the optimal rank-r approximation of ``W C^(1/2)`` is ``U_r U_r^T W C^(1/2)``, Eckart-Young).
   Without a covariance (``C = I``) this is plain weight SVD. Keys and values can be balanced first (the key rows
   scaled by one factor, undone in ``up``), so neither dominates the latent: ``energy`` gives both the same total
   energy under ``C``; ``feature_norm`` is TransMLA's code (the same mean per-feature norm over the tokens).
   **Folded frequencies (FreqFold, per K/V head).** Neighbouring pairs turn at nearly the same speed. With a fold
   of ``F``, each head's pairs are cut into windows of ``F`` consecutive pairs and re-based, queries and keys alike,
   by the eigenvectors of the window's key energy (``M_ij = sum over both components of E[k_i k_j]``): one real
   orthogonal ``F x F`` mix applied the same way to both components of every pair, so the position-free dot
   product ``q . k`` is unchanged. The top component sits at the window's pair nearest its energy-weighted mean
   frequency and is the window's one candidate to stay rotated; the others become position-free. Turning the mix
   at one frequency is exact only where the window's frequencies are equal: the fold trades that error for more
   key energy kept rotated per cached pair. A fold of 1 is the plain choice above.
3. **Ranks per layer.** ``allocate_latent_ranks`` splits a total latent size over the layers from each layer's
   spectrum (the relative energy a rank leaves out) with the same knapsack as the DHA Search's K/V budget
   (``ops.budget.allocate_slots``); a uniform rank is the alternative.

Weights use the nn.Linear layout of ``ops.heads``: k_proj/v_proj are (kv_heads * head_dim, hidden).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dha_train.ops.budget import allocate_slots

PAIR_CRITERIA = ('norm', 'uniform', 'high_frequency')


def pair_norms(states: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(heads, head_dim / 2): the mean over tokens of each RoPE pair's 2-norm. ``states`` is (tokens, heads *
    head_dim), one projection's outputs (queries or keys), rotated or not."""
    if head_dim % 2:
        raise ValueError(f'RoPE needs an even head_dim, got {head_dim}')
    if states.ndim != 2 or states.shape[1] % head_dim:
        raise ValueError(f'states must be (tokens, heads * {head_dim}), got {tuple(states.shape)}')
    half = head_dim // 2
    heads = states.reshape(states.shape[0], -1, 2, half)  # (tokens, heads, [first, second half], pair)
    return heads.double().pow(2).sum(dim=2).sqrt().mean(dim=0)


def rope_pair_scores(query_states: torch.Tensor, key_states: torch.Tensor, head_dim: int,
                     query_to_kv: Sequence[int]) -> torch.Tensor:
    """(kv_heads, head_dim / 2): MHA2MLA's 2-norm score of every pair of every K/V head, summed over the query heads
    that read it (``query_to_kv[h]`` is the K/V head of query head h; MHA: the identity)."""
    query_norms = pair_norms(query_states, head_dim)
    key_norms = pair_norms(key_states, head_dim)
    if query_norms.shape[0] != len(query_to_kv):
        raise ValueError(f'{query_norms.shape[0]} query heads but query_to_kv has {len(query_to_kv)} entries')
    index = torch.as_tensor(list(query_to_kv), dtype=torch.long, device=query_norms.device)
    if int(index.max()) >= key_norms.shape[0] or int(index.min()) < 0:
        raise ValueError(f'query_to_kv names K/V heads outside 0..{key_norms.shape[0] - 1}')
    summed = torch.zeros_like(key_norms).index_add_(0, index, query_norms)
    return summed * key_norms


def kept_rope_pairs(num_kv_heads: int, head_dim: int, pairs: int, criterion: str = 'norm',
                    scores: torch.Tensor | None = None, centres: torch.Tensor | None = None) -> torch.Tensor:
    """(kv_heads, pairs) long: the RoPE pairs each K/V head keeps rotated, increasing, chosen among its
    ``centres`` (kv_heads, windows), increasing: each fold window's one candidate (``folded_pair_bases``); every
    pair without a fold. ``norm`` takes the ``pairs`` candidates of highest ``scores`` (``rope_pair_scores``, over
    all the head's pairs); ``uniform`` spreads them evenly over the frequencies (candidate ``floor(j * windows /
    pairs)``); ``high_frequency`` keeps the first ``pairs``."""
    half = head_dim // 2
    if centres is None:
        centres = torch.arange(half, dtype=torch.long, device='cpu').expand(num_kv_heads, half)
    windows = centres.shape[1]
    if tuple(centres.shape) != (num_kv_heads, windows):
        raise ValueError(f'centres must be ({num_kv_heads}, windows), got {tuple(centres.shape)}')
    if not 0 <= pairs <= windows:
        raise ValueError(f'pairs kept must be within 0..{windows} (head_dim {head_dim}, {windows} candidate pairs '
                         f'a head), got {pairs}')
    if criterion not in PAIR_CRITERIA:
        raise ValueError(f'criterion must be one of {", ".join(PAIR_CRITERIA)}, got {criterion!r}')
    centres = centres.long().cpu()
    if criterion == 'norm':
        if scores is None or tuple(scores.shape) != (num_kv_heads, half):
            raise ValueError(f'criterion norm needs scores of shape ({num_kv_heads}, {half}), got '
                             f'{None if scores is None else tuple(scores.shape)}')
        # stable: equal scores keep the lower (higher-frequency) candidate
        candidate_scores = scores.double().cpu().gather(1, centres)
        order = torch.sort(-candidate_scores, dim=1, stable=True).indices[:, :pairs]
        return centres.gather(1, order.sort(dim=1).values)
    if criterion == 'uniform':
        row = torch.tensor([j * windows // pairs for j in range(pairs)], dtype=torch.long, device='cpu')
    else:
        row = torch.arange(pairs, dtype=torch.long, device='cpu')
    return centres[:, row].clone()


def fold_windows(half: int, fold: int) -> list[list[int]]:
    """Consecutive runs of ``fold`` pairs covering ``0..half-1`` (the last one shorter when ``fold`` does not divide
    ``half``)."""
    if fold < 1:
        raise ValueError(f'the frequency fold must be at least 1, got {fold}')
    return [list(range(first, min(first + fold, half))) for first in range(0, half, fold)]


def folded_pair_bases(cross: torch.Tensor, fold: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FreqFold per K/V head (the module's note) from ``pair_key_cross_energy`` (pairs, G, pairs, G):
    (bases (G, pairs, pairs) float64, orthogonal and block-diagonal over the windows, new pair ``j`` of head ``g``
    being ``sum_i bases[g, i, j]`` old pair ``i``; centres (G, windows) long, where each window's top component
    sits; kept (G, windows), the key energy of that component). A fold of 1 gives the identity and every pair."""
    half, kv_heads = cross.shape[0], cross.shape[1]
    windows = fold_windows(half, fold)
    bases = torch.zeros(kv_heads, half, half, dtype=torch.float64, device=cross.device)
    centres = torch.zeros(kv_heads, len(windows), dtype=torch.long, device='cpu')
    kept = torch.zeros(kv_heads, len(windows), dtype=torch.float64, device='cpu')
    for head in range(kv_heads):
        energy = cross[:, head, :, head].double()
        for window_index, window in enumerate(windows):
            index = torch.tensor(window, dtype=torch.long, device=cross.device)
            block = energy[index][:, index]
            values, vectors = torch.linalg.eigh((block + block.T) / 2)
            values, vectors = values.flip(0), vectors.flip(1)  # largest first
            top = vectors[:, 0]
            weight = top.pow(2)
            centre = int(torch.round(weight @ torch.arange(len(window), dtype=torch.float64, device=cross.device)
                                     / weight.sum()))
            # the top component at the centre, the others in order at the remaining positions
            positions = [centre] + [p for p in range(len(window)) if p != centre]
            placed = torch.zeros_like(vectors)
            placed[:, positions] = vectors * torch.sign(top[top.abs().argmax()])
            bases[head][index.unsqueeze(1), index.unsqueeze(0)] = placed
            centres[head, window_index] = window[centre]
            kept[head, window_index] = float(values[0].clamp_min(0.0))
    return bases, centres, kept


def mix_head_pairs(states: torch.Tensor, bases: torch.Tensor, head_dim: int,
                   query_to_kv: Sequence[int] | None = None) -> torch.Tensor:
    """``states`` (..., heads * head_dim) with each head's pairs re-based by its K/V head's ``bases``
    (``folded_pair_bases``), the same mix on both components; ``query_to_kv`` maps query heads to K/V heads (None:
    the heads are the K/V heads). A projection's weight (heads * head_dim, hidden) is mixed as its transpose."""
    half = head_dim // 2
    shaped = states.double().reshape(*states.shape[:-1], -1, 2, half)
    per_head = bases if query_to_kv is None else bases[torch.as_tensor(list(query_to_kv), dtype=torch.long,
                                                                        device=bases.device)]
    if per_head.shape[0] != shaped.shape[-3]:
        raise ValueError(f'{shaped.shape[-3]} heads in the states but bases for {per_head.shape[0]}')
    mixed = torch.einsum('...hci,hij->...hcj', shaped, per_head.to(shaped.device))
    return mixed.reshape(states.shape).to(states.dtype)


def recovered_pair_bases(source_queries: torch.Tensor, converted_queries: torch.Tensor, head_dim: int,
                         kv_heads: int) -> tuple[torch.Tensor, float]:
    """(bases (G, pairs, pairs), relative mismatch): the per-K/V-head pair re-basis that takes a source's query
    projection (heads * head_dim, hidden) to a converted one, ``converted = mix_head_pairs(source.T, bases).T``, by
    least squares over every query head of the K/V head (contiguous groups). The identity for a conversion without
    FreqFold; the mismatch (relative Frobenius residual) is large for one made from another source."""
    half = head_dim // 2

    def by_pair(weight: torch.Tensor) -> torch.Tensor:  # (G, pairs, group * 2 * hidden)
        shaped = weight.double().reshape(kv_heads, -1, 2, half, weight.shape[-1])
        return shaped.permute(0, 3, 1, 2, 4).reshape(kv_heads, half, -1)

    source, converted = by_pair(source_queries), by_pair(converted_queries)
    # converted[j] = sum_i bases[i, j] source[i]  <=>  source^T bases = converted^T
    bases = torch.linalg.lstsq(source.transpose(1, 2), converted.transpose(1, 2)).solution
    residual = source.transpose(1, 2) @ bases - converted.transpose(1, 2)
    return bases, float(residual.norm() / converted.norm().clamp_min(1e-30))


def pair_key_cross_energy(k_weight: torch.Tensor, covariance: torch.Tensor | None, kv_heads: int,
                          head_dim: int) -> torch.Tensor:
    """(pairs, G, pairs, G) float64: the key energy ``sum over both components of E[k_gi k_hj]`` across pairs and
    heads, from the key projection and the input covariance (the identity without one). Block ``(i, i)`` is pair
    ``i``'s energy across heads (the shared RoPE key's, ``ops.deepseek``); ``[:, g, :, g]`` is head ``g``'s across
    pairs (FreqFold's windows, ``folded_pair_bases``)."""
    half = head_dim // 2
    rows = k_weight.double().reshape(kv_heads, 2, half, -1).permute(1, 2, 0, 3)  # (component, pair, G, hidden)
    if covariance is None:
        return torch.einsum('cpgh,cqkh->pgqk', rows, rows)
    return torch.einsum('cpgh,hj,cqkj->pgqk', rows, covariance.double(), rows)


def rope_dims(kept_pairs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(kv_heads, 2 * pairs): the head dimensions of the kept pairs, first halves then second halves, the order in
    which the rotated key part is stored (so ``rotate_half`` on it pairs them again)."""
    return torch.cat([kept_pairs, kept_pairs + head_dim // 2], dim=1)


def nope_dims(kept_pairs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(kv_heads, head_dim - 2 * pairs): the position-free dimensions of each head, increasing."""
    keep = torch.zeros(kept_pairs.shape[0], head_dim, dtype=torch.bool, device=kept_pairs.device)
    keep.scatter_(1, rope_dims(kept_pairs, head_dim), True)
    return torch.stack([torch.nonzero(~row).flatten() for row in keep])


def head_rows(dims: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Flat row indices into a (heads * head_dim, ...) projection for per-head dimension lists (heads, n)."""
    offsets = torch.arange(dims.shape[0], dtype=torch.long, device=dims.device).unsqueeze(1) * head_dim
    return (dims + offsets).flatten()


BALANCES = ('energy', 'feature_norm', 'none')


def balance_scales(key_rows: torch.Tensor, value_rows: torch.Tensor, covariance: torch.Tensor | None = None,
                   balance: str = 'energy') -> torch.Tensor:
    """Per-row scales of ``[key_rows; value_rows]`` that scale the keys by one factor before the joint factorisation,
    so neither block dominates the latent (the scale is undone in the up-projection). Values keep scale 1.

    - ``energy``: equal total energy under ``covariance`` (``trace(W C W^T)``, C = I without one): keys scaled by
      ``sqrt(E_v / E_k)``;
    - ``feature_norm``: TransMLA's code: equal mean over features of each feature's norm over the tokens, i.e. of
      ``sqrt(w_f^T C w_f)`` per row ``w_f``: keys scaled by ``mean_f sqrt(v_f C v_f) / mean_f sqrt(k_f C k_f)``.

    The two agree when every feature of a block carries the same energy; ``energy`` lets a few strong key features
    set the factor, ``feature_norm`` the typical feature.
    """
    if balance not in BALANCES[:2]:
        raise ValueError(f'balance must be one of {", ".join(BALANCES[:2])}, got {balance!r}')
    if balance == 'energy':
        key_size, value_size = _energy(key_rows, covariance), _energy(value_rows, covariance)
    else:
        key_size, value_size = _row_energies(key_rows, covariance).sqrt().mean(), \
            _row_energies(value_rows, covariance).sqrt().mean()
    if key_size <= 0 or value_size <= 0:
        raise ValueError('cannot balance a key or value block with no energy')
    key_scale = (value_size / key_size).sqrt() if balance == 'energy' else value_size / key_size
    return torch.cat([key_scale.expand(key_rows.shape[0]), torch.ones(value_rows.shape[0], dtype=torch.float64,
                                                                    device=key_scale.device)])


def _row_energies(rows: torch.Tensor, covariance: torch.Tensor | None) -> torch.Tensor:
    rows = rows.double()
    if covariance is None:
        return rows.pow(2).sum(dim=1)
    return torch.einsum('ij,jk,ik->i', rows, covariance.double(), rows)


def _energy(rows: torch.Tensor, covariance: torch.Tensor | None) -> torch.Tensor:
    return _row_energies(rows, covariance).sum()


def _latent_gram(weight: torch.Tensor, covariance: torch.Tensor | None,
                 row_scale: torch.Tensor | None) -> torch.Tensor:
    """``S W C W^T S`` in float64, symmetrised; ``S = diag(row_scale)`` (1 without one), ``C = I`` without a
    covariance."""
    scaled = weight.double() if row_scale is None else weight.double() * row_scale.double().unsqueeze(1)
    if covariance is None:
        gram = scaled @ scaled.T
    else:
        if tuple(covariance.shape) != (weight.shape[1], weight.shape[1]):
            raise ValueError(f'covariance must be ({weight.shape[1]}, {weight.shape[1]}), got {tuple(covariance.shape)}')
        gram = scaled @ covariance.double() @ scaled.T
    return (gram + gram.T) / 2


def latent_spectrum(weight: torch.Tensor, covariance: torch.Tensor | None = None,
                    row_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues descending, eigenvectors as columns) of ``S W C W^T S`` (``_latent_gram``) in float64: the
    energy each latent direction carries, and the directions."""
    values, vectors = torch.linalg.eigh(_latent_gram(weight, covariance, row_scale))
    return values.flip(0).clamp_min(0.0), vectors.flip(1)


def latent_energies(weight: torch.Tensor, covariance: torch.Tensor | None = None,
                    row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The eigenvalues of ``latent_spectrum``, descending, without the eigenvectors (cheaper): what the rank
    allocation needs before any layer is factored."""
    return torch.linalg.eigvalsh(_latent_gram(weight, covariance, row_scale)).flip(0).clamp_min(0.0)


def latent_factors(weight: torch.Tensor, rank: int, covariance: torch.Tensor | None = None,
                   row_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(up (m x rank), down (rank x n)) in float64 with ``up @ down`` the rank-``rank`` approximation of ``weight``
    (m x n) that minimises ``E ||S (W - up @ down) x||^2`` for inputs of covariance ``C``: ``down = U_r^T S W`` and
    ``up = S^-1 U_r``. Exact (to float64 rounding) at rank m."""
    if not 1 <= rank <= weight.shape[0]:
        raise ValueError(f'rank must be within 1..{weight.shape[0]}, got {rank}')
    _, vectors = latent_spectrum(weight, covariance, row_scale)
    basis = vectors[:, :rank]
    scale = (torch.ones(weight.shape[0], dtype=torch.float64, device=weight.device) if row_scale is None
             else row_scale.double())
    down = basis.T @ (weight.double() * scale.unsqueeze(1))
    up = basis / scale.unsqueeze(1)
    return up, down


def left_out_energy(spectrum: torch.Tensor, rank: int) -> float:
    """The fraction of a layer's energy a rank-``rank`` latent leaves out: sum of the eigenvalues past ``rank`` over
    their total (0 at full rank; comparable across layers of different scale)."""
    total = float(spectrum.sum())
    return float(spectrum[rank:].sum()) / total if total > 0 else 0.0


def allocate_latent_ranks(spectra: Sequence[torch.Tensor], total_rank: int, step: int = 1,
                          min_rank: int | None = None) -> list[int]:
    """A latent rank per layer, each a multiple of ``step`` between ``min_rank`` (default ``step``) and the layer's
    size, summing exactly to ``total_rank``, that leaves out the least summed relative energy
    (``left_out_energy``): the knapsack of ``ops.budget.allocate_slots``."""
    if step < 1:
        raise ValueError(f'step must be >= 1, got {step}')
    lowest = step if min_rank is None else min_rank
    if lowest < 1 or lowest % step:
        raise ValueError(f'min_rank must be a positive multiple of step {step}, got {lowest}')
    sizes = [int(spectrum.shape[0]) for spectrum in spectra]
    if total_rank % step:
        raise ValueError(f'total_rank {total_rank} is not a multiple of step {step}')
    counts = list(range(lowest // step, max(sizes) // step + 1))
    if not counts:
        raise ValueError(f'no rank between {lowest} and the layer sizes {sizes} is a multiple of {step}')
    reachable = (len(spectra) * lowest, sum(size // step * step for size in sizes))
    if not reachable[0] <= total_rank <= reachable[1]:
        raise ValueError(f'total_rank {total_rank} is out of reach: ranks over {len(spectra)} layers sum to '
                         f'{reachable[0]}..{reachable[1]}')

    def cost(layer: int, units: int) -> float:
        rank = units * step
        return float('inf') if rank > sizes[layer] else left_out_energy(spectra[layer], rank)

    picked = allocate_slots(cost, len(spectra), counts, total_rank // step, what=lambda layer: f'layer={layer}')
    if picked is None:
        raise ValueError(f'total_rank {total_rank} cannot be split into multiples of {step} within the layer sizes')
    return [units * step for units in picked]


def key_scales_per_layer(pairs: int, key_norm_head_dim: int | None) -> int:
    """Key scales an MLA layer caches per K/V head and token: with a per-head k_norm (``key_norm_head_dim``, the head
    width; None without one), each K/V head's 1 / rms for its position-free key dims, when it has any (fewer than
    ``head_dim / 2`` pairs kept rotated); else none."""
    return int(key_norm_head_dim is not None and 2 * int(pairs) < key_norm_head_dim)


def cache_values_per_token(ranks: Sequence[int], kept_pairs: Sequence[int], num_kv_heads: int,
                           key_norm_head_dim: int | None = None) -> int:
    """Numbers an MLA model caches per token over all layers: each layer's latent rank plus the rotated key part
    (``2 * pairs`` dimensions for each of its K/V heads) and, with a per-head k_norm, its key scales
    (``key_scales_per_layer``)."""
    if len(ranks) != len(kept_pairs):
        raise ValueError(f'{len(ranks)} ranks for {len(kept_pairs)} layers of kept pairs')
    return sum(int(rank) + (2 * int(pairs) + key_scales_per_layer(pairs, key_norm_head_dim)) * num_kv_heads
               for rank, pairs in zip(ranks, kept_pairs))


def joint_latent_rows(k_weight: torch.Tensor, v_weight: torch.Tensor, kept_pairs: torch.Tensor, head_dim: int,
                      covariance: torch.Tensor | None = None,
                      balance: str = 'none') -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the rows the latent factors: per head the position-free key rows, then the value rows, in float64; their
    balance scales (``balance_scales``) or None for ``none``). ``latent_energies(rows, covariance, scales)`` is the
    layer's spectrum."""
    if balance not in BALANCES:
        raise ValueError(f'balance must be one of {", ".join(BALANCES)}, got {balance!r}')
    key_nope = k_weight.double()[head_rows(nope_dims(kept_pairs, head_dim), head_dim)]
    scales = (balance_scales(key_nope, v_weight, covariance, balance)
              if balance != 'none' and key_nope.shape[0] else None)
    return torch.cat([key_nope, v_weight.double()]), scales


def mla_layer_weights(k_weight: torch.Tensor, v_weight: torch.Tensor, kept_pairs: torch.Tensor, head_dim: int,
                      rank: int, covariance: torch.Tensor | None = None, balance: str = 'none',
                      k_bias: torch.Tensor | None = None, v_bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One layer's MLA projections from its k_proj/v_proj (kv_heads * head_dim rows): ``k_rope_proj`` (the kept
    pairs' key rows, first halves then second halves per head), ``kv_down_proj`` (rank x hidden) and ``kv_up_proj``
    (per head the position-free key dims, then per head the value dims; x rank), in float64. Biases, when given, go
    to ``k_rope_proj`` and ``kv_up_proj`` exactly (the latent factors only the weights)."""
    rope_rows = head_rows(rope_dims(kept_pairs, head_dim), head_dim)
    nope_rows = head_rows(nope_dims(kept_pairs, head_dim), head_dim)
    joint, scales = joint_latent_rows(k_weight, v_weight, kept_pairs, head_dim, covariance, balance)
    up, down = latent_factors(joint, rank, covariance, scales)
    weights = {'k_rope_proj.weight': k_weight.double()[rope_rows], 'kv_down_proj.weight': down,
               'kv_up_proj.weight': up}
    if (k_bias is None) != (v_bias is None):
        raise ValueError('k_bias and v_bias must be given together')
    if k_bias is not None:
        weights['k_rope_proj.bias'] = k_bias.double()[rope_rows]
        weights['kv_up_proj.bias'] = torch.cat([k_bias.double()[nope_rows], v_bias.double()])
    return weights

"""MHA/GQA attention in DeepSeek's MLA format (transformers' ``DeepseekV3Attention``): the maths, no modules.

DeepSeek's attention caches, per token, a latent ``c = W_a x`` of ``kv_lora_rank`` numbers and ONE rotated key of
``qk_rope_head_dim = 2p`` dims shared by every query head. Query head ``h`` scores key ``t`` by

    q_nope_h . (W_b,k_h n_t) + RoPE(q_rope_h) . RoPE(k_rope_t),     n_t = RMSNorm(c_t) (the latent norm),

and reads the value ``W_b,v_h n_t``. A LLaMA source has ``G`` rotated key heads, each query head reading its own.

**A shared RoPE key (RoRoPE).** RoPE turns pair ``i`` (dims ``i`` and ``i + d/2``) of every K/V head by the same
angle, so mixing the ``G`` heads' pair-``i`` 2-vectors with one real orthogonal ``G x G`` matrix ``R_i`` (the same on
both components) commutes with RoPE. With ``u_i`` the top eigenvector of ``M_i = sum over both components of
E[k_i k_i^T]`` (the pair-``i`` key energy across heads, ``A C A^T + B C B^T`` from the input covariance ``C``),
the key of head ``g`` on pair ``i`` splits exactly into ``u_ig * k'_i`` (the principal rotated head, shared) and the
residual ``k_gi - u_ig * k'_i``. So for the kept pairs:

- the shared RoPE key is ``k'_i = sum_g u_ig k_gi`` and query head ``h`` (of K/V head ``g``) reads it with the query
  pair scaled by ``u_ig``: exact under RoPE;
- the residual joins the position-free key of head ``g`` (its ``d`` dims: the full key on the pairs not kept, the
  residual on the kept ones), and loses RoPE: the approximation, zero for an MQA source (``G = 1``).

**Folded frequencies (FreqFold).** Neighbouring RoPE frequencies turn at nearly the same speed. With a fold of
``F`` slots, ``F`` consecutive slots of the shared key share one principal analysis over every source pair their
frequencies span (``s F`` pairs at stride ``s``, ``G`` heads each): the top ``F`` eigenvectors of the cross-pair key
energy ``M_(i,g),(j,h) = sum over both components of E[k_gi k_hj]`` become the ``F`` slots, each turned at its
slot's frequency (ordered by the energy-weighted mean frequency of what they mix, fastest first). Mixing pairs of
different frequencies is exact only at equal frequencies: the fold trades that error for more key energy kept
rotated (the top ``F`` of ``s F G`` components, against one per slot's own pair without it). A fold of 1 is the
plain per-pair analysis above. (TransMLA's FreqFold, derived here for the strided, shared-key layout.)

**Frequencies.** The class computes ``theta'^(-2k / 2p)``, ``k < p``, from ``rope_theta``, so the kept pairs must
be ``0, s, 2s, ..., (p-1)s`` for a stride ``s``, with ``theta' = theta^(2 p s / d)`` (``s = d / 2p`` keeps
``theta``). The conversion picks the stride whose shared key keeps the most key energy. ``linear`` and ``llama3``
RoPE scaling act per frequency and carry over; YaRN and dynamic scaling do not (refused by the conversion).

**Latent.** The position-free keys and the values of all ``G`` heads are factored jointly as in ``ops.mla``
(activation-aware, balanced), one rank for every layer (the format has one ``kv_lora_rank``).

**Latent norm.** ``n = c / sqrt(mean(c^2) + eps) * w`` divides each token's latent by its own RMS once
``mean(c^2)`` outweighs ``eps``, which no linear map undoes. The default fit keeps the latent where ``eps``
outweighs it instead (the linear range, below); the older fits bound the error:

- a **pin channel** (``pin_channel``): one latent row ``a * v^T x`` with ``v = Sigma^-1 mu`` (``mu``, ``Sigma``: the
  mean and covariance of the attention inputs), the linear read-out of the input whose value varies least
  relative to its mean, scaled to dominate the latent (``PIN_DOMINANCE`` times the other rows' RMS). The RMS of
  the latent is then that channel's value, near-constant over tokens (its coefficient of variation, a few % on
  SmolLM2's layers), so the norm is close to a fixed scale; ``kv_b`` reads nothing from the channel itself. It
  costs one latent dim and needs no bias (engines' ``kv_a_proj_with_mqa`` has none);
- ``kv_b`` is then ``up * E[rms(c)]`` (``scalar``: right on average) or the least-squares regression of the
  source's position-free keys and values on ``n`` over calibration tokens (``regression``, a closed-form refit).

**The norm's linear range** (``linear``, the default fit) removes the approximation instead of bounding it. The norm
is ``c / sqrt(mean(c^2) + eps)``: where ``mean(c^2)`` is small against ``eps`` it is ``c / sqrt(eps)``, linear.
So the latent rows are scaled by ``s`` so that, over the calibration tokens, ``mean(c^2)`` averages
``LINEAR_RANGE * eps``, and ``kv_b`` is ``up / s`` times the mean of ``sqrt(mean((s c)^2) + eps)``: a token's keys
and values are then off by ``1 - sqrt((1 + LINEAR_RANGE) / (1 + r LINEAR_RANGE))`` for a token at ``r`` times the
mean square (under 1% at twice it), and a token far outside the calibration range is bounded, not blown up: its
normed latent has an RMS of at most 1 where the typical one has ``sqrt(LINEAR_RANGE)``. No pin channel is needed and
every latent dim carries keys and values. It reaches what the latent with no norm at all scores, where the pin and
the regression stayed more than a nat above it on 512-token text (docs/methods/mla.md). The latent is small (RMS
``sqrt(LINEAR_RANGE * eps)``, about 1e-4), which float32 and bfloat16 hold at full precision; so are the latent
rows, which is why training rescales them (``latent_training_eps``).

**Scale.** The class scales scores by ``(d + 2p)^-0.5``; the queries are multiplied by ``sqrt((d + 2p) / d)`` so the
scores keep the source's ``d^-0.5``.

Layouts: ``rope_interleave: true`` (DeepSeek's own checkpoints, and what engines assume): the rotated dims are
stored as ``[a_0, b_0, a_1, b_1, ...]`` (pair ``k``'s two components adjacent); ``kv_b_proj`` has, per query head,
its ``d`` key rows then its ``d`` value rows.
"""

from __future__ import annotations

import math

import torch

from dha_train.ops.mla import balance_scales, latent_factors

LATENT_NORM_FITS = ('linear', 'regression', 'scalar')
# the latent's mean square over the norm's eps, averaged over calibration tokens, under the ``linear`` fit: chosen
# on the validation text (docs/methods/mla.md); smaller is more linear, larger keeps the latent further from
# float16's subnormals in llama.cpp's files
LINEAR_RANGE = 0.01
PIN_DOMINANCE = 30.0  # the pin channel's mean over the RMS of the other latent rows: the latent RMS varies < 0.1%
LATENT_NORM_EPS = 1e-6  # DeepseekV3Attention builds kv_a_layernorm with the RMSNorm default, not rms_norm_eps


# llama.cpp's quantized K/V cache types (q8_0, q4_0, ...) store blocks of 32 values: it refuses one for a model whose
# K or V head size is not a multiple (llama_init_from_model: "K cache type q8_0 with block size 32 does not divide").
QUANTIZED_CACHE_BLOCK = 32


def unquantizable_cache(sizes: dict[str, int]) -> str | None:
    """Why llama.cpp cannot quantize a cache with these {name: size} head sizes (None when it can)."""
    bad = [f'{name} {size}' for name, size in sizes.items() if size % QUANTIZED_CACHE_BLOCK]
    if not bad:
        return None
    return f'{" and ".join(bad)} {"is" if len(bad) == 1 else "are"} not a multiple of {QUANTIZED_CACHE_BLOCK}'


def strided_pairs(pairs: int, stride: int) -> list[int]:
    """The pairs a stride keeps: 0, s, ..., (p-1)s."""
    return [k * stride for k in range(pairs)]


def stride_choices(head_dim: int, pairs: int) -> list[int]:
    """Strides whose ``pairs`` kept pairs fit in the ``head_dim / 2`` pairs (1 for a single pair)."""
    half = head_dim // 2
    if not 1 <= pairs <= half:
        raise ValueError(f'the shared RoPE key keeps 1..{half} pairs of a {head_dim}-dim head, got {pairs}')
    return [1] if pairs == 1 else list(range(1, (half - 1) // (pairs - 1) + 1))


def rope_theta_for_stride(theta: float, head_dim: int, pairs: int, stride: int) -> float:
    """The ``rope_theta`` whose ``2 * pairs``-dim RoPE turns at the source's frequencies of the strided pairs."""
    return float(theta) ** (2 * pairs * stride / head_dim)


def fold_spans(slots: list[int], fold: int, stride: int, half: int) -> list[tuple[list[int], list[int]]]:
    """(slot indices, source pairs) of each fold: ``fold`` consecutive slots and every source pair their frequencies
    span (``stride * fold`` pairs from the first slot's, within the head); a fold of 1 reads only its slot's pair."""
    if fold < 1:
        raise ValueError(f'the frequency fold must be at least 1, got {fold}')
    spans = []
    for first in range(0, len(slots), fold):
        members = list(range(first, min(first + fold, len(slots))))
        if fold == 1:
            spans.append((members, [slots[first]]))
        else:
            spans.append((members, list(range(slots[first], min(slots[first] + stride * len(members), half)))))
    return spans


def shared_key_mix(cross: torch.Tensor, slots: list[int], fold: int = 1, stride: int = 1) -> tuple[torch.Tensor,
                                                                                                      float]:
    """(mix (p, pairs, G): slot ``k`` of the shared key is ``sum_(i,g) mix[k, i, g] k_gi``, orthonormal over slots;
    the key energy it keeps) from ``pair_key_cross_energy``. Fold 1: each slot the top eigenvector of its pair's
    energy across heads; fold ``F``: see the module's note on folded frequencies."""
    half, kv_heads = cross.shape[0], cross.shape[1]
    mix = torch.zeros(len(slots), half, kv_heads, dtype=torch.float64, device=cross.device)
    kept = 0.0
    for members, pairs in fold_spans(slots, fold, stride, half):
        index = torch.tensor(pairs, dtype=torch.long, device=cross.device)
        block = cross[index][:, :, index].reshape(len(pairs) * kv_heads, len(pairs) * kv_heads)
        values, vectors = torch.linalg.eigh((block + block.T) / 2)
        top = vectors[:, -len(members):].flip(1).T                                 # (F, pairs * G), largest first
        sign = torch.sign(top.gather(1, top.abs().argmax(1, keepdim=True)))
        top = (top * sign).reshape(len(members), len(pairs), kv_heads)
        weight = top.pow(2).sum(-1)                                                # (F, pairs): where each one lives
        centre = weight @ index.double() / weight.sum(1)
        for member, component in zip(members, centre.argsort().tolist()):
            mix[member, index] = top[component]
        kept += float(values[-len(members):].clamp_min(0.0).sum())
    return mix, kept


def _interleave(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Rows ``[first_0, second_0, first_1, second_1, ...]`` (DeepSeek's interleaved RoPE layout)."""
    return torch.stack([first, second], dim=1).reshape(-1, first.shape[-1])


def pin_channel(down: torch.Tensor, covariance: torch.Tensor, inputs: torch.Tensor,
                ridge: float = 0.1) -> torch.Tensor:
    """(hidden,) the pin row: ``a * (Sigma + ridge)^-1 mu``, with ``mu`` and ``Sigma`` the mean and covariance of the
    sampled attention inputs (tokens, hidden), scaled to ``PIN_DOMINANCE`` times the RMS over tokens of the latent
    rows ``down`` (under ``C = E[x x^T]``).
    The ridge (relative to the mean variance) keeps the direction off the inputs' rarest directions: unregularised,
    it fits the calibration tokens and fails on new ones (SmolLM2's layer 0: 2.6x the keys' and values' energy in
    error on held-out tokens, against 1.4% at 0.1)."""
    inputs = inputs.double()
    mean, spread = inputs.mean(0), torch.cov(inputs.T)
    spread = spread + ridge * spread.diagonal().mean() * torch.eye(spread.shape[0], dtype=torch.float64,
                                                                            device=spread.device)
    direction = torch.linalg.solve(spread, mean)
    level = float(direction @ mean)
    if level <= 0:
        raise ValueError('the attention inputs have no mean to pin the latent norm to')
    rest = float(torch.einsum('rh,hj,rj->', down.double(), covariance, down.double()).clamp_min(1e-30).sqrt())
    return direction * (PIN_DOMINANCE * rest / level)


def deepseek_attention_weights(q_weight: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor,
                               num_heads: int, kv_heads: int, head_dim: int, mix: torch.Tensor,
                               rank: int, covariance: torch.Tensor | None = None,
                               balance: str = 'energy',
                               pin_inputs: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One layer in float64: ``q_proj`` (H * (d + 2p) rows: per head its d position-free then 2p interleaved
    rotated rows, scaled for the class's ``(d + 2p)^-0.5``), ``kv_a_proj_with_mqa`` (the latent's ``rank`` rows,
    then the shared rotated key's 2p interleaved rows), ``up`` (per K/V head its d position-free key rows, then per
    K/V head its d value rows; x rank: ``kv_b_proj`` before the latent norm, see ``kv_b_weight``) and ``targets``
    (the same rows as maps of the input, un-factored: what ``up @ latent`` approximates). With ``pin_inputs``
    (sampled attention inputs; needs ``covariance``) the last latent row is the pin channel (``pin_channel``), whose
    column of ``up`` is 0, and the factorisation gets ``rank - 1``. ``mix`` (p, d/2, G) makes the shared key's
    slots from the source's pairs (``shared_key_mix``)."""
    half = head_dim // 2
    group = num_heads // kv_heads
    keys = k_weight.double().reshape(kv_heads, head_dim, -1)
    queries = q_weight.double().reshape(num_heads, head_dim, -1)
    mix = mix.double().to(keys.device)
    shared_first = torch.einsum('kig,gih->kh', mix, keys[:, :half])             # (p, hidden)
    shared_second = torch.einsum('kig,gih->kh', mix, keys[:, half:])
    nope_keys = keys.clone()                                                    # what the shared key leaves out
    nope_keys[:, :half] -= torch.einsum('kig,kh->gih', mix, shared_first)
    nope_keys[:, half:] -= torch.einsum('kig,kh->gih', mix, shared_second)
    targets = torch.cat([nope_keys.reshape(kv_heads * head_dim, -1), v_weight.double()])
    scales = None
    if balance != 'none':
        scales = balance_scales(targets[:kv_heads * head_dim], targets[kv_heads * head_dim:], covariance, balance)
    pinned = pin_inputs is not None
    if pinned and (covariance is None or rank < 2):
        raise ValueError('a pin channel needs the input covariance and a rank of at least 2')
    up, down = latent_factors(targets, rank - 1 if pinned else rank, covariance, scales)
    if pinned:
        down = torch.cat([down, pin_channel(down, covariance, pin_inputs)[None]])
        up = torch.cat([up, torch.zeros(up.shape[0], 1, dtype=up.dtype, device=up.device)], dim=1)

    kv_of_query = torch.arange(num_heads, device=keys.device) // group
    query_mix = mix.permute(2, 0, 1)[kv_of_query]                               # (H, p, d/2): each head's K/V head's
    rope_queries = torch.stack([_interleave(query_mix[h] @ queries[h, :half], query_mix[h] @ queries[h, half:])
                                for h in range(num_heads)])                    # (H, 2p, hidden)
    rope_dim = 2 * mix.shape[0]
    score_scale = math.sqrt((head_dim + rope_dim) / head_dim)
    q_proj = torch.cat([queries, rope_queries], dim=1).reshape(num_heads * (head_dim + rope_dim), -1) * score_scale
    kv_a = torch.cat([down, _interleave(shared_first, shared_second)])
    return {'q_proj.weight': q_proj, 'kv_a_proj_with_mqa.weight': kv_a, 'up': up, 'targets': targets}


def latent_eps_scale(to_eps: float, from_eps: float = LATENT_NORM_EPS) -> float:
    """The factor ``s`` on the latent rows under which an RMSNorm with ``to_eps`` gives what one with ``from_eps``
    gives on the unscaled latent: ``s c / sqrt(mean((s c)^2) + to_eps) = c / sqrt(mean(c^2) + from_eps)`` for
    ``s = sqrt(to_eps / from_eps)``, exactly (engines' own eps, and the training form below)."""
    return math.sqrt(to_eps / from_eps)


def scale_latent_rows(kv_a_weight: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """``kv_a_proj_with_mqa.weight`` with its first ``rank`` rows (the latent) times ``scale``, the RoPE rows as
    they are (a new tensor)."""
    return torch.cat([kv_a_weight[:rank] * scale, kv_a_weight[rank:]])


def latent_training_eps(kv_a_weight: torch.Tensor, rank: int) -> float:
    """The latent norm's eps for training a layer whose ``kv_a_proj_with_mqa.weight`` has the latent in its first
    ``rank`` rows: the eps under which those rows, scaled by ``latent_eps_scale(eps)``, have the RMS of the RoPE
    rows below them, so the model computes the same function. Why: a latent in the norm's linear range has rows a
    few thousand times smaller than the others, and an Adam step moves every weight by about the learning rate
    whatever its size, which would throw the latent out of that range at the first step; at the training eps the
    rows train at the scale of every other weight. ``LATENT_NORM_EPS`` when either part is zero."""
    weight = kv_a_weight.double()
    latent, rope = weight[:rank].pow(2).mean().sqrt(), weight[rank:].pow(2).mean().sqrt()
    if float(latent) == 0.0 or weight.shape[0] <= rank or float(rope) == 0.0:
        return LATENT_NORM_EPS
    return LATENT_NORM_EPS * float(rope / latent) ** 2


def rms_normed(latent: torch.Tensor, eps: float = LATENT_NORM_EPS) -> torch.Tensor:
    """``c / sqrt(mean(c^2) + eps)`` per token (row): the latent norm with weight 1."""
    return latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps)


def linear_range_scale(down: torch.Tensor, inputs: torch.Tensor, eps: float = LATENT_NORM_EPS) -> float:
    """The factor ``s`` on the latent rows ``down`` (x hidden) that puts the mean over the sampled attention inputs
    (tokens, hidden) of ``mean((s c)^2)`` at ``LINEAR_RANGE * eps``: the norm's linear range."""
    mean_square = float((inputs.double() @ down.double().T).pow(2).mean())
    if mean_square <= 0:
        raise ValueError('the latent is zero on every calibration token; nothing to scale into the norm')
    return math.sqrt(LINEAR_RANGE * eps / mean_square)


def latent_norm_fit(fit: str, up: torch.Tensor, down: torch.Tensor, targets: torch.Tensor,
                    inputs: torch.Tensor, ridge: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(the latent rows, the rows ``kv_b`` maps the normed latent with: one per row of ``up``, x rank), from sampled
    attention inputs (tokens, hidden): ``linear``: ``down`` scaled into the norm's linear range
    (``linear_range_scale``), then ``scalar`` on it; ``scalar``: ``down``, ``up * mean_t rms(c_t)``;
    ``regression``: ``down``, ``argmin sum_t ||targets x_t - B n_t||^2`` (ridge relative to the mean eigenvalue, for
    rank-deficient samples)."""
    if fit not in LATENT_NORM_FITS:
        raise ValueError(f'latent norm fit must be one of {", ".join(LATENT_NORM_FITS)}, got {fit!r}')
    down, up = down.double(), up.double()
    if fit == 'linear':
        scale = linear_range_scale(down, inputs)
        down, up = down * scale, up / scale
    latent = inputs.double() @ down.T                                           # (tokens, rank)
    if fit in ('linear', 'scalar'):
        rms = latent.pow(2).mean(-1).add(LATENT_NORM_EPS).sqrt().mean()
        return down, up * rms
    normed = rms_normed(latent)
    gram = normed.T @ normed
    gram = gram + ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=torch.float64, device=gram.device)
    cross = (inputs.double() @ targets.double().T).T @ normed                    # (rows, rank)
    return down, torch.linalg.solve(gram, cross.T).T


def normed_latent_error(targets: torch.Tensor, down: torch.Tensor, rows: torch.Tensor, inputs: torch.Tensor) -> float:
    """The relative error, over input rows (tokens, hidden), of the keys and values read through the latent norm:
    ``sum ||targets x - rows n(down x)||^2 / sum ||targets x||^2``."""
    truth = inputs.double() @ targets.double().T
    predicted = rms_normed(inputs.double() @ down.double().T) @ rows.double().T
    return float((predicted - truth).pow(2).sum() / truth.pow(2).sum().clamp_min(1e-30))


def kv_b_weight(rows: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``kv_b_proj.weight`` (H * 2d, rank) from per-K/V-head rows (``up`` layout: G key blocks then G value blocks):
    each query head gets its K/V head's key rows then value rows."""
    keys = rows[:kv_heads * head_dim].reshape(kv_heads, head_dim, -1)
    values = rows[kv_heads * head_dim:].reshape(kv_heads, head_dim, -1)
    kv_of_query = torch.arange(num_heads, device=rows.device) // (num_heads // kv_heads)
    return torch.cat([keys[kv_of_query], values[kv_of_query]], dim=1).reshape(num_heads * 2 * head_dim, -1)

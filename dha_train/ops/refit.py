"""Closed-form refit of compressed attention to its source, per layer, from the attention input's second moment.

Everything here works on one layer's projection weights (nn.Linear layout, as in ``ops/heads.py``) and on
``gram = E[x x^T]``, the uncentred second moment of the normed hidden state that enters the attention (calibration's
``input`` kind, recorded on the SOURCE model: the fit is teacher-forced). Nothing depends on the number of
calibration tokens beyond that (hidden x hidden) matrix.

Keys. A query head h reads source key head s(h); after conversion it reads a compact key head g shared with other
query heads. LLaMA's RoPE pairs dimension i with i + d/2 (``rotate_half``); as a complex number per pair p,
z = k_i + j k_{i+d/2}, RoPE multiplies queries and keys by unit phases, and a pair's logit is Re(z_q conj(z_k)).
A per-pair complex scale on the query therefore commutes with RoPE. For every compact key head g and pair p we fit

    min over k_g (a linear map of x) and u_m (one complex number per member m = source key head of g's queries)
        sum_m e_m E|k_m - u_m k_g|^2,     e_m = sum of E|q_h|^2 over g's query heads reading m,

which is the expected squared logit error when query and key tokens are independent (the weights are the query
energies). Its optimum is a weighted complex rank-1 approximation: the top eigenvector w of S = D G D, with
G[m, n] = E[k_m conj(k_n)] and D = diag(sqrt(e)), gives k_g = sum_m conj(w_m) sqrt(e_m) k_m and
u_m = w_m / sqrt(e_m). Each query head folds conj(u_m) into its pair rows (a 2x2 rotation and scale). The
objective left over is tr(S) - lambda_max: zero when the members' keys are equal up to a per-pair complex scale
(in particular one member: the identity budget).

Values and outputs. Query head h adds T_h x = O_h V_s(h) x to the residual stream (per token, before the attention
mixes tokens). For a compact value head g we fit one value projection V'_g and an output block O'_h per query head:

    min sum_{h in g} E || (T_h - O'_h V'_g) x ||^2.

With gram = L L^T, the optimum row space of V'_g L is the top-d eigenvectors U of L^T (sum_h T_h^T T_h) L, so
V'_g = U^T L^-1 (values whitened: V'_g gram V'_g^T = I) and O'_h = T_h L U. Exact when the heads of a group share
one value head up to an invertible map. The same fit onto a latent z = A x (MLA) first regresses each value head
on z (``regress_onto_latent``) and then solves the problem above in z's second moment.

Biases. A projection with a bias is one more column of its weight against an input with a constant 1 appended:
``augmented_gram`` is E[x' x'^T] for x' = [x; 1], and every fit above runs unchanged on [W | b] rows in it.

Per-head key norms (``key_metric``; Qwen3, Gemma 3: k_norm and q_norm over each head, before RoPE). The target is
the key BEFORE k_norm, each member head scaled to unit mean RMS: the norm removes each token's key scale, so only
the direction matters, and the per-pair complex scale above cannot be folded into the queries (q_norm's per-dimension
weight does not commute with a rotation in a pair). The fit is the real rank-1 one: a shared key k_g with
member m's key about s_m k_g, whose magnitude |s_m| the norms remove and whose sign is folded into the member's query
heads (q_norm commutes with a sign). Dimensions are weighted by the product of the squared q_norm and k_norm
weights (the post-norm logit's weights), members by their number of query heads (q_norm equalises the query
energies). The per-token RMS is replaced by its mean over the calibration tokens: an approximation, exact when the
members' keys are equal up to a positive scale (then the refit is the identity).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dha_train.ops.heads import split_heads

EIGEN_FLOOR = 1e-10  # relative floor on the second moment's eigenvalues (a direction no token used)


def output_blocks(o_weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """An o_proj weight (D_out, heads * d) as its per-head blocks (heads, D_out, d)."""
    return split_heads(o_weight.T, head_dim).transpose(1, 2)


def output_weight(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of ``output_blocks``: (heads, D_out, d) -> (D_out, heads * d)."""
    return blocks.transpose(1, 2).reshape(-1, blocks.shape[1]).T


def _complex_pairs(heads: torch.Tensor) -> torch.Tensor:
    """(heads, d, D) real rows -> (heads, d/2, D) complex rows, pair p = row p + j row p + d/2."""
    half = heads.shape[1] // 2
    return torch.complex(heads[:, :half], heads[:, half:])


def _real_rows(pairs: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_complex_pairs``: (heads, d/2, D) complex -> (heads, d, D) real."""
    return torch.cat([pairs.real, pairs.imag], dim=1)


def pair_energy(rows: torch.Tensor, gram: torch.Tensor, head_dim: int) -> torch.Tensor:
    """E|z_p|^2 for every head and RoPE pair of a q/k projection: (heads, d/2)."""
    heads = split_heads(rows.double(), head_dim)
    projected = heads @ gram.double()
    per_dim = (projected * heads).sum(-1)  # E[(w . x)^2] per row
    half = head_dim // 2
    return per_dim[:, :half] + per_dim[:, half:]


@dataclass
class KeyFit:
    rows: torch.Tensor          # (d, D) the compact key head
    scales: torch.Tensor        # (members, d/2) complex u_m: member m's key is about u_m * k_g
    residual: float             # the weighted objective left over, sum over pairs of tr(S) - lambda_max
    total: float                # sum over pairs of tr(S): the objective of a zero key


def fit_shared_key(member_rows: torch.Tensor, weights: torch.Tensor, gram: torch.Tensor) -> KeyFit:
    """One compact key head from its members' key rows (members, d, D) and query-energy weights (members, d/2)."""
    members, head_dim, _ = member_rows.shape
    if head_dim % 2:
        raise ValueError(f'RoPE needs an even head_dim, got {head_dim}')
    z = _complex_pairs(member_rows.double())                      # (M, P, D)
    gram_c = gram.to(torch.complex128)
    cross = torch.einsum('mpd,de,npe->pmn', z, gram_c, z.conj())  # G[p, m, n] = E[k_m conj(k_n)]
    weights = weights.double().clamp_min(0).T                       # (P, M)
    floor = weights.amax(dim=1, keepdim=True).clamp_min(1e-30) * 1e-12
    root = weights.clamp_min(floor).sqrt()
    weighted = root[:, :, None] * cross * root[:, None, :]          # S = D G D
    weighted = 0.5 * (weighted + weighted.conj().transpose(1, 2))
    values, vectors = torch.linalg.eigh(weighted)
    top, w = values[:, -1].real.clamp_min(0), vectors[:, :, -1]      # (P,), (P, M)
    # Phase: make sum_m conj(w_m) sqrt(e_m) real and positive, so equal members give k_g = their key, not a rotation.
    anchor = (w.conj() * root).sum(dim=1)
    phase = torch.where(anchor.abs() > 1e-30, anchor / anchor.abs().clamp_min(1e-30), torch.ones_like(anchor))
    w = w * phase[:, None]
    # Scale: the shared key keeps the members' mean energy E|k|^2, so a later trained model sees familiar magnitudes.
    mean_energy = torch.diagonal(cross, dim1=1, dim2=2).real.mean(dim=1)
    scale = torch.where(top > 1e-30, (mean_energy / top.clamp_min(1e-30)).sqrt(), torch.ones_like(top))
    coefficients = w.conj() * root * scale[:, None]                  # (P, M): k_g = sum_m c_m k_m
    shared = torch.einsum('pm,mpd->pd', coefficients, z)
    scales = (w / (root * scale[:, None].clamp_min(1e-30))).T        # (M, P)
    total = torch.diagonal(weighted, dim1=1, dim2=2).real.sum(dim=1)
    return KeyFit(_real_rows(shared[None])[0], scales, float((total - top).clamp_min(0).sum()), float(total.sum()))


def scale_query_pairs(query_rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A query head's rows (d, D) with pair p multiplied by conj(scales[p]): its logit against u * k_g equals the
    original logit against k_g's member, and RoPE commutes with the per-pair complex scale."""
    z = _complex_pairs(query_rows.double()[None])[0]
    return _real_rows((z * scales.conj()[:, None])[None])[0]


def augmented_gram(gram: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """E[x' x'^T] for x' = [x; 1] from E[x x^T] and E[x]: the second moment against which a projection with a bias,
    as rows [W | b], is fitted."""
    gram, mean = gram.double(), mean.double()
    top = torch.cat([gram, mean[:, None]], dim=1)
    return torch.cat([top, torch.cat([mean, mean.new_ones(1)])[None]], dim=0)


@dataclass
class NormedKeyFit:
    rows: torch.Tensor      # (d, D) the compact key head (before k_norm)
    signs: torch.Tensor     # (members,) +-1: member m's normed key is about sign_m times the shared one's
    residual: float         # the weighted objective left over
    total: float            # the objective of a zero key


def _unit_rms_heads(member_rows: torch.Tensor, gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(members' rows scaled to unit mean RMS over the tokens, their raw energies E||k_m||^2)."""
    energy = torch.einsum('mid,de,mie->m', member_rows, gram, member_rows)
    scale = (energy / member_rows.shape[1]).clamp_min(1e-30).sqrt()
    return member_rows / scale[:, None, None], energy


def fit_shared_normed_key(member_rows: torch.Tensor, counts: torch.Tensor, gram: torch.Tensor,
                          metric: torch.Tensor) -> NormedKeyFit:
    """One compact key head of a per-head-normed family (module docstring) from its members' key rows
    (members, d, D), their query-head counts (members,) and the per-dimension weights ``metric`` (d,)."""
    gram = gram.double()
    rows, energy = _unit_rms_heads(member_rows.double(), gram)
    weighted = rows * metric.double().clamp_min(0).sqrt()[None, :, None]
    cross = torch.einsum('mid,de,nie->mn', weighted, gram, weighted)
    root = counts.double().clamp_min(0).sqrt()
    moment = root[:, None] * cross * root[None, :]
    values, vectors = torch.linalg.eigh(0.5 * (moment + moment.T))
    top, w = values[-1].clamp_min(0), vectors[:, -1]
    if float((w * root).sum()) < 0:  # equal members give their own key, not its negative
        w = -w
    shared = torch.einsum('m,mid->id', w * root, rows)
    shared_energy = torch.einsum('id,de,ie->', shared, gram, shared)
    # the shared key keeps the members' mean energy: the norm's eps then acts on it as on theirs
    shared = shared * (energy.mean() / shared_energy.clamp_min(1e-30)).sqrt()
    signs = torch.where(w >= 0, 1.0, -1.0).to(torch.float64)
    total = float(torch.trace(moment))
    return NormedKeyFit(shared, signs, max(total - float(top), 0.0), total)


def normed_key_error(member_rows: torch.Tensor, counts: torch.Tensor, key_rows: torch.Tensor, gram: torch.Tensor,
                     metric: torch.Tensor) -> tuple[float, float]:
    """(objective, objective of a zero key) of ``fit_shared_normed_key`` for a given compact key's rows (d, D), with
    each member's best scale and sign."""
    gram = gram.double()
    rows, _ = _unit_rms_heads(member_rows.double(), gram)
    root_metric = metric.double().clamp_min(0).sqrt()
    weighted, key = rows * root_metric[None, :, None], key_rows.double() * root_metric[:, None]
    own = torch.einsum('mid,de,mie->m', weighted, gram, weighted)
    cross = torch.einsum('mid,de,ie->m', weighted, gram, key)
    key_energy = torch.einsum('id,de,ie->', key, gram, key).clamp_min(1e-30)
    counts = counts.double()
    total = float((counts * own).sum())
    return max(float((counts * (own - cross ** 2 / key_energy)).sum()), 0.0), total


def whitening(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, L^-1) with gram = L L^T, from the eigendecomposition; eigenvalues under EIGEN_FLOOR x the largest are
    raised to it, so a direction no calibration token used costs a bounded, not an infinite, weight."""
    values, vectors = torch.linalg.eigh(gram.double())
    values = values.clamp_min(values.max().clamp_min(1e-30) * EIGEN_FLOOR)
    return vectors * values.sqrt(), (vectors / values.sqrt()).T


@dataclass
class ValueOutputFit:
    rows: torch.Tensor              # (d, D_in) the compact value head
    output_columns: torch.Tensor    # (heads, D_out, d) the o_proj block of each query head of the group
    residual: float                 # sum_h E||(T_h - O'_h V') x||^2
    total: float                    # sum_h E||T_h x||^2


def fit_shared_value(value_rows: torch.Tensor, output_columns: torch.Tensor, gram: torch.Tensor) -> ValueOutputFit:
    """One compact value head for a group of query heads. ``value_rows`` (heads, d, D_in): the source value rows
    each query head read; ``output_columns`` (heads, D_out, d): its o_proj block; ``gram``: E[x x^T] of the input."""
    values_src, outputs = value_rows.double(), output_columns.double()
    head_dim = values_src.shape[1]
    root, root_inverse = whitening(gram)
    # sum_h T_h^T T_h = sum_h V_h^T (O_h^T O_h) V_h, formed from d x d blocks (never D_out x D_in per head)
    reach = outputs.transpose(1, 2) @ outputs                        # (heads, d, d)
    whitened = values_src @ root                                      # V_h L: (heads, d, D_in)
    moment = torch.einsum('hid,hij,hje->de', whitened, reach, whitened)
    moment = 0.5 * (moment + moment.T)
    eigenvalues, eigenvectors = torch.linalg.eigh(moment)
    kept = min(head_dim, moment.shape[0])  # an input narrower than the head (a small MLA latent) caps the rank
    basis = eigenvectors[:, -kept:]                                   # U: (D_in, kept)
    rows = basis.T @ root_inverse
    new_outputs = outputs @ (whitened @ basis)                        # O_h V_h L U: (heads, D_out, kept)
    if kept < head_dim:  # the value head keeps its width; the spare dims carry nothing
        rows = torch.cat([rows, rows.new_zeros(head_dim - kept, rows.shape[1])])
        new_outputs = torch.cat([new_outputs, new_outputs.new_zeros(*new_outputs.shape[:2], head_dim - kept)], dim=2)
    total = float(eigenvalues.clamp_min(0).sum())
    residual = float(eigenvalues[:-kept].clamp_min(0).sum()) if kept < moment.shape[0] else 0.0
    return ValueOutputFit(rows, new_outputs, residual, total)


def regress_onto_latent(rows: torch.Tensor, gram: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares map from a latent z = down @ x to ``rows`` @ x: returns (rows C A^T (A C A^T)^-1, A C A^T),
    the regression and the latent's second moment (C = gram, A = down)."""
    gram, down = gram.double(), down.double()
    latent_gram = down @ gram @ down.T
    latent_gram = 0.5 * (latent_gram + latent_gram.T)
    _, root_inverse = whitening(latent_gram)
    inverse = root_inverse.T @ root_inverse
    return rows.double() @ gram @ down.T @ inverse, latent_gram


# --- errors of an attention layer against its source (the same objectives, for any weights) ---------------------

def logit_error(source_query: torch.Tensor, source_key: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                gram: torch.Tensor) -> tuple[float, float]:
    """(sum over pairs of E|q conj(k) - q' conj(k')|^2, sum of E|q conj(k)|^2) for one query head's rows (d, D) and
    its key head's rows, source against converted, with query and key tokens drawn independently from ``gram``.
    With z = x_q^T A x_k for complex A = alpha beta^H, E|z|^2 = (alpha^H C alpha)(beta^H C beta) (real C)."""
    gram_c = gram.to(torch.complex128)
    a, b = (_complex_pairs(m.double()[None])[0] for m in (source_query, source_key))
    a2, b2 = (_complex_pairs(m.double()[None])[0] for m in (query, key))

    def form(x, y):  # per pair x^H C y
        return torch.einsum('pd,de,pe->p', x.conj(), gram_c, y)

    reference = (form(a, a) * form(b, b)).real
    cross = (form(a, a2) * form(b2, b)).real
    error = reference - 2 * cross + (form(a2, a2) * form(b2, b2)).real
    return float(error.clamp_min(0).sum()), float(reference.sum())


def value_output_error(source_value: torch.Tensor, source_output: torch.Tensor, value: torch.Tensor,
                       output: torch.Tensor, gram: torch.Tensor) -> tuple[float, float]:
    """(E||(O V - O' V') x||^2, E||O V x||^2) for one query head: value rows (d, D_in), output block (D_out, d)."""
    gram = gram.double()
    v, o, v2, o2 = (m.double() for m in (source_value, source_output, value, output))
    reference = torch.trace((o.T @ o) @ (v @ gram @ v.T))
    cross = torch.trace((o2.T @ o) @ (v @ gram @ v2.T))
    converted = torch.trace((o2.T @ o2) @ (v2 @ gram @ v2.T))
    return float((reference - 2 * cross + converted).clamp_min(0)), float(reference)


def group_members(query_source: Sequence[int], source_kv_of_query: Sequence[int], compact_of_query: Sequence[int]
                  ) -> list[list[tuple[int, list[int]]]]:
    """For each compact head g, its members: (source K/V head, the converted query heads of g that read it)."""
    groups: dict[int, dict[int, list[int]]] = {}
    for head, compact in enumerate(compact_of_query):
        source_head = source_kv_of_query[query_source[head]]
        groups.setdefault(compact, {}).setdefault(source_head, []).append(head)
    return [list(groups[g].items()) for g in sorted(groups)]


@dataclass
class LayerRefit:
    q: torch.Tensor  # (heads * d, D)
    k: torch.Tensor  # (compact key heads * d, D)
    v: torch.Tensor  # (compact value heads * d, D)
    o: torch.Tensor  # (D_out, heads * d)
    key_residual: float
    key_total: float
    value_residual: float
    value_total: float


def refit_head_map_layer(source: dict[str, torch.Tensor], gram: torch.Tensor, head_dim: int, *,
                         source_kv_of_query: Sequence[int], query_source: Sequence[int],
                         key_of_query: Sequence[int], value_of_query: Sequence[int],
                         value_gram: torch.Tensor | None = None, key_metric: torch.Tensor | None = None) -> LayerRefit:
    """Refit one layer of a head-mapped model (GQA, AsymGQA, DHA: any key and value maps) to its source.

    ``source``: the source layer's ``q``, ``k``, ``v``, ``o`` weights; ``source_kv_of_query[s]``: the source K/V head
    of source query head s; ``query_source[h]``: the source query head that converted query head h derives from;
    ``key_of_query`` / ``value_of_query``: the converted map. Returns the converted layer's weights, in its order.
    ``q``/``k`` rows have ``gram``'s width and ``v`` rows ``value_gram``'s (default ``gram``): with biases, the
    augmented ones (``augmented_gram``). ``key_metric`` (d,): the family normalises each query and key head
    (``fit_shared_normed_key``; queries then get only signs).
    """
    value_gram = gram if value_gram is None else value_gram
    q_heads = split_heads(source['q'].double(), head_dim)
    if sorted(query_source) != list(range(q_heads.shape[0])):
        raise ValueError(f'query_source {list(query_source)} must be a permutation of the {q_heads.shape[0]} heads')
    k_heads = split_heads(source['k'].double(), head_dim)
    v_heads = split_heads(source['v'].double(), head_dim)
    o_blocks = output_blocks(source['o'].double(), head_dim)           # (heads, D_out, d)
    query_energy = pair_energy(source['q'], gram, head_dim)              # per source query head
    new_q = q_heads[list(query_source)].clone()
    new_o = o_blocks[list(query_source)].clone()
    keys, key_residual, key_total = [], 0.0, 0.0
    for members in group_members(query_source, source_kv_of_query, key_of_query):
        rows = torch.stack([k_heads[source_head] for source_head, _ in members])
        if key_metric is not None:
            counts = torch.tensor([len(readers) for _, readers in members], dtype=torch.float64)
            normed = fit_shared_normed_key(rows, counts, gram, key_metric)
            keys.append(normed.rows)
            key_residual, key_total = key_residual + normed.residual, key_total + normed.total
            for index, (_, readers) in enumerate(members):
                for head in readers:
                    new_q[head] = q_heads[query_source[head]] * normed.signs[index]
            continue
        weights = torch.stack([query_energy[[query_source[h] for h in readers]].sum(0) for _, readers in members])
        fit = fit_shared_key(rows, weights, gram)
        keys.append(fit.rows)
        key_residual, key_total = key_residual + fit.residual, key_total + fit.total
        for index, (_, readers) in enumerate(members):
            for head in readers:
                new_q[head] = scale_query_pairs(q_heads[query_source[head]], fit.scales[index])
    values, value_residual, value_total = [], 0.0, 0.0
    for members in group_members(query_source, source_kv_of_query, value_of_query):
        readers = [head for _, group in members for head in group]
        fit = fit_shared_value(torch.stack([v_heads[source_kv_of_query[query_source[h]]] for h in readers]),
                               o_blocks[[query_source[h] for h in readers]], value_gram)
        values.append(fit.rows)
        value_residual, value_total = value_residual + fit.residual, value_total + fit.total
        for index, head in enumerate(readers):
            new_o[head] = fit.output_columns[index]
    return LayerRefit(new_q.reshape(-1, new_q.shape[-1]), torch.cat(keys), torch.cat(values), output_weight(new_o),
                      key_residual, key_total, value_residual, value_total)

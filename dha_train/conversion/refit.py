"""Refit a converted model to its source from calibration statistics alone (``dha-train refit``).

The source is run over ``tokens`` tokens of the data (teacher-forced: every layer sees the source's own hidden
states) and the second moment of each layer's attention input is kept (calibration's ``input`` kind: one
hidden x hidden Gram per layer, so memory does not grow with the tokens). Then, per layer, in closed form
(``dha_train.ops.refit``):

- head-mapped models (mean-pool GQA, aligned GQA, AsymGQA, DHA; plain LLaMA or the DHA class): each compact key head
  is the query-energy-weighted complex rank-1 fit of its members' keys per RoPE pair, with a 2x2 rotation-and-scale
  folded into each query head; each compact value head and the o_proj blocks of its query heads are the
  activation-weighted fit of the source's value-output maps;
- MLA: with the latent down-projection kept, the position-free key up-projection is regressed on the latent and the
  value up-projection is refitted jointly with o_proj (the source's value-output maps regressed on the latent).

Every family (``dha_train.families``) is refitted in its own class. Projection biases (Qwen2's q/k/v, LLaMA's
optional ones) are fitted as one more column against the input with a 1 appended (``ops.refit.augmented_gram``),
so the refitted K/V heads keep their biases. With per-head q/k norms (Qwen3, Gemma 3) the key target is the key
before k_norm, each member head at unit mean RMS, fitted up to a scale and a sign (``ops.refit``'s docstring): the
norms remove the scale, the sign goes into the query heads, and the norm weights themselves are kept. An MLA folder
of a source with biases or per-head norms is refused (its latent regression has neither).

Every other weight (embeddings, MLP, norms, the MLA latent and RoPE key projections) is the converted folder's.
Which source query head each converted head comes from is read off the query weights (mean-pool keeps them,
aligned GQA permutes heads and rotates RoPE pairs, both of which leave each pair's B^T B unchanged); for MLA, the
FreqFold re-basis of each K/V head's pairs is read off them (least squares) and applied to the source's keys. MoH
keeps every K/V head, so there is nothing to refit: refused.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dha_train import families
from dha_train.calibration import calibrate, calibration_batches, load_source_model
from dha_train.config import ConfigError
from dha_train.errors import DhaTrainError
from dha_train.methods import kv_cache_bytes
from dha_train.model_card import card_stage, write_model_card
from dha_train.model_folders import (
    SOURCE_MODEL_TYPES,
    check_model_folder,
    load_causal_lm,
    load_model_config,
    load_source_config,
)
from dha_train.models.head_map import HEAD_MAP_FILE, HeadMap, source_head_map
from dha_train.models.llama_layout import attention_modules
from dha_train.ops import refit as fit
from dha_train.ops.heads import split_heads
from dha_train.ops.mla import mix_head_pairs, nope_dims, recovered_pair_bases
from dha_train.paths import refuse_nonempty, staged_folder

REFIT_REPORT = 'refit.json'
REFITTABLE = (*families.supported(), 'dha_llama', 'mla_llama')
# Converted models that have nothing for this command to do, and why (the message names what to run instead).
NOT_REFITTED_HERE = {
    'moh_llama': 'MoH keeps every K/V head of its source (it routes query heads), so there is no compressed '
                 'attention to refit; heal it with distillation instead',
    'deepseek_v3': 'a DeepSeek-format MLA folder is refitted by its conversion (`convert --format deepseek` regresses '
                   'kv_b_proj on the normed latent, --latent-norm-fit regression, the default); heal it from '
                   'attention transfer (launch/heal.sh skips the refit for it)',
}
# A converted query head whose per-pair B^T B differs from every source head's by more than this (relative) was not
# made from that source.
MATCH_TOLERANCE = 0.25


class RefitError(DhaTrainError, ValueError):
    """The converted folder cannot be refitted to the source given."""


@dataclass
class RefitSettings:
    data: str
    tokens: int = 16384
    batch_size: int = 8
    seed: int = 0
    device: str = 'cpu'


def match_query_heads(source_q: torch.Tensor, converted_q: torch.Tensor, head_dim: int) -> tuple[list[int], float]:
    """(source query head of each converted head, the largest relative mismatch). Heads are compared by B_p^T B_p
    per RoPE pair p (B_p: the pair's 2 x D rows), which mean-pooling keeps and a RoPE-commuting rotation of the pair
    leaves unchanged; head permutations only reorder them. Greedy on the globally smallest distance, which is exact
    when the heads were copied."""
    def pairs(rows):  # (heads, P, 2, D)
        heads = rows.double().reshape(-1, head_dim, rows.shape[1])
        half = head_dim // 2
        return torch.stack([heads[:, :half], heads[:, half:]], dim=2)

    src, conv = pairs(source_q), pairs(converted_q)
    square = lambda a, b: torch.einsum('hpid,gpjd->hgpij', a, b).pow(2).sum((-1, -2))  # noqa: E731  ||B B'^T||^2
    own_src = torch.diagonal(square(src, src), dim1=0, dim2=1).T          # (S, P): ||B^T B||_F^2
    own_conv = torch.diagonal(square(conv, conv), dim1=0, dim2=1).T       # (C, P)
    cross = square(conv, src)                                             # (C, S, P)
    distance_sq = (own_conv[:, None, :] + own_src[None, :, :] - 2 * cross).sum(-1).clamp_min(0)
    distance = (distance_sq / own_src.sum(-1).clamp_min(1e-30)[None, :]).sqrt()
    order, mismatch = [-1] * conv.shape[0], 0.0
    taken = distance.clone()
    for _ in range(conv.shape[0]):
        flat = int(torch.argmin(taken))
        head, source = divmod(flat, taken.shape[1])
        order[head] = source
        mismatch = max(mismatch, float(distance[head, source]))
        taken[head, :] = float('inf')
        taken[:, source] = float('inf')
    return order, mismatch


def _check_pair(source_config, converted_config) -> None:
    for key in ('num_hidden_layers', 'hidden_size', 'num_attention_heads', 'vocab_size'):
        if getattr(source_config, key) != getattr(converted_config, key):
            raise RefitError(f'refit: the converted model has {key}={getattr(converted_config, key)}, the source '
                             f'{getattr(source_config, key)}: not a conversion of this source')
    families.check('refit', source_config, 'refit')
    converted_family = families.source_model_type(converted_config)
    if converted_family != source_config.model_type:
        raise RefitError(f'refit: the converted model is built on {converted_family}, the source is a '
                         f'{source_config.model_type} model: not a conversion of this source')
    source_bytes, converted_bytes = kv_cache_bytes(source_config, 1, 2), kv_cache_bytes(converted_config, 1, 2)
    if converted_bytes > source_bytes:  # equal is the identity conversion, the refit's closed-form check
        raise RefitError(f'refit: the converted model caches {converted_bytes} bytes per token (bf16), more than the '
                         f"source's {source_bytes}: not a conversion of this source (are the two folders swapped?)")


def _layer_gram(stats, layer: int) -> torch.Tensor:
    running = stats.layer(layer, 'input').running
    return running.gram / running.count


def _layer_mean(stats, layer: int) -> torch.Tensor:
    running = stats.layer(layer, 'input').running
    return running.total / running.count


def _attention_weights(attention, augmented: dict[str, bool] | None = None) -> dict[str, torch.Tensor]:
    """q/k/v/o weights in float64; a projection named in ``augmented`` gets its bias (or zeros) as a last column."""
    weights = {}
    for name in ('q', 'k', 'v', 'o'):
        projection = getattr(attention, f'{name}_proj')
        weight = projection.weight.detach().double()
        if augmented is not None and augmented.get(name):
            bias = projection.bias.detach().double() if projection.bias is not None else weight.new_zeros(len(weight))
            weight = torch.cat([weight, bias[:, None]], dim=1)
        weights[name] = weight
    return weights


def _write(projection, rows: torch.Tensor, what: str) -> None:
    """Rows [W | b] (or W) into an nn.Linear; a bias column the projection has no bias for must be zero."""
    width = projection.weight.shape[1]
    with torch.no_grad():
        projection.weight.copy_(rows[:, :width].to(projection.weight.dtype))
        if rows.shape[1] > width:
            if projection.bias is not None:
                projection.bias.copy_(rows[:, width].to(projection.bias.dtype))
            elif bool(rows[:, width].abs().max() > 1e-9 * max(float(rows.abs().max()), 1e-30)):
                raise RefitError(f'refit: {what} has no bias, but the fit needs one')


def _layer_layout(source_attn, attn, index: int) -> tuple[dict[str, bool], torch.Tensor | None]:
    """Which of q/k/v are fitted with their bias (the source's layout; a head-mapped ``attn`` must have it too),
    and the per-dimension key metric of a family with per-head q/k norms (None without)."""
    biased = {name: getattr(source_attn, f'{name}_proj').bias is not None for name in ('q', 'k', 'v')}
    for name, has in biased.items():
        if has and attn is not None and getattr(attn, f'{name}_proj').bias is None:
            raise RefitError(f'refit: layer {index}: the source\'s {name}_proj has a bias, the converted model\'s '
                             'has none (a conversion dropped it)')
    augmented = {'q': biased['q'] or biased['k'], 'k': biased['q'] or biased['k'], 'v': biased['v']}
    k_norm, q_norm = getattr(source_attn, 'k_norm', None), getattr(source_attn, 'q_norm', None)
    if k_norm is None and q_norm is None:
        return augmented, None
    probe = torch.ones(1, source_attn.head_dim, dtype=next(source_attn.parameters()).dtype,
                       device=next(source_attn.parameters()).device)
    with torch.no_grad():  # each norm's per-dimension multiplier on a unit-RMS head (w, or Gemma's 1 + w)
        scales = [norm(probe)[0].double().cpu() if norm is not None else torch.ones(source_attn.head_dim,
                                                                                   dtype=torch.float64)
                  for norm in (q_norm, k_norm)]
    return augmented, (scales[0] * scales[1]) ** 2


def _head_map_errors(source, converted, maps, grams, head_dim, key_metric=None) -> tuple[float, float]:
    """Relative key-logit (or, with per-head norms, normed-key) and value-output errors of a head-mapped layer
    (``ops.refit`` objectives); ``grams``: (q/k gram, v gram)."""
    query_source, source_kv, key_of_query, value_of_query = maps
    gram, value_gram = grams
    q_s, k_s, v_s = (split_heads(source[name], head_dim) for name in ('q', 'k', 'v'))
    q_c, k_c, v_c = (split_heads(converted[name], head_dim) for name in ('q', 'k', 'v'))
    o_s, o_c = fit.output_blocks(source['o'], head_dim), fit.output_blocks(converted['o'], head_dim)
    key = [0.0, 0.0]
    value = [0.0, 0.0]
    if key_metric is not None:
        for compact, members in enumerate(fit.group_members(query_source, source_kv, key_of_query)):
            rows = torch.stack([k_s[member] for member, _ in members])
            counts = torch.tensor([len(readers) for _, readers in members], dtype=torch.float64)
            error, total = fit.normed_key_error(rows, counts, k_c[compact], gram, key_metric)
            key = [key[0] + error, key[1] + total]
    for head, source_head in enumerate(query_source):
        if key_metric is None:
            error, total = fit.logit_error(q_s[source_head], k_s[source_kv[source_head]], q_c[head],
                                           k_c[key_of_query[head]], gram)
            key = [key[0] + error, key[1] + total]
        error, total = fit.value_output_error(v_s[source_kv[source_head]], o_s[source_head], v_c[value_of_query[head]],
                                              o_c[head], value_gram)
        value = [value[0] + error, value[1] + total]
    return key[0] / max(key[1], 1e-30), value[0] / max(value[1], 1e-30)


def _refit_head_mapped(source_model, converted_model, stats, source_map: HeadMap, head_dim: int) -> list[dict]:
    target_map = HeadMap.from_hf_config(converted_model.config)
    layers = []
    for index, (source_attn, attn) in enumerate(zip(attention_modules(source_model),
                                                    attention_modules(converted_model))):
        augmented, key_metric = _layer_layout(source_attn, attn, index)
        plain, mean = _layer_gram(stats, index), _layer_mean(stats, index)
        full = fit.augmented_gram(plain, mean)
        grams = (full if augmented['k'] else plain, full if augmented['v'] else plain)
        source = _attention_weights(source_attn, augmented)
        converted = _attention_weights(attn, augmented)
        query_source, mismatch = match_query_heads(source_attn.q_proj.weight.detach(), attn.q_proj.weight.detach(),
                                                   head_dim)
        if mismatch > MATCH_TOLERANCE:
            raise RefitError(f'refit: layer {index}: the converted query heads do not match the source\'s (relative '
                             f'mismatch {mismatch:.2f}): was it converted from this source?')
        layer_map = target_map.layers[index]
        source_kv = list(source_map.layers[index].key)
        maps = (query_source, source_kv, list(layer_map.key), list(layer_map.value))
        before = _head_map_errors(source, converted, maps, grams, head_dim, key_metric)
        result = fit.refit_head_map_layer(source, grams[0], head_dim, source_kv_of_query=source_kv,
                                          query_source=query_source, key_of_query=layer_map.key,
                                          value_of_query=layer_map.value, value_gram=grams[1],
                                          key_metric=key_metric)
        for name, rows in (('q', result.q), ('k', result.k), ('v', result.v), ('o', result.o)):
            _write(getattr(attn, f'{name}_proj'), rows, f'layer {index} {name}_proj')
        # the fit's residuals are the same objectives (tests/ops/test_ops_refit.py checks that they agree)
        layers.append({'layer': index, 'query_mismatch': round(mismatch, 6),
                       'key_error_before': before[0], 'key_error_after': result.key_residual / max(result.key_total, 1e-30),
                       'value_error_before': before[1],
                       'value_error_after': result.value_residual / max(result.value_total, 1e-30)})
    return layers


def _mla_value_output_error(source, attn, up_value, out_columns, down, gram, head_dim) -> float:
    """Relative E||sum over heads (O V x - O' U_v A x)||^2 per head, summed: the value-output objective on the
    latent (targets O_h V_h, the converted map O'_h U_v A)."""
    v_s, o_s = split_heads(source['v'], head_dim), fit.output_blocks(source['o'], head_dim)
    group = attn.num_key_value_groups
    error = total = 0.0
    for head in range(o_s.shape[0]):
        kv = head // group
        e, t = fit.value_output_error(v_s[kv], o_s[head], up_value[kv] @ down, out_columns[head], gram)
        error, total = error + e, total + t
    return error / max(total, 1e-30)


def _refit_mla(source_model, converted_model, stats, head_dim: int) -> list[dict]:
    layers = []
    for index, (source_attn, attn) in enumerate(zip(attention_modules(source_model),
                                                    attention_modules(converted_model))):
        augmented, key_metric = _layer_layout(source_attn, None, index)
        if any(augmented.values()) or key_metric is not None:
            raise RefitError('refit: an MLA folder of a source with attention biases or per-head q/k norms is not '
                             'refitted (the latent regression has no bias term and no k_norm); heal it from '
                             'attention transfer')
        gram = _layer_gram(stats, index)
        source = _attention_weights(source_attn)
        down = attn.kv_down_proj.weight.detach().double()
        kv_heads, group = attn.num_kv_heads, attn.num_key_value_groups
        # the conversion's FreqFold re-based each K/V head's pairs, queries and keys alike (the identity without one):
        # read it off the queries and re-base the source's keys the same way
        bases, mismatch = recovered_pair_bases(source['q'], attn.q_proj.weight.detach(), head_dim, kv_heads)
        if mismatch > MATCH_TOLERANCE:
            raise RefitError(f'refit: layer {index}: the MLA model\'s query heads are not the source\'s (relative '
                             f'mismatch {mismatch:.2g}): was it converted from this source?')
        source_keys = mix_head_pairs(source['k'].double().T, bases, head_dim).T
        up_value = attn._split_up()[1].detach().double()
        o_blocks = fit.output_blocks(source['o'], head_dim)
        before = _mla_value_output_error(source, attn, up_value,
                                         fit.output_blocks(attn.o_proj.weight.detach().double(), head_dim), down, gram,
                                         head_dim)
        kept = torch.tensor(converted_model.config.layer_layout(index)[1], dtype=torch.long)
        nope = nope_dims(kept, head_dim)
        k_heads, v_heads = split_heads(source_keys, head_dim), split_heads(source['v'], head_dim)
        new_keys, new_values, new_o = [], [], o_blocks.clone()
        for kv in range(kv_heads):
            key_rows, latent_gram = fit.regress_onto_latent(k_heads[kv][nope[kv]], gram, down)
            value_rows, _ = fit.regress_onto_latent(v_heads[kv], gram, down)
            heads = list(range(kv * group, (kv + 1) * group))
            value_fit = fit.fit_shared_value(value_rows.expand(group, -1, -1), o_blocks[heads], latent_gram)
            new_keys.append(key_rows)
            new_values.append(value_fit.rows)
            new_o[heads] = value_fit.output_columns
        up = torch.cat([torch.cat(new_keys), torch.cat(new_values)])
        with torch.no_grad():
            attn.kv_up_proj.weight.copy_(up.to(attn.kv_up_proj.weight.dtype))
            attn.o_proj.weight.copy_(fit.output_weight(new_o).to(attn.o_proj.weight.dtype))
        after = _mla_value_output_error(source, attn, torch.stack(new_values), new_o, down, gram, head_dim)
        layers.append({'layer': index, 'value_error_before': before, 'value_error_after': after})
    return layers


def refit_folder(source_dir: str | Path, converted_dir: str | Path, out_dir: str | Path, settings: RefitSettings,
                 *, overwrite: bool = False) -> dict:
    """Refit ``converted_dir`` to ``source_dir`` (see the module docstring) and save it, same class, to
    ``out_dir`` with ``refit.json`` (per-layer errors before and after). Returns that report."""
    source_dir, converted_dir, out_dir = Path(source_dir), Path(converted_dir), Path(out_dir)
    check_model_folder(source_dir, who='refit (source)', model_types=SOURCE_MODEL_TYPES)
    converted_json = check_model_folder(converted_dir, who='refit (converted)')
    model_type = converted_json.get('model_type')
    if model_type in NOT_REFITTED_HERE:
        raise RefitError(f'refit: {NOT_REFITTED_HERE[model_type]}')
    if model_type not in REFITTABLE:
        raise RefitError(f"refit: cannot refit a '{model_type}' model")
    if settings.tokens < 1:
        raise ConfigError(f'refit: --tokens must be >= 1, got {settings.tokens}')
    refuse_nonempty(out_dir, overwrite)
    started = time.perf_counter()
    source_config = load_source_config(source_dir, who='refit (source)')
    source_map = source_head_map(source_config, 'refit')
    import dha_train.models  # noqa: F401  (registers the DHA / MLA classes with the Auto classes)

    converted_config = load_model_config(converted_dir, who='refit (converted)')
    _check_pair(source_config, converted_config)
    source_model, _ = load_source_model(source_dir, source_config, device=settings.device, who='refit')
    batches = calibration_batches(source_dir, source_config, data=settings.data, split='train',
                                  batch_size=settings.batch_size, seed=settings.seed, who='refit')
    stats = calibrate(source_model, batches, num_tokens=settings.tokens, kinds=('input',), seed=settings.seed)
    calibrated = time.perf_counter()
    saved_dtype = converted_config.torch_dtype or torch.float32
    saved_dtype = getattr(torch, saved_dtype) if isinstance(saved_dtype, str) else saved_dtype
    converted_model = load_causal_lm(converted_dir, who='refit (converted)', config=converted_config,
                                     torch_dtype=torch.float32).to(settings.device)
    head_dim = source_map.head_dim
    if converted_config.model_type == 'mla_llama':
        layers = _refit_mla(source_model, converted_model, stats, head_dim)
        kind = 'mla'
    else:
        layers = _refit_head_mapped(source_model, converted_model, stats, source_map, head_dim)
        kind = 'head_map'
    del source_model
    report = {
        'source': str(source_dir), 'converted': str(converted_dir), 'kind': kind,
        'model_type': converted_config.model_type, 'settings': asdict(settings),
        'kv_cache_bytes_per_4096_tokens': kv_cache_bytes(converted_model.config),
        'calibration_seconds': round(calibrated - started, 1),
        'fit_seconds': round(time.perf_counter() - calibrated, 1), 'layers': layers,
    }
    for name in ('key_error_before', 'key_error_after', 'value_error_before', 'value_error_after'):
        values = [layer[name] for layer in layers if name in layer]
        if values:
            report[f'mean_{name}'] = sum(values) / len(values)
    with staged_folder(out_dir, overwrite) as staging:
        converted_model.to('cpu', dtype=saved_dtype)
        converted_model.save_pretrained(staging, safe_serialization=True)
        write_model_card(staging, name=out_dir.name, method=None, source=source_dir, start=converted_dir, stage=card_stage(
            'refit: closed form, from calibration statistics', calibration_tokens=settings.tokens))
        for extra in (HEAD_MAP_FILE, 'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
                      'tokenizer.model', 'generation_config.json'):
            if (converted_dir / extra).is_file() and not (staging / extra).is_file():
                shutil.copy2(converted_dir / extra, staging / extra)
        (staging / REFIT_REPORT).write_text(json.dumps(report, indent=2))
    return report

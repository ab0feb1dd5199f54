"""The MLA conversion behind `dha-train convert --method mla`: an MHA or GQA folder of any supported family
(``dha_train.families``) to multi-head latent attention (``ops.mla``) inside that family's decoder
(``models.modeling_mla``), its q/k norms and biases carried.

Per layer: each K/V head's RoPE pairs folded into windows (FreqFold, ``ops.mla``: queries and keys re-based alike,
so the window's top component can stay rotated), the pairs each K/V head keeps (MHA2MLA's 2-norm criterion over
calibration queries and keys, or a uniform / high-frequency choice, among the windows' candidates), then the
position-free keys and the values factored jointly into a latent (activation-aware SVD whitened by the calibration
covariance of the attention input, or plain weight SVD), with ranks uniform or allocated from the spectra. The
budget is a fraction of the source's K+V cache, in cache numbers per token (the unit of every method's KV bytes):
``ranks + kv_heads * 2 * pairs`` per layer, plus one key scale per K/V head where a per-head k_norm (Qwen3,
Gemma 3) meets position-free key dims. With q/k norms there is no FreqFold (the mix does not commute with the norms'
weights) and the 2-norm pair scores are taken after the norms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dha_train import families
from dha_train.calibration import CalibrationError, calibrate, calibration_batches, load_source_model
from dha_train.config import ConfigError
from dha_train.model_card import card_stage, write_model_card
from dha_train.model_folders import check_model_folder, load_source_config
from dha_train.models.llama_layout import attention_modules, head_dim
from dha_train.models.modeling_mla import MlaLlamaConfig, MlaLlamaForCausalLM
from dha_train.ops.mla import (
    BALANCES,
    PAIR_CRITERIA,
    allocate_latent_ranks,
    cache_values_per_token,
    fold_windows,
    folded_pair_bases,
    joint_latent_rows,
    kept_rope_pairs,
    key_scales_per_layer,
    latent_energies,
    mix_head_pairs,
    mla_layer_weights,
    pair_key_cross_energy,
    rope_pair_scores,
)
from dha_train.paths import refuse_nonempty, staged_folder
from dha_train.tokenizer_files import load_tokenizer_folder

RANK_CHOICES = ('uniform', 'spectrum')
# fields of a source config that name the source itself, not carried into the MLA config
SOURCE_IDENTITY_FIELDS = ('model_type', 'architectures', 'auto_map', 'transformers_version', '_name_or_path')
FACTORISATIONS = ('activation', 'weight')


@dataclass
class MlaSettings:
    cache_fraction: float  # of the source's K+V cache numbers per token
    # RoPE pairs kept per K/V head (2 * pairs rotated key dims); None: default_rope_pairs
    rope_pairs: int | None = None
    # FreqFold per K/V head (ops.mla): each kept pair holds the top component of a window of this many consecutive
    # pairs; 1 keeps source pairs as they are; None: default_freq_fold
    freq_fold: int | None = None
    pair_criterion: str = 'norm'  # norm (MHA2MLA 2-norm), uniform, high_frequency
    ranks: str = 'spectrum'  # uniform or spectrum (allocated over the layers)
    factorisation: str = 'activation'  # activation (calibration covariance) or weight (plain SVD)
    balance: str = 'energy'  # scale keys against values before the joint factorisation (ops.mla.BALANCES)
    rank_step: int = 8  # spectrum ranks are multiples of this
    data: str | None = None  # `dha-train data prep` folder for calibration
    split: str = 'train'
    tokens: int = 16384
    sample_tokens: int = 4096  # token rows kept for the 2-norm pair scores
    batch_size: int = 8
    seed: int = 0
    device: str = 'cpu'


# The rotated keys' share of the cached numbers by default. Chosen on a validation text no conversion calibrates on
# (vim's help, 512 tokens a sequence), SmolLM2-135M at a third and two thirds of its cache, with the default fold
# (docs/methods/mla.md): 3/8 was best at both (8 and 16 pairs of 32 per K/V head).
ROPE_BUDGET_SHARE = 3 / 8


def default_rope_pairs(dims_per_head: int, cache_fraction: float) -> int:
    """RoPE pairs kept per K/V head by default: the rotated keys take ``ROPE_BUDGET_SHARE`` of the cached numbers,
    ``2 * pairs`` a K/V head against the source's ``2 * head_dim``, so ``share * fraction * head_dim`` pairs, rounded
    (a fraction written 0.3333 gives what 1/3 does), within 1..head_dim / 2."""
    return max(1, min(dims_per_head // 2, round(ROPE_BUDGET_SHARE * cache_fraction * dims_per_head)))


def default_freq_fold(dims_per_head: int, rope_pairs: int) -> int:
    """The fold by default: the widest windows that still leave one window per kept pair, so the kept pairs hold
    the top components of (nearly) all the head's pairs (8 pairs of 32: windows of 4)."""
    return max(1, (dims_per_head // 2) // rope_pairs) if rope_pairs else 1


def resolved_settings(settings: MlaSettings, dims_per_head: int, qk_norm: bool = False) -> MlaSettings:
    """The settings with the RoPE pairs and the fold their defaults give for this head size; with per-head q/k
    norms no fold by default (``check_family_settings``)."""
    pairs = (default_rope_pairs(dims_per_head, settings.cache_fraction) if settings.rope_pairs is None
             else settings.rope_pairs)
    fold = settings.freq_fold
    if fold is None:
        fold = 1 if qk_norm else default_freq_fold(dims_per_head, pairs)
    return replace(settings, rope_pairs=pairs, freq_fold=fold)


def check_family_settings(settings: MlaSettings, family: families.Family) -> None:
    """Refuse, in one line, a setting the family's attention cannot carry: FreqFold mixes the RoPE pairs of the
    query and key projections, which q_norm/k_norm's per-dimension weights, applied after them, do not commute
    with."""
    if family.qk_norm and settings.freq_fold > 1:
        raise ConfigError(f'convert --method mla: --freq-fold {settings.freq_fold} cannot carry {family.label} '
                          "per-head q/k norms: the fold mixes the query and key RoPE pairs ahead of q_norm/k_norm, "
                          "whose per-dimension weights do not commute with the mix; use --freq-fold 1 (this "
                          "family's default)")


def check_settings(settings: MlaSettings) -> None:
    if not 0 < settings.cache_fraction <= 1:
        raise ConfigError(f'mla: --cache-fraction must be in (0, 1], got {settings.cache_fraction}')
    for name, value, allowed in (('--pair-criterion', settings.pair_criterion, PAIR_CRITERIA),
                                 ('--ranks', settings.ranks, RANK_CHOICES),
                                 ('--factorisation', settings.factorisation, FACTORISATIONS),
                                 ('--balance', settings.balance, BALANCES)):
        if value not in allowed:
            raise ConfigError(f"mla: {name} must be one of {', '.join(allowed)}, got '{value}'")
    if ((settings.rope_pairs is not None and settings.rope_pairs < 0) or settings.rank_step < 1 or settings.tokens < 1
            or (settings.freq_fold is not None and settings.freq_fold < 1)):
        raise ConfigError('mla: --rope-pairs must be >= 0, --rank-step, --tokens and --freq-fold >= 1')
    if settings.data is None and (settings.pair_criterion == 'norm' or settings.factorisation == 'activation'):
        raise ConfigError('mla: the 2-norm pair criterion and the activation-aware factorisation need calibration '
                          'data (--data); or use --pair-criterion uniform --factorisation weight')


def latent_budget(config, settings: MlaSettings, key_norm: bool = False) -> tuple[int, int]:
    """(total latent rank over the layers, the source's cache numbers per token) for the settings' cache fraction,
    after the kept RoPE key dims (and, with a per-head k_norm, the key scales: ``ops.mla.key_scales_per_layer``) are
    paid for."""
    layers, kv_heads, dim = config.num_hidden_layers, config.num_key_value_heads, head_dim(config)
    if settings.rope_pairs > dim // 2:
        raise ConfigError(f'mla: --rope-pairs {settings.rope_pairs} exceeds the {dim // 2} pairs of a '
                          f'{dim}-dim head')
    windows = len(fold_windows(dim // 2, settings.freq_fold))
    if settings.rope_pairs > windows:
        raise ConfigError(f'mla: --rope-pairs {settings.rope_pairs} with --freq-fold {settings.freq_fold}: a '
                          f'{dim}-dim head has only {windows} windows of {settings.freq_fold} pairs, one kept pair '
                          'each; keep fewer pairs or fold fewer')
    source_values = layers * 2 * kv_heads * dim
    budget = math.floor(settings.cache_fraction * source_values + 1e-9)
    scales = key_scales_per_layer(settings.rope_pairs, dim if key_norm else None)
    latent = budget - layers * kv_heads * (2 * settings.rope_pairs + scales)
    if latent < layers:
        raise ConfigError(f'mla: a cache fraction of {settings.cache_fraction} ({budget} numbers per token over '
                          f'{layers} layers) leaves no latent after {settings.rope_pairs} RoPE pairs per head; '
                          'keep fewer pairs or raise the fraction')
    return latent, source_values


def convert_to_mla(model_dir: str | Path, out_dir: str | Path, settings: MlaSettings, *,
                   overwrite: bool = False) -> dict:
    """Convert and save the MLA folder; returns a report (ranks, pairs, cache numbers against the source)."""
    check_settings(settings)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_model_folder(model_dir, who='convert --method mla')
    refuse_nonempty(out_dir, overwrite)
    config = load_source_config(model_dir, who='convert --method mla')
    family = families.check('mla', config, 'convert --method mla')
    settings = resolved_settings(settings, head_dim(config), family.qk_norm)
    check_family_settings(settings, family)
    total_latent, source_values = latent_budget(config, settings, family.qk_norm)
    model, source = load_source_model(model_dir, config, device=settings.device, who='convert --method mla')
    dim, kv_heads = head_dim(config), config.num_key_value_heads

    calibration = None
    if settings.data is not None:
        batches = calibration_batches(model_dir, config, data=settings.data, split=settings.split,
                                      batch_size=settings.batch_size, seed=settings.seed, who='convert --method mla')
        try:
            calibration = calibrate(model, batches, num_tokens=settings.tokens, kinds=('query', 'key', 'input'),
                                    sample_tokens=min(settings.sample_tokens, settings.tokens), seed=settings.seed)
        except CalibrationError as exc:
            raise CalibrationError(f'convert --method mla: {exc}') from exc

    layers = attention_modules(model)
    kept, covariances, rotated_energy = [], [], [0.0, 0.0]
    for index, attention in enumerate(layers):
        query_to_kv = source.layers[index].key  # each query head's K/V head
        covariance = None
        if settings.factorisation == 'activation':
            running = calibration.layer(index, 'input').running
            covariance = running.gram / running.count  # E[x x^T] over the calibration tokens
        covariances.append(covariance)
        cross = pair_key_cross_energy(attention.k_proj.weight.detach(), covariance, kv_heads, dim)
        bases, centres, _ = folded_pair_bases(cross, settings.freq_fold)
        if settings.freq_fold > 1:
            fold_query_and_key_pairs(attention, bases, dim, query_to_kv)
        scores = None
        if settings.pair_criterion == 'norm':
            query_states, key_states = (calibration.layer(index, kind).sample for kind in ('query', 'key'))
            if settings.freq_fold > 1:
                query_states = mix_head_pairs(query_states, bases.to(query_states.device), dim, query_to_kv)
                key_states = mix_head_pairs(key_states, bases.to(key_states.device), dim)
            if family.qk_norm:  # the pairs' share of the scores after the norms, as attention sees them
                query_states = _normed_heads(attention.q_norm, query_states, dim)
                key_states = _normed_heads(attention.k_norm, key_states, dim)
            scores = rope_pair_scores(query_states, key_states, dim, query_to_kv)
        kept.append(kept_rope_pairs(kv_heads, dim, settings.rope_pairs, settings.pair_criterion, scores, centres))
        # each pair's key energy after the fold, diag(B^T M B) per head: no second pass over the weights
        head_energy = torch.stack([cross[:, head, :, head] for head in range(kv_heads)])  # (G, pairs, pairs)
        per_pair = torch.einsum('gij,gik,gkj->gj', bases, head_energy, bases)  # (G, pairs)
        rotated_energy[0] += float(per_pair.gather(1, kept[-1].to(per_pair.device)).sum())
        rotated_energy[1] += float(per_pair.sum())

    if settings.ranks == 'uniform':
        rank = total_latent // len(layers)
        ranks = [rank] * len(layers)
    else:
        spectra = []
        for index, attention in enumerate(layers):
            rows, scales = joint_latent_rows(attention.k_proj.weight.detach(), attention.v_proj.weight.detach(),
                                             kept[index], dim, covariances[index], settings.balance)
            spectra.append(latent_energies(rows, covariances[index], scales))
        step = settings.rank_step
        try:
            ranks = allocate_latent_ranks(spectra, total_latent // step * step, step=step)
        except ValueError as exc:
            raise ConfigError(f'mla: --cache-fraction {settings.cache_fraction}: {exc}') from exc
    full = kv_heads * (dim - 2 * settings.rope_pairs) + kv_heads * dim
    if any(rank > full for rank in ranks):
        raise ConfigError(f'mla: rank {max(ranks)} exceeds the {full} position-free key and value dims of a layer; '
                          'lower --cache-fraction or keep more RoPE pairs')

    mla_model = mla_model_of(model, family.model_type, kept, ranks, covariances, settings.balance)
    del model
    cached = cache_values_per_token(ranks, [settings.rope_pairs] * len(ranks), kv_heads,
                                    dim if family.qk_norm else None)
    report = {'family': family.model_type, 'ranks': [int(r) for r in ranks], 'rope_pairs': settings.rope_pairs,
              'key_scales_per_kv_head': key_scales_per_layer(settings.rope_pairs, dim if family.qk_norm else None),
              'freq_fold': settings.freq_fold,
              'rope_energy_kept': rotated_energy[0] / rotated_energy[1] if rotated_energy[1] else 0.0,
              'pair_criterion': settings.pair_criterion, 'factorisation': settings.factorisation,
              'balance': settings.balance, 'cache_values_per_token': cached, 'source_values_per_token': source_values,
              'fraction_of_source': cached / source_values,
              'fraction_of_mha': cached / (config.num_hidden_layers * 2 * config.num_attention_heads * dim),
              'calibration_tokens': calibration.tokens if calibration is not None else 0}
    with staged_folder(out_dir, overwrite) as staging:
        mla_model.save_pretrained(staging, safe_serialization=True)
        write_model_card(staging, name=out_dir.name, method='mla', source=model_dir, stage=card_stage(
            'convert --method mla', calibration_tokens=report['calibration_tokens']))
        if (model_dir / 'tokenizer_config.json').is_file():
            load_tokenizer_folder(model_dir, 'convert --method mla').save_pretrained(staging)
    return report


def mla_model_of(model, source_model_type: str, kept: list[torch.Tensor], ranks: list[int],
                 covariances: list[torch.Tensor | None] | None = None, balance: str = 'none') -> MlaLlamaForCausalLM:
    """The MLA model (float32, CPU) of a source model of the family ``source_model_type`` whose RoPE pairs are as
    the conversion left them (folded or not): per layer the ``kept`` pairs (kv_heads, pairs) rotated and the
    position-free keys and values factored at ``ranks`` (``ops.mla.mla_layer_weights``, K/V biases carried); every
    other weight, q/k norms included, copied."""
    config = model.config
    dim = head_dim(config)
    layers = attention_modules(model)
    covariances = covariances or [None] * len(layers)
    state = {name: tensor.float().cpu() for name, tensor in model.state_dict().items()
             if '.k_proj.' not in name and '.v_proj.' not in name}
    for index, attention in enumerate(layers):
        converted = mla_layer_weights(attention.k_proj.weight.detach(), attention.v_proj.weight.detach(),
                                      kept[index], dim, ranks[index], covariances[index], balance,
                                      *_kv_biases(attention))
        if attention.k_proj.bias is None:  # a value bias alone: the rotated keys have none
            converted.pop('k_rope_proj.bias', None)
        prefix = f'model.layers.{index}.self_attn.'
        state.update({prefix + name: tensor.float().cpu() for name, tensor in converted.items()})
    # every field of the source config (the family's classes read them), not only those off LLaMA's defaults
    settings_dict = {k: v for k, v in config.to_dict().items() if k not in SOURCE_IDENTITY_FIELDS}
    mla_config = MlaLlamaConfig(mla_ranks=[int(r) for r in ranks], mla_rope_pairs=[k.tolist() for k in kept],
                                source_model_type=source_model_type, **settings_dict)
    mla_model = MlaLlamaForCausalLM(mla_config).float()
    missing, unexpected = mla_model.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (name.endswith('lm_head.weight') and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f'mla conversion: weights do not match (missing {missing[:4]}, unexpected {unexpected[:4]})')
    return mla_model


def fold_query_and_key_pairs(attention, bases: torch.Tensor, dim: int, query_to_kv) -> None:
    """Re-base, in place, the RoPE pairs of a layer's query and key projections (weights and biases) by each K/V
    head's FreqFold ``bases`` (``ops.mla.folded_pair_bases``): an orthogonal mix, the same for a K/V head and the
    query heads reading it, so every position-free score is unchanged."""
    with torch.no_grad():
        for projection, mapping in ((attention.q_proj, query_to_kv), (attention.k_proj, None)):
            bases_here = bases.to(projection.weight.device)
            projection.weight.copy_(mix_head_pairs(projection.weight.T, bases_here, dim, mapping).T)
            if projection.bias is not None:
                projection.bias.copy_(mix_head_pairs(projection.bias, bases_here, dim, mapping))


def _bias(projection) -> torch.Tensor | None:
    return None if projection.bias is None else projection.bias.detach()


def _kv_biases(attention) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(key bias, value bias) of a source attention, both or neither (a missing one as zeros)."""
    key, value = _bias(attention.k_proj), _bias(attention.v_proj)
    if key is None and value is None:
        return None, None
    zeros = lambda projection: projection.weight.new_zeros(projection.out_features).detach()  # noqa: E731
    return (zeros(attention.k_proj) if key is None else key), (zeros(attention.v_proj) if value is None else value)


def _normed_heads(norm, states: torch.Tensor, dim: int) -> torch.Tensor:
    """(tokens, heads * dim) projection outputs through a per-head norm (q_norm / k_norm)."""
    with torch.no_grad():
        weight = norm.weight
        normed = norm(states.to(weight.device, weight.dtype).reshape(states.shape[0], -1, dim))
    return normed.reshape(states.shape).to(states.device, states.dtype)

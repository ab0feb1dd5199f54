"""`dha-train convert --method mla --format deepseek`: a LLaMA folder (MHA or GQA) to a folder that transformers'
own ``DeepseekV3ForCausalLM`` loads with no custom code (dense layers, ``q_lora_rank`` null), the format whose MLA
kernels serving engines run. The maths is ``ops.deepseek``; here the calibration, the budget, the config and the
weights of the whole model.

Budget: ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer (what an engine with MLA kernels caches) as
a fraction of the source's K+V cache. transformers' own ``DeepseekV3Attention`` does not cache the latent: its
``DynamicCache`` holds every query head's expanded key and value, so the budget holds only where an engine
implements the latent cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from dha_train import families
from dha_train.calibration import CalibrationError, calibrate, calibration_batches, load_source_model
from dha_train.config import ConfigError
from dha_train.conversion.deepseek_choice import (
    CHOICE_TOKENS,
    FIXED_BALANCES,
    Candidate,
    candidates,
    choice_sequences,
)
from dha_train.model_card import card_stage, write_model_card
from dha_train.model_folders import check_model_folder, load_source_config
from dha_train.models.llama_layout import attention_modules, head_dim
from dha_train.ops.deepseek import (
    LATENT_NORM_EPS,
    LATENT_NORM_FITS,
    QUANTIZED_CACHE_BLOCK,
    deepseek_attention_weights,
    kv_b_weight,
    latent_norm_fit,
    normed_latent_error,
    rope_theta_for_stride,
    shared_key_mix,
    stride_choices,
    strided_pairs,
)
from dha_train.ops.mla import BALANCES, pair_key_cross_energy
from dha_train.ops.sequence_loss import mean_token_losses
from dha_train.paths import refuse_nonempty, staged_folder
from dha_train.tokenizer_files import load_tokenizer_folder

CARRIED_ROPE_TYPES = ('default', 'linear', 'llama3')  # per-frequency scalings: the same at the kept frequencies
# Defaults chosen on a validation text no conversion calibrates on and no bench scores (vim's help files, 512 tokens a
# sequence), on SmolLM2-135M at a third and two thirds of its cache with the latent in the norm's linear range
# (docs/methods/mla.md): a fold of 2 beat 1 and 4 at both; a shared key of 5/8 of the head's RoPE pairs (20 of 32)
# came within 0.02 nats of the best width at both budgets (18 pairs at a third, 24 at two thirds), where a key of
# half the head or a quarter of the budget lost 0.2 or more. The key takes at most a third of the cached numbers.
DEFAULT_FREQ_FOLD = 2
ROPE_PAIR_SHARE = 0.625  # of the head's RoPE pairs
ROPE_BUDGET_CAP = 1 / 3  # of the numbers cached per token and layer
# The quantizable split: llama.cpp quantizes a K/V cache (-ctk q8_0 -ctv q8_0, half the f16 bytes) only when the K head
# (latent + RoPE key) and the V head (the latent) are whole 32-value blocks. Of the splits that are, the one whose
# key is nearest a quarter of the cached numbers, at stride 1. Chosen on the validation text (vim, SmolLM2-135M,
# docs/methods/mla.md), with the feature-norm balance: at a third 32 + 96 scored 3.804 against 3.815 for the
# unrounded 40 + 88 (stride 2 lost 0.23, energy balance 0.12); at two thirds the best such split (64 + 192) lost 0.058
# to the unrounded 40 + 216. So it is the default up to a third of the source's cache, and an option above.
QUANTIZABLE_BY_DEFAULT_UP_TO = 1 / 3  # of the source's cache
QUANTIZABLE_KEY_SHARE = 0.25  # of the numbers cached per token and layer
# --cache-fraction is read to three decimals: a budget may exceed it by this much of the source's cache, so 0.333
# and 0.3333 are a third
FRACTION_TOLERANCE = 1e-3


@dataclass
class DeepseekSettings:
    cache_fraction: float  # of the source's K+V cache numbers per token
    # Pairs of the shared RoPE key (qk_rope_head_dim / 2); default ROPE_PAIR_SHARE of the head's pairs, the key at
    # most ROPE_BUDGET_CAP of the cached numbers.
    rope_pairs: int | None = None
    # Consecutive RoPE slots that share one analysis of the source pairs they span (ops.deepseek, FreqFold).
    freq_fold: int = DEFAULT_FREQ_FOLD
    # the latent and the RoPE key in whole QUANTIZED_CACHE_BLOCKs, so llama.cpp can quantize the cache; None: chosen
    # on the val split of --data (conversion.deepseek_choice), else so up to QUANTIZABLE_BY_DEFAULT_UP_TO where the
    # budget has room for it
    quantizable_cache: bool | None = None
    # linear (the latent scaled into the norm's linear range), regression (kv_b regressed on the normed latent) or
    # scalar (the mean RMS); ops.deepseek
    latent_norm_fit: str = 'linear'
    # a pin channel (ops.deepseek.pin_channel) in each layer where it lowers the held-out error; with the regression
    # and scalar fits only (the linear range needs none)
    pin: bool = True
    # energy or feature_norm; None: chosen on the val split of --data with the split (conversion.deepseek_choice)
    balance: str | None = None
    choose_tokens: int = CHOICE_TOKENS  # of the val split the split and balance are chosen on; 0: the fixed defaults
    data: str | None = None
    split: str = 'train'
    tokens: int = 16384
    sample_tokens: int = 4096  # attention inputs kept per layer for the latent norm fit
    batch_size: int = 8
    seed: int = 0
    device: str = 'cpu'


def check_source(config) -> None:
    """Refuse what the format cannot carry, by name, before any work: the family's features DeepseekV3's decoder
    has no place for (biases, per-head q/k norms, sliding windows, Gemma's block: the family layer's refusals under
    'mla_deepseek'), then a RoPE scaling it cannot carry."""
    families.check('mla_deepseek', config, 'convert --format deepseek')
    scaling = getattr(config, 'rope_scaling', None) or {}
    rope_type = scaling.get('rope_type', scaling.get('type', 'default'))
    if rope_type not in CARRIED_ROPE_TYPES:
        raise ConfigError(f"convert --format deepseek: the source's '{rope_type}' RoPE scaling does not carry over to "
                          f"a shared RoPE key at other frequencies; sources with {', '.join(CARRIED_ROPE_TYPES)} "
                          'RoPE convert')
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConfigError('convert --format deepseek: num_attention_heads must be a multiple of num_key_value_heads')


def budget(config, settings: DeepseekSettings) -> tuple[int, int, int, bool]:
    """(pairs of the shared RoPE key, kv_lora_rank, the source's K+V numbers per token and layer, whether the split
    is the quantizable one)."""
    dim, kv_heads = head_dim(config), config.num_key_value_heads
    source, numbers = cached_numbers(config, settings)
    if quantizable(settings, numbers, dim):
        return (*quantizable_split(numbers, dim, settings.rope_pairs), source, True)
    default_pairs = max(1, min(round(ROPE_PAIR_SHARE * dim / 2), int(ROPE_BUDGET_CAP * numbers + 1e-9) // 2))
    pairs = settings.rope_pairs if settings.rope_pairs is not None else default_pairs
    if not 1 <= pairs <= dim // 2:
        raise ConfigError(f'convert --format deepseek: --rope-pairs must be within 1..{dim // 2} for {dim}-dim heads, '
                          f'got {pairs}')
    rank = numbers - 2 * pairs
    if rank < 1:
        raise ConfigError(f'convert --format deepseek: a cache fraction of {settings.cache_fraction} '
                          f'({numbers} numbers per token and layer) leaves '
                          f'no latent after a {2 * pairs}-dim RoPE key; lower --rope-pairs or raise the fraction')
    if rank > 2 * kv_heads * dim:
        raise ConfigError(f'convert --format deepseek: latent rank {rank} exceeds the {2 * kv_heads * dim} key and '
                          'value dims it factors')
    return pairs, rank, source, False


def cached_numbers(config, settings: DeepseekSettings) -> tuple[int, int]:
    """(the source's K+V numbers per token and layer, the budget's)."""
    source = 2 * config.num_key_value_heads * head_dim(config)
    # the fraction read to three decimals (FRACTION_TOLERANCE): 0.3333 of SmolLM2's 384 is 127.99, and floored to 127
    # the quantizable split's whole blocks kept 96, a quarter for a third asked
    return source, min(source, math.floor((settings.cache_fraction + FRACTION_TOLERANCE) * source + 1e-9))


def quantizable_fits(config, settings: DeepseekSettings) -> bool:
    """Whether the budget holds a quantizable split (of the asked key, when --rope-pairs is given)."""
    dim, numbers = head_dim(config), cached_numbers(config, settings)[1]
    keys = _block_keys(numbers // QUANTIZED_CACHE_BLOCK * QUANTIZED_CACHE_BLOCK, dim)
    return bool(keys) and (settings.rope_pairs is None or 2 * settings.rope_pairs in keys)


def fixed_candidate(config, settings: DeepseekSettings) -> Candidate:
    """The split and balance with no choice: as asked, else the fixed defaults. Chosen by the lowest mean loss over
    three validation texts of different kinds (vim's help, C headers, Markdown; `bench mla-zero`'s
    ``fixed_default``, docs/methods/mla.md), SmolLM2-135M at 0 tokens: up to a third of the cache the quantizable
    split with the feature-norm balance (ahead of the former unrounded split with the energy balance on all three
    and on held-out Perl), above it the unrounded split with the energy balance (feature-norm was behind it there)."""
    _, numbers = cached_numbers(config, settings)
    above = settings.cache_fraction > QUANTIZABLE_BY_DEFAULT_UP_TO + 1e-6
    balance = settings.balance or FIXED_BALANCES[above]
    return Candidate(quantizable(settings, numbers, head_dim(config)), balance)


def deepseek_config(config, rank: int, pairs: int, stride: int) -> DeepseekV3Config:
    """The ``DeepseekV3Config`` of the converted model: dense MLPs (``first_k_dense_replace`` = every layer), no
    query LoRA, the source's vocabulary, positions and RoPE scaling, ``rope_theta`` for the kept stride.
    ``rms_norm_eps`` is the latent norm's (``LATENT_NORM_EPS``), not the source's: transformers builds the latent norm
    with it whatever the config says, while vLLM, SGLang and llama.cpp build every norm with ``rms_norm_eps``, and a
    latent in the norm's linear range is scaled by the eps (SmolLM2's 1e-5 would read it 3.2x too small). The other
    norms barely notice: SmolLM2-135M's validation loss moves by 3e-5 from 1e-5 to 1e-6."""
    dim = head_dim(config)
    return DeepseekV3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_attention_heads,
        n_shared_experts=1, n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
        first_k_dense_replace=config.num_hidden_layers, kv_lora_rank=rank, q_lora_rank=None,
        qk_rope_head_dim=2 * pairs, qk_nope_head_dim=dim, v_head_dim=dim, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=LATENT_NORM_EPS,
        rope_theta=rope_theta_for_stride(config.rope_theta, dim, pairs, stride), rope_scaling=getattr(config, 'rope_scaling', None),
        rope_interleave=True, attention_bias=False, attention_dropout=config.attention_dropout,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        initializer_range=config.initializer_range, torch_dtype='float32')


def _fitted(attention, config, mix: torch.Tensor, rank: int,
            covariance: torch.Tensor | None, balance: str, fit: str | None, inputs: torch.Tensor | None,
            pin: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(``ops.deepseek.deepseek_attention_weights`` with its latent rows as the fit leaves them, the rows ``kv_b``
    maps the normed latent with) in float64."""
    dim, heads, kv_heads = head_dim(config), config.num_attention_heads, config.num_key_value_heads
    weights = deepseek_attention_weights(attention.q_proj.weight.detach(), attention.k_proj.weight.detach(),
                                         attention.v_proj.weight.detach(), heads, kv_heads, dim, mix,
                                         rank, covariance, balance, inputs if pin else None)
    if fit is None:
        return weights, weights['up']
    down, rows = latent_norm_fit(fit, weights['up'], weights['kv_a_proj_with_mqa.weight'][:rank],
                                 weights['targets'], inputs)
    weights['kv_a_proj_with_mqa.weight'] = torch.cat([down, weights['kv_a_proj_with_mqa.weight'][rank:]])
    return weights, rows


def pin_helps(attention, config, mix: torch.Tensor, rank: int, covariance: torch.Tensor,
              balance: str, fit: str, inputs: torch.Tensor) -> tuple[bool, dict[bool, float]]:
    """Whether a pin channel lowers the layer's key and value error through the latent norm on tokens it was not
    fitted on (fitted on one half of ``inputs``, measured on the other); and both errors (relative)."""
    half = inputs.shape[0] // 2
    fitted_on, held_out = inputs[:half].double(), inputs[half:].double()
    errors = {}
    for pin in (False, True):
        weights, rows = _fitted(attention, config, mix, rank, covariance, balance, fit, fitted_on, pin)
        errors[pin] = normed_latent_error(weights['targets'], weights['kv_a_proj_with_mqa.weight'][:rank], rows,
                                          held_out)
    return errors[True] < errors[False], errors


def layer_weights(attention, config, mix: torch.Tensor, rank: int,
                  covariance: torch.Tensor | None, balance: str, fit: str | None,
                  inputs: torch.Tensor | None, pin: bool = False) -> dict[str, torch.Tensor]:
    """One attention's DeepSeek weights (float32). ``fit`` None keeps ``kv_b`` = ``up`` for the latent un-normed
    (the exact part of the conversion, for tests that replace the latent norm by the identity). ``pin`` adds the
    pin channel, its direction from ``inputs`` (sampled attention inputs)."""
    dim, heads, kv_heads = head_dim(config), config.num_attention_heads, config.num_key_value_heads
    weights, rows = _fitted(attention, config, mix, rank, covariance, balance, fit, inputs, pin)
    return {'q_proj.weight': weights['q_proj.weight'].float(),
            'kv_a_proj_with_mqa.weight': weights['kv_a_proj_with_mqa.weight'].float(),
            'kv_a_layernorm.weight': torch.ones(rank, device=rows.device),
            'kv_b_proj.weight': kv_b_weight(rows, heads, kv_heads, dim).float(),
            'o_proj.weight': attention.o_proj.weight.detach().float()}


def quantizable(settings: DeepseekSettings, numbers: int, dim: int) -> bool:
    """Whether the split is the quantizable one: as asked, or by default up to QUANTIZABLE_BY_DEFAULT_UP_TO of the
    source's cache when the budget holds a latent and a key of whole blocks."""
    if settings.quantizable_cache is not None:
        return settings.quantizable_cache
    return (settings.cache_fraction <= QUANTIZABLE_BY_DEFAULT_UP_TO + 1e-6
            and bool(_block_keys(numbers // QUANTIZED_CACHE_BLOCK * QUANTIZED_CACHE_BLOCK, dim)))


def _block_keys(numbers: int, dim: int) -> list[int]:
    block = QUANTIZED_CACHE_BLOCK
    return list(range(block, min(dim, numbers - block) + 1, block))


def quantizable_split(numbers: int, dim: int, rope_pairs: int | None) -> tuple[int, int]:
    """(key pairs, latent rank) whose K head (rank + key) and V head (rank) are whole QUANTIZED_CACHE_BLOCKs, within
    ``numbers`` rounded down to whole blocks; the key ``2 * rope_pairs`` when given, else the block multiple nearest
    QUANTIZABLE_KEY_SHARE of the numbers."""
    block = QUANTIZED_CACHE_BLOCK
    numbers = numbers // block * block
    keys = _block_keys(numbers, dim)
    if not keys:
        raise ConfigError(f'convert --format deepseek --quantizable-cache: the budget\'s {numbers} numbers per token '
                          f'and layer, in whole {block}-value blocks, do not split into a latent and a RoPE key of at '
                          f'least one block each (the key at most the {dim}-dim head); raise --cache-fraction')
    if rope_pairs is not None:
        if 2 * rope_pairs not in keys:
            raise ConfigError(f'convert --format deepseek --quantizable-cache: --rope-pairs {rope_pairs} gives a '
                              f'{2 * rope_pairs}-dim key; it must be one of {keys} (dims, whole {block}-value blocks)')
        key = 2 * rope_pairs
    else:
        key = min(keys, key=lambda width: (abs(width - QUANTIZABLE_KEY_SHARE * numbers), width))
    return key // 2, numbers - key


def choose_shared_key(cross_energies: list[torch.Tensor], dim: int, pairs: int,
                      fold: int, strides: list[int] | None = None) -> tuple[int, list[torch.Tensor], list[float]]:
    """(the stride, each layer's ``mix`` at it, each layer's share of its key energy kept rotated): of ``strides``
    (default: every stride the pairs fit), the one whose shared key keeps the most key energy, summed over layers as
    shares (layers of different scale count alike)."""
    # each layer's whole key energy: the trace of its (pair, head) x (pair, head) energy
    totals = [float(cross.flatten(0, 1).flatten(1, 2).trace()) for cross in cross_energies]
    best = None
    for stride in strides or stride_choices(dim, pairs):
        slots = strided_pairs(pairs, stride)
        mixes, shares = [], []
        for cross, total in zip(cross_energies, totals):
            mix, kept = shared_key_mix(cross, slots, fold, stride)
            mixes.append(mix)
            shares.append(kept / total if total > 0 else 0.0)
        if best is None or sum(shares) > sum(best[2]):
            best = (stride, mixes, shares)
    return best


def convert_to_deepseek(model_dir: str | Path, out_dir: str | Path, settings: DeepseekSettings, *,
                        overwrite: bool = False) -> dict:
    """Convert and save; returns a report (rank, RoPE key, stride, cache numbers against the source and MHA, and the
    choice of split and balance with every candidate's loss on the val split)."""
    if not 0 < settings.cache_fraction <= 1:
        raise ConfigError(f'convert --format deepseek: --cache-fraction must be in (0, 1], got {settings.cache_fraction}')
    if settings.latent_norm_fit not in LATENT_NORM_FITS:
        raise ConfigError(f"convert --format deepseek: --latent-norm-fit must be one of {', '.join(LATENT_NORM_FITS)}")
    if settings.balance is not None and settings.balance not in BALANCES:
        raise ConfigError(f"convert --format deepseek: --balance must be one of {', '.join(BALANCES)}")
    if not settings.pin and settings.latent_norm_fit == 'linear':
        raise ConfigError('convert --format deepseek: --no-latent-pin applies to --latent-norm-fit regression or '
                          'scalar; the linear fit (the default) has no pin channel')
    if settings.freq_fold < 1:
        raise ConfigError(f'convert --format deepseek: --freq-fold must be at least 1, got {settings.freq_fold}')
    if settings.choose_tokens < 0:
        raise ConfigError(f'convert --format deepseek: --choose-tokens must be >= 0, got {settings.choose_tokens}')
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_model_folder(model_dir, who='convert --format deepseek')
    refuse_nonempty(out_dir, overwrite)
    config = load_source_config(model_dir, who='convert --format deepseek')
    check_source(config)
    if settings.data is None:
        raise ConfigError('convert --format deepseek needs calibration data (--data): the shared RoPE key, the '
                          'latent and its norm fit are taken from the source\'s attention inputs')
    options = candidates(settings.quantizable_cache, settings.balance, quantizable_fits(config, settings))
    fixed = fixed_candidate(config, settings)
    for option in options + [fixed]:  # every budget is checked before any work
        budget(config, replace(settings, quantizable_cache=option.quantizable_cache))
    sequences = choice_sequences(settings.data, settings.choose_tokens) if len(options) > 1 else []
    fixed_because = None if sequences else _why_fixed(settings, len(options))
    if not sequences:
        options = [fixed]
    model, _ = load_source_model(model_dir, config, device=settings.device, who='convert --format deepseek')
    batches = calibration_batches(model_dir, config, data=settings.data, split=settings.split,
                                  batch_size=settings.batch_size, seed=settings.seed, who='convert --format deepseek')
    try:
        calibration = calibrate(model, batches, num_tokens=settings.tokens, kinds=('input',),
                                sample_tokens=min(settings.sample_tokens, settings.tokens), seed=settings.seed)
    except CalibrationError as exc:
        raise CalibrationError(f'convert --format deepseek: {exc}') from exc
    model = model.cpu().float()
    dim, kv_heads = head_dim(config), config.num_key_value_heads
    layers = attention_modules(model)
    covariances, cross_energies = [], []
    for index, attention in enumerate(layers):
        running = calibration.layer(index, 'input').running
        covariances.append((running.gram / running.count).double().cpu())
        cross_energies.append(pair_key_cross_energy(attention.k_proj.weight.detach(), covariances[-1], kv_heads, dim))

    losses, best, kept = [], None, None  # every candidate's loss; the lowest so far (the first of equals) and its build
    for option in options:
        chosen = replace(settings, quantizable_cache=option.quantizable_cache, balance=option.balance)
        built = _converted_model(model, config, calibration, covariances, cross_energies, chosen)
        if len(options) > 1:
            values = mean_token_losses(built[0].eval(), sequences)
            losses.append((option, sum(values) / len(values)))
        if best is None or losses[-1][1] < dict(losses)[best]:
            best, kept = option, built  # the others are let go
    del model
    converted, report = kept
    report['choice'] = ({'chosen': best.label, 'on': f'the val split of {settings.data}: {len(sequences)} sequences, '
                                                     f'{sum(map(len, sequences))} tokens',
                         'losses': {option.label: loss for option, loss in losses}} if losses else
                        {'chosen': best.label, 'on': fixed_because})
    with staged_folder(out_dir, overwrite) as staging:
        converted.save_pretrained(staging, safe_serialization=True)
        write_model_card(staging, name=out_dir.name, method='mla_deepseek', source=model_dir, stage=card_stage(
            'convert --method mla --format deepseek', calibration_tokens=report['calibration_tokens'],
            latent_norm_fit=settings.latent_norm_fit, split_and_balance=report['choice']))
        if (model_dir / 'tokenizer_config.json').is_file():
            load_tokenizer_folder(model_dir, 'convert --format deepseek').save_pretrained(staging)
    return report


def _why_fixed(settings: DeepseekSettings, options: int) -> str:
    if options == 1:
        return 'as asked (--quantizable-cache and --balance, or the one split the budget allows with --balance)'
    if settings.choose_tokens == 0:
        return 'the fixed defaults (--choose-tokens 0)'
    return f'the fixed defaults ({settings.data} has no val split to choose on)'


def _converted_model(model, config, calibration, covariances: list[torch.Tensor],
                     cross_energies: list[torch.Tensor], settings: DeepseekSettings) -> tuple[DeepseekV3ForCausalLM, dict]:
    """The DeepSeek-format model of ``settings``' split and balance from one calibration pass, and its report."""
    pairs, rank, source_values, quantized = budget(config, settings)
    dim = head_dim(config)
    layers = attention_modules(model)
    # the quantizable split keeps its key at stride 1: stride 2 kept more key energy at a third and lost 0.23 nats
    stride, mixes, kept_shares = choose_shared_key(cross_energies, dim, pairs, settings.freq_fold,
                                                   [1] if quantized else None)
    kept = strided_pairs(pairs, stride)
    ds_config = deepseek_config(config, rank, pairs, stride)
    state = {name: tensor for name, tensor in model.state_dict().items() if '.self_attn.' not in name}
    pinned, pin_errors = [], []
    for index, attention in enumerate(layers):
        inputs = calibration.layer(index, 'input').sample.double().cpu()
        pin = False
        if settings.pin and settings.latent_norm_fit != 'linear':
            pin, errors = pin_helps(attention, config, mixes[index], rank, covariances[index],
                                    settings.balance, settings.latent_norm_fit, inputs)
            pin_errors.append({'unpinned': errors[False], 'pinned': errors[True]})
        if pin:
            pinned.append(index)
        weights = layer_weights(attention, config, mixes[index], rank, covariances[index],
                                settings.balance, settings.latent_norm_fit, inputs, pin)
        state.update({f'model.layers.{index}.self_attn.{name}': tensor for name, tensor in weights.items()})
    converted = DeepseekV3ForCausalLM(ds_config)
    missing, unexpected = converted.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (name == 'lm_head.weight' and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f'deepseek conversion: weights do not match (missing {missing[:4]}, unexpected '
                           f'{unexpected[:4]})')
    cached = config.num_hidden_layers * (rank + 2 * pairs)
    report = {'kv_lora_rank': rank, 'qk_rope_head_dim': 2 * pairs, 'rope_stride': stride, 'rope_pairs': kept,
              'quantizable_cache': quantized, 'freq_fold': settings.freq_fold,
              'rope_theta': ds_config.rope_theta, 'latent_norm_fit': settings.latent_norm_fit, 'pinned_layers': pinned,
              'layer_pin_errors': pin_errors, 'latent_norm_eps': LATENT_NORM_EPS, 'balance': settings.balance,
              'rope_energy_kept': sum(kept_shares) / len(kept_shares), 'cache_values_per_token': cached,
              'source_values_per_token': config.num_hidden_layers * source_values,
              'fraction_of_source': cached / (config.num_hidden_layers * source_values),
              'fraction_of_mha': cached / (config.num_hidden_layers * 2 * config.num_attention_heads * dim),
              'calibration_tokens': calibration.tokens}
    return converted, report

"""The conversion-method registry: everything a method adds to the common path, recorded in one place.

A method turns a source model of any family (``dha_train.families``; MHA or GQA) into cheaper attention. For each one this records:

- ``name``: the tag its training-time surgery writes into the HF config (``dha_train_method``) at ``Event.INIT``, so a
  checkpoint says which method made it (``tag_method``);
- ``algorithm``: the Composer algorithm (a ``dha_train.registry.algorithms`` name) that does that surgery, if any;
- ``export``: ``(config, weights) -> (config, weights)``, the checkpoint of that surgery turned into the model it
  stands for (DHA: fusion baked into compact heads; aligned GQA: the group heads only; MoH: the MoH class);
- ``model_type``: the HF ``model_type`` of its exports. ``builders.build_model_config`` accepts exactly the plain
  LLaMA plus these as a starting point for further training (their classes are registered with the transformers
  Auto classes by ``dha_train.models``);
- ``kv_cache_bytes``: the KV-cache size of one of its models, from the HF config (default: the head map the config
  serves, ``HeadMap.from_hf_config``).

Adding a method adds one ``register(Method(...))`` below; see "Adding a method" in docs/developing.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig

from dha_train import families
from dha_train.errors import DhaTrainError
from dha_train.models.head_map import HeadMap
from dha_train.models.llama_layout import head_dim
from dha_train.models.modeling_dha import DhaLlamaConfig
from dha_train.models.modeling_moh import MohLlamaConfig
from dha_train.models.transfer import transfer_to_gqa_state_dict
from dha_train.ops.deepseek import LATENT_NORM_EPS, latent_eps_scale, scale_latent_rows
from dha_train.ops.fusion import bake_llama_state_dict
from dha_train.ops.mla import cache_values_per_token

# Modules that healing algorithms add to a model for training only (attention_transfer's frozen source attention in
# each decoder layer): every export drops their weights, so the exported model is the converted one alone.
TRAINING_ONLY_MODULES = ('transfer_source',)
METHOD_TAG = 'dha_train_method'  # HF config attribute naming the method whose surgery a checkpoint holds
# HF config attribute of a DeepSeek-format model in training: each layer's latent norm eps
# (``ops.deepseek.latent_training_eps``); the export scales the latent rows back to transformers' own eps
LATENT_TRAINING_EPS = 'dha_latent_norm_eps'
BASE_MODEL_TYPE = 'llama'

Weights = dict
Export = Callable[[PretrainedConfig, Weights], tuple[PretrainedConfig, Weights]]


class MethodError(DhaTrainError, ValueError):
    """An unknown method tag, or a checkpoint its method cannot export."""


def head_map_kv_cache_bytes(config, seq_len: int, bytes_per_value: int) -> int:
    """K+V bytes of one sequence for any config that serves a head map (plain, GQA, DHA, AsymGQA, MoH)."""
    return HeadMap.from_hf_config(config).kv_cache_bytes(1, seq_len, bytes_per_value)


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    model_type: str = BASE_MODEL_TYPE
    algorithm: str | None = None
    export: Export | None = None
    kv_cache_bytes: Callable[[PretrainedConfig, int, int], int] = head_map_kv_cache_bytes
    # Migration: recognises a checkpoint of this method's surgery written before methods were tagged (dha_train
    # 0.1.0 up to the method registry), so such checkpoints still export.
    untagged: Callable[[PretrainedConfig, Weights], bool] | None = None


_METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in _METHODS:
        raise ValueError(f'method {method.name!r} is registered twice')
    _METHODS[method.name] = method
    return method


def get(name: str) -> Method:
    if name not in _METHODS:
        raise MethodError(f"unknown conversion method '{name}' (known: {', '.join(sorted(_METHODS))})")
    return _METHODS[name]


def names() -> list[str]:
    return sorted(_METHODS)


def trainable_model_types() -> list[str]:
    """HF model types a run may start from: every source family and every method's export."""
    return sorted({*families.supported()} | {method.model_type for method in _METHODS.values()})


def tag_method(config: PretrainedConfig, name: str) -> None:
    """Record in ``config`` (and so in every checkpoint) that ``name``'s surgery has been applied."""
    get(name)
    setattr(config, METHOD_TAG, name)


def method_of(config: PretrainedConfig, weights: Weights | None = None) -> Method | None:
    """The method whose training-time surgery a checkpoint's config records, or None for a plain model. An
    untagged checkpoint (written before the tag existed) is recognised by the methods' ``untagged`` checks."""
    name = getattr(config, METHOD_TAG, None)
    if name is not None:
        return get(name)
    if weights is not None:
        for method in _METHODS.values():
            if method.untagged is not None and method.untagged(config, weights):
                return method
    return None


def export_model(config: PretrainedConfig, weights: Weights) -> tuple[PretrainedConfig, Weights]:
    """A checkpoint's (config, weights) -> the exportable model's: its method's export, or unchanged when the
    checkpoint holds no surgery. The exported config no longer carries the tag (the surgery is undone or baked).
    Weights of ``TRAINING_ONLY_MODULES`` are dropped first."""
    if any(f'.{module}.' in name for name in weights for module in TRAINING_ONLY_MODULES):
        weights = {name: value for name, value in weights.items()
                   if not any(f'.{module}.' in name for module in TRAINING_ONLY_MODULES)}
    method = method_of(config, weights)
    if method is not None and method.export is not None:
        try:
            config, weights = method.export(config, weights)
        except ValueError as exc:
            raise MethodError(f'{method.name} export: {exc}') from exc
    if hasattr(config, METHOD_TAG):
        delattr(config, METHOD_TAG)
    return config, weights


def kv_cache_bytes(config: PretrainedConfig, seq_len: int = 4096, bytes_per_value: int = 2) -> int:
    """K+V bytes per sequence of ``seq_len`` tokens (bf16 by default) of any model the project trains or exports,
    by the method whose exports have this ``model_type``."""
    for method in _METHODS.values():
        if method.model_type == config.model_type and method.model_type != BASE_MODEL_TYPE:
            return method.kv_cache_bytes(config, seq_len, bytes_per_value)
    return head_map_kv_cache_bytes(config, seq_len, bytes_per_value)


# --- the methods ------------------------------------------------------------------------------------------------


def _llama_settings(config: PretrainedConfig) -> dict:
    """A config's fields without its class identity or method tag, to rebuild it as another LLaMA variant."""
    return {k: v for k, v in config.to_dict().items()
            if k not in ('model_type', 'architectures', 'auto_map', METHOD_TAG)}


def _bake_fusion(config, weights):
    """DHA Fusion (``HeadFusion``'s omega in the K/V projections): omega averaged within each group, one compact
    K/V head per group (``ops.fusion.bake_llama_state_dict``), served by the DHA model."""
    baked, key_partitions, value_partitions = bake_llama_state_dict(weights, head_dim(config))
    # The partitions are over the source's K/V heads (the query heads for MHA, the shared heads for GQA).
    head_map = HeadMap.from_source_partitions(HeadMap.from_hf_config(config), key_partitions, value_partitions)
    # The source family's settings and name (its decoder serves the DHA model; q/k norms and biases are kept).
    return DhaLlamaConfig.for_source(config, head_map.to_dict(), drop=(METHOD_TAG,)), baked


def _keep_group_heads(config, weights):
    """Aligned GQA's pruning run (``KVHeadTransfer``): with every gate frozen at 0, only the group heads remain, a
    standard HF GQA model of the source's own family."""
    weights, num_kv_heads = transfer_to_gqa_state_dict(weights, head_dim(config))
    config_class = families.of(config, 'aligned_gqa export').config_class
    return config_class(**{**_llama_settings(config), 'num_key_value_heads': num_kv_heads}), weights


def _as_moh_model(config, weights):
    """MoH continue-tuning (``MixtureOfHeads``): the same weights (plus routers) under the MoH model class, whose
    config carries the routing settings the algorithm wrote."""
    if config.model_type == 'moh_llama':
        return config, weights
    return MohLlamaConfig.from_source(config), weights  # inside the source family's decoder (source_model_type)


register(Method('mean_pool', 'GQA baseline: mean-pool the K/V heads of each group (`dha-train convert`); '
                'non-uniform or decoupled maps become a DHA model', model_type='dha_llama'))
register(Method('asym_gqa', 'AsymGQA: activation-informed groups of unequal size (`dha-train search --method asym`), '
                'served by the DHA model', model_type='dha_llama'))
def _has_weight(suffix: str) -> Callable[[PretrainedConfig, Weights], bool]:
    return lambda config, weights: any(name.endswith(suffix) for name in weights)


register(Method('dha', 'DHA: Search -> Fusion (head_fusion) -> baked compact heads', model_type='dha_llama',
                algorithm='head_fusion', export=_bake_fusion, untagged=_has_weight('.k_proj.omega')))
register(Method('aligned_gqa', 'Aligned GQA: Procrustes alignment (`dha-train align`), then L0 transfer '
                '(kv_head_transfer) onto the group heads', model_type=BASE_MODEL_TYPE, algorithm='kv_head_transfer',
                export=_keep_group_heads, untagged=_has_weight('.k_proj.group_weight')))
register(Method('moh', 'MoH: shared + routed heads, continue-tuned from MHA (mixture_of_heads)',
                model_type='moh_llama', algorithm='mixture_of_heads', export=_as_moh_model,
                untagged=lambda config, weights: getattr(config, 'moh_router', None) is not None))


def _mla_kv_cache_bytes(config, seq_len: int, bytes_per_value: int) -> int:
    """MLA caches each layer's latent plus the kept rotated key dims of each K/V head, and for a family with a
    per-head k_norm (Qwen3, Gemma 3) each K/V head's key scale (``ops.mla.key_scales_per_layer``)."""
    pairs = [len(layer[0]) for layer in config.mla_rope_pairs]
    key_norm_head_dim = head_dim(config) if families.of(config, 'mla kv bytes').qk_norm else None
    return cache_values_per_token(config.mla_ranks, pairs, config.num_key_value_heads,
                                  key_norm_head_dim) * seq_len * bytes_per_value


register(Method('mla', 'MLA: partial RoPE + joint K/V latent (`dha-train convert --method mla`), served by the MLA '
                'model', model_type='mla_llama', kv_cache_bytes=_mla_kv_cache_bytes))


def _deepseek_kv_cache_bytes(config, seq_len: int, bytes_per_value: int) -> int:
    """DeepSeek's MLA caches each layer's latent plus one shared rotated key (in an engine that caches the latent;
    transformers' own class caches the expanded keys and values)."""
    return config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * seq_len * bytes_per_value


def _deepseek_engine_form(config, weights):
    """A DeepSeek-format model trained at its training eps (``builders``, ``ops.deepseek.latent_training_eps``)
    -> the same function at transformers' own latent norm eps: each layer's latent rows scaled back."""
    training_eps = getattr(config, LATENT_TRAINING_EPS, None)
    if training_eps is None:
        return config, weights
    if len(training_eps) != config.num_hidden_layers:
        raise ValueError(f'{LATENT_TRAINING_EPS} has {len(training_eps)} layers, the model {config.num_hidden_layers}')
    weights = dict(weights)
    for index, eps in enumerate(training_eps):
        name = f'model.layers.{index}.self_attn.kv_a_proj_with_mqa.weight'
        weights[name] = scale_latent_rows(weights[name], config.kv_lora_rank, latent_eps_scale(LATENT_NORM_EPS, eps))
    delattr(config, LATENT_TRAINING_EPS)
    return config, weights


register(Method('mla_deepseek', 'MLA in DeepSeek\'s format (`dha-train convert --method mla --format deepseek`): a '
                'shared RoPE key and a normed latent, served by transformers\' own DeepseekV3ForCausalLM; trained '
                'at a latent norm eps that puts the latent rows at the scale of the others (builders)',
                model_type='deepseek_v3', export=_deepseek_engine_form, kv_cache_bytes=_deepseek_kv_cache_bytes))

"""What a model config declares, checked against the weights that back it before a model is built.

A config (a model folder's ``config.json``, or the Hugging Face config a checkpoint carries) is data. Sizes that are
not numbers (``hidden_size: "eight"``) end in a traceback deep in transformers, and sizes that ask for a 52 GB model
beside 40 KB of weights make transformers allocate the declared model before it finds the weights do not fit. So,
before anything is built:

- ``check_config_sizes``: every size field of the project's model types is absent, null, or a whole number (the
  widths, counts and heads a model is built from at least 1);
- ``check_parameter_budget``: the model the config builds, counted on the meta device (no memory), has no more
  parameters than the weights beside it can hold at ``MIN_BYTES_PER_PARAMETER`` (float weights take two or four
  bytes: the margin is for dtypes). A cheap bound (the embedding and two norms a layer, which every model type has)
  comes first, so a config of a billion layers is refused without building them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dha_train.distributed import causal_lm_on_meta
from dha_train.untrusted import UntrustedDataError

# Sizes a model of the project's types is built from: absent, null or a whole number >= 1.
POSITIVE_SIZES = ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
                  'num_key_value_heads', 'head_dim', 'max_position_embeddings')
# DeepSeek's (and MLA's) ranks, widths and expert counts: absent, null or a whole number >= 0.
COUNT_SIZES = ('kv_lora_rank', 'q_lora_rank', 'qk_rope_head_dim', 'qk_nope_head_dim', 'v_head_dim',
               'moe_intermediate_size', 'n_shared_experts', 'n_routed_experts', 'num_experts_per_tok', 'n_group',
               'topk_group', 'first_k_dense_replace')
# The fewest bytes a stored parameter takes in a folder the project loads (8-bit; float weights take 2 or 4).
MIN_BYTES_PER_PARAMETER = 1


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config_sizes(config: Mapping[str, Any], where: str) -> None:
    """Refuse a config whose size fields are not whole numbers (``POSITIVE_SIZES`` at least 1, ``COUNT_SIZES`` at
    least 0); ``where`` names the file."""
    for keys, least in ((POSITIVE_SIZES, 1), (COUNT_SIZES, 0)):
        for key in keys:
            value = config.get(key)
            if value is not None and not (_whole(value) and value >= least):
                raise UntrustedDataError(f'{where}: {key} is {value!r:.60}, not a whole number of at least {least}')


def parameter_count(config) -> int:
    """The parameters of the causal LM ``config`` builds (its class: LLaMA, DHA, MoH, MLA or DeepSeek), counted on
    the meta device: nothing is allocated."""
    return sum(parameter.numel() for parameter in causal_lm_on_meta(config).parameters())


def check_parameter_budget(config, weight_bytes: int, where: str) -> int:
    """Refuse ``config`` unless the model it builds fits in ``weight_bytes`` of weights at ``MIN_BYTES_PER_PARAMETER``
    (nothing is allocated: the model is counted on the meta device, after a bound that needs no build). Returns the
    parameter count."""
    budget = weight_bytes // MIN_BYTES_PER_PARAMETER
    hidden, layers = config.hidden_size, config.num_hidden_layers
    floor = config.vocab_size * hidden + 2 * hidden * layers  # the embedding, and every layer's two norms
    if floor > budget:
        raise UntrustedDataError(_too_large(where, f'at least {floor:,}', weight_bytes))
    try:
        count = parameter_count(config)
    except Exception as exc:  # a config that builds no model raises anything from the model's own code
        lines = str(exc).strip().splitlines()
        raise UntrustedDataError(f"{where}: the config builds no model ({type(exc).__name__}: "
                                 f"{lines[0][:160] if lines else ''})") from exc
    if count > budget:
        raise UntrustedDataError(_too_large(where, f'{count:,}', weight_bytes))
    return count


def _too_large(where: str, count: str, weight_bytes: int) -> str:
    return (f'{where}: the config declares a model of {count} parameters, more than its {weight_bytes:,} bytes of '
            f'weights hold (at {MIN_BYTES_PER_PARAMETER} byte a parameter or more); dha-train builds nothing the '
            'weights do not back')

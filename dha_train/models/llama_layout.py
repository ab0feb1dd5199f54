"""Reading the layout of an HF LLaMA-style model or config: the one place that knows where things sit.

``head_dim`` of a config, the HF model inside a Composer wrapper, every layer's attention module, and which modules
are decoder blocks (FSDP2's wrap units).
"""

from __future__ import annotations

from torch import nn

from dha_train.errors import DhaTrainError


class LayoutError(DhaTrainError, ValueError):
    """A model that is not a LLaMA-style causal LM (no ``model.layers[i].self_attn``)."""


def head_dim(config) -> int:
    """Per-head width: the config's ``head_dim`` when it sets one, else hidden_size / num_attention_heads."""
    return getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads


def attention_head_widths(config) -> tuple[int, int]:
    """(query/key, value) width of one attention head. DeepSeek's format (``deepseek_v3``) has a query/key head of
    ``qk_nope_head_dim + qk_rope_head_dim`` and a value head of ``v_head_dim``; transformers sets its ``head_dim`` to
    ``qk_rope_head_dim``, which is neither."""
    if getattr(config, 'model_type', None) == 'deepseek_v3':
        return config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    width = head_dim(config)
    return width, width


def mha_kv_values(config) -> int:
    """K+V values one token caches per layer in the model's MHA form: every query head with its own K and V head. For
    DeepSeek's format that is the source's MHA, whose head width the conversion keeps as ``qk_nope_head_dim`` and
    ``v_head_dim`` (the shared RoPE key is the conversion's own)."""
    if getattr(config, 'model_type', None) == 'deepseek_v3':
        return config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim)
    return 2 * config.num_attention_heads * head_dim(config)


def hf_model(model: nn.Module) -> nn.Module:
    """The HF causal LM itself, whether given bare or inside Composer's ``HuggingFaceModel`` wrapper."""
    return model if hasattr(model, 'lm_head') else model.model


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer of an HF LLaMA-style causal LM (bare or wrapped)."""
    # A Composer wrapper, a causal LM or a bare decoder stack: the first of them that holds the layers.
    inner = getattr(model, 'model', None)
    layers = next((c.layers for c in (model, inner, getattr(inner, 'model', None)) if hasattr(c, 'layers')), None)
    if layers is None or not all(hasattr(layer, 'self_attn') for layer in layers):
        raise LayoutError(f'{type(model).__name__} has no model.layers[i].self_attn; a LLaMA-style causal LM is '
                          'needed')
    return [layer.self_attn for layer in layers]


TRAINABLE = ('attention', 'all')  # what a healing stage trains: the attention modules alone, or every parameter


def train_only_attention(model: nn.Module) -> None:
    """Freeze every parameter but the attention modules' (healing stages that train the converted attention)."""
    model.requires_grad_(False)
    for attention in attention_modules(model):
        attention.requires_grad_(True)


def is_decoder_block(module: nn.Module) -> bool:
    """FSDP2 shards each decoder layer as its own unit. By class name, so attention variants that subclass or
    replace the decoder layer are wrapped the same way."""
    return type(module).__name__.endswith('DecoderLayer')

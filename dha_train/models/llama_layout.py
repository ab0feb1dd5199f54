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

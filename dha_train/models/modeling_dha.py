"""Decoupled-head attention (DHA) for HF transformers, inside the decoder of any source family.

Every layer has its own number of key heads and of value heads; a head map says which compact key head and which
compact value head each query head reads. MHA (identity map), GQA and AsymGQA are special cases.

The model is the source family's own decoder stack (``source_model_type``: llama, mistral, qwen2, qwen3 or
gemma3_text; absent means llama): its embeddings (Gemma's scaled ones), its decoder layers (norms, MLP), its rotary
embeddings (Gemma's local/global pair) and its forward, with only each layer's ``self_attn`` replaced by
``DhaLlamaAttention``. That module takes from the family's own attention its q/o projections, q/k norms (applied
before RoPE, after the compact K projection), scale and sliding window; its K/V projections have the compact head
counts, with biases where the family has them.

The KV cache stores only the compact heads, so a model at a 25% KV-head budget holds 25% of MHA's cache.

- **Decode** (one new token over a cache, eval mode) attends grouped by compact head and reads each cached head once:
  the scores per key head for the query heads that read it, the softmax per query head, the values per value head
  for the query heads that read it (``grouped_attention``). No K/V tensor of query-head size is built, so a step
  reads the small cache only, which is what makes a smaller cache decode faster.
- **Training and prefill** expand the compact K/V to the query heads and call the standard kernels (SDPA, eager,
  flash-attention-2) as plain MHA (``expanded_attention``): there the copy is the size of the queries, and the fused
  kernels are worth more than avoiding it.

This file is self-contained (torch and transformers only, plus ``family_classes.py``, the table of the families'
transformers classes, which it imports relatively): ``save_pretrained`` copies both next to the weights (transformers
copies a modeling file's relative imports with it, and fetches them again for ``trust_remote_code``), so an exported
model loads with ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` anywhere. It runs under
transformers 4.5x and 5.x alike (tests/commands/test_export_transformers5.py loads exports in both).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .family_classes import FAMILY_CLASSES, FamilyClasses, family_classes

# Settings a family's config class defines that a DHA config does not take from it: the K/V head count is the head
# map's, per layer.
_NOT_FROM_FAMILY = ("num_key_value_heads", "model_type", "architectures", "auto_map", "transformers_version")


@functools.lru_cache(maxsize=1)
def _omissible_keys() -> frozenset[str]:
    """Keys that ``PretrainedConfig.to_diff_dict`` leaves out of a saved config when their value equals both
    PretrainedConfig's and LlamaConfig's default (``pad_token_id`` None, ...). A DHA config of another family saves
    those of them that differ from its family's defaults (``DhaLlamaConfig.to_diff_dict``), so that a key a loaded
    config lacks means the family's default."""
    base, llama = PretrainedConfig().to_dict(), LlamaConfig().to_dict()
    return frozenset(key for key, value in base.items() if llama.get(key, value) == value)


def _family_defaults(classes: FamilyClasses, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The source family's config defaults for the settings ``kwargs`` lacks (Gemma 3's query_pre_attn_scalar,
    layer_types, rope_local_base_freq, pad_token_id, ...), derived by the family's own config class from the
    settings given."""
    if classes.config is LlamaConfig:
        return {}
    family = classes.config(**kwargs).to_dict()
    return {key: value for key, value in family.items() if key not in kwargs and key not in _NOT_FROM_FAMILY}


class DhaLlamaConfig(LlamaConfig):
    """A ``LlamaConfig`` plus ``head_map`` and ``source_model_type``, holding every setting of the source family's
    config (built from its full ``to_dict()``; the family's defaults fill any it lacks).

    ``head_map`` is ``{'head_dim': d, 'num_query_heads': H, 'layers': [{'key': [...], 'value': [...]}, ...]}``:
    per layer, for every query head, the index of its compact key head and of its compact value head. ``None`` means
    MHA (every query head has its own key and value head). ``source_model_type`` names the family whose decoder the
    model is built from (a key of ``family_classes.FAMILY_CLASSES``; None means llama); given a source config's dict
    (``to_dict()`` or ``to_diff_dict()``) instead, its ``model_type`` names the family. ``for_source`` builds one
    from a source config.
    """

    model_type = "dha_llama"

    def __init__(self, head_map: Optional[dict[str, Any]] = None, source_model_type: Optional[str] = None, **kwargs):
        # A source config's own dict names its family in model_type (``DhaLlamaConfig(**qwen2_config.to_dict())``); a
        # saved DHA config's says dha_llama. Either way the instance keeps the class's model_type.
        named = kwargs.pop("model_type", None)
        if source_model_type is None and named in FAMILY_CLASSES:
            source_model_type = named
        if source_model_type is not None:
            kwargs = {**_family_defaults(family_classes(source_model_type), kwargs), **kwargs}
        super().__init__(**kwargs)
        self.source_model_type = source_model_type
        self.head_map = head_map
        if head_map is not None:
            self._validate_head_map()
    @classmethod
    def for_source(cls, source: PretrainedConfig, head_map: Optional[dict[str, Any]],
                   drop: tuple[str, ...] = ()) -> "DhaLlamaConfig":
        """The DHA config of a model converted from ``source`` (a family's config, or a project config that names
        its family in ``source_model_type``): every setting of ``source.to_dict()`` but its class identity, its K/V
        head count and the keys in ``drop``, with ``head_map`` and the family."""
        model_type = getattr(source, "model_type", None)
        family = model_type if model_type in FAMILY_CLASSES else getattr(source, "source_model_type", None)
        family_classes(family)  # a family outside the table is refused here
        settings = {key: value for key, value in source.to_dict().items()
                    if key not in _NOT_FROM_FAMILY and key not in drop
                    and key not in ("head_map", "source_model_type")}
        return cls(head_map=head_map, source_model_type=family or "llama", **settings)

    def to_diff_dict(self) -> dict[str, Any]:
        """transformers' diff, plus the keys it drops as LLaMA's defaults where the source family's defaults differ
        (Gemma 3's ``pad_token_id`` None), so that loading fills only what was the family's default."""
        diff = super().to_diff_dict()
        classes = family_classes(self.source_model_type)
        if classes.config is not LlamaConfig:
            full, family = self.to_dict(), classes.config().to_dict()
            diff.update({key: full[key] for key in sorted(_omissible_keys())
                         if key in full and key not in diff and family.get(key) != full[key]})
        return diff

    def _validate_head_map(self) -> None:
        head_map = self.head_map
        if not isinstance(head_map, dict) or not isinstance(head_map.get("layers"), list):
            raise ValueError(f"DhaLlamaConfig.head_map must be a dict with a 'layers' list, got {head_map!r}")
        layers = head_map["layers"]
        if len(layers) != self.num_hidden_layers:
            raise ValueError(
                f"DhaLlamaConfig.head_map has {len(layers)} layers but num_hidden_layers={self.num_hidden_layers}"
            )
        if "head_dim" in head_map and head_map["head_dim"] != self.head_dim:
            raise ValueError(f"DhaLlamaConfig.head_map has head_dim={head_map['head_dim']} but the model has "
                             f"head_dim={self.head_dim}")
        if head_map.get("num_query_heads", self.num_attention_heads) != self.num_attention_heads:
            raise ValueError(f"DhaLlamaConfig.head_map has num_query_heads={head_map['num_query_heads']} but "
                             f"num_attention_heads={self.num_attention_heads}")
        for index, layer in enumerate(layers):
            for kind in ("key", "value"):
                mapping = layer.get(kind) if isinstance(layer, dict) else None
                if not isinstance(mapping, list) or len(mapping) != self.num_attention_heads:
                    raise ValueError(f"DhaLlamaConfig.head_map layer {index} {kind}: expected a list mapping "
                                     f"{self.num_attention_heads} query heads, got {mapping!r}")
                used = sorted(set(mapping))
                if used != list(range(len(used))):
                    raise ValueError(f"DhaLlamaConfig.head_map layer {index} {kind}: compact heads {used} must be "
                                     "0..n-1 with every head used by some query head")

    def layer_head_map(self, layer_idx: int) -> tuple[list[int], list[int]]:
        """(query head -> key head, query head -> value head) of one layer."""
        if self.head_map is None:
            identity = list(range(self.num_attention_heads))
            return identity, identity
        layer = self.head_map["layers"][layer_idx]
        return [int(h) for h in layer["key"]], [int(h) for h in layer["value"]]


class DhaLlamaAttention(nn.Module):
    """The source family's attention with K and V projections of their own (per-layer) numbers of heads.

    Built from the family's attention module of this layer (``source``; by default a new one): its q/o projections,
    its q_norm/k_norm if it has them, its scale and its sliding window are kept, and its K/V projections are replaced
    by compact ones (with a bias where the family's have one)."""

    def __init__(self, config: DhaLlamaConfig, layer_idx: int, source: Optional[nn.Module] = None):
        super().__init__()
        if source is None:
            source = family_classes(config.source_model_type).attention(config, layer_idx)
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = source.head_dim
        # K/V are expanded to all query heads before the attention call, so HF's repeat_kv must be a no-op.
        self.num_key_value_groups = 1
        self.scaling = source.scaling  # Gemma 3: query_pre_attn_scalar ** -0.5
        self.attention_dropout = source.attention_dropout
        self.is_causal = True
        # Qwen2/Qwen3/Gemma 3 state it per layer; Mistral reads its config's (one window for every layer).
        self.sliding_window = getattr(source, "sliding_window", getattr(config, "sliding_window", None))
        self.is_sliding = getattr(source, "is_sliding", self.sliding_window is not None)  # Gemma's layer reads it

        key_index, value_index = config.layer_head_map(layer_idx)
        self.num_key_heads = max(key_index) + 1
        self.num_value_heads = max(value_index) + 1
        # Not persistent: the map lives in the config, and a state dict stays a plain tensor-per-weight file.
        self.register_buffer("key_index", torch.tensor(key_index, dtype=torch.long), persistent=False)
        self.register_buffer("value_index", torch.tensor(value_index, dtype=torch.long), persistent=False)
        self._register_groups(key_index, value_index)

        self.q_proj = source.q_proj
        self.k_proj = self._compact(source.k_proj, self.num_key_heads)
        self.v_proj = self._compact(source.v_proj, self.num_value_heads)
        self.o_proj = source.o_proj
        self.q_norm = getattr(source, "q_norm", None)
        self.k_norm = getattr(source, "k_norm", None)

    def _compact(self, projection: nn.Linear, heads: int) -> nn.Linear:
        weight = projection.weight
        return nn.Linear(projection.in_features, heads * self.head_dim, bias=projection.bias is not None,
                         device=weight.device, dtype=weight.dtype)

    @staticmethod
    def _groups(index: list[int]) -> tuple[list[list[int]], list[int]]:
        """(per compact head, the query heads that read it, padded to the largest group by repeating its first
        member; per query head, its slot in the flattened padded groups). Python lists: a meta-device build holds
        no values to read back."""
        members: list[list[int]] = [[] for _ in range(max(index) + 1)]
        for query_head, compact_head in enumerate(index):
            members[compact_head].append(query_head)
        width = max(len(group) for group in members)
        slot = [0] * len(index)
        for compact_head, group in enumerate(members):
            for position, query_head in enumerate(group):
                slot[query_head] = compact_head * width + position
        return [group + [group[0]] * (width - len(group)) for group in members], slot

    def _register_groups(self, key_index: list[int], value_index: list[int]) -> None:
        for kind, index in (("key", key_index), ("value", value_index)):
            groups, slot = self._groups(index)
            self.register_buffer(f"{kind}_group_queries", torch.tensor(groups, dtype=torch.long), persistent=False)
            self.register_buffer(f"{kind}_group_slot", torch.tensor(slot, dtype=torch.long), persistent=False)

    def reset_head_index(self) -> None:
        """Refill the head-index buffers from the config (``_init_weights`` calls this)."""
        key_index, value_index = self.config.layer_head_map(self.layer_idx)
        self.key_index.copy_(torch.tensor(key_index, dtype=torch.long))
        self.value_index.copy_(torch.tensor(value_index, dtype=torch.long))
        for kind, index in (("key", key_index), ("value", value_index)):
            groups, slot = self._groups(index)
            getattr(self, f"{kind}_group_queries").copy_(torch.tensor(groups, dtype=torch.long))
            getattr(self, f"{kind}_group_slot").copy_(torch.tensor(slot, dtype=torch.long))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        past_key_values: Optional[Cache] = None,
        cache_position: Optional[torch.LongTensor] = None,
        past_key_value: Optional[Cache] = None,
        **kwargs,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        # transformers 4.5x's decoder layer passes the cache as ``past_key_value``, 5.x's as ``past_key_values``.
        cache = past_key_values if past_key_values is not None else past_key_value
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)      # (B, H_K, T, D)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)    # (B, H_V, T, D)

        if self.q_norm is not None:  # per-head RMSNorms over head_dim (Qwen3, Gemma 3), before RoPE
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        # RoPE is per head and position, so rotating the compact keys equals rotating the expanded ones.
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None and self.layer_idx == 0 and getattr(cache, "is_compileable", False):
            # transformers 5.x no longer refuses a static cache for models without _supports_static_cache.
            raise ValueError("DHA layers have their own numbers of key and value heads, which a preallocated "
                             "(static) cache cannot hold: generate with the default dynamic cache")
        if cache is not None:
            # The cache holds only the compact heads; DynamicCache keeps K and V as separate tensors, so their head
            # counts may differ.
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, cache_kwargs)

        if cache is not None and input_shape[1] == 1 and not self.training and self._mask_holds_window(
                attention_mask, key_states.shape[2]):
            attn_output, attn_weights = self.grouped_attention(query_states, key_states, value_states, attention_mask)
        else:
            attn_output, attn_weights = self.expanded_attention(query_states, key_states, value_states,
                                                                attention_mask, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights

    def _mask_holds_window(self, attention_mask, source_length: int) -> bool:
        """Whether the grouped path, which reads the window from the mask alone, sees this layer's sliding window:
        the eager and SDPA masks of a sliding layer hold it (SDPA's is None only when every position is visible);
        flash-attention's padding mask does not, so such a step past the window takes the expanded kernel, which
        is given the window."""
        return (self.sliding_window is None or source_length <= self.sliding_window
                or (attention_mask is not None and attention_mask.dim() == 4))

    def expanded_attention(self, query_states, key_states, value_states, attention_mask, **kwargs):
        """The compact K/V expanded to one head per query head, then the configured kernel as plain MHA:
        ((B, T, H, D) output, weights or None)."""
        key_states = key_states.index_select(1, self.key_index)
        value_states = value_states.index_select(1, self.value_index)

        attention_interface: Callable = eager_attention_forward
        if self.config._attn_implementation != "eager":
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]

        return attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )

    def grouped_attention(self, query_states, key_states, value_states, attention_mask):
        """Attention that reads every compact K/V head once: queries (B, H, T, D) against keys (B, H_K, S, D) and
        values (B, H_V, S, D), for T new positions that see every cached one (a decode step). ((B, T, H, D) output,
        (B, H, T, S) weights). Query heads are gathered per key head (each group padded to the largest), scored
        against their key head in one batched matmul, the softmax taken per query head, and the weights gathered
        per value head for one batched matmul with the values."""
        batch, heads, length, dim = query_states.shape
        key_heads, source_length = key_states.shape[1], key_states.shape[2]
        value_heads = value_states.shape[1]
        # (B, H_K, G_K * T, D) @ (B, H_K, D, S): each cached key head is read once
        grouped_query = query_states[:, self.key_group_queries.flatten()].reshape(batch, key_heads, -1, dim)
        scores = torch.matmul(grouped_query, key_states.transpose(2, 3))
        scores = scores.reshape(batch, -1, length, source_length)[:, self.key_group_slot] * self.scaling
        if attention_mask is not None:
            if attention_mask.dim() == 2:  # flash-attention-2 passes the (B, S) padding mask
                mask = attention_mask[:, None, None, :source_length].bool()
            else:
                mask = attention_mask[:, :, -length:, :source_length]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        # at least float32 for the softmax, as the eager kernel; float64 inputs stay float64
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        weights = weights.to(query_states.dtype)
        # (B, H_V, G_V * T, S) @ (B, H_V, S, D): each cached value head is read once
        grouped_weights = weights[:, self.value_group_queries.flatten()].reshape(batch, value_heads, -1,
                                                                                  source_length)
        output = torch.matmul(grouped_weights, value_states)
        output = output.reshape(batch, -1, length, dim)[:, self.value_group_slot]
        return output.transpose(1, 2), weights




def _dha_decoder_layer(classes: FamilyClasses, config: DhaLlamaConfig, layer_idx: int) -> nn.Module:
    """The family's own decoder layer with its attention replaced by the DHA one (built from it)."""
    layer = classes.decoder_layer(config, layer_idx)
    layer.self_attn = DhaLlamaAttention(config, layer_idx, source=layer.self_attn)
    return layer


class DhaLlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = DhaLlamaConfig
    _no_split_modules = sorted({classes.decoder_layer.__name__ for classes in FAMILY_CLASSES.values()})
    # A static cache preallocates num_key_value_heads for every layer; DHA layers differ, so use a dynamic cache.
    _supports_static_cache = False
    # transformers 5.x records attention weights (output_attentions) from the modules of these classes.
    _can_record_outputs = {"hidden_states": LlamaDecoderLayer, "attentions": DhaLlamaAttention}

    @property
    def family(self) -> FamilyClasses:
        """The transformers classes of the source family (``config.source_model_type``)."""
        return family_classes(self.config.source_model_type)

    def _init_weights(self, module):
        pretrained = self.family.pretrained
        if pretrained is LlamaPreTrainedModel:
            super()._init_weights(module)
        else:
            # The family's own initialiser: its norms, and in transformers 5.x the non-persistent buffers it builds
            # (Gemma's embed_scale and its local/global RoPE frequencies), which a meta-device build leaves empty.
            # It reads only the config and the module, so it runs on a bare instance of the family's class (its
            # super() calls need one) that holds this config.
            stand_in = pretrained.__new__(pretrained)
            stand_in.__dict__["config"] = self.config
            pretrained._init_weights(stand_in, module)
        # transformers 5.x builds the model on the meta device and leaves non-persistent buffers empty until here.
        if isinstance(module, DhaLlamaAttention):
            module.reset_head_index()


class DhaLlamaModel(DhaLlamaPreTrainedModel, LlamaModel):
    """The source family's decoder stack (its ``...Model``: embeddings, rotary embeddings, final norm, forward) with
    DHA decoder layers. For LLaMA it is a ``LlamaModel``; for another family the family model's own ``__init__``
    builds every part but the layers, which are built one at a time (so no full MHA stack is ever held), and its
    ``forward`` runs."""

    def __init__(self, config: DhaLlamaConfig):
        LlamaPreTrainedModel.__init__(self, config)
        classes = family_classes(config.source_model_type)
        shell_config = copy.copy(config)
        shell_config.num_hidden_layers = 0
        shell = classes.model(shell_config)  # the family's embeddings, norm, rotary embeddings; no layers
        for name, child in shell.named_children():
            setattr(self, name, child)
        for name, value in vars(shell).items():  # plain attributes its forward reads (Qwen2's has_sliding_layers)
            if name not in vars(self) and not name.startswith("_") and not isinstance(value, nn.Module):
                setattr(self, name, value)
        self.layers = nn.ModuleList(
            [_dha_decoder_layer(classes, config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.gradient_checkpointing = False
        self.post_init()

    @functools.wraps(LlamaModel.forward)
    def forward(self, *args, **kwargs):
        return self.family.model.forward(self, *args, **kwargs)


class DhaLlamaForCausalLM(DhaLlamaPreTrainedModel, LlamaForCausalLM):
    def __init__(self, config: DhaLlamaConfig):
        LlamaPreTrainedModel.__init__(self, config)
        self.model = DhaLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        self.post_init()

    # The family's causal-LM forward (Gemma 3's final logit softcapping), under LLaMA's signature, which every family
    # shares (generate reads it).
    @functools.wraps(LlamaForCausalLM.forward)
    def forward(self, *args, **kwargs):
        return self.family.causal_lm.forward(self, *args, **kwargs)


# save_pretrained then writes ``auto_map`` into config.json and copies this file (and family_classes.py, which it
# imports) next to the weights.
DhaLlamaConfig.register_for_auto_class()
DhaLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")


def register_auto_classes() -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` load ``dha_llama`` folders without ``trust_remote_code``."""
    AutoConfig.register(DhaLlamaConfig.model_type, DhaLlamaConfig, exist_ok=True)
    AutoModelForCausalLM.register(DhaLlamaConfig, DhaLlamaForCausalLM, exist_ok=True)

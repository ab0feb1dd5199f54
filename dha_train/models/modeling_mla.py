"""Multi-head latent attention (MLA) for HF transformers, converted from an MHA or GQA model of any source family.

The model is the source family's own decoder stack (``source_model_type``: llama, mistral, qwen2, qwen3 or
gemma3_text; absent means llama, the only family of earlier exports): its embeddings, decoder layers, rotary
embeddings (Gemma's local/global pair) and forward, with only each layer's ``self_attn`` replaced by
``MlaLlamaAttention``, which keeps the family attention's q/o projections (and biases), q_norm/k_norm, scale and
sliding window. Per layer, each K/V head keeps some RoPE pairs rotated (pair ``i`` is dimensions ``i`` and
``i + d/2``, the ``rotate_half`` layout of every family here); the rest of the key and all of the value come from
one latent per token:

    c = kv_down_proj(x)                          # (rank,)       cached
    k_rope = RoPE(k_rope_proj(x))                # (kv_heads, 2 * pairs), cached
    [k_nope; v] = kv_up_proj(c)                  # per K/V head: the position-free key dims, then the value

A query head scores a key by ``q_nope . k_nope + RoPE(q_rope) . k_rope``, its dimensions split like its K/V head's.
The cache (transformers' ``DynamicCache``) holds ``c`` in its key slot and ``k_rope`` in its value slot: ``rank +
kv_heads * 2 * pairs`` numbers per token and layer. K/V biases (Qwen2) ride on ``k_rope_proj`` and ``kv_up_proj``.

A per-head **k_norm** (Qwen3, Gemma 3) norms the whole key head before RoPE, ``w * x / rms(x)``; its weight does not
commute with RoPE and its RMS needs every dim. So a new token's pre-norm head is rebuilt when it is written
(``x_nope`` from its latent), the rotated dims are normed and then rotated as the family does, and each K/V head's
``1 / rms(x)`` is cached beside them (``kv_heads`` more numbers per token and layer; none when every pair stays
rotated); the position-free keys read from the latent later are ``w_nope * x_nope`` times that factor. RoPE stays
at write time, and full rank is the source.

- Training and prefill expand ``c`` to keys and values and call the standard kernels (eager, SDPA,
  flash-attention-2) with the family's scaling and sliding window.
- Decode (one new token, a cache, eval mode) absorbs the up-projection: keys into the query (``q_nope @ U_k``
  scores against ``c`` directly) and values into the output (``(attn @ c) @ U_v^T``), reading only the cache.

With every pair kept and the full rank it is the source model. The file is self-contained (torch and transformers,
plus ``family_classes.py``, imported relatively, which ``save_pretrained`` copies beside it) so an exported folder
loads with ``trust_remote_code=True`` where dha_train is not installed.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig
from transformers.cache_utils import Cache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaPreTrainedModel,
    eager_attention_forward,
    rotate_half,
)

from .family_classes import DEFAULT_SOURCE, FAMILY_CLASSES, family_classes

# A family config's fields that name the model itself: never taken from the family's defaults.
_IDENTITY_FIELDS = ("model_type", "architectures", "auto_map", "transformers_version")


@functools.lru_cache(maxsize=1)
def _base_fields() -> frozenset:
    return frozenset(PretrainedConfig().to_dict())


class MlaLlamaConfig(LlamaConfig):
    """A ``LlamaConfig`` plus the latent layout and the source family.

    ``mla_ranks``: the latent rank of every layer. ``mla_rope_pairs``: per layer, per K/V head, the RoPE pairs kept
    rotated (increasing; every head of a layer keeps as many). ``source_model_type``: the family whose decoder the
    model is built from (a key of ``family_classes.FAMILY_CLASSES``; None means llama). The config holds every field
    of the source config (built from its whole ``to_dict()``); a field a saved folder left out is LLaMA's default
    where LLaMA's config has it (``to_diff_dict`` left it out for equalling that), else the family config's default.
    """

    model_type = "mla_llama"

    def __init__(self, mla_ranks: Optional[list[int]] = None, mla_rope_pairs: Optional[list[list[list[int]]]] = None,
                 source_model_type: Optional[str] = None, **kwargs):
        kwargs.pop("model_type", None)  # a source's model_type among the fields would shadow the class's
        super().__init__(**kwargs)
        self.source_model_type = source_model_type
        if source_model_type not in (None, DEFAULT_SOURCE):
            # the family's own config class derives what the fields given leave out (Gemma 3's layer_types, and
            # under transformers 5.x its per-layer-type rope_parameters); only PretrainedConfig's own fields,
            # which to_diff_dict leaves out when they equal its and LLaMA's defaults, keep LLaMA's value
            family = family_classes(source_model_type).config(**kwargs).to_dict()  # refuses a type outside the table
            for key, value in family.items():
                if key not in kwargs and key not in _IDENTITY_FIELDS and key not in _base_fields():
                    setattr(self, key, value)
        self.mla_ranks = mla_ranks
        self.mla_rope_pairs = mla_rope_pairs
        if mla_ranks is not None or mla_rope_pairs is not None:
            self._validate_layout()

    def _validate_layout(self) -> None:
        layers, kv_heads, head_dim = self.num_hidden_layers, self.num_key_value_heads, self.head_dim
        ranks, pairs = self.mla_ranks, self.mla_rope_pairs
        if not isinstance(ranks, list) or len(ranks) != layers:
            raise ValueError(f"MlaLlamaConfig.mla_ranks must list {layers} layer ranks, got {ranks!r}")
        if not isinstance(pairs, list) or len(pairs) != layers:
            raise ValueError(f"MlaLlamaConfig.mla_rope_pairs must list {layers} layers, got {pairs!r}")
        for index, (rank, layer) in enumerate(zip(ranks, pairs)):
            if not isinstance(layer, list) or len(layer) != kv_heads:
                raise ValueError(f"MlaLlamaConfig.mla_rope_pairs layer {index}: expected {kv_heads} K/V heads, "
                                 f"got {layer!r}")
            counts = {len(head) for head in layer}
            if len(counts) != 1:
                raise ValueError(f"MlaLlamaConfig.mla_rope_pairs layer {index}: every head must keep as many "
                                 f"pairs, got {sorted(counts)}")
            for head in layer:
                if sorted(set(head)) != list(head) or any(not 0 <= p < head_dim // 2 for p in head):
                    raise ValueError(f"MlaLlamaConfig.mla_rope_pairs layer {index}: pairs must be increasing and "
                                     f"within 0..{head_dim // 2 - 1}, got {head}")
            latent_size = kv_heads * (head_dim - 2 * counts.pop()) + kv_heads * head_dim
            if not isinstance(rank, int) or not 1 <= rank <= latent_size:
                raise ValueError(f"MlaLlamaConfig.mla_ranks layer {index}: rank must be within 1..{latent_size} "
                                 f"(position-free key and value dims), got {rank!r}")

    def layer_layout(self, layer_idx: int) -> tuple[int, list[list[int]]]:
        """(rank, kept pairs per K/V head) of one layer."""
        return int(self.mla_ranks[layer_idx]), [[int(p) for p in head] for head in self.mla_rope_pairs[layer_idx]]


def _dims(pairs: list[list[int]], head_dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated dims (kv_heads, 2p): kept pairs' first then second halves; position-free dims (kv_heads, d - 2p)).
    Worked out in Python: under a meta-device build the tensors hold no values to read back."""
    half, width = head_dim // 2, 2 * len(pairs[0])
    rope = [head + [p + half for p in head] for head in pairs]
    nope = [[dim for dim in range(head_dim) if dim not in set(row)] for row in rope]
    as_tensor = lambda rows, columns: torch.tensor(rows, dtype=torch.long, device=device).view(len(rows), columns)  # noqa: E731
    return as_tensor(rope, width), as_tensor(nope, head_dim - width)


def _rope_attention_factor(config) -> float:
    """The factor a scaled RoPE (YaRN, LongRoPE) multiplies cos and sin by: 1 for the default and linear types."""
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", "linear", "dynamic", "llama3"):
        return 1.0
    return float(ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")[1])


def _norm_epsilon(norm: nn.Module) -> float:
    """The epsilon of a family's per-head RMSNorm (Qwen3's ``variance_epsilon``, Gemma 3's ``eps``)."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise ValueError(f"{type(norm).__name__} states no epsilon (variance_epsilon or eps)")


class MlaLlamaAttention(nn.Module):
    """The source family's attention with a joint K/V latent and partial RoPE (see the module docstring).

    Built from the family's attention module of this layer (``source``; by default a new one): its q/o projections,
    q_norm/k_norm, scale and sliding window are kept; its K/V projections give way to the latent ones, with biases
    where the family's K/V projections have them."""

    def __init__(self, config: MlaLlamaConfig, layer_idx: int, source: Optional[nn.Module] = None):
        super().__init__()
        if source is None:
            source = family_classes(getattr(config, "source_model_type", None)).attention(config, layer_idx)
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = source.scaling
        # Qwen2/3 and Gemma 3 state the window on the attention (None on full layers); Mistral's reads its config.
        self.sliding_window = getattr(source, "sliding_window", getattr(config, "sliding_window", None))
        self.is_sliding = getattr(source, "is_sliding", self.sliding_window is not None)  # Gemma 3's layer reads it
        # YaRN (and other scaled RoPE types) multiply cos and sin by an attention factor m, so every rotated score
        # carries m^2; the position-free dims are never rotated and must carry it too, or they lose it.
        self.nope_score_scale = _rope_attention_factor(config) ** 2
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        self.rank, pairs = config.layer_layout(layer_idx)
        self.rope_width = 2 * len(pairs[0])
        self.nope_width = self.head_dim - self.rope_width
        self._register_dims(pairs)

        self.q_proj, self.o_proj = source.q_proj, source.o_proj
        self.q_norm = getattr(source, "q_norm", None)
        self.k_norm = getattr(source, "k_norm", None)
        # the value slot of the cache: the rotated key dims, and with a k_norm each K/V head's 1 / rms for the
        # position-free dims (none when every pair stays rotated: the whole key is normed when it is written)
        self.caches_key_scale = self.k_norm is not None and self.nope_width > 0
        self.cache_width = self.rope_width + self.caches_key_scale
        key_bias, value_bias = source.k_proj.bias is not None, source.v_proj.bias is not None
        hidden = config.hidden_size
        self.k_rope_proj = nn.Linear(hidden, self.num_kv_heads * self.rope_width, bias=key_bias)
        self.kv_down_proj = nn.Linear(hidden, self.rank, bias=False)
        self.kv_up_proj = nn.Linear(self.rank, self.num_kv_heads * (self.nope_width + self.head_dim),
                                    bias=key_bias or value_bias)

    def _register_dims(self, pairs: list[list[int]]) -> None:
        rope, nope = _dims(pairs, self.head_dim)
        kv_of_query = torch.arange(self.num_heads) // self.num_key_value_groups
        # Not persistent: the layout lives in the config; each query head reads its K/V head's split.
        self.register_buffer("query_rope_dims", rope[kv_of_query], persistent=False)
        self.register_buffer("query_nope_dims", nope[kv_of_query], persistent=False)
        self.register_buffer("key_rope_dims", rope, persistent=False)
        self.register_buffer("key_nope_dims", nope, persistent=False)

    def reset_dims(self) -> None:
        """Refill the layout buffers from the config (``_init_weights`` calls this)."""
        device = self.query_rope_dims.device
        rope, nope = _dims(self.config.layer_layout(self.layer_idx)[1], self.head_dim, device)
        kv_of_query = torch.arange(self.num_heads, device=device) // self.num_key_value_groups
        self.query_rope_dims.copy_(rope[kv_of_query])
        self.query_nope_dims.copy_(nope[kv_of_query])
        self.key_rope_dims.copy_(rope)
        self.key_nope_dims.copy_(nope)

    @staticmethod
    def _rotate(states: torch.Tensor, dims: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on (B, heads, T, 2p) states whose columns are head dims ``dims`` (heads, 2p); cos/sin (B, T, d)."""
        if states.shape[-1] == 0:
            return states
        cos = cos[:, None, :, :].expand(-1, dims.shape[0], -1, -1)
        sin = sin[:, None, :, :].expand(-1, dims.shape[0], -1, -1)
        index = dims[None, :, None, :].expand(cos.shape[0], -1, cos.shape[2], -1)
        cos, sin = cos.gather(-1, index), sin.gather(-1, index)
        return states * cos + rotate_half(states) * sin

    def _split_up(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """kv_up_proj as (U_k (kv_heads, nope, rank), U_v (kv_heads, d, rank), key bias, value bias)."""
        key_rows = self.num_kv_heads * self.nope_width
        weight, bias = self.kv_up_proj.weight, self.kv_up_proj.bias
        up_key = weight[:key_rows].reshape(self.num_kv_heads, self.nope_width, self.rank)
        up_value = weight[key_rows:].reshape(self.num_kv_heads, self.head_dim, self.rank)
        if bias is None:
            return up_key, up_value, None, None
        return (up_key, up_value, bias[:key_rows].reshape(self.num_kv_heads, self.nope_width),
                bias[key_rows:].reshape(self.num_kv_heads, self.head_dim))

    def key_norm_weight(self) -> torch.Tensor:
        """(d,) float32: the per-dimension factor k_norm applies after dividing by the RMS (w, or Gemma's 1 + w), read
        off the module itself as ``k_norm(1) * sqrt(1 + eps)``."""
        ones = torch.ones(self.head_dim, dtype=torch.float32, device=self.k_norm.weight.device)
        return self.k_norm(ones).float() * (1.0 + _norm_epsilon(self.k_norm)) ** 0.5

    def _key_nope(self, latent: torch.Tensor) -> torch.Tensor:
        """The position-free key dims (B, G, S, n) of latents (B, S, rank), before any k_norm."""
        rows = self.num_kv_heads * self.nope_width
        bias = None if self.kv_up_proj.bias is None else self.kv_up_proj.bias[:rows]
        keys = nn.functional.linear(latent, self.kv_up_proj.weight[:rows], bias)
        return keys.view(*latent.shape[:2], self.num_kv_heads, self.nope_width).transpose(1, 2)

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
        batch, length = hidden_states.shape[:2]
        cos, sin = position_embeddings

        query = self.q_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            query = self.q_norm(query)
        query = query.transpose(1, 2)
        gather_query = lambda dims: query.gather(-1, dims[None, :, None, :].expand(batch, -1, length, -1))  # noqa: E731
        query_rope = self._rotate(gather_query(self.query_rope_dims), self.query_rope_dims, cos, sin)
        query_nope = gather_query(self.query_nope_dims)
        if self.nope_score_scale != 1.0:
            query_nope = query_nope * self.nope_score_scale

        latent = self.kv_down_proj(hidden_states).unsqueeze(1)                                  # (B, 1, T, rank)
        key_rope = self.k_rope_proj(hidden_states).view(batch, length, self.num_kv_heads, self.rope_width)
        key_rope = key_rope.transpose(1, 2)                                                    # (B, G, T, 2p)
        if self.k_norm is not None:  # norm the whole pre-norm head of each new token, then rotate (module docstring)
            key_nope = self._key_nope(latent.squeeze(1)).float()
            energy = key_nope.pow(2).sum(-1) + key_rope.float().pow(2).sum(-1)                 # (B, G, T)
            inverse_rms = torch.rsqrt(energy / self.head_dim + _norm_epsilon(self.k_norm))
            weight = self.key_norm_weight()[self.key_rope_dims][None, :, None, :]
            key_rope = (key_rope.float() * inverse_rms[..., None] * weight).to(key_rope.dtype)
        key_rope = self._rotate(key_rope, self.key_rope_dims, cos, sin)
        if self.caches_key_scale:
            key_rope = torch.cat([key_rope, inverse_rms[..., None].to(key_rope.dtype)], dim=-1)  # (B, G, T, 2p + 1)

        if cache is not None and self.layer_idx == 0 and getattr(cache, "is_compileable", False):
            raise ValueError("MLA layers cache a latent, which a preallocated (static) cache for keys and values "
                             "cannot hold: generate with the default dynamic cache")
        if cache is not None:
            # transformers' cache stores the latent in its key slot and the rotated key part in its value slot.
            latent, key_rope = cache.update(latent, key_rope, self.layer_idx, {"cache_position": cache_position})

        if cache is not None and length == 1 and not self.training:
            attn_output, attn_weights = self.latent_attention(query_nope, query_rope, latent, key_rope, attention_mask)
            return self.o_proj(attn_output), attn_weights

        up = self.kv_up_proj(latent.squeeze(1))                                               # (B, S, G*(n+d))
        key_rows = self.num_kv_heads * self.nope_width
        source_length = up.shape[1]
        key_nope = up[..., :key_rows].view(batch, source_length, self.num_kv_heads, self.nope_width).transpose(1, 2)
        value = up[..., key_rows:].view(batch, source_length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.caches_key_scale:
            key_rope, inverse_rms = key_rope[..., :self.rope_width], key_rope[..., self.rope_width:]
            weight = self.key_norm_weight()[self.key_nope_dims][None, :, None, :]
            key_nope = (key_nope.float() * inverse_rms.float() * weight).to(key_nope.dtype)
        # The dot product splits over the two parts, so [nope | rope] on both sides scores like the split.
        query_states = torch.cat([query_nope, query_rope], dim=-1)
        key_states = torch.cat([key_nope, key_rope], dim=-1)

        attention_interface: Callable = eager_attention_forward
        if self.config._attn_implementation != "eager":
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
            sliding_window=self.sliding_window, **kwargs)
        attn_output = attn_output.reshape(batch, length, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def latent_attention(self, query_nope, query_rope, latent, key_rope, attention_mask):
        """One decode step against the latent cache, U_k absorbed into the query and U_v into the output: the
        (B, 1, H * d) attention output before o_proj, and the (B, H, 1, S) attention weights. ``key_rope`` is the
        cache's value slot (with a k_norm, each K/V head's 1 / rms in its last column).

        Every product is one batched matmul over the cache as it is stored: all query heads against the one latent
        (B, H, r) x (B, r, S), and the query heads of a K/V head against its rotated keys, so nothing of the cache is
        copied per query head."""
        batch, heads = query_nope.shape[:2]
        kv_heads, group, rank = self.num_kv_heads, self.num_key_value_groups, self.rank
        up_key, up_value, key_bias, value_bias = self._split_up()
        inverse_rms = None
        if self.caches_key_scale:  # k_norm's weight moves onto the query, its 1 / rms onto each key's score
            key_rope, inverse_rms = key_rope[..., :self.rope_width], key_rope[..., self.rope_width]  # (B, G, S)
            weight = self.key_norm_weight()[self.query_nope_dims][None, :, None, :]
            query_nope = (query_nope.float() * weight).to(query_nope.dtype)
        latent = latent.reshape(batch, -1, rank)                                              # (B, S, r)
        query_nope = query_nope.reshape(batch, kv_heads, group, self.nope_width)
        # each query head through its K/V head's key up-projection: (B, G, group, n) x (G, n, r)
        query_latent = torch.einsum("bgqn,gnr->bgqr", query_nope, up_key).reshape(batch, heads, rank)
        scores = torch.bmm(query_latent, latent.transpose(1, 2))                              # (B, H, S)
        if key_bias is not None:  # a constant per query: kept so the weights equal the expanded path's
            scores = scores + torch.einsum("bgqn,gn->bgq", query_nope, key_bias).reshape(batch, heads, 1)
        if inverse_rms is not None:
            scores = scores * inverse_rms.repeat_interleave(group, dim=1)
        rope_scores = torch.matmul(query_rope.reshape(batch, kv_heads, group, self.rope_width),
                                   key_rope.transpose(2, 3))                                  # (B, G, group, S)
        scores = (scores + rope_scores.reshape(batch, heads, -1)) * self.scaling
        length = scores.shape[-1]
        if attention_mask is not None and attention_mask.dim() != 2:
            mask = attention_mask[:, :, -1, :length]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        else:
            if attention_mask is not None:  # flash-attention-2 passes the (B, S) padding mask
                scores = scores.masked_fill(~attention_mask[:, None, :length].bool(), float("-inf"))
            if self.sliding_window is not None and length > self.sliding_window:  # not in a 2-D mask: the window
                scores[..., : length - self.sliding_window] = float("-inf")
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        weights = weights.to(query_rope.dtype)
        mixed = torch.bmm(weights, latent).reshape(batch, kv_heads, group, rank)              # (B, G, group, r)
        output = torch.einsum("bgqr,gdr->bgqd", mixed, up_value)
        if value_bias is not None:  # the weights sum to 1
            output = output + value_bias[None, :, None, :]
        return output.reshape(batch, 1, heads * self.head_dim).contiguous(), weights.unsqueeze(2)


class MlaLlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = MlaLlamaConfig
    _no_split_modules = ["LlamaDecoderLayer"]  # each model names its family's decoder layer
    _supports_static_cache = False
    _can_record_outputs = {"hidden_states": LlamaDecoderLayer, "attentions": MlaLlamaAttention}

    def _init_weights(self, module):
        super()._init_weights(module)
        # transformers 5.x builds the model on the meta device and leaves non-persistent buffers empty until here.
        if isinstance(module, MlaLlamaAttention):
            module.reset_dims()


def _decoder_class(base: type, decoder_layer: type) -> type:
    """The MLA decoder stack of a family: its own model class (embeddings, layers, norms, rotary embeddings and
    forward) with every layer's ``self_attn`` replaced by ``MlaLlamaAttention`` built from it."""

    def __init__(self, config: MlaLlamaConfig):
        base.__init__(self, config)
        for index, layer in enumerate(self.layers):
            layer.self_attn = MlaLlamaAttention(config, index, layer.self_attn)

    def _init_weights(self, module):
        base._init_weights(self, module)
        if isinstance(module, MlaLlamaAttention):
            module.reset_dims()

    name = "Mla" + base.__name__
    return type(name, (base,), {"__init__": __init__, "_init_weights": _init_weights, "config_class": MlaLlamaConfig,
                                "_can_record_outputs": {"hidden_states": decoder_layer,
                                                        "attentions": MlaLlamaAttention},
                                "__module__": __name__, "__qualname__": name})


# Each family's MLA decoder stack (module-level names, so that instances pickle): MlaLlamaModel, MlaQwen3Model, ...
MLA_DECODERS: dict[str, type] = {}
for _key, _classes in FAMILY_CLASSES.items():
    _decoder = _decoder_class(_classes.model, _classes.decoder_layer)
    MLA_DECODERS[_key] = globals()[_decoder.__name__] = _decoder


class MlaLlamaForCausalLM(MlaLlamaPreTrainedModel, LlamaForCausalLM):
    """The source family's decoder stack (``source_model_type``) with MLA attention in every layer, an LM head, and
    the family's own causal-LM forward (Gemma's final logit soft-capping, where a config sets it)."""

    def __init__(self, config: MlaLlamaConfig):
        LlamaPreTrainedModel.__init__(self, config)
        source = getattr(config, "source_model_type", None) or DEFAULT_SOURCE
        self._no_split_modules = [family_classes(source).decoder_layer.__name__]
        self.model = MLA_DECODERS[source](config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    # cache_position (4.5x) travels in kwargs: 5.x's generate makes one only for a forward that names it
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        causal_lm = family_classes(getattr(self.config, "source_model_type", None)).causal_lm
        return causal_lm.forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                                 use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)


# save_pretrained then writes ``auto_map`` into config.json and copies this file next to the weights.
MlaLlamaConfig.register_for_auto_class()
MlaLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")


def register_auto_classes() -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` load ``mla_llama`` folders without ``trust_remote_code``."""
    AutoConfig.register(MlaLlamaConfig.model_type, MlaLlamaConfig, exist_ok=True)
    AutoModelForCausalLM.register(MlaLlamaConfig, MlaLlamaForCausalLM, exist_ok=True)

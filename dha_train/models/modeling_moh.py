"""Mixture-of-head attention (MoH, seed 002) for HF transformers, inside the decoder of its source family.

The model is the source family's own decoder stack (``source_model_type`` in the config: LLaMA, Mistral, Qwen2,
Qwen3, Gemma 3; absent means LLaMA, the only family of earlier exports): its embeddings, decoder layers, norms and
rotary embeddings (Gemma's local/global pair), with only ``self_attn`` replaced. The MoH attention IS the family's
attention class (a subclass made per family from ``family_classes``), so it keeps the family's projections and their
biases, its per-head q/k norms (applied before RoPE), its attention scale and its sliding windows; it only adds the
routing below. The query_norm router reads each query head's norm before q_norm (q_norm would make every head's
norm about the same).

Each token uses the first ``h_s`` heads of a layer (shared, always on) plus the top-k of the remaining ``R = H - h_s``
heads (routed), and the head outputs are weighted before ``o_proj`` (Eq. 4). Two routers:

- ``learned`` (training from scratch, Eq. 5-6): one linear layer gives the shared logits, the routed logits and the
  two head-type logits; g = alpha_1 softmax(W_s x) on shared heads, alpha_2 softmax(W_r x) on the selected routed
  heads, 0 elsewhere, with [alpha_1, alpha_2] = softmax(W_h x).
- ``query_norm`` (continue-tuning a pretrained MHA model, section 4.4): no parameters. A routed head's score is the
  softmax over the routed heads of its query's L2 norm; the forward pass uses the quantised score (1 for the top-k
  routed heads and for every shared head, else 0), and gradients pass straight through to the real score (Eq. 9-10).
  With every head active the model is the MHA model.

The load-balance loss (Eq. 7, sum over routed heads of P_i f_i) of each forward is kept on the layer
(``balance_loss``) next to its detached routing statistics, overwritten by the next forward: nothing accumulates in a
global list, so a trainer reads it once per forward (dha_train's ``MixtureOfHeads`` does at ``AFTER_LOSS``), which
stays right under gradient accumulation and activation checkpointing (a recomputed forward only overwrites it).

Decoding (one new token, with a cache) computes attention only for the heads that some sequence of the batch uses
(with batch size 1: exactly the token's h_s + k heads), as a few SDPA calls on strided views of the cache (no copy);
the cache still holds every head's K/V, since later tokens may route to any head. Where the skipped heads would save
less than the extra calls cost (short caches, few skipped heads), decode computes every head in one call. Prefill and
training compute every head and weight them.

This file is self-contained (torch and transformers only; ``family_classes.py`` beside it, which ``save_pretrained``
copies with it as a relative import): ``save_pretrained`` copies it next to the weights, so an exported model loads with ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` anywhere. It runs
under transformers 4.5x and 5.x alike (tests/commands/test_export_transformers5.py loads exports in both).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaForCausalLM,
    LlamaPreTrainedModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .family_classes import FAMILY_CLASSES, family_classes
from .moh_decode import _block_view, _decode_mask, _decode_plan, _runs, _strided_blocks  # noqa: F401 (read here)

ROUTERS = ("learned", "query_norm")


def moh_layer_budget(config, layer_idx: int) -> tuple[int, int]:
    """(shared heads, routed heads each token selects) of one layer: ``moh_shared_heads`` and ``moh_top_k`` are an
    int for every layer or a list with one entry per layer."""
    def pick(value):
        return int(value[layer_idx]) if isinstance(value, (list, tuple)) else int(value)

    return pick(config.moh_shared_heads), pick(config.moh_top_k)


def check_moh_settings(num_heads: int, num_layers: int, shared_heads, top_k, router: str) -> None:
    """Raise ValueError naming the problem when the MoH settings do not fit the model."""
    if router not in ROUTERS:
        raise ValueError(f"MoH: router must be one of {', '.join(ROUTERS)}, got {router!r}")
    for name, value in (("shared_heads", shared_heads), ("top_k", top_k)):
        if isinstance(value, (list, tuple)) and len(value) != num_layers:
            raise ValueError(f"MoH: {name} has {len(value)} entries for {num_layers} layers")
        if not isinstance(value, (int, list, tuple)) or isinstance(value, bool):
            raise ValueError(f"MoH: {name} must be an int or a per-layer list of ints, got {value!r}")
    for layer in range(num_layers):
        shared = int(shared_heads[layer]) if isinstance(shared_heads, (list, tuple)) else int(shared_heads)
        k = int(top_k[layer]) if isinstance(top_k, (list, tuple)) else int(top_k)
        routed = num_heads - shared
        if not 0 <= shared <= num_heads:
            raise ValueError(f"MoH: layer {layer}: shared_heads={shared} must be in 0..{num_heads}")
        if not 0 <= k <= routed or (routed > 0 and k == 0):
            raise ValueError(f"MoH: layer {layer}: top_k={k} must be in 1..{routed} (the {routed} routed heads)")
        if router == "learned" and routed == 0:
            raise ValueError(f"MoH: layer {layer}: the learned router needs at least one routed head")


SOURCE_MODEL_TYPE = "source_model_type"  # the config field naming the source family (absent or None: LLaMA)
# Fields of a config's dict that name its class or its files, not the model: never carried into another class.
_IDENTITY_FIELDS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")


def source_model_type_of(config) -> str:
    """The family whose decoder a config's model is built on: a family's own ``model_type``, else the config's
    ``source_model_type`` (LLaMA when it has none)."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILY_CLASSES:
        return model_type
    return getattr(config, SOURCE_MODEL_TYPE, None) or "llama"


class MohLlamaConfig(LlamaConfig):
    """A ``LlamaConfig`` plus the MoH settings: ``moh_shared_heads`` (h_s), ``moh_top_k`` (routed heads per token),
    each an int or a per-layer list, and ``moh_router`` ('learned' or 'query_norm'). The defaults are the paper's
    continue-tuning setting: H/2 shared heads and the top H/4 routed (75% active).

    ``source_model_type`` names the source family; the config then holds every field of that family's config (built
    from the source config's whole dict, ``from_source``, and read by the family's own config class)."""

    model_type = "moh_llama"

    def __init__(self, moh_shared_heads=None, moh_top_k=None, moh_router: str = "query_norm",
                 source_model_type: Optional[str] = None, **kwargs):
        kwargs.pop("model_type", None)  # a model_type among the fields would shadow the class's
        super().__init__(**kwargs)
        self.source_model_type = source_model_type
        if source_model_type not in (None, "llama"):
            # The family's config class reads the same fields (LLaMA's defaults for those a saved folder left out as
            # equal to them, its own defaults for the rest) and derives what its classes read (Gemma's layer_types,
            # transformers 5.x's per-layer-type rope_parameters): this config holds its view of every field.
            fields = {key: value for key, value in self.to_dict().items()
                      if key not in _IDENTITY_FIELDS and key != SOURCE_MODEL_TYPE}
            family = family_classes(source_model_type).config(**{**fields, **kwargs})  # refuses an unknown type
            for key, value in family.to_dict().items():
                if key not in _IDENTITY_FIELDS:
                    setattr(self, key, value)
        heads = self.num_attention_heads
        self.moh_shared_heads = heads // 2 if moh_shared_heads is None else moh_shared_heads
        self.moh_top_k = heads // 4 if moh_top_k is None else moh_top_k
        self.moh_router = moh_router
        check_moh_settings(heads, self.num_hidden_layers, self.moh_shared_heads, self.moh_top_k, moh_router)

    @classmethod
    def from_source(cls, config, **settings) -> "MohLlamaConfig":
        """The MoH config of a source family's config (or of an MoH config): every field of it, its family in
        ``source_model_type``, and ``settings`` (the moh_* fields) over them."""
        fields = {key: value for key, value in config.to_dict().items() if key not in _IDENTITY_FIELDS}
        return cls(**{**fields, SOURCE_MODEL_TYPE: source_model_type_of(config), **settings})

    def active_fraction(self) -> float:
        """Fraction of all query heads each token uses, over the whole model."""
        budgets = [moh_layer_budget(self, layer) for layer in range(self.num_hidden_layers)]
        return sum(shared + k for shared, k in budgets) / (self.num_hidden_layers * self.num_attention_heads)


def straight_through(hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """``hard`` in the forward pass, the gradient of ``soft`` in the backward pass (Eq. 10)."""
    return hard + (soft - soft.detach())


def load_balance_loss(routed_probs: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Eq. 7 over every token of the forward: sum_i P_i f_i, P_i the mean router probability of routed head i and
    f_i the fraction of tokens that select it. ``routed_probs`` and ``selected`` are (..., R)."""
    probs = routed_probs.reshape(-1, routed_probs.shape[-1])
    fractions = selected.reshape(-1, selected.shape[-1]).to(probs.dtype)
    return (probs.mean(0) * fractions.mean(0)).sum()


class MohLlamaAttention(nn.Module):
    """The source family's attention with shared and routed heads; K/V projections as the family's (MHA or GQA).

    ``MohLlamaAttention(config, layer_idx)`` builds the subclass of the config's family attention class
    (``MOH_ATTENTION``): that class's ``__init__`` makes the projections with the family's biases, the q/k norms,
    ``scaling`` and ``sliding_window``; this one adds the router. ``from_attention`` wraps a built attention's
    modules instead (the model and the surgery: nothing is built twice or copied)."""

    def __new__(cls, config=None, layer_idx=None, *args, **kwargs):
        if cls is MohLlamaAttention:
            cls = MOH_ATTENTION[source_model_type_of(config)]
        return super().__new__(cls)

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)  # the family's attention (the next class in the MRO)
        if not hasattr(self, "sliding_window"):  # LLaMA and Mistral attention read it from the config when called
            self.sliding_window = getattr(config, "sliding_window", None)
        self.num_heads = config.num_attention_heads
        self.shared_heads, self.top_k = moh_layer_budget(config, layer_idx)
        self.routed_heads = self.num_heads - self.shared_heads
        self.router_kind = config.moh_router
        self.two_stage = self.router_kind == "learned" and self.shared_heads > 0
        self.router = None
        if self.router_kind == "learned":
            outputs = self.shared_heads + self.routed_heads + (2 if self.two_stage else 0)
            self.router = nn.Linear(config.hidden_size, outputs, bias=False)
        # Per forward, overwritten by the next one (see the module docstring).
        self.balance_loss: Optional[torch.Tensor] = None
        self.routing_stats: Optional[dict[str, torch.Tensor]] = None
        self.sparse_decode = getattr(config, "moh_sparse_decode", True)
        # What one extra attention call costs, in cache elements (heads x cached positions x head_dim) of work:
        # runs of active heads are merged across gaps cheaper than a call, and when the calls would cost more than
        # the skipped heads save, decode computes every head in one call. Inactive heads that get computed are
        # zeroed by their gates. About 20-25 us per call (views, dispatch, the output copy) against about 0.3 ns
        # per element read from memory on a 2-core CPU.
        self.decode_merge_elements = getattr(config, "moh_decode_merge_elements", 1 << 16)

    @classmethod
    def from_attention(cls, attention: nn.Module, config) -> "MohLlamaAttention":
        """MoH attention around a built family attention: its modules (projections with their biases, q/k norms)
        become this one's; a learned router is made on their device (initialised by the model or the surgery)."""
        with torch.device("meta"):
            moh = MohLlamaAttention(config, attention.layer_idx)
        for name, child in attention.named_children():
            setattr(moh, name, child)
        if moh.router is not None:
            weight = moh.q_proj.weight
            moh.router = nn.Linear(moh.router.in_features, moh.router.out_features, bias=False,
                                   device=weight.device, dtype=weight.dtype)
        return moh

    def route(self, hidden_states: torch.Tensor, query_states: torch.Tensor) -> torch.Tensor:
        """Per-token head gates (B, T, H); sets ``balance_loss`` and ``routing_stats``."""
        batch, length = hidden_states.shape[:2]
        shared = self.shared_heads
        if self.router_kind == "learned":
            logits = self.router(hidden_states).float()
            routed_probs = logits[..., shared:shared + self.routed_heads].softmax(-1)
            selected = _top_k_mask(routed_probs, self.top_k)
            routed_gates = routed_probs * selected
            if shared:
                shared_gates = logits[..., :shared].softmax(-1)
                if self.two_stage:
                    alpha = logits[..., shared + self.routed_heads:].softmax(-1)
                    shared_gates = alpha[..., :1] * shared_gates
                    routed_gates = alpha[..., 1:] * routed_gates
                gates = torch.cat([shared_gates, routed_gates], dim=-1)
            else:
                gates = routed_gates
        else:
            ones = query_states.new_ones(batch, length, shared, dtype=torch.float32)
            if self.routed_heads == 0:
                self.balance_loss = None
                self.routing_stats = {"load": ones.new_ones(self.num_heads)}
                return ones
            norms = query_states[:, shared:].float().norm(dim=-1).transpose(1, 2)  # (B, T, R)
            routed_probs = norms.softmax(-1)
            selected = _top_k_mask(norms, self.top_k)
            gates = torch.cat([ones, straight_through(selected.float(), routed_probs)], dim=-1)
        self.balance_loss = load_balance_loss(routed_probs, selected)
        with torch.no_grad():
            load = torch.cat([routed_probs.new_ones(shared),
                              selected.reshape(-1, self.routed_heads).float().mean(0)])
            entropy = -(routed_probs * routed_probs.clamp_min(1e-12).log()).sum(-1).mean()
            self.routing_stats = {"load": load, "router_entropy": entropy,
                                  "router_max_prob": routed_probs.max(-1).values.mean(),
                                  "balance_loss": self.balance_loss.detach()}
            if self.two_stage:
                self.routing_stats["alpha_shared"] = alpha[..., 0].mean()
        return gates

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
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        # RoPE rotates each query in planes, so the norm the query_norm router reads is the same before or after it;
        # q_norm (Qwen3, Gemma 3) would set every head's norm to about the same, so the router reads it before.
        gates = self.route(hidden_states, query_states)
        if getattr(self, "q_norm", None) is not None:
            query_states = self.q_norm(query_states)
        if getattr(self, "k_norm", None) is not None:
            key_states = self.k_norm(key_states)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, cache_kwargs)

        attn_weights = attn_output = None
        # A sliding-window layer skips heads only with a 4-D mask, which holds its window.
        windowed = self.sliding_window is not None and (attention_mask is None or attention_mask.dim() != 4)
        if self.sparse_decode and not self.training and input_shape[1] == 1 and cache is not None and not windowed:
            attn_output = self.active_heads_attention(query_states, key_states, value_states, gates, attention_mask)
        if attn_output is None:  # training, prefill, or a decode step where skipping heads would not pay
            attention_interface: Callable = eager_attention_forward
            if self.config._attn_implementation != "eager":
                attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                sliding_window=self.sliding_window,
                **kwargs,
            )  # (B, T, H, D)
        attn_output = attn_output * gates.unsqueeze(-1).to(attn_output.dtype)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def active_heads_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               gates: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """One new token's attention over the cache for the heads some sequence of the batch uses; the other heads'
        outputs are 0 (their gates are 0 too). query (B, H, 1, D), key/value (B, H_kv, S, D) -> (B, 1, H, D), or
        None when one call over every head (the model's own attention function) costs less.

        MHA (one K/V head per query head): the active heads are covered by few strided views of the cache (no copy,
        see ``_strided_blocks``), one attention call each: a run of consecutive heads, or equally long runs spaced
        evenly (two lone heads always are). Fewer calls cost less overhead, and a call over two or more heads keeps
        both cores of a CPU streaming the cache, where a lone head's call reads it on one. Under GQA the active query
        heads of one K/V head are stacked as query rows against that head's cache."""
        batch, heads, _, dim = query.shape
        length = key.shape[2]
        call_heads = self.decode_merge_elements / (length * dim)  # one call's overhead, in heads of work
        # About one call for the shared run and one per two routed heads (lone heads chain in pairs), plus about a
        # call's worth for reading the routing back: when the heads a token skips save less than that (short caches,
        # few skipped heads), every head in one call, as MHA does.
        if self.routed_heads - self.top_k <= (2 + self.top_k / 2) * call_heads:
            return None
        mask = _decode_mask(attention_mask, batch, length)
        active = gates.reshape(batch, heads).ne(0).any(0).tolist()  # one host sync per layer and token
        group = self.num_key_value_groups
        if group == 1:
            blocks = _decode_plan(active, call_heads, chain_runs=batch == 1)
            if blocks is None:  # skipping so few heads costs more calls than it saves
                return None
            output = query.new_zeros(batch, heads, 1, dim)
            for block in blocks:
                _block_view(output, block).copy_(F.scaled_dot_product_attention(
                    _block_view(query, block), _block_view(key, block), _block_view(value, block),
                    attn_mask=mask, scale=self.scaling))
        else:
            output = query.new_zeros(batch, heads, 1, dim)
            for kv_head in range(heads // group):
                members = [h for h in range(kv_head * group, (kv_head + 1) * group) if active[h]]
                if not members:
                    continue
                index = torch.tensor(members, device=query.device)
                rows = query.index_select(1, index).transpose(1, 2)  # (B, 1, n, D): n query rows, one K/V head
                out = F.scaled_dot_product_attention(rows, key[:, kv_head:kv_head + 1], value[:, kv_head:kv_head + 1],
                                                     attn_mask=mask, scale=self.scaling)
                output.index_copy_(1, index, out.transpose(1, 2))
        return output.transpose(1, 2)


def _top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the k largest entries along the last dimension (exactly k per row)."""
    index = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, True)


# The MoH attention of each family: a subclass of the family's own attention class (module-level names, so that
# instances pickle).
MOH_ATTENTION: dict[str, type] = {}
for _key, _classes in FAMILY_CLASSES.items():
    _name = "MohLlamaAttentionOf" + _classes.attention.__name__
    MOH_ATTENTION[_key] = globals()[_name] = type(_name, (MohLlamaAttention, _classes.attention),
                                                  {"__module__": __name__, "__qualname__": _name})


class SoftCappedLinear(nn.Linear):
    """The LM head of a family that soft-caps its logits (Gemma's ``final_logit_softcapping``): cap * tanh(z / cap),
    so the causal LM's own forward (and loss) see the capped logits, as the family's own causal LM computes them."""

    def __init__(self, in_features: int, out_features: int, cap: float):
        super().__init__(in_features, out_features, bias=False)
        self.cap = float(cap)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(hidden) / self.cap) * self.cap


class MohLlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = MohLlamaConfig
    _no_split_modules = ["LlamaDecoderLayer"]  # each model names its family's decoder layer


class MohLlamaForCausalLM(MohLlamaPreTrainedModel, LlamaForCausalLM):
    """The source family's decoder stack (``source_model_type``) with MoH attention in every layer, and an LM head
    (soft-capped where the config sets ``final_logit_softcapping``, as Gemma's causal LM caps its logits)."""

    def __init__(self, config: MohLlamaConfig):
        LlamaPreTrainedModel.__init__(self, config)
        classes = family_classes(source_model_type_of(config))
        self._no_split_modules = [classes.decoder_layer.__name__]
        self.model = classes.model(config)
        for layer in self.model.layers:
            layer.self_attn = MohLlamaAttention.from_attention(layer.self_attn, config)
        self.vocab_size = config.vocab_size
        cap = getattr(config, "final_logit_softcapping", None)
        self.lm_head = (nn.Linear(config.hidden_size, config.vocab_size, bias=False) if cap is None
                        else SoftCappedLinear(config.hidden_size, config.vocab_size, cap))

        self.post_init()


# save_pretrained then writes ``auto_map`` into config.json and copies this file next to the weights.
MohLlamaConfig.register_for_auto_class()
MohLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")


def register_auto_classes() -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` load ``moh_llama`` folders without ``trust_remote_code``."""
    AutoConfig.register(MohLlamaConfig.model_type, MohLlamaConfig, exist_ok=True)
    AutoModelForCausalLM.register(MohLlamaConfig, MohLlamaForCausalLM, exist_ok=True)


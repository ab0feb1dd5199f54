"""``AttentionTransfer``: layer-wise, teacher-forced local distillation of a converted attention to its source.

At ``Event.INIT`` (before the FSDP wrap) every decoder layer gets the source's attention for that layer beside its
own, as ``layer.transfer_source``: the source family's own attention class (``dha_train.families``: its biases, q/k
norms, scale and sliding window; the layer passes it the same position embeddings and mask as its own attention, so
Gemma's local/global RoPE and sliding-window layers are the source's), frozen, in the same decoder-layer module, so FSDP2 shards and gathers both in one
unit. Only the source's attention weights are read (``safetensors`` per tensor), so memory is one model plus one
extra attention per layer. A forward hook on each layer's own attention then runs the source attention on the same
input and returns the SOURCE's output to the layer: the residual stream is the source's (teacher forcing), and the
converted attention only learns. Its loss per layer is the normalised MSE

    ||a_converted - a_source||^2 / ||a_source||^2      (over the micro-batch's tokens),

kept on the layer's module per forward (never in a global list). At ``Event.AFTER_LOSS`` the loss becomes

    lm_weight * L_lm + weight * mean over layers of the normalised MSE

(``lm_weight`` 0 by default; without the carry below, at 0 the LM head computes only the last position's logits,
no LM loss is taken and no train LM metric is kept, since none would reach the converted attention). Under FSDP2,
or with a positive ``lm_weight``, the layer output has the source's values with the converted output's gradient path
(a straight-through carry: FSDP2 unshards a layer for backward from hooks on its outputs), so a positive ``lm_weight`` trains the converted attention on the LM loss with the stream
teacher-forced; at 0 that term is exactly zero. Otherwise the source's output is returned as is. Either way each
converted attention reads its input detached, so a layer's MSE trains that layer's attention alone: without it, the
carry let every later layer's MSE reach every earlier attention through the stream (layer-local gradients were off
by 68% / 27% / 0% on a 3-layer model).
``trainable: attention`` (the default and the only value) freezes every parameter but the converted attentions'.
``transfer/layer<l>/mse`` and ``transfer/mse`` are logged per batch. The frozen source is not state: a resumed
run builds it again at INIT and loads the checkpoint's copy of it with the model. Exports drop it
(``methods.TRAINING_ONLY_MODULES``), so the exported model is the converted one alone.

When the student's weights come from rank 0 alone (``model.load_on_rank0``: the other ranks built the model on the
meta device), the source attentions are built on the meta device there too, and Composer's FSDP2 broadcasts rank 0's
copy with the rest of the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from safetensors import safe_open
from torch import nn

from dha_train import families, registry
from dha_train.config import ConfigError
from dha_train.methods import TRAINING_ONLY_MODULES
from dha_train.model_folders import SOURCE_MODEL_TYPES, check_model_folder, load_source_config, safetensors_shards
from dha_train.models.llama_layout import hf_model, train_only_attention

SOURCE_MODULE = TRAINING_ONLY_MODULES[0]


def _source_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Just the named tensors of a (possibly sharded) safetensors folder."""
    shards = safetensors_shards(folder, 'attention_transfer source_path')  # every shard name checked
    unmapped = sorted(set(names) - set(shards)) if shards is not None else []
    if unmapped:
        raise ConfigError(f'attention_transfer: the shard index of {folder} maps no shard for {unmapped[0]}')
    files = ({name: shards[name] for name in names} if shards is not None
             else {name: 'model.safetensors' for name in names})
    tensors = {}
    for file in sorted(set(files.values())):
        with safe_open(str(folder / file), framework='pt') as handle:
            for name in names:
                if files[name] == file:
                    tensors[name] = handle.get_tensor(name).float()
    return tensors


def _detached_input(module, args, kwargs):
    """The converted attention reads its input detached: each layer's MSE trains that layer's attention alone, also
    when the stream carries gradient paths (the straight-through carry), so transfer stays layer-local."""
    if args:
        return (args[0].detach(), *args[1:]), kwargs
    return args, {**kwargs, 'hidden_states': kwargs['hidden_states'].detach()}


class AttentionTransfer(Algorithm):
    def __init__(self, source_path: str, weight: float = 1.0, lm_weight: float = 0.0, trainable: str = 'attention'):
        if weight <= 0 or lm_weight < 0:
            raise ValueError(f'attention_transfer: weight must be > 0 and lm_weight >= 0, got {weight} and {lm_weight}')
        if trainable != 'attention':
            # anything else would let the MSE train embeddings, MLPs and norms through the stream: not teacher forcing
            raise ValueError(f"attention_transfer: trainable must be 'attention' (each converted attention learns its "
                             f"source's output on the source's stream), got '{trainable}'; train the rest with "
                             'distillation (trainable: all)')
        check_model_folder(source_path, who='attention_transfer source_path', model_types=SOURCE_MODEL_TYPES)
        self.source_path = Path(source_path)
        self.weight, self.lm_weight, self.trainable = weight, lm_weight, trainable
        self._layers: list[nn.Module] = []
        # Whether layer outputs carry the converted attention's gradient path (see the hook); set at FIT_START.
        self._carry = lm_weight > 0
        self._terms: Optional[torch.Tensor] = None  # detached per-layer MSE of the last micro-batch
        self._skip_logits = False  # whether the LM head computes one position only (set at FIT_START)

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.FIT_START, Event.BEFORE_FORWARD, Event.BEFORE_LOSS, Event.AFTER_LOSS,
                         Event.BATCH_END)

    def _install(self, state: State) -> None:
        model = hf_model(state.model)
        source_config = load_source_config(self.source_path, who='attention_transfer source_path')
        for key in ('num_hidden_layers', 'hidden_size', 'num_attention_heads'):
            if getattr(source_config, key) != getattr(model.config, key):
                raise ConfigError(f'attention_transfer: the source has {key}={getattr(source_config, key)}, the '
                                  f'model {getattr(model.config, key)}')
        source_config._attn_implementation = model.config._attn_implementation
        family = families.of(source_config, 'attention_transfer source_path')
        student_family = families.source_model_type(model.config)
        if student_family in families.FAMILIES and student_family != source_config.model_type:
            raise ConfigError(f'attention_transfer: the model is built on {student_family}, the source is a '
                              f'{source_config.model_type} model: not a conversion of this source')
        # A student whose RoPE differs from the source's (DeepSeek's format: one shared key of other width and
        # frequencies) passes position embeddings the source cannot use: the hook then makes the source's own, one
        # RoPE for every layer (the families DeepSeek's format takes have no per-layer RoPE; check refuses others).
        self._source_rope = None
        if getattr(model.config, 'qk_rope_head_dim', None) is not None:
            families.check('mla_deepseek', source_config, 'attention_transfer')
            self._source_rope = family.classes.rotary(source_config)
        layers = model.model.layers
        on_meta = next(model.parameters()).device.type == 'meta'
        train_only_attention(model)
        # Building draws random initial weights; forking keeps them out of the training RNG streams (exact resume).
        with torch.random.fork_rng():
            with torch.device('meta' if on_meta else 'cpu'):
                sources = [family.classes.attention(source_config, layer_idx=index) for index in range(len(layers))]
            # exactly the tensors the family's attention has (its biases and q/k norms included)
            names = [f'model.layers.{index}.self_attn.{key}' for index, source in enumerate(sources)
                     for key in source.state_dict()]
            tensors = {} if on_meta else _source_tensors(self.source_path, names)
            for index, (layer, source) in enumerate(zip(layers, sources)):
                if not on_meta:
                    prefix = f'model.layers.{index}.self_attn.'
                    source.load_state_dict({name[len(prefix):]: value for name, value in tensors.items()
                                            if name.startswith(prefix)})
                source.requires_grad_(False)
                layer.add_module(SOURCE_MODULE, source)
                layer.self_attn.register_forward_pre_hook(_detached_input, with_kwargs=True)
                layer.self_attn.register_forward_hook(self._hook(layer), with_kwargs=True)
                self._layers.append(layer)

    def _hook(self, layer: nn.Module):
        def teacher_forced(module, args, kwargs, output):
            source = getattr(layer, SOURCE_MODULE)
            call = dict(kwargs)
            call.pop('past_key_value', None)
            call.pop('past_key_values', None)
            if args:  # hidden_states given positionally
                call['hidden_states'] = args[0]
            if self._source_rope is not None:
                call['position_embeddings'] = self._source_position_embeddings(call['hidden_states'],
                                                                               call.get('position_ids'))
            with torch.no_grad():
                reference = source(**call)[0]
            converted = output[0]
            error = (converted.float() - reference.float()).pow(2).sum()
            source.transfer_mse = error / reference.float().pow(2).sum().clamp_min(1e-12)
            reference = reference.to(converted.dtype)
            if not self._carry:
                return (reference, *output[1:])
            # The layer carries the source's values on, with the converted output's autograd node behind them:
            # FSDP2 unshards a layer for backward from hooks on its outputs, so the backward pass must run through
            # every layer's output, and a positive lm_weight trains the converted attention through the stream.
            # Its gradient there is d(lm_weight * L_lm), exactly zero at lm_weight 0 (Event.AFTER_LOSS cancels the
            # LM term on the same tensor). No MSE crosses layers: each converted attention reads a detached input.
            return (reference + (converted - converted.detach()), *output[1:])
        return teacher_forced

    def _source_position_embeddings(self, hidden_states: torch.Tensor, position_ids: Optional[torch.Tensor]):
        """The source's (cos, sin) at the layer's positions (its own RoPE; the student's differs)."""
        if position_ids is None:
            position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
        return self._source_rope.to(hidden_states.device)(hidden_states, position_ids)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            self._install(state)
        elif event == Event.FIT_START:
            # FSDP2 wraps each decoder layer as an FSDPModule subclass after INIT
            self._carry = self.lm_weight > 0 or any(type(layer).__name__.startswith('FSDP') for layer in
                                                    hf_model(state.model).model.layers)
            # Without the carry no gradient reaches the LM head, and at lm_weight 0 the LM term is not in the loss:
            # every position's logits (a vocabulary-wide matmul, most of Gemma 3 270M's forward) would be thrown
            # away, so the head computes the last position's only (HF's logits_to_keep) and no LM loss is taken.
            self._skip_logits = (not self._carry and self.lm_weight == 0
                                 and 'logits_to_keep' in getattr(state.model, 'model_forward_args', ()))
            if self._skip_logits:
                # the train LM metric would score the source's stream (teacher forcing), not the converted model
                state.train_metrics = {}
        elif event == Event.BEFORE_FORWARD and self._skip_logits:
            state.batch = {**{key: value for key, value in state.batch.items() if key != 'labels'},
                           'logits_to_keep': 1}
        elif event == Event.BEFORE_LOSS and self._skip_logits:
            state.outputs['loss'] = state.outputs['logits'].new_zeros(())
        elif event == Event.AFTER_LOSS:
            errors = torch.stack([getattr(layer, SOURCE_MODULE).transfer_mse for layer in self._layers])
            lm = state.outputs['loss']
            state.loss = state.loss + (self.lm_weight - 1.0) * lm + self.weight * errors.mean()
            # (with the logits skipped, lm is 0 and the loss is the MSE term alone, as it is at lm_weight 0 with them)
            self._terms = errors.detach()
            for layer in self._layers:
                getattr(layer, SOURCE_MODULE).transfer_mse = None
        elif event == Event.BATCH_END and self._terms is not None:
            metrics = {f'transfer/layer{index}/mse': float(value) for index, value in enumerate(self._terms)}
            metrics['transfer/mse'] = float(self._terms.mean())
            logger.log_metrics(metrics)

    def state_dict(self) -> dict[str, Any]:
        return {}  # the source is a fixed input (rebuilt at INIT, its weights in the model's checkpoint)


registry.algorithms.register('attention_transfer', AttentionTransfer)

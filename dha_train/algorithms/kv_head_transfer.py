"""``KVHeadTransfer``: aligned GQA's pruning stage as a Composer algorithm (seed 001 section 3.5, Eq. 25-29).

- ``Event.INIT`` (before FSDP wrapping): every k_proj / v_proj of the (aligned, regrouped) MHA model becomes a
  ``TransferProjection`` with ``num_groups`` contiguous group heads, mean-pooled, and one hard-concrete gate per
  original head, open at the start (z = 1: the model is the MHA model). Gates get their own parameter group
  (``mask_lr``, no weight decay); the group heads train with the model.
- ``Event.AFTER_LOSS``: adds ``l0_weight`` (|s - T| + (s - T)^2) (Eq. 29), s the mean expected L0 of all gates, T
  falling linearly from ``target_start`` to 0 over the first ``warmup_fraction`` of the run.
- ``Event.BATCH_END``: at ``freeze_fraction`` of the run the gates freeze at 0 (deterministic from then on; any gate
  not yet closed is closed and counted in ``forced_closed``), so the rest of the run trains the model it exports:
  standard GQA, the original heads dropped (``dha-train export``).

The gates' frozen values live in the model (a persistent buffer) and the history in the algorithm's state, so a
resumed run keeps both.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger

from dha_train import families, registry
from dha_train.config import ConfigError
from dha_train.distributed import unsharded
from dha_train.methods import tag_method
from dha_train.models.head_map import source_head_map
from dha_train.models.llama_layout import attention_modules, head_dim, hf_model
from dha_train.models.transfer import TransferProjection
from dha_train.ops.hard_concrete import l0_loss, l0_target
from dha_train.optim import add_param_group

MASK_GROUP = 'transfer_masks'
GROUP_HEADS_GROUP = 'transfer_group_heads'


class KVHeadTransfer(Algorithm):
    def __init__(self, num_groups: int, mask_lr: float = 1e-2, l0_weight: float = 1.0, warmup_fraction: float = 0.3,
                 freeze_fraction: float = 0.8, target_start: float = 1.0, init_log_alpha: Optional[float] = None):
        if num_groups < 1:
            raise ValueError(f'kv_head_transfer: num_groups must be >= 1, got {num_groups}')
        if not 0.0 <= warmup_fraction <= freeze_fraction <= 1.0:
            raise ValueError('kv_head_transfer: need 0 <= warmup_fraction <= freeze_fraction <= 1, got '
                             f'{warmup_fraction} and {freeze_fraction}')
        if mask_lr <= 0 or l0_weight < 0 or not 0.0 <= target_start <= 1.0:
            raise ValueError('kv_head_transfer: mask_lr must be > 0, l0_weight >= 0 and target_start in [0, 1]')
        self.num_groups, self.mask_lr, self.l0_weight = num_groups, mask_lr, l0_weight
        self.warmup_fraction, self.freeze_fraction, self.target_start = warmup_fraction, freeze_fraction, target_start
        self.init_log_alpha = init_log_alpha
        self.projections: list[TransferProjection] = []
        self.history: list[dict[str, float]] = []
        self.frozen_at: Optional[int] = None
        self.forced_closed = 0
        self._density: Optional[torch.Tensor] = None
        self._target = target_start
        self.generator = torch.Generator()  # gate noise, seeded from the run seed at INIT

    def apply_surgery(self, model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        config = hf_model(model).config
        # An MHA or GQA model (aligned first with `dha-train align`): its own K/V heads merge into the groups.
        source_head_map(config, 'kv_head_transfer')
        families.check('aligned_gqa', config, 'kv_head_transfer')
        if config.num_key_value_heads % self.num_groups:
            raise ConfigError(f'kv_head_transfer: num_groups {self.num_groups} must divide the '
                             f'{config.num_key_value_heads} K/V heads')
        width = head_dim(config)
        self.projections = []
        for attn in attention_modules(model):
            attn.k_proj = TransferProjection(attn.k_proj, self.num_groups, width, self.init_log_alpha)
            attn.v_proj = TransferProjection(attn.v_proj, self.num_groups, width, self.init_log_alpha)
            self.projections += [attn.k_proj, attn.v_proj]
        tag_method(config, 'aligned_gqa')  # the checkpoint exports as the group heads alone (dha_train.methods)
        for projection in self.projections:
            projection.generator = self.generator
        group_heads = [p.group_weight for p in self.projections]
        group_heads += [p.group_bias for p in self.projections if p.group_bias is not None]  # Qwen2's k/v biases
        return [p.log_alpha for p in self.projections], group_heads

    def density(self) -> torch.Tensor:
        """Mean expected L0 over every gate, from the last forward."""
        if any(p.expected_density is None for p in self.projections):
            raise RuntimeError('kv_head_transfer: no forward pass has run yet')
        return torch.stack([p.expected_density for p in self.projections]).mean()

    @property
    def frozen(self) -> bool:
        return all(p.frozen for p in self.projections)

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.AFTER_LOSS, Event.BATCH_END)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            self.generator.manual_seed(state.rank_zero_seed)  # the same on every rank: the ranks sample alike
            masks, group_heads = self.apply_surgery(state.model)
            for optimizer in state.optimizers:
                add_param_group(optimizer, MASK_GROUP, masks, lr=self.mask_lr, weight_decay=0.0)
                add_param_group(optimizer, GROUP_HEADS_GROUP, group_heads)
        elif event == Event.AFTER_LOSS:
            density = self.density()
            self._density = density.detach()
            fraction = float(state.get_elapsed_duration() or 0.0)
            self._target = l0_target(fraction, 1.0, self.warmup_fraction, self.target_start)
            if not self.frozen and self.l0_weight:
                state.loss = state.loss + self.l0_weight * l0_loss(density, self._target)
        elif event == Event.BATCH_END:
            self._batch_end(state, logger)

    def _batch_end(self, state: State, logger: Logger) -> None:
        density = float(self._density) if self._density is not None else float(self.density())
        record = {'density': density, 'target': self._target, 'frozen': float(self.frozen)}
        self.history.append(record)
        fraction = float(state.get_elapsed_duration() or 0.0)
        if not self.frozen and fraction >= self.freeze_fraction:
            self.forced_closed = sum(p.freeze(unsharded(p.log_alpha), close=True) for p in self.projections)
            self.frozen_at = int(state.timestamp.batch)
        logger.log_metrics({'transfer/density': density, 'transfer/target': self._target,
                            'transfer/frozen': float(self.frozen), 'transfer/forced_closed': self.forced_closed})

    def state_dict(self) -> dict[str, Any]:
        return {'history': list(self.history), 'frozen_at': self.frozen_at, 'forced_closed': self.forced_closed,
                'gate_rng': self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history, self.frozen_at = list(state['history']), state['frozen_at']
        self.forced_closed = int(state['forced_closed'])
        self.generator.set_state(state['gate_rng'])


registry.algorithms.register('kv_head_transfer', KVHeadTransfer)

"""``HeadFusion``: DHA's fusion stage as a Composer algorithm (seed 000 section 4.2, Eq. 5-8, appendix B.2).

- ``Event.INIT`` (before FSDP wrapping): every k_proj / v_proj becomes a ``FusedProjection`` whose fusion weights
  start at the Kronecker delta (the model still equals MHA), grouped by a head map's K and V groups, or, for the
  Search stage, by ``warmup_groups`` contiguous groups per layer; the fusion weights join the optimizer as their own
  parameter group (``omega_lr``).
- ``Event.AFTER_LOSS``: adds lambda max(L_fusion - t, 0) (+ rho/2 max(.)^2), L_fusion being the mean over layers of
  each layer's fusion loss (``ops.fusion.fusion_loss``) as recorded by the projections in this forward.
- ``Event.BATCH_END``: dual ascent on lambda, the margin step advances, the history grows; once L_fusion falls below
  ``threshold`` the run stops cleanly (``stop_at_threshold``). The ``fusion_monitor`` callback logs all of it.

lambda, the step, the history and the convergence batch are the algorithm's state, saved in every checkpoint.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger

from dha_train import registry
from dha_train.models.fusion import FusedProjection
from dha_train.models.head_map import HeadMap
from dha_train.ops.fusion import dual_ascent, fusion_margin, group_members, lagrangian_penalty
from dha_train.ops.grouping import neighbour_groups

OMEGA_GROUP = 'fusion_omega'


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    return model if hasattr(model, 'lm_head') else model.model


class HeadFusion(Algorithm):
    def __init__(self, head_map: Optional[str] = None, warmup_groups: Optional[int] = None, omega_lr: float = 0.05,
                 lambda_lr: float = 0.05, lambda_init: float = 0.0, rho: float = 0.0, margin_base: float = 0.999,
                 margin_warmup_steps: int = 80, threshold: float = 1e-3, stop_at_threshold: bool = True):
        if (head_map is None) == (warmup_groups is None):
            raise ValueError('head_fusion: give exactly one of head_map (Fusion) and warmup_groups (Search)')
        if threshold <= 0 or omega_lr <= 0 or lambda_lr < 0 or rho < 0 or margin_warmup_steps < 0:
            raise ValueError('head_fusion: threshold and omega_lr must be > 0; lambda_lr, rho and '
                             'margin_warmup_steps >= 0')
        self.head_map_path, self.warmup_groups = head_map, warmup_groups
        self.omega_lr, self.lambda_lr, self.rho = omega_lr, lambda_lr, rho
        self.margin_base, self.margin_warmup_steps = margin_base, margin_warmup_steps
        self.threshold, self.stop_at_threshold = threshold, stop_at_threshold
        self.lam = float(lambda_init)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.converged_at: Optional[int] = None
        self.projections: list[tuple[FusedProjection, FusedProjection]] = []
        self._last_loss: Optional[torch.Tensor] = None

    # --- surgery ------------------------------------------------------------------------------------------------

    def partitions(self, config) -> tuple[list, list]:
        """Per-layer K and V partitions: the head map's groups, or contiguous warm-up groups (Search)."""
        num_layers, num_heads = config.num_hidden_layers, config.num_attention_heads
        if self.head_map_path is None:
            groups = neighbour_groups(num_heads, self.warmup_groups)
            return [groups] * num_layers, [groups] * num_layers
        from dha_train.convert import check_head_map_fits

        head_map = HeadMap.load(self.head_map_path)
        check_head_map_fits(head_map, config)
        return [layer.key_groups() for layer in head_map.layers], [layer.value_groups() for layer in head_map.layers]

    def apply_surgery(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        from dha_train.calibration import attention_modules

        hf_model = _hf_model(model)
        config = hf_model.config
        if config.num_key_value_heads != config.num_attention_heads:
            raise ValueError('head_fusion: fusion starts from an MHA model (num_key_value_heads == num_attention_heads)')
        key_partitions, value_partitions = self.partitions(config)
        head_dim = getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads
        self.projections = []
        for attn, key_groups, value_groups in zip(attention_modules(hf_model), key_partitions, value_partitions):
            attn.k_proj = FusedProjection(attn.k_proj, group_members(key_groups, config.num_attention_heads), head_dim)
            attn.v_proj = FusedProjection(attn.v_proj, group_members(value_groups, config.num_attention_heads),
                                          head_dim)
            self.projections.append((attn.k_proj, attn.v_proj))
        return [p.omega for pair in self.projections for p in pair]

    # --- loss ---------------------------------------------------------------------------------------------------

    def _recorded_projections(self) -> list[tuple[FusedProjection, FusedProjection]]:
        if any(p.pair_squares is None for pair in self.projections for p in pair):
            raise RuntimeError('head_fusion: no forward pass has recorded the fusion terms yet')
        return self.projections

    def kind_losses(self) -> list[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """Each layer's K and V fusion loss from the last forward (None for a kind whose groups hold one head)."""
        return [tuple(p.pair_squares / p.pair_elements if p.pair_elements else None for p in pair)
                for pair in self._recorded_projections()]

    def layer_losses(self) -> list[torch.Tensor]:
        """Each layer's fusion loss from the last forward (mean squared omega difference over its K and V pairs)."""
        return [(key.pair_squares + value.pair_squares) / (key.pair_elements + value.pair_elements)
                for key, value in self._recorded_projections() if key.pair_elements + value.pair_elements]

    def fusion_loss(self) -> torch.Tensor:
        losses = self.layer_losses()
        return torch.stack(losses).mean() if losses else torch.zeros(())

    @property
    def margin(self) -> float:
        return fusion_margin(self.step, self.margin_warmup_steps, self.margin_base)

    # --- Composer -----------------------------------------------------------------------------------------------

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.FIT_START, Event.AFTER_LOSS, Event.BATCH_END)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            from dha_train.train import add_param_group

            omegas = self.apply_surgery(state.model)
            for optimizer in state.optimizers:
                add_param_group(optimizer, OMEGA_GROUP, omegas, lr=self.omega_lr, weight_decay=0.0)
        elif event == Event.FIT_START:
            if self.converged_at is not None and self.stop_at_threshold:
                state.stop_training()  # resumed from the checkpoint written when fusion converged: nothing to do
        elif event == Event.AFTER_LOSS:
            loss = self.fusion_loss()
            self._last_loss = loss.detach()
            state.loss = state.loss + lagrangian_penalty(loss, self.margin, self.lam, self.rho)
        elif event == Event.BATCH_END:
            self._batch_end(state, logger)

    def _batch_end(self, state: State, logger: Logger) -> None:
        loss = float(self._last_loss) if self._last_loss is not None else float(self.fusion_loss())
        margin = self.margin
        self.lam = dual_ascent(self.lam, loss, margin, self.lambda_lr)
        self.step += 1
        record = {'fusion_loss': loss, 'lambda': self.lam, 'margin': margin}
        self.history.append(record)
        if loss < self.threshold and self.converged_at is None:
            self.converged_at = int(state.timestamp.batch)
            if self.stop_at_threshold:
                state.stop_training()

    @staticmethod
    def of(state: State, needed_by: str) -> 'HeadFusion':
        """The run's HeadFusion algorithm, for the callbacks that read it."""
        for algorithm in state.algorithms:
            if isinstance(algorithm, HeadFusion):
                return algorithm
        raise ValueError(f'{needed_by} needs the head_fusion algorithm in the recipe (algorithms: head_fusion: ...)')

    def state_dict(self) -> dict[str, Any]:
        return {'lam': self.lam, 'step': self.step, 'history': list(self.history), 'converged_at': self.converged_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lam, self.step = float(state['lam']), int(state['step'])
        self.history, self.converged_at = list(state['history']), state['converged_at']


@registry.algorithms.register('head_fusion')
def _head_fusion(**kwargs) -> HeadFusion:
    return HeadFusion(**kwargs)

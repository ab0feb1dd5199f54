"""``HeadFusion``: DHA's fusion stage as a Composer algorithm (seed 000 section 4.2, Eq. 5-8, appendix B.2).

- ``Event.INIT`` (before FSDP wrapping): every k_proj / v_proj becomes a ``FusedProjection`` whose fusion weights
  start at the Kronecker delta (the model still equals MHA), grouped by a head map's K and V groups, or, for the
  Search stage, by ``warmup_groups`` contiguous groups per layer; the fusion weights join the optimizer as their own
  parameter group (``omega_lr``).
- ``Event.AFTER_LOSS``: adds lambda max(L_fusion - t, 0) (+ rho/2 max(.)^2), L_fusion being the mean over layers of
  each layer's fusion loss (``ops.fusion.fusion_loss``) as recorded by the projections in this forward.
- ``Event.BATCH_END``: dual ascent on lambda, the margin step advances, the history grows; once L_fusion falls below
  ``threshold`` the run stops cleanly (``stop_at_threshold``). The ``fusion_monitor`` callback logs all of it.

Progressive fusion (seed 000 B.2, ``progressive: [2]`` = fuse 2x, then the whole groups): the loss first counts
only the pairs within sub-groups of each head-map group (the closest heads by Eq. 6's weight-space distance, split
by the annealing search); each time it falls below ``threshold`` the next stage joins sub-groups (their union with
the nearest others, ``ops.fusion.split_into_subgroups``), lambda restarts at ``lambda_init`` and the margin schedule
restarts; the run converges when the last stage (the whole groups) falls below the threshold. The paper's
LM-only measuring steps before each stage are not reproduced: a stage clusters on the weights as they are then.

lambda, the step, the stage, its sub-groups, the history and the convergence batch are the algorithm's state,
saved in every checkpoint.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from composer.utils import dist

from dha_train import families, registry
from dha_train.config import ConfigError
from dha_train.distributed import unsharded
from dha_train.methods import tag_method
from dha_train.models.fusion import FusedProjection
from dha_train.models.head_map import HeadMap, source_head_map
from dha_train.models.llama_layout import attention_modules, head_dim, hf_model
from dha_train.ops.fusion import (
    dual_ascent,
    fusion_margin,
    group_members,
    groups_of,
    head_distances,
    lagrangian_penalty,
    progressive_sizes,
    split_into_subgroups,
    with_bias_column,
)
from dha_train.ops.grouping import Partition, neighbour_groups
from dha_train.optim import add_param_group

OMEGA_GROUP = 'fusion_omega'


class HeadFusion(Algorithm):
    def __init__(self, head_map: Optional[str] = None, warmup_groups: Optional[int] = None, omega_lr: float = 0.05,
                 lambda_lr: float = 0.05, lambda_init: float = 0.0, rho: float = 0.0, margin_base: float = 0.999,
                 margin_warmup_steps: int = 80, threshold: float = 1e-3, stop_at_threshold: bool = True,
                 progressive: Optional[list[int]] = None, progressive_seed: int = 0):
        if (head_map is None) == (warmup_groups is None):
            raise ValueError('head_fusion: give exactly one of head_map (Fusion) and warmup_groups (Search)')
        progressive = list(progressive or [])
        if progressive and (warmup_groups is not None or any(not isinstance(size, int) or size < 2
                                                             for size in progressive)
                            or progressive != sorted(set(progressive))):
            raise ValueError(f'head_fusion: progressive must be increasing sub-group sizes >= 2 (e.g. [2] to fuse 2x '
                             f'before the whole groups), used with head_map only; got {progressive}')
        if threshold <= 0 or omega_lr <= 0 or lambda_lr < 0 or rho < 0 or margin_warmup_steps < 0:
            raise ValueError('head_fusion: threshold and omega_lr must be > 0; lambda_lr, rho and '
                             'margin_warmup_steps >= 0')
        self.head_map_path, self.warmup_groups = head_map, warmup_groups
        # Read now, so a missing or malformed head map fails with the recipe's other errors, before any launch.
        self.head_map = HeadMap.load(head_map) if head_map is not None else None
        self.omega_lr, self.lambda_lr, self.rho = omega_lr, lambda_lr, rho
        self.margin_base, self.margin_warmup_steps = margin_base, margin_warmup_steps
        self.threshold, self.stop_at_threshold = threshold, stop_at_threshold
        self.progressive, self.progressive_seed = progressive, progressive_seed
        self.lambda_init = float(lambda_init)
        self.lam = float(lambda_init)
        self.step = 0
        self.stage = 0  # progressive-fusion stage; the last one fuses the whole groups
        self.stage_started = 0  # the step at which the stage began: its margin schedule starts there
        self.stage_subgroups: Optional[list[list[Partition]]] = None  # per layer, K and V sub-groups of the stage
        self.history: list[dict[str, float]] = []
        self.converged_at: Optional[int] = None
        self.projections: list[tuple[FusedProjection, FusedProjection]] = []
        self._last_loss: Optional[torch.Tensor] = None

    # --- surgery ------------------------------------------------------------------------------------------------

    def partitions(self, config) -> tuple[list, list]:
        """Per-layer K and V partitions of the source's own K/V heads (the query heads for an MHA source, the shared
        heads for a GQA one: fusion weights mix the source heads of a group, nothing is expanded per query head):
        the head map's groups, or contiguous warm-up groups (Search)."""
        source = source_head_map(config, 'head_fusion')
        if self.head_map_path is None:
            num_units = source.layers[0].num_key_heads
            if num_units % self.warmup_groups:
                raise ConfigError(f'head_fusion: warmup_groups {self.warmup_groups} must divide the source\'s '
                                  f'{num_units} K/V heads')
            groups = neighbour_groups(num_units, self.warmup_groups)
            return [groups] * source.num_layers, [groups] * source.num_layers
        self.head_map.check_fits(config)
        return self.head_map.source_partitions(source)

    def apply_surgery(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        hf = hf_model(model)
        config = hf.config
        # The fused model is the source family's own class with these projections: its q/k norms and biases apply
        # after the fused projection, as in the source.
        families.check('dha', config, 'head_fusion')
        key_partitions, value_partitions = self.partitions(config)
        width = head_dim(config)
        self.projections = []
        for attn, key_groups, value_groups in zip(attention_modules(hf), key_partitions, value_partitions):
            attn.k_proj = FusedProjection(attn.k_proj, group_members(key_groups, config.num_key_value_heads), width)
            attn.v_proj = FusedProjection(attn.v_proj, group_members(value_groups, config.num_key_value_heads), width)
            self.projections.append((attn.k_proj, attn.v_proj))
        tag_method(config, 'dha')  # the checkpoint exports by baking the fusion (dha_train.methods)
        # A rank without weights yet (model.load_on_rank0 builds ranks other than 0 on the meta device) cannot split
        # the groups by head distance: it takes rank 0's split at Event.INIT.
        if self.progressive and not self.projections[0][0].weight.is_meta:
            self._enter_stage(0)
        return [p.omega for pair in self.projections for p in pair]

    # --- progressive fusion ---------------------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.progressive) + 1

    def _stage_size(self, projection: FusedProjection, stage: int) -> int:
        return progressive_sizes(projection.members.shape[1], self.progressive)[stage]

    def _next_stage(self) -> Optional[int]:
        """The next stage that fuses more pairs than the current one (None at the last): a stage whose sizes equal
        the current ones for every layer and kind (e.g. ``[2]`` where every group holds 2 heads) is skipped."""
        for stage in range(self.stage + 1, self.num_stages):
            if any(self._stage_size(projection, stage) != self._stage_size(projection, self.stage)
                   for pair in self.projections for projection in pair):
                return stage
        return None

    def _enter_stage(self, stage: int) -> None:
        """Point every projection's fusion pairs at the stage's sub-groups: the whole groups at the last stage, else
        splits of the last stage's sub-groups by the current weight-space head distances (a collective under FSDP2:
        every rank runs it at the same batch, since the fusion loss that triggers it is the same on every rank)."""
        previous = self.stage_subgroups
        self.stage, self.stage_subgroups = stage, []
        for layer, pair in enumerate(self.projections):
            kinds = []
            for kind, projection in enumerate(pair):
                groups = groups_of(projection.members)
                size = self._stage_size(projection, stage)
                if size == projection.members.shape[1]:
                    subgroups = groups
                else:
                    bias = None if projection.bias is None else unsharded(projection.bias).float().cpu()
                    rows = with_bias_column(unsharded(projection.weight).float().cpu(), bias)
                    distance, _ = head_distances(rows, unsharded(projection.omega).float().cpu(),
                                                 projection.members.cpu())
                    subgroups = split_into_subgroups(distance, groups, size,
                                                     previous[layer][kind] if previous else None,
                                                     seed=self.progressive_seed)
                kinds.append(subgroups)
            self.stage_subgroups.append(kinds)
        self._point_projections_at_subgroups()

    def _point_projections_at_subgroups(self) -> None:
        for pair, kinds in zip(self.projections, self.stage_subgroups):
            for projection, subgroups in zip(pair, kinds):
                projection.set_fusion_pairs(group_members(subgroups, projection.members.shape[0]))

    # --- loss ---------------------------------------------------------------------------------------------------

    def _recorded_projections(self) -> list[tuple[FusedProjection, FusedProjection]]:
        if any(p.pair_squares is None for pair in self.projections for p in pair):
            raise RuntimeError('head_fusion: no forward pass has recorded the fusion terms yet')
        return self.projections

    def kind_losses(self) -> list[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """Each layer's K and V fusion loss from the last forward, detached for reporting (None for a kind whose
        groups hold one head)."""
        return [tuple(p.pair_squares.detach() / p.pair_elements if p.pair_elements else None for p in pair)
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
        return fusion_margin(self.step - self.stage_started, self.margin_warmup_steps, self.margin_base)

    # --- Composer -----------------------------------------------------------------------------------------------

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.FIT_START, Event.AFTER_LOSS, Event.BATCH_END)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            omegas = self.apply_surgery(state.model)
            if self.progressive and dist.get_world_size() > 1:
                # Every rank fuses rank 0's stage-0 sub-groups (the only ones under model.load_on_rank0; otherwise
                # every rank split the same weights alike).
                subgroups = [self.stage_subgroups]
                dist.broadcast_object_list(subgroups, src=0)
                self.stage_subgroups = subgroups[0]
                self._point_projections_at_subgroups()
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
        if self.progressive:
            record['stage'] = self.stage
        self.history.append(record)
        upcoming = self._next_stage() if loss < self.threshold else None
        if upcoming is not None:
            self.stage_started, self.lam = self.step, self.lambda_init  # a new constraint: fresh multiplier, margin
            self._enter_stage(upcoming)
        elif loss < self.threshold and self.converged_at is None:
            self.converged_at = int(state.timestamp.batch)
            if self.stop_at_threshold:
                state.stop_training()

    @staticmethod
    def of(state: State, needed_by: str) -> 'HeadFusion':
        """The run's HeadFusion algorithm, for the callbacks that read it."""
        for algorithm in state.algorithms:
            if isinstance(algorithm, HeadFusion):
                return algorithm
        raise ConfigError(f'{needed_by} needs the head_fusion algorithm in the recipe (algorithms: head_fusion: ...)')

    def state_dict(self) -> dict[str, Any]:
        return {'lam': self.lam, 'step': self.step, 'history': list(self.history), 'converged_at': self.converged_at,
                'stage': self.stage, 'stage_started': self.stage_started, 'stage_subgroups': self.stage_subgroups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lam, self.step = float(state['lam']), int(state['step'])
        self.history, self.converged_at = list(state['history']), state['converged_at']
        self.stage, self.stage_started = int(state.get('stage', 0)), int(state.get('stage_started', 0))
        saved = state.get('stage_subgroups')
        if bool(saved) != bool(self.progressive):
            raise ConfigError('head_fusion: the checkpoint was written with progressive fusion '
                             f'{"on" if saved else "off"} but the recipe has it {"on" if self.progressive else "off"}')
        if saved:
            self.stage_subgroups = saved
            self._point_projections_at_subgroups()


registry.algorithms.register('head_fusion', HeadFusion)

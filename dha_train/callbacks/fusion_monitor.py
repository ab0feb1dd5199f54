"""``FusionMonitor``: DHA fusion on the dashboards (seed 000 section 4.2).

Every ``interval`` batches it logs, to every configured logger (console, wandb, ...):

- ``fusion/loss``, ``fusion/lambda``, ``fusion/margin``, ``fusion/violation`` (= max(L_fusion - t, 0)), and
  ``fusion/stage`` under progressive fusion (the loss then counts the current stage's sub-groups);
- ``fusion/layer{l}/key_loss`` and ``value_loss``: each layer's K and V fusion loss (Eq. 7 normalised as Alg. 3);
- ``fusion/layer{l}/key_self_weight`` and ``value_self_weight``: the mean fusion weight a query head puts on its own
  MHA head, 1 at the Kronecker init and 1/g once the group has fused to its mean;
- ``fusion/omega_mean``, ``omega_std``, ``omega_abs_max`` over all fusion weights.
"""

from __future__ import annotations

import torch
from composer.core import Callback, State
from composer.loggers import Logger

from dha_train import registry
from dha_train.algorithms.head_fusion import HeadFusion
from dha_train.distributed import unsharded


def self_weight(omega: torch.Tensor, members: torch.Tensor) -> float:
    """Mean over query heads h and dimensions of omega[h, j] where members[h, j] == h."""
    own = members.to(omega.device) == torch.arange(members.shape[0], device=omega.device)[:, None]
    return float(omega[own].mean())


class FusionMonitor(Callback):
    def __init__(self, interval: int = 1, per_layer: bool = True):
        if interval < 1:
            raise ValueError(f'fusion_monitor: interval must be >= 1, got {interval}')
        self.interval, self.per_layer = interval, per_layer
        self._fusion: HeadFusion | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        self._fusion = HeadFusion.of(state, 'fusion_monitor')

    def batch_end(self, state: State, logger: Logger) -> None:
        fusion = self._fusion
        if fusion is None or not fusion.history or int(state.timestamp.batch) % self.interval:
            return
        record = fusion.history[-1]
        metrics = {'fusion/loss': record['fusion_loss'], 'fusion/lambda': record['lambda'],
                   'fusion/margin': record['margin'],
                   'fusion/violation': max(record['fusion_loss'] - record['margin'], 0.0)}
        if 'stage' in record:
            metrics['fusion/stage'] = record['stage']
        omegas = []
        for layer, ((key, value), losses) in enumerate(zip(fusion.projections, fusion.kind_losses())):
            for kind, projection, loss in (('key', key, losses[0]), ('value', value, losses[1])):
                omega = unsharded(projection.omega).float()  # gathered on every rank: a collective
                omegas.append(omega.flatten())
                if self.per_layer:
                    if loss is not None:
                        metrics[f'fusion/layer{layer}/{kind}_loss'] = float(loss)
                    metrics[f'fusion/layer{layer}/{kind}_self_weight'] = self_weight(omega, projection.members)
        every = torch.cat(omegas)
        metrics.update({'fusion/omega_mean': float(every.mean()), 'fusion/omega_std': float(every.std()),
                        'fusion/omega_abs_max': float(every.abs().max())})
        logger.log_metrics(metrics)


registry.callbacks.register('fusion_monitor', FusionMonitor)

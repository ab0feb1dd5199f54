"""``MohMonitor``: MoH routing on the dashboards (seed 002 Fig. 3).

Every ``interval`` batches it logs, from the ``mixture_of_heads`` algorithm's statistics of that batch (mean over
its micro-batches, on rank 0's tokens):

- ``moh/active_fraction``: the measured share of query heads each token used (shared heads count 1);
- ``moh/router_entropy`` and ``moh/router_max_prob``: of the routed-head softmax, mean over layers and tokens;
  ``moh/alpha_shared``: the weight of the shared heads in the learned router's two-stage weighting;
- ``moh/load_min``, ``moh/load_max``, ``moh/load_std``: spread of the routed heads' load (1/R-balanced when equal);
- with ``per_head``, ``moh/layer{l}/head{h}/load`` for every head.

Every ``plot_interval`` batches (and at the end of training) it draws the per-head load of every layer as a heatmap
and logs it as an image (``moh/head_load``); with ``plot_dir`` (``{run_name}`` is filled in) rank 0 also writes the
PNG there, ``head_load_ba{batch}.png``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from dha_train import registry
from dha_train.algorithms.mixture_of_heads import MixtureOfHeads
from dha_train.plots import _pyplot, plot_head_load


class MohMonitor(Callback):
    def __init__(self, interval: int = 1, per_head: bool = False, plot_interval: int = 0,
                 plot_dir: Optional[str] = None):
        if interval < 1 or plot_interval < 0:
            raise ValueError(f'moh_monitor: interval must be >= 1 and plot_interval >= 0, got {interval} and '
                             f'{plot_interval}')
        self.interval, self.per_head = interval, per_head
        self.plot_interval, self.plot_dir = plot_interval, plot_dir
        self._moh: Optional[MixtureOfHeads] = None
        self._plotted_batch: Optional[int] = None

    def fit_start(self, state: State, logger: Logger) -> None:
        self._moh = MixtureOfHeads.of(state, 'moh_monitor')

    def metrics(self) -> dict[str, float]:
        """The last batch's routing figures, as logged."""
        routing = self._moh.routing
        load = routing['load']  # (layers, heads)
        metrics = {'moh/active_fraction': float(load.mean())}
        for key in ('router_entropy', 'router_max_prob', 'alpha_shared'):
            if key in routing:
                metrics[f'moh/{key}'] = float(routing[key].mean())
        routed = [load[layer, attn.shared_heads:] for layer, attn in enumerate(self._moh.attentions)]
        routed = [row for row in routed if row.numel()]
        if routed:
            every = torch.cat(routed)
            metrics.update({'moh/load_min': float(every.min()), 'moh/load_max': float(every.max()),
                            'moh/load_std': float(every.std()) if every.numel() > 1 else 0.0})
        if self.per_head:
            for layer, row in enumerate(load.tolist()):
                for head, value in enumerate(row):
                    metrics[f'moh/layer{layer}/head{head}/load'] = value
        return metrics

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._moh is None or not self._moh.routing:
            return
        batch = int(state.timestamp.batch)
        if batch % self.interval == 0:
            logger.log_metrics(self.metrics())
        if self.plot_interval and batch % self.plot_interval == 0:
            self.plot(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        done = self._plotted_batch == int(state.timestamp.batch)
        if self.plot_interval and self._moh is not None and self._moh.routing and not done:
            self.plot(state, logger)

    def plot(self, state: State, logger: Logger) -> None:
        batch = self._plotted_batch = int(state.timestamp.batch)
        if dist.get_global_rank() != 0:
            return
        title = f'MoH head load, batch {batch} ({float(self._moh.routing["load"].mean()):.0%} of heads active)'
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(self.plot_dir.format(run_name=state.run_name)) if self.plot_dir else Path(tmp)
            path = plot_head_load(self._moh.routing['load'].numpy(), folder / f'head_load_ba{batch}.png', title)
            image = _pyplot().imread(str(path))[..., :3]
        logger.log_images(image, name='moh/head_load', channels_last=True, step=batch)


registry.callbacks.register('moh_monitor', MohMonitor)

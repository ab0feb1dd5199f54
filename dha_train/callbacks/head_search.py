"""``HeadSearch``: DHA's Search stage as a Composer callback (seed 000 section 4.3, appendix B.3-B.4).

It runs beside ``head_fusion`` with ``warmup_groups: 1`` (every layer's K heads form one warm-up group, and so do
its V heads) for a short run (about 240 steps at paper scale). Every ``interval`` batches it gathers each layer's
K and V head distances: the weight-space form of Eq. 6, L(h, h') = 1/g ||W^(h) - W^(h')||^2 (a k/v bias, as Qwen2
has, is one more column of W: ``ops.fusion.with_bias_column``), drives the grouping,
and the omega-only form of Eq. 7 is logged and saved beside it. At the end of the run, on the mean distances:

1. a DP picks each layer's K and V counts so that they sum exactly to ``kv_budget`` of the source's K+V heads (MHA's,
   or a GQA source's shared heads, which are then the units grouped: nothing is expanded per query head), from
   each layer's fusion loss (Eq. 7 as Alg. 3 normalises it, per kind, averaged over the Search): the cost of giving a
   (layer, kind) ``c`` heads is its loss x (H / c - 1), so layers whose heads resist fusing keep more heads (section
   4.3: "allocate more head budget to layers with higher loss"; App. B.4). That loss lives in the space of the fusion
   weights omega, which start at the Kronecker delta in every layer, so it measures how hard the heads are to fuse and
   not how large W_k or W_v happen to be: rescaling W_k (and W_q inversely) or W_v (and W_o) leaves it, and the
   allocation, unchanged;
2. every (layer, kind) matrix of Eq. 6 weight-space distances is grouped into that many equal groups by simulated
   annealing (Alg. 4, incremental swap deltas; temperatures follow each matrix's spread, so a rescaled layer groups
   the same way);
3. ``out`` receives head_map.json (the Fusion stage's input), search.json, distances.pt, kv_heads.png (Fig. 8) and
   head_distance_{key,value}.png.

``servable: true`` keeps the map to what serving engines take (llama.cpp's per-layer ``head_count_kv``, vLLM): in
every layer plain GQA up to a permutation of the query heads. The DP then gives each layer one count for K and V
together (priced at the K cost plus the V cost, spending two heads of the total), from the divisors of the source's
K/V heads (so every group is the same size), and each layer's K and V share one partition, annealed on the mean of
its K and V Eq. 6 distances, each matrix first scaled to a mean off-diagonal distance of one
(``ops.budget.shared_kv_matrices``). The Fusion stage is unchanged.

The accumulated distances are the callback's checkpoint state, so a resumed Search continues its averages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from dha_train import registry
from dha_train.algorithms.head_fusion import HeadFusion
from dha_train.config import ConfigError
from dha_train.distributed import unsharded
from dha_train.models.head_map import HEAD_MAP_FILE, HeadMap, source_head_map
from dha_train.models.llama_layout import hf_model
from dha_train.ops.budget import (
    allocate_kv_heads,
    divisors,
    fusion_loss_costs,
    group_at_allocation,
    reachable_totals,
    totals_text,
    whole_head_count,
)
from dha_train.ops.fusion import head_distances, with_bias_column
from dha_train.paths import refuse_nonempty, staged_folder
from dha_train.plots import plot_head_similarity, plot_kv_allocation

SEARCH_REPORT = 'search.json'
DISTANCES_FILE = 'distances.pt'
KINDS = ('key', 'value')


def total_heads_for_budget(kv_budget: float, num_layers: int, num_heads: int) -> int:
    """The K+V head total that ``kv_budget`` (a fraction of the source's K+V heads) stands for; it must be whole."""
    return whole_head_count(kv_budget, 2 * num_layers * num_heads)


class HeadSearch(Callback):
    def __init__(self, out: str, kv_budget: float, interval: int = 1, start_batch: int = 0, restarts: int = 8,
                 steps: Optional[int] = None, seed: int = 0, allowed: Optional[list[int]] = None,
                 overwrite: bool = False, servable: bool = False):
        if interval < 1 or start_batch < 0 or restarts < 1:
            raise ValueError('head_search: interval and restarts must be >= 1 and start_batch >= 0')
        if not 0 < kv_budget <= 1:
            raise ValueError(f'head_search: kv_budget must be in (0, 1], got {kv_budget}')
        self.out, self.kv_budget, self.interval, self.start_batch = Path(out), kv_budget, interval, start_batch
        self.restarts, self.steps, self.seed, self.allowed, self.overwrite = restarts, steps, seed, allowed, overwrite
        if not isinstance(servable, bool):
            raise ConfigError(f'head_search: servable must be true or false, got {servable!r}')
        self.servable = servable
        self.records = 0
        self.weight_sum: Optional[torch.Tensor] = None  # (2L, H, H) float64: K of every layer, then V
        self.omega_sum: Optional[torch.Tensor] = None
        self.loss_sum: Optional[torch.Tensor] = None  # (L, 2) omega fusion loss per layer and kind (Eq. 7, Alg. 3)
        self.result: Optional[dict] = None
        self._fusion: Optional[HeadFusion] = None
        self._source: Optional[HeadMap] = None  # the source model's map (MHA or GQA), to state the result over

    # --- checks -------------------------------------------------------------------------------------------------

    def _check(self, state: State) -> None:
        fusion = HeadFusion.of(state, 'head_search')
        if fusion.head_map_path is not None or fusion.warmup_groups != 1:
            raise ConfigError('head_search: the Search stage needs head_fusion with warmup_groups: 1 (one warm-up '
                             'group per layer) and no head_map')
        if fusion.stop_at_threshold:
            raise ConfigError('head_search: set head_fusion.stop_at_threshold: false, so the Search runs its '
                             'whole duration')
        num_layers, num_heads = len(fusion.projections), fusion.projections[0][0].members.shape[0]
        total = total_heads_for_budget(self.kv_budget, num_layers, num_heads)
        if self.servable:
            self._check_servable(num_layers, num_heads, total)
        else:
            allocate_kv_heads(lambda *_: 0.0, num_layers, num_heads, total, allowed=self.allowed)  # reachable?
        self._fusion = fusion
        self._source = source_head_map(hf_model(state.model).config, 'head_search')

    def _check_servable(self, num_layers: int, num_heads: int, total: int) -> None:
        """A servable Search's counts divide the source's K/V heads, and its total is a sum of one such count per
        layer, twice (K and V); otherwise a ConfigError names the budget, the reachable totals and the nearest
        reachable budgets."""
        counts = divisors(num_heads)
        if self.allowed is not None:
            unequal = sorted(set(int(c) for c in self.allowed) - set(counts))
            if unequal:
                raise ConfigError(f'head_search: servable: allowed counts {unequal} do not divide the source\'s '
                                  f'{num_heads} K/V heads, so their groups would differ in size; use counts among '
                                  f'{counts}')
            counts = sorted({int(c) for c in self.allowed})
        totals = reachable_totals(num_layers, counts, unit=2)
        if total in totals:
            return
        whole = 2 * num_layers * num_heads
        below, above = [t for t in totals if t < total][-1:], [t for t in totals if t > total][:1]
        nearest = ' or '.join(f'{t / whole:.6g} ({t} heads)' for t in below + above)
        raise ConfigError(
            f'head_search: servable kv_budget {self.kv_budget} is {total} of the source\'s {whole} K+V heads '
            f'({num_layers} layers x {num_heads} K and {num_heads} V heads), which no servable allocation reaches: '
            f'every layer takes one count from {counts} for K and V together, so the reachable totals are '
            f'{totals_text(totals)}; the nearest reachable kv_budget is {nearest}')

    def fit_start(self, state: State, logger: Logger) -> None:
        self._check(state)
        if int(state.timestamp.batch) == 0 and self.records == 0:
            refuse_nonempty(self.out, self.overwrite)  # a fresh Search never silently replaces an old one

    # --- accumulation -------------------------------------------------------------------------------------------

    def batch_end(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        if batch < self.start_batch or batch % self.interval:
            return
        fusion = self._fusion
        weight, omega = [], []
        for key, value in fusion.projections:
            for projection in (key, value):
                bias = None if projection.bias is None else unsharded(projection.bias).float()
                rows = with_bias_column(unsharded(projection.weight).float(), bias)  # a k/v bias counts (Qwen2)
                ws, om = head_distances(rows, unsharded(projection.omega).float(), projection.members)
                weight.append(ws.cpu())
                omega.append(om.cpu())
        num_layers = len(fusion.projections)
        # projections alternate K, V per layer; store all K first, then all V (the layout group_and_allocate takes)
        order = [2 * layer for layer in range(num_layers)] + [2 * layer + 1 for layer in range(num_layers)]
        weight, omega = torch.stack(weight)[order], torch.stack(omega)[order]
        losses = torch.tensor([[float(loss) if loss is not None else 0.0 for loss in pair]
                               for pair in fusion.kind_losses()], dtype=torch.float64)
        if self.weight_sum is None:
            self.weight_sum, self.omega_sum, self.loss_sum = weight, omega, losses
        else:
            self.weight_sum += weight
            self.omega_sum += omega
            self.loss_sum += losses
        self.records += 1
        metrics = {}
        for index, kind in enumerate(KINDS):
            for layer in range(num_layers):
                matrix = index * num_layers + layer
                metrics[f'search/layer{layer}/{kind}_head_distance'] = _mean_off_diagonal(weight[matrix])
                metrics[f'search/layer{layer}/{kind}_omega_distance'] = _mean_off_diagonal(omega[matrix])
        logger.log_metrics(metrics)

    # --- the search ---------------------------------------------------------------------------------------------

    def mean_distances(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(2L, H, H) weight-space and omega-only distances averaged over the recorded batches."""
        return self.weight_sum / self.records, self.omega_sum / self.records

    def search(self) -> dict:
        """Group and allocate from the mean distances; returns the report (the head map under 'head_map')."""
        if not self.records:
            raise RuntimeError(f'head_search: no distances were recorded (start_batch={self.start_batch}, '
                               f'interval={self.interval}); the Search run was too short')
        weight, omega = self.mean_distances()
        num_layers, num_heads = weight.shape[0] // 2, weight.shape[-1]
        head_dim = self._fusion.projections[0][0].head_dim
        total = total_heads_for_budget(self.kv_budget, num_layers, num_heads)
        layer_loss = (self.loss_sum / self.records).tolist()
        costs = fusion_loss_costs(layer_loss, num_heads, allowed=self.allowed)
        allocation = allocate_kv_heads(costs, num_layers, num_heads, total, allowed=self.allowed,
                                       shared=self.servable)
        key_partitions, value_partitions = group_at_allocation(-weight, allocation, restarts=self.restarts,
                                                               steps=self.steps, seed=self.seed, shared=self.servable)
        head_map = HeadMap.from_source_partitions(self._source, key_partitions, value_partitions)
        if head_map.head_dim != head_dim:
            raise RuntimeError(f'head_search: head dim {head_map.head_dim} of the source vs {head_dim} of fusion')
        problems = head_map.servable_problems()
        if self.servable and problems:  # the source itself is not plain GQA (it is checked to be plain LLaMA)
            raise RuntimeError(f'head_search: the servable Search made a map engines cannot serve: {problems}')
        return {
            'head_map': head_map.to_dict(), 'kv_budget': self.kv_budget, 'kv_heads_total': total,
            'servable': self.servable, 'servable_problems': problems,
            'kv_budget_fraction_of_source': head_map.kv_budget_fraction_of(self._source),
            'kv_budget_fraction': head_map.kv_budget_fraction(), 'recorded_batches': self.records,
            'allocation': head_map.kv_heads(), 'allocation_costs': costs,
            'layers': [{'key_heads': len(key_partitions[layer]), 'value_heads': len(value_partitions[layer]),
                        # groups of the source's K/V heads (the query heads for an MHA source)
                        'key_groups': key_partitions[layer], 'value_groups': value_partitions[layer],
                        'key_fusion_loss': layer_loss[layer][0], 'value_fusion_loss': layer_loss[layer][1],
                        'key_mean_head_distance': _mean_off_diagonal(weight[layer]),
                        'value_mean_head_distance': _mean_off_diagonal(weight[num_layers + layer]),
                        'key_mean_omega_distance': _mean_off_diagonal(omega[layer]),
                        'value_mean_omega_distance': _mean_off_diagonal(omega[num_layers + layer])}
                       for layer in range(num_layers)],
        }

    def _write(self, logger: Logger) -> None:
        if self.result is not None:
            return
        self.result = self.search() if dist.get_global_rank() == 0 else {}
        if dist.get_global_rank() != 0:
            return
        head_map = HeadMap.from_dict(self.result['head_map'])
        num_layers = len(head_map.layers)
        weight, omega = self.mean_distances()
        with staged_folder(self.out, overwrite=True) as staging:
            head_map.save(staging / HEAD_MAP_FILE)
            (staging / SEARCH_REPORT).write_text(json.dumps(self.result, indent=2) + '\n')
            torch.save({'weight_space': weight, 'omega_only': omega, 'records': self.records},
                       staging / DISTANCES_FILE)
            plot_kv_allocation(head_map, staging / 'kv_heads.png', title='DHA search: K/V heads per layer')
            source_partitions = head_map.source_partitions(self._source)  # the distances are between source heads
            for index, kind in enumerate(KINDS):
                matrices = weight[index * num_layers:(index + 1) * num_layers]
                partitions = source_partitions[index]
                plot_head_similarity(list(matrices), staging / f'head_distance_{kind}.png', partitions=partitions,
                                     limits=(0.0, float(matrices.max())),
                                     title=f'Eq. 6 distance between {kind} heads (ordered by group)')
        metrics = {'search/kv_heads_total': self.result['kv_heads_total']}
        for layer, (keys, values) in enumerate(head_map.kv_heads()):
            metrics[f'search/layer{layer}/key_heads'] = keys
            metrics[f'search/layer{layer}/value_heads'] = values
        logger.log_metrics(metrics)
        print(f'head_search: wrote {self.out / HEAD_MAP_FILE} (K/V heads per layer {head_map.kv_heads()})',
              flush=True)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._write(logger)

    def after_load(self, state: State, logger: Logger) -> None:
        # A Search resumed after it had finished (killed before the map was written) writes it here.
        if state.max_duration is not None and self.records and \
                state.timestamp.get(state.max_duration.unit) >= state.max_duration and \
                not (self.out / HEAD_MAP_FILE).is_file():
            self._check(state)
            self._write(logger)

    # --- checkpoint state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {'records': self.records, 'weight_sum': self.weight_sum, 'omega_sum': self.omega_sum,
                'loss_sum': self.loss_sum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = int(state['records'])
        self.weight_sum, self.omega_sum, self.loss_sum = state['weight_sum'], state['omega_sum'], state['loss_sum']


def _mean_off_diagonal(matrix: torch.Tensor) -> float:
    mask = ~torch.eye(matrix.shape[0], dtype=torch.bool)
    return float(matrix[mask].mean())


registry.callbacks.register('head_search', HeadSearch)

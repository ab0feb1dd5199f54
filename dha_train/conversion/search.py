"""Head search behind `dha-train search`: a head map (and its analysis plots) from an MHA or GQA source folder of any
family (``dha_train.families``) plus calibration data.

The units grouped are the source's own K/V heads: the query heads of an MHA model, the shared heads of a GQA one
(``kv_heads`` and ``kv_budget`` count those); the map written is stated over the query heads.

Methods:

- ``neighbour``: contiguous equal groups, the GQA baseline (no data needed).
- ``similarity``: calibrate K (before RoPE) and V on N streamed tokens, measure head similarity (centred CKA from
  the accumulated cross-covariances, or AsymGQA's best-match cosine on a token subsample), then group heads into
  equal groups by simulated annealing. K and V are grouped separately (a DHA map, served by the DHA model class)
  unless ``shared_kv``, which groups on their mean similarity (a GQA map that exports as plain HF LLaMA). With
  ``allocation='dp'`` the per-layer K and V counts come from one total budget by dynamic programming, the cost of a
  count being the within-group dissimilarity (1 - S) of its best grouping; with ``shared_kv`` as well, each layer
  gets one count for K and V together (priced on K plus V, spending two heads of the total), grouped on the mean.
  ``servable`` asks for a map that serving engines take (in every layer plain GQA up to a permutation of the query
  heads: K and V grouped together, groups of equal size): it implies ``shared_kv``, and the counts (uniform or by
  DP) divide the source's K/V heads.
- ``asym``: AsymGQA (seed 004): best-match cosine (Eq. 1) of K and V on a token subsample guides a fitness search
  (App. A, Alg. 2, or Alg. 1 with ``symmetric``) layer by layer from the first; the fitness of a grouping is minus
  the LM loss, on held-out calibration batches, of the model whose K/V heads of that layer are mean-pooled by it.
  Groups may differ in size; K and V share the map (DESIGN.md section 5).

Every method also writes the weight CKA redundancy of W_q, W_k, W_v per layer (DHA Fig. 3b).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from dha_train import families
from dha_train.calibration import CALIBRATION_FILE, CalibrationStats, calibrate, calibration_batches, load_source_model
from dha_train.config import ConfigError
from dha_train.errors import InputNotFoundError
from dha_train.model_folders import load_source_config
from dha_train.models.head_map import HEAD_MAP_FILE, HeadMap, source_head_map
from dha_train.models.llama_layout import attention_modules, head_dim
from dha_train.ops.budget import (
    divisors,
    group_and_allocate,
    reachable_totals,
    shared_kv_matrices,
    totals_text,
    whole_head_count,
)
from dha_train.ops.fitness_search import asymmetric_search, symmetric_search
from dha_train.ops.grouping import (
    Partition,
    anneal_equal_groups_batch,
    neighbour_groups,
    partition_to_assignment,
    within_group_score,
)
from dha_train.ops.heads import gather_heads, mean_pool_heads
from dha_train.ops.similarity import best_match_cosine, cka_from_gram, layer_redundancy, weight_cka
from dha_train.paths import refuse_nonempty, staged_folder
from dha_train.plots import plot_head_similarity, plot_kv_allocation, plot_layer_redundancy

METHODS = ('neighbour', 'similarity', 'asym')
MEASURES = ('cka', 'best-match')
ALLOCATIONS = ('uniform', 'dp')
FITNESS = ('loss', 'kl')
SEARCH_REPORT = 'search.json'
SIMILARITY_FILE = 'similarity.pt'


@dataclass
class SearchSettings:
    method: str = 'similarity'
    kv_heads: Optional[int] = None  # K and V heads per layer (uniform allocation)
    kv_budget: Optional[float] = None  # fraction of the source's K+V heads, over all layers (dp allocation)
    allocation: str = 'uniform'
    measure: str = 'cka'  # similarity method: 'cka' (all N tokens) or 'best-match' (Eq. 1 on the subsample)
    shared_kv: bool = False
    servable: bool = False  # a map engines serve: shared K/V groups of equal size (implies shared_kv)
    data: Optional[str] = None  # root written by `dha-train data prep`
    split: str = 'train'
    tokens: int = 16384  # calibration tokens
    batch_size: int = 8
    sample_tokens: int = 256  # token subsample for Eq. 1 (quadratic in tokens)
    restarts: int = 8
    steps: Optional[int] = None  # annealing proposals per restart (default 100 x H)
    iterations: int = 50  # asym: fitness evaluations per layer
    symmetric: bool = False  # asym: Alg. 1 (equal sizes) instead of Alg. 2
    p_preserve: float = 0.2
    p_acc: float = 0.1
    p_reset: float = 0.1
    top_k: int = 3
    fitness_batches: int = 2
    fitness: str = 'loss'  # asym: 'loss' (LM loss of the grouped model) or 'kl' (KL from the MHA model)
    seed: int = 0
    device: str = 'cpu'
    dtype: str = 'float32'
    save_calibration: bool = False


@dataclass
class SearchResult:
    head_map: HeadMap
    report: dict = field(default_factory=dict)


def _check_settings(settings: SearchSettings, num_layers: int, num_heads: int) -> None:
    def bad(message: str) -> ConfigError:
        return ConfigError(f'search: {message}')

    if settings.method not in METHODS:
        raise bad(f"unknown method '{settings.method}'; choose one of {', '.join(METHODS)}")
    if settings.measure not in MEASURES:
        raise bad(f"unknown measure '{settings.measure}'; choose one of {', '.join(MEASURES)}")
    if settings.allocation not in ALLOCATIONS:
        raise bad(f"unknown allocation '{settings.allocation}'; choose one of {', '.join(ALLOCATIONS)}")
    if (settings.kv_heads is None) == (settings.kv_budget is None):
        raise bad('give exactly one of kv_heads (per layer) and kv_budget (a fraction of the source K+V heads)')
    if settings.servable and (settings.method == 'asym' and not settings.symmetric):
        raise bad("servable needs groups of equal size; method 'asym' makes unequal ones unless symmetric")
    if settings.allocation == 'dp':
        if settings.method != 'similarity':
            raise bad("allocation 'dp' needs method 'similarity'")
        if settings.kv_budget is None:
            raise bad('allocation dp needs kv_budget (a fraction of the source K+V heads)')
        try:
            total = whole_head_count(settings.kv_budget, 2 * num_layers * num_heads)
        except ValueError as exc:
            raise bad(str(exc)) from exc
        if shares_kv(settings):  # one count per layer for K and V: the total must be twice a sum of divisors
            totals = reachable_totals(num_layers, divisors(num_heads), unit=2)
            if total not in totals:
                raise bad(f'kv_budget {settings.kv_budget} is {total} of the source\'s {2 * num_layers * num_heads} '
                          f'K+V heads, which a shared K/V allocation cannot meet: every layer takes one count from '
                          f'{divisors(num_heads)} for K and V together, so the reachable totals are '
                          f'{totals_text(totals)}')
    else:
        count = per_layer_count(settings, num_heads)
        if settings.method == 'asym' and not settings.symmetric:
            if not 1 <= count <= num_heads:
                raise bad(f'kv heads per layer must be in 1..{num_heads}, got {count}')
        elif count < 1 or num_heads % count:
            raise bad(f'{count} K/V heads per layer cannot form equal groups of {num_heads} heads; use one of '
                      f'{divisors(num_heads)}')
    if settings.method != 'neighbour':
        if settings.data is None:
            raise bad(f"method '{settings.method}' needs calibration data (--data, a `dha-train data prep` root)")
        if settings.tokens < 1 or settings.batch_size < 1:
            raise bad(f'tokens and batch_size must be positive, got {settings.tokens} and {settings.batch_size}')
        needs_sample = settings.method == 'asym' or settings.measure == 'best-match'
        if needs_sample and not 1 <= settings.sample_tokens <= settings.tokens:
            raise bad(f'sample_tokens must be in 1..tokens={settings.tokens}, got {settings.sample_tokens}')
    if settings.fitness not in FITNESS:
        raise bad(f"unknown fitness '{settings.fitness}'; choose one of {', '.join(FITNESS)}")
    if settings.method == 'asym' and (settings.iterations < 0 or settings.fitness_batches < 1):
        raise bad(f'asym needs iterations >= 0 and fitness_batches >= 1, got {settings.iterations} and '
                  f'{settings.fitness_batches}')


def shares_kv(settings: SearchSettings) -> bool:
    """Whether K and V get one grouping per layer (``shared_kv``, or ``servable``, which implies it)."""
    return settings.shared_kv or settings.servable


def per_layer_count(settings: SearchSettings, num_heads: int) -> int:
    """K/V heads per layer for a uniform allocation, from kv_heads or kv_budget."""
    if settings.kv_heads is not None:
        return settings.kv_heads
    if not 0 < settings.kv_budget <= 1:
        raise ConfigError(f'search: kv_budget must be in (0, 1], got {settings.kv_budget}')
    try:
        return whole_head_count(settings.kv_budget, num_heads)
    except ValueError as exc:
        raise ConfigError(f'search: kv_budget {settings.kv_budget} of the {num_heads} K/V heads of each layer is '
                          f'{settings.kv_budget * num_heads:g} heads, not a whole number; use a multiple of '
                          f'1/{num_heads} ({1 / num_heads:g})') from exc


# ----------------------------------------------------------------------------------------------------------------
# Model and data
# ----------------------------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------------------------
# Methods
# ----------------------------------------------------------------------------------------------------------------

def _activation_similarity(stats: CalibrationStats, kind: str, measure: str) -> list[torch.Tensor]:
    similarities = []
    for layer in range(stats.num_layers):
        kind_stats = stats.layer(layer, kind)
        if measure == 'cka':
            similarities.append(cka_from_gram(kind_stats.running.centered(), kind_stats.num_heads))
        else:
            similarities.append(best_match_cosine(kind_stats.sample_by_head()))
    return similarities


def _dissimilarity_cost(similarity: torch.Tensor, partition: Partition) -> float:
    """Sum over groups of (1 - S[i, j]) over the pairs i < j a group merges: zero when nothing is merged."""
    pairs = sum(len(group) * (len(group) - 1) // 2 for group in partition)
    return pairs - within_group_score(similarity, partition)


def _group_by_similarity(key_sim: list[torch.Tensor], value_sim: list[torch.Tensor], settings: SearchSettings,
                         num_heads: int) -> tuple[list[Partition], list[Partition], dict]:
    num_layers = len(key_sim)
    matrices = torch.stack(key_sim + value_sim)
    shared = shares_kv(settings)
    if settings.allocation == 'uniform':
        if shared:  # CKA and cosine are scale-free: their plain mean
            partitions = anneal_equal_groups_batch(shared_kv_matrices(matrices, normalise=False),
                                                   per_layer_count(settings, num_heads), restarts=settings.restarts,
                                                   steps=settings.steps, seed=settings.seed)
            return partitions, partitions, {}
        partitions = anneal_equal_groups_batch(matrices, per_layer_count(settings, num_heads),
                                               restarts=settings.restarts, steps=settings.steps, seed=settings.seed)
        return partitions[:num_layers], partitions[num_layers:], {}
    # dp: the best grouping at every allowed count, then the cheapest counts meeting the total exactly (shared: one
    # count per layer for K and V, the grouping of their mean similarity priced on both).
    total = int(round(settings.kv_budget * 2 * num_layers * num_heads))
    key_partitions, value_partitions, costs = group_and_allocate(
        matrices, num_layers, num_heads, total, _dissimilarity_cost, restarts=settings.restarts, steps=settings.steps,
        seed=settings.seed, shared=shared, normalise=False)
    return key_partitions, value_partitions, {'allocation_costs': costs}


class _PooledLayerFitness:
    """Fitness of a grouping of one layer, on fixed held-out batches, for the model whose K and V heads of that layer
    are replaced by their group means (what the GQA conversion would serve). Cached per grouping.

    ``loss``: minus the LM loss (AsymGQA scores the grouped model itself). ``kl``: minus the mean KL(MHA || grouped)
    of the next-token distributions, which measures function preservation and needs no trained LM head to be
    informative; it keeps the MHA log-probabilities of the fitness batches (batches x tokens x vocab floats).
    """

    def __init__(self, model, batches: list[torch.Tensor], head_dim: int, criterion: str):
        self.model, self.batches, self.head_dim, self.criterion = model, batches, head_dim, criterion
        self.attention = attention_modules(model)
        # each layer's K and V projection tensors: the weights, and the biases where the family has them (Qwen2)
        self.original = [[[tensor.detach().clone() for tensor in self._tensors(projection)]
                          for projection in (a.k_proj, a.v_proj)] for a in self.attention]
        self.evaluations = 0
        self.reference = None
        if criterion == 'kl':
            with torch.no_grad():
                self.reference = [torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
                                  for ids in batches]

    @torch.no_grad()
    def loss(self) -> float:
        """Mean LM loss (criterion 'loss') or mean KL(MHA || current) per token (criterion 'kl')."""
        values = []
        for index, ids in enumerate(self.batches):
            if self.reference is None:
                values.append(float(self.model(input_ids=ids, labels=ids, use_cache=False).loss))
            else:
                log_probs = torch.log_softmax(self.model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
                reference = self.reference[index]
                values.append(float((reference.exp() * (reference - log_probs)).sum(-1).mean()))
        self.evaluations += 1
        return float(np.mean(values))

    @staticmethod
    def _tensors(projection) -> list[torch.Tensor]:
        return [projection.weight] + ([projection.bias] if projection.bias is not None else [])

    @torch.no_grad()
    def set_layer(self, layer: int, partition: Partition | None) -> None:
        """Mean-pool layer ``layer`` by ``partition``, weights and biases alike (None restores the MHA weights)."""
        attn = self.attention[layer]
        for projection, originals in zip((attn.k_proj, attn.v_proj), self.original[layer]):
            for tensor, original in zip(self._tensors(projection), originals):
                if partition is None:
                    tensor.copy_(original)
                    continue
                assignment = partition_to_assignment(partition, original.shape[0] // self.head_dim).tolist()
                pooled = mean_pool_heads(original, assignment, self.head_dim)
                tensor.copy_(gather_heads(pooled, assignment, self.head_dim))

    def for_layer(self, layer: int):
        cache: dict[tuple, float] = {}

        def fitness(partition: Partition) -> float:
            key = tuple(tuple(group) for group in partition)
            if key not in cache:
                self.set_layer(layer, partition)
                cache[key] = -self.loss()
            return cache[key]
        return fitness


def _asym_search(model, similarity: list[torch.Tensor], fitness_batches: list[torch.Tensor], settings: SearchSettings,
                 head_dim: int, num_heads: int) -> tuple[list[Partition], dict]:
    count = per_layer_count(settings, num_heads)
    pooled = _PooledLayerFitness(model, fitness_batches, head_dim, settings.fitness)
    mha_loss = pooled.loss()
    for layer in range(len(similarity)):
        pooled.set_layer(layer, neighbour_groups(num_heads, count) if num_heads % count == 0 else None)
    neighbour_loss = pooled.loss() if num_heads % count == 0 else None
    for layer in range(len(similarity)):
        pooled.set_layer(layer, None)
    partitions, layer_losses = [], []
    search = symmetric_search if settings.symmetric else asymmetric_search
    extra = {} if settings.symmetric else {'p_preserve': settings.p_preserve}
    for layer, matrix in enumerate(similarity):  # sequential, first layer first; earlier layers stay pooled
        best, best_fitness = search(matrix, count, pooled.for_layer(layer), iterations=settings.iterations,
                                    top_k=settings.top_k, p_acc=settings.p_acc, p_reset=settings.p_reset,
                                    seed=settings.seed + layer, **extra)
        pooled.set_layer(layer, best)
        partitions.append(best)
        layer_losses.append(-best_fitness)
    report = {'criterion': settings.fitness, 'mha_loss': mha_loss, 'neighbour_loss': neighbour_loss, 'loss_after_layer': layer_losses,
              'final_loss': layer_losses[-1] if layer_losses else mha_loss,
              'fitness_evaluations': pooled.evaluations,
              'fitness_tokens': int(sum(batch.numel() for batch in fitness_batches))}
    return partitions, report


# ----------------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------------

def run_search(model_dir: str | Path, out_dir: str | Path, settings: SearchSettings, *,
               overwrite: bool = False) -> SearchResult:
    """Search a head map for the MHA or GQA source model (of any family) in ``model_dir``; write head_map.json, search.json, similarity.pt and
    PNG plots to ``out_dir`` (replaced atomically; an existing non-empty folder needs ``overwrite``)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / 'config.json').is_file():
        raise InputNotFoundError(f'no HF config.json in {model_dir}')
    config = load_source_config(model_dir, who='search')
    # num_heads: the units grouped, the source's K/V heads (the query heads for MHA).
    num_layers, num_query_heads, num_heads = (config.num_hidden_layers, config.num_attention_heads,
                                              config.num_key_value_heads)
    width = head_dim(config)
    source_head_map(config, 'search')
    # asym's map is served by the DHA class (AsymGQA); the other maps feed convert's mean-pool or DHA's Fusion
    families.check('asym_gqa' if settings.method == 'asym' else 'mean_pool', config, 'search')
    _check_settings(settings, num_layers, num_heads)
    if settings.method != 'neighbour' and not Path(settings.data).is_dir():
        raise InputNotFoundError(f'search: calibration data folder {settings.data} does not exist')
    refuse_nonempty(out_dir, overwrite)  # fail before the slow part
    timings: dict[str, float] = {}
    started = time.perf_counter()
    model, source = load_source_model(model_dir, config, dtype=settings.dtype, device=settings.device)
    attention = attention_modules(model)

    weight_similarity = {name: [weight_cka(getattr(a, f'{name}_proj').weight,
                                           num_query_heads if name == 'q' else num_heads) for a in attention]
                         for name in ('q', 'k', 'v')}
    redundancy = {f'W_{name}': [layer_redundancy(s) for s in sims] for name, sims in weight_similarity.items()}
    report: dict[str, Any] = {'method': settings.method, 'settings': asdict(settings), 'model': str(model_dir),
                              'num_layers': num_layers, 'num_heads': num_query_heads, 'num_source_kv_heads': num_heads,
                              'head_dim': width}
    activation_similarity: dict[str, list[torch.Tensor]] = {}
    stats = None

    if settings.method == 'neighbour':
        count = per_layer_count(settings, num_heads)
        key_partitions = value_partitions = [neighbour_groups(num_heads, count) for _ in range(num_layers)]
    else:
        batches = calibration_batches(model_dir, config, data=settings.data, split=settings.split,
                                      batch_size=settings.batch_size, seed=settings.seed)
        fitness_batches = []
        if settings.method == 'asym':  # held out from calibration, fixed for the whole search
            for _ in range(settings.fitness_batches):
                try:
                    fitness_batches.append(next(batches)['input_ids'].to(settings.device))
                except StopIteration:
                    raise ConfigError(f'search: the data has fewer than {settings.fitness_batches} batches of '
                                      f'{settings.batch_size} for the asym fitness') from None
        measure = 'best-match' if settings.method == 'asym' else settings.measure
        t0 = time.perf_counter()
        stats = calibrate(model, batches, num_tokens=settings.tokens, kinds=('key', 'value'),
                          sample_tokens=settings.sample_tokens if measure == 'best-match' else 0, seed=settings.seed)
        timings['calibration_s'] = time.perf_counter() - t0
        t0 = time.perf_counter()
        activation_similarity = {kind: _activation_similarity(stats, kind, measure) for kind in ('key', 'value')}
        timings['similarity_s'] = time.perf_counter() - t0
        report.update({'measure': measure, 'calibration_tokens': stats.tokens,
                       'subsample_tokens': stats.sample_tokens if measure == 'best-match' else None})
        redundancy.update({f'{kind} activations': [layer_redundancy(s) for s in sims]
                           for kind, sims in activation_similarity.items()})
        t0 = time.perf_counter()
        if settings.method == 'similarity':
            key_partitions, value_partitions, extra = _group_by_similarity(
                activation_similarity['key'], activation_similarity['value'], settings, num_heads)
            report.update(extra)
        else:
            shared = [(k + v) / 2 for k, v in zip(activation_similarity['key'], activation_similarity['value'])]
            key_partitions, asym_report = _asym_search(model, shared, fitness_batches, settings, width, num_heads)
            value_partitions = key_partitions
            report['asym'] = asym_report
        timings['grouping_s'] = time.perf_counter() - t0

    # The groups are of the source's K/V heads; the map serves the query heads.
    head_map = HeadMap.from_source_partitions(source, key_partitions, value_partitions)
    report['servable'] = settings.servable
    report['servable_problems'] = head_map.servable_problems()
    if settings.servable and report['servable_problems']:
        raise RuntimeError(f'search: the servable search made a map engines cannot serve: '
                           f'{report["servable_problems"]}')
    report['layers'] = []
    for layer in range(num_layers):
        entry = {'key_heads': len(key_partitions[layer]), 'value_heads': len(value_partitions[layer]),
                 'key_groups': key_partitions[layer], 'value_groups': value_partitions[layer],
                 **{f'redundancy_{name}': values[layer] for name, values in redundancy.items()}}
        for kind, partitions in (('key', key_partitions), ('value', value_partitions)):
            if kind in activation_similarity:
                matrix = activation_similarity[kind][layer]
                entry[f'{kind}_within_group_similarity'] = within_group_score(matrix, partitions[layer])
                count = len(partitions[layer])
                if num_heads % count == 0:
                    entry[f'{kind}_within_group_similarity_neighbour'] = within_group_score(
                        matrix, neighbour_groups(num_heads, count))
        report['layers'].append(entry)
    report['kv_budget_fraction'] = head_map.kv_budget_fraction()
    report['kv_budget_fraction_of_source'] = head_map.kv_budget_fraction_of(source)
    report['source_head_map'] = source.to_dict()
    report['kv_heads_total'] = sum(k + v for k, v in head_map.kv_heads())
    timings['total_s'] = time.perf_counter() - started
    report['timings'] = timings

    with staged_folder(out_dir, overwrite) as staging:
        head_map.save(staging / HEAD_MAP_FILE)
        (staging / SEARCH_REPORT).write_text(json.dumps(report, indent=2) + '\n')
        torch.save({'weights': {name: torch.stack(s) for name, s in weight_similarity.items()},
                    'activations': {kind: torch.stack(s) for kind, s in activation_similarity.items()}},
                   staging / SIMILARITY_FILE)
        if stats is not None and settings.save_calibration:
            stats.save(staging / CALIBRATION_FILE)
        plot_layer_redundancy(redundancy, staging / 'redundancy.png', title=f'{model_dir.name}: layer redundancy')
        for name, sims in weight_similarity.items():
            plot_head_similarity(sims, staging / f'similarity_W_{name}.png', title=f'CKA between heads of W_{name}')
        for kind, sims in activation_similarity.items():
            partitions = key_partitions if kind == 'key' else value_partitions
            plot_head_similarity(sims, staging / f'similarity_{kind}.png', partitions=partitions,
                                 title=f'{report["measure"]} similarity between {kind} heads (ordered by group)')
        plot_kv_allocation(head_map, staging / 'kv_heads.png', title=f'{settings.method}: K/V heads per layer')
    return SearchResult(head_map, report)

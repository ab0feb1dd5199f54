"""The aligned-GQA transform behind `dha-train align`: the transform stage of aligned GQA (seed 001 sections 3.3-3.4, Alg. 1 and 2).

From an MHA or GQA LLaMA folder and calibration data (for a GQA source the heads below are its shared K/V heads,
and each query head's Q rows and O columns follow the maps and the order of the K/V head it reads):

1. calibrate K (before RoPE) and V on N tokens, keeping each layer's Gram of the raw caches and of the rows scaled to
   unit norm per head;
2. measure every head pair's similarity after its optimal alignment (``ops.alignment.aligned_similarity``: cos or
   dist; values: any orthogonal map, keys: rotations in RoPE's planes), for keys and for values;
3. group each layer's heads into ``num_groups`` equal groups by the key or the value similarity (annealing, Eq. 23-24);
4. align the heads inside each group by generalised Procrustes, K and V separately, and fold the maps into
   q/k and v/o projections (the model is unchanged);
5. permute the heads so that each group is contiguous (Q/K/V rows, O columns; unchanged again).

It writes a folder of the source's shape (MHA or GQA) that computes what the input computes, with a contiguous GQA head map beside it
(``target_head_map.json``: mean-pooling by it gives standard HF GQA, the ``KVHeadTransfer`` starting point) and
``alignment.json`` (groups, similarities, within-group cache cosine before and after alignment, timings).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from dha_train import families
from dha_train.calibration import calibrate, calibration_batches, load_source_model
from dha_train.config import ConfigError
from dha_train.errors import InputNotFoundError
from dha_train.model_card import card_stage, write_model_card
from dha_train.model_folders import load_source_config
from dha_train.models.head_map import HeadMap, source_head_map
from dha_train.models.llama_layout import head_dim as config_head_dim
from dha_train.ops.alignment import align_llama_state_dict, aligned_similarity, group_maps, within_group_cosine
from dha_train.ops.grouping import anneal_equal_groups_batch, within_group_score
from dha_train.ops.heads import permute_llama_state_dict
from dha_train.paths import refuse_nonempty, staged_folder

ALIGNMENT_REPORT = 'alignment.json'
# The GQA map the aligned model is to be merged to. Not head_map.json: that name marks a folder as a head-mapped
# (DHA) model, and this folder still holds the MHA model.
TARGET_MAP_FILE = 'target_head_map.json'
CRITERIA = ('cos', 'dist')
GROUP_BY = ('key', 'value')


@dataclass
class AlignSettings:
    num_groups: int  # K/V heads per layer after merging (GQA-<num_groups>)
    criterion: str = 'cos'  # 'cos' (unit rows, mean cosine) or 'dist' (raw rows, minus mean squared distance)
    group_by: str = 'value'  # which similarity the groups maximise: 'key' or 'value'
    data: Optional[str] = None
    split: str = 'train'
    tokens: int = 16384
    batch_size: int = 8
    restarts: int = 8
    steps: Optional[int] = None
    seed: int = 0
    device: str = 'cpu'


def _check(settings: AlignSettings, num_heads: int) -> None:
    if settings.criterion not in CRITERIA:
        raise ConfigError(f"align: criterion must be one of {', '.join(CRITERIA)}, got '{settings.criterion}'")
    if settings.group_by not in GROUP_BY:
        raise ConfigError(f"align: group_by must be one of {', '.join(GROUP_BY)}, got '{settings.group_by}'")
    if settings.num_groups < 1 or num_heads % settings.num_groups:
        raise ConfigError(f'align: num_groups {settings.num_groups} must divide the {num_heads} K/V heads per layer')
    if settings.data is None or not Path(settings.data).is_dir():
        raise InputNotFoundError(f'align: calibration data folder {settings.data} does not exist')
    if settings.tokens < 1:
        raise ConfigError(f'align: tokens must be positive, got {settings.tokens}')


def run_align(model_dir: str | Path, out_dir: str | Path, settings: AlignSettings, *, overwrite: bool = False) -> dict:
    """Align and regroup the MHA or GQA source model (LLaMA, Mistral, Qwen2: families whose maths allows it) in ``model_dir``; write the aligned folder to ``out_dir``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / 'config.json').is_file():
        raise InputNotFoundError(f'no HF config.json in {model_dir}')
    config = load_source_config(model_dir, who='align')
    families.check('aligned_gqa', config, 'align')
    num_heads = config.num_key_value_heads  # the units aligned and grouped: the source's K/V heads
    head_dim = config_head_dim(config)
    source_head_map(config, 'align')
    _check(settings, num_heads)
    refuse_nonempty(out_dir, overwrite)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    model, source = load_source_model(model_dir, config, device=settings.device, who='align')
    batches = calibration_batches(model_dir, config, data=settings.data, split=settings.split,
                                  batch_size=settings.batch_size, seed=settings.seed, who='align')
    stats = calibrate(model, batches, num_tokens=settings.tokens,
                      kinds=('key', 'value'), seed=settings.seed, unit_rows=True)
    timings['calibration_s'] = time.perf_counter() - started

    def gram(layer: int, kind: str, criterion: str) -> torch.Tensor:
        kind_stats = stats.layer(layer, kind)
        return kind_stats.unit_gram() if criterion == 'cos' else kind_stats.running.gram

    t0 = time.perf_counter()
    layers = range(config.num_hidden_layers)
    similarity = {kind: [aligned_similarity(gram(layer, kind, settings.criterion), num_heads, kind,
                                            settings.criterion, stats.tokens) for layer in layers]
                  for kind in GROUP_BY}
    timings['similarity_s'] = time.perf_counter() - t0
    t0 = time.perf_counter()
    partitions = anneal_equal_groups_batch(torch.stack(similarity[settings.group_by]), settings.num_groups,
                                           restarts=settings.restarts, steps=settings.steps, seed=settings.seed)
    timings['grouping_s'] = time.perf_counter() - t0
    t0 = time.perf_counter()
    maps = {kind: [group_maps(gram(layer, kind, settings.criterion), partitions[layer], kind) for layer in layers]
            for kind in GROUP_BY}
    timings['procrustes_s'] = time.perf_counter() - t0

    report_layers = []
    for layer in layers:
        entry = {'groups': partitions[layer]}
        for kind in GROUP_BY:
            unit = stats.layer(layer, kind).unit_gram()
            entry[f'{kind}_within_group_similarity'] = within_group_score(similarity[kind][layer], partitions[layer])
            entry[f'{kind}_cosine_before'] = within_group_cosine(unit, partitions[layer], stats.tokens)
            entry[f'{kind}_cosine_after'] = within_group_cosine(unit, partitions[layer], stats.tokens,
                                                                maps[kind][layer])
        report_layers.append(entry)

    # The weights are rewritten on the CPU, so the maps (computed where the model ran, a GPU with --device cuda) go
    # there too.
    state_dict = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    query_to_kv = [layer.key for layer in source.layers]
    state_dict = align_llama_state_dict(state_dict, [m.cpu() for m in maps['key']], [m.cpu() for m in maps['value']],
                                        query_to_kv)
    orders = [[head for group in partition for head in group] for partition in partitions]  # K/V heads
    # Query heads follow their K/V head (stable within it): a GQA source stays standard GQA.
    query_orders = [[h for kv in order for h, source_kv in enumerate(shared) if source_kv == kv]
                    for order, shared in zip(orders, query_to_kv)]
    state_dict = permute_llama_state_dict(state_dict, query_orders, head_dim, kv_orders=orders)
    model.load_state_dict(state_dict)
    head_map = HeadMap.gqa(config.num_hidden_layers, config.num_attention_heads, settings.num_groups, head_dim)
    timings['total_s'] = time.perf_counter() - started

    def mean_over_layers(key: str) -> float:
        return sum(entry[key] for entry in report_layers) / len(report_layers)

    report = {'model': str(model_dir), 'settings': asdict(settings), 'calibration_tokens': stats.tokens,
              'num_heads': config.num_attention_heads, 'num_source_kv_heads': num_heads, 'head_dim': head_dim,
              'head_order': orders, 'query_head_order': query_orders,
              'mean_cosine': {f'{kind}_{when}': mean_over_layers(f'{kind}_cosine_{when}')
                              for kind in GROUP_BY for when in ('before', 'after')},
              'layers': report_layers, 'timings': timings}
    with staged_folder(out_dir, overwrite) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        write_model_card(staging, name=out_dir.name, method='aligned_gqa', source=model_dir,
                         stage=card_stage('align: Procrustes alignment, heads regrouped'))
        for name in ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json'):
            if (model_dir / name).is_file():
                (staging / name).write_bytes((model_dir / name).read_bytes())
        head_map.save(staging / TARGET_MAP_FILE)
        (staging / ALIGNMENT_REPORT).write_text(json.dumps(report, indent=2) + '\n')
        torch.save({kind: torch.stack(s).cpu() for kind, s in similarity.items()}, staging / 'aligned_similarity.pt')
    return report

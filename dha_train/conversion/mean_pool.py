"""Mean-pooling behind `dha-train convert`: mean-pool an MHA or GQA source folder of any family to a head map (the GQA baseline's starting point).

The source's own K/V heads are the units pooled: a target over a GQA source (e.g. SmolLM2's 3 K/V heads to 1)
groups whole source heads (``HeadMap.source_partitions``) and each compact head is the mean of its source heads,
so the K/V weights are never expanded to one head per query head. A map whose groups are equal-size and shared by
K and V is first made contiguous by permuting the query heads
(a function-preserving reorder), so it exports as the source family's own class (a Qwen2 source stays a
``Qwen2ForCausalLM``) with ``num_key_value_heads``; biases and per-head q/k norms are carried; any other map
becomes a ``DhaLlamaForCausalLM`` folder (with its modeling file, loadable with ``trust_remote_code=True``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dha_train import families
from dha_train.model_card import card_stage, write_model_card
from dha_train.model_folders import check_model_folder, load_source_config
from dha_train.models.head_map import HEAD_MAP_FILE, HeadMap, source_head_map
from dha_train.models.modeling_dha import DhaLlamaConfig, DhaLlamaForCausalLM
from dha_train.ops.grouping import partition_to_assignment
from dha_train.ops.heads import mean_pool_llama_state_dict, permute_llama_state_dict
from dha_train.paths import refuse_nonempty, staged_folder
from dha_train.tokenizer_files import load_tokenizer_folder


def as_contiguous_gqa(head_map: HeadMap) -> tuple[HeadMap, list[list[int]]] | None:
    """If reordering query heads turns the map into standard GQA, return that map and the per-layer order."""
    order = head_map.contiguous_permutation()
    permuted = head_map.permuted(order)
    return (permuted, order) if permuted.uniform_gqa_groups() is not None else None


def source_order(source: HeadMap, query_order: list[list[int]]) -> list[list[int]]:
    """Per layer, the order of the source's K/V heads that a query-head reorder implies (each source head in the
    place of its first query head). Valid when the reorder keeps every source head's query heads together, which
    ``contiguous_permutation`` does for a target that groups whole source heads."""
    orders = []
    for layer, order in zip(source.layers, query_order):
        orders.append(list(dict.fromkeys(layer.key[h] for h in order)))
    return orders


def convert_checkpoint(model_dir: str | Path, out_dir: str | Path, head_map: HeadMap, *,
                       overwrite: bool = False) -> Path:
    """Mean-pool the K/V heads of an MHA or GQA HF folder of any family to ``head_map`` and save the result as a HF
    folder."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_model_folder(model_dir, who='convert')
    refuse_nonempty(out_dir, overwrite)  # fail before the slow part
    config = load_source_config(model_dir, who='convert')
    family = families.check('mean_pool', config, 'convert')
    head_map.check_fits(config)
    source = source_head_map(config, 'convert')
    head_map.source_partitions(source)  # a target that splits a source head fails here, before loading
    model = family.causal_lm_class.from_pretrained(model_dir, config=config, local_files_only=True, trust_remote_code=False,
                                             torch_dtype=torch.float32)
    state = model.state_dict()
    del model

    contiguous = as_contiguous_gqa(head_map)
    if contiguous is not None:
        head_map, order = contiguous
        state = permute_llama_state_dict(state, order, head_map.head_dim, kv_orders=source_order(source, order))
        source = source.permuted(order)
    key_partitions, value_partitions = head_map.source_partitions(source)
    def as_maps(partitions):  # groups of source heads -> each source head's compact head
        return [partition_to_assignment(p, sum(map(len, p))).tolist() for p in partitions]

    state = mean_pool_llama_state_dict(state, as_maps(key_partitions), as_maps(value_partitions), head_map.head_dim)
    if contiguous is not None:
        config.num_key_value_heads = head_map.uniform_gqa_groups()
        converted = family.causal_lm_class(config)
    else:
        # K and V grouped differently, or unequal groups: the decoupled-head model serves any head map.
        # built inside the source family's decoder (source_model_type), from the source's full config
        converted = DhaLlamaForCausalLM(DhaLlamaConfig.for_source(config, head_map.to_dict()))
    converted.load_state_dict(state)

    with staged_folder(out_dir, overwrite) as staging:
        converted.save_pretrained(staging, safe_serialization=True)
        write_model_card(staging, name=out_dir.name, method='mean_pool', source=model_dir,
                         stage=card_stage('convert: K/V heads mean-pooled to the head map'))
        head_map.save(staging / HEAD_MAP_FILE)
        if (model_dir / 'tokenizer_config.json').is_file():
            load_tokenizer_folder(model_dir, 'convert').save_pretrained(staging)
    return out_dir

"""`dha-train convert`: mean-pool an MHA LLaMA folder to a head map (the GQA baseline's starting point).

A map whose groups are equal-size and shared by K and V is first made contiguous by permuting the query heads
(a function-preserving reorder), so it exports as a standard HF LLaMA with ``num_key_value_heads``; any other map
becomes a ``DhaLlamaForCausalLM`` folder (with its modeling file, loadable with ``trust_remote_code=True``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.errors import InputNotFoundError
from dha_train.models.head_map import HEAD_MAP_FILE, HeadMap, HeadMapError
from dha_train.models.llama_layout import head_dim
from dha_train.models.modeling_dha import DhaLlamaConfig, DhaLlamaForCausalLM
from dha_train.ops.heads import mean_pool_llama_state_dict, permute_llama_state_dict
from dha_train.paths import refuse_nonempty, staged_folder


def as_contiguous_gqa(head_map: HeadMap) -> tuple[HeadMap, list[list[int]]] | None:
    """If reordering query heads turns the map into standard GQA, return that map and the per-layer order."""
    order = head_map.contiguous_permutation()
    permuted = head_map.permuted(order)
    return (permuted, order) if permuted.uniform_gqa_groups() is not None else None


def convert_checkpoint(model_dir: str | Path, out_dir: str | Path, head_map: HeadMap, *,
                       overwrite: bool = False) -> Path:
    """Mean-pool the K/V heads of an MHA LLaMA HF folder to ``head_map`` and save the result as a HF folder."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / 'config.json').is_file():
        raise InputNotFoundError(f'no HF config.json in {model_dir}')
    refuse_nonempty(out_dir, overwrite)  # fail before the slow part
    config = LlamaConfig.from_pretrained(model_dir, local_files_only=True)
    if config.num_key_value_heads != config.num_attention_heads:
        raise HeadMapError(f'{model_dir} already shares K/V heads (num_key_value_heads={config.num_key_value_heads});'
                           ' convert an MHA checkpoint')
    head_map.check_fits(config)
    model = LlamaForCausalLM.from_pretrained(model_dir, local_files_only=True, torch_dtype=torch.float32)
    state = model.state_dict()

    contiguous = as_contiguous_gqa(head_map)
    if contiguous is not None:
        head_map, order = contiguous
        state = permute_llama_state_dict(state, order, head_map.head_dim)
    state = mean_pool_llama_state_dict(state, [layer.key for layer in head_map.layers],
                                       [layer.value for layer in head_map.layers], head_map.head_dim)
    if contiguous is not None:
        config.num_key_value_heads = head_map.uniform_gqa_groups()
        converted = LlamaForCausalLM(config)
    else:
        # K and V grouped differently, or unequal groups: the decoupled-head model serves any head map.
        dha_config = DhaLlamaConfig(head_map=head_map.to_dict(), **config.to_diff_dict())
        converted = DhaLlamaForCausalLM(dha_config)
    converted.load_state_dict(state)

    with staged_folder(out_dir, overwrite) as staging:
        converted.save_pretrained(staging, safe_serialization=True)
        head_map.save(staging / HEAD_MAP_FILE)
        if (model_dir / 'tokenizer_config.json').is_file():
            AutoTokenizer.from_pretrained(model_dir, local_files_only=True).save_pretrained(staging)
    return out_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('model_dir', help='local HF LLaMA folder (MHA)')
    parser.add_argument('out_dir')
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument('--head-map', default=None, help='a head_map.json')
    target.add_argument('--kv-heads', type=int, default=None, help='contiguous GQA with this many K/V heads per layer')
    parser.add_argument('--overwrite', action='store_true')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.head_map is not None:
        head_map = HeadMap.load(args.head_map)
    else:
        config = LlamaConfig.from_pretrained(args.model_dir, local_files_only=True)
        try:
            head_map = HeadMap.gqa(config.num_hidden_layers, config.num_attention_heads, args.kv_heads,
                                   head_dim(config))
        except HeadMapError as exc:
            raise HeadMapError(f'--kv-heads {args.kv_heads}: {exc}') from exc
    out = convert_checkpoint(args.model_dir, args.out_dir, head_map, overwrite=args.overwrite)
    print(f'dha-train convert: wrote {out} ({head_map.kv_budget_fraction():.0%} of the MHA KV heads)')
    return 0

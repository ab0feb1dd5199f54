"""`dha-train convert`: mean-pool an MHA LLaMA folder to a head map (the GQA baseline's starting point).

A map whose groups are equal-size and shared by K and V is first made contiguous by permuting the query heads
(a function-preserving reorder), so it exports as a standard HF LLaMA with ``num_key_value_heads``; any other map
becomes a ``DhaLlamaForCausalLM`` folder (with its modeling file, loadable with ``trust_remote_code=True``).
"""

from __future__ import annotations

from pathlib import Path

from dha_train.models.head_map import HEAD_MAP_FILE, HeadMap, HeadMapError
from dha_train.paths import refuse_nonempty, staged_folder
from dha_train.ops.heads import mean_pool_llama_state_dict, permute_llama_state_dict


def check_head_map_fits(head_map: HeadMap, config) -> None:
    head_dim = getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads
    problems = []
    if head_map.num_layers != config.num_hidden_layers:
        problems.append(f'{head_map.num_layers} layers vs num_hidden_layers={config.num_hidden_layers}')
    if head_map.num_query_heads != config.num_attention_heads:
        problems.append(f'{head_map.num_query_heads} query heads vs num_attention_heads={config.num_attention_heads}')
    if head_map.head_dim != head_dim:
        problems.append(f'head_dim {head_map.head_dim} vs the model head_dim {head_dim}')
    if problems:
        raise HeadMapError('head map does not fit the model: ' + '; '.join(problems))


def as_contiguous_gqa(head_map: HeadMap) -> tuple[HeadMap, list[list[int]]] | None:
    """If reordering query heads turns the map into standard GQA, return that map and the per-layer order."""
    order = head_map.contiguous_permutation()
    permuted = head_map.permuted(order)
    return (permuted, order) if permuted.uniform_gqa_groups() is not None else None


def convert_checkpoint(model_dir: str | Path, out_dir: str | Path, head_map: HeadMap, *,
                       overwrite: bool = False) -> Path:
    """Mean-pool the K/V heads of an MHA LLaMA HF folder to ``head_map`` and save the result as a HF folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / 'config.json').is_file():
        raise FileNotFoundError(f'no HF config.json in {model_dir}')
    refuse_nonempty(out_dir, overwrite)  # fail before the slow part
    config = LlamaConfig.from_pretrained(model_dir, local_files_only=True)
    if config.num_key_value_heads != config.num_attention_heads:
        raise HeadMapError(f'{model_dir} already shares K/V heads (num_key_value_heads={config.num_key_value_heads});'
                           ' convert an MHA checkpoint')
    check_head_map_fits(head_map, config)
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
        from dha_train.models.modeling_dha import DhaLlamaConfig, DhaLlamaForCausalLM

        dha_config = DhaLlamaConfig(head_map=head_map.to_dict(), **config.to_diff_dict())
        converted = DhaLlamaForCausalLM(dha_config)
    converted.load_state_dict(state)

    with staged_folder(out_dir, overwrite) as staging:
        converted.save_pretrained(staging, safe_serialization=True)
        head_map.save(staging / HEAD_MAP_FILE)
        if (model_dir / 'tokenizer_config.json').is_file():
            AutoTokenizer.from_pretrained(model_dir, local_files_only=True).save_pretrained(staging)
    return out_dir

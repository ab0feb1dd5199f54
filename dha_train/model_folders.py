"""Check a Hugging Face model folder before anything loads it, so a bad folder is one line naming what is wrong,
and load it so that nothing in it runs.

Every command that takes a model folder (convert, refit, search, align, eval, export-gguf, and training from
``model.pretrained_path`` or a recipe's ``source_path``/``teacher_path``) loads it through ``load_model_config`` /
``load_causal_lm``: ``check_model_folder`` first, then the config built by ``dha_train.untrusted.config_from_dict``
(allowed model types; ``trust_remote_code``, ``auto_map`` and ``_name_or_path`` dropped) and the weights into the
project's own or transformers' classes with ``trust_remote_code=False``. A folder's ``auto_map`` is never followed:
the project's own exports carry one (with their modeling file, for users without dha_train), and dha-train loads them
with the classes it ships. ``check_model_folder`` catches, without reading the tensors:

- no ``config.json``, or one that is not JSON;
- a config of another architecture (not LLaMA nor one of this project's LLaMA variants);
- no weights beside the config;
- a truncated or unreadable safetensors file (an interrupted copy): the header is parsed and the file must be as
  long as the header says;
- a sharded index (``*.safetensors.index.json`` / ``pytorch_model.bin.index.json``) naming a shard that is missing.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from dha_train.errors import DhaTrainError, InputNotFoundError
from dha_train.untrusted import MODEL_TYPES, UntrustedDataError, config_fields, config_from_dict

# The model types the project reads (``dha_train.untrusted.MODEL_TYPES``). Commands that need a plain LLaMA source
# pass ``model_types=('llama',)``.
LLAMA_MODEL_TYPES = MODEL_TYPES
_SINGLE_FILES = ('model.safetensors', 'pytorch_model.bin')
_INDEX_FILES = ('model.safetensors.index.json', 'pytorch_model.bin.index.json')


def safetensors_files(folder: str | Path) -> list[str]:
    """The safetensors files holding a folder's weights: the shards its index names, else ``model.safetensors``."""
    index = Path(folder) / 'model.safetensors.index.json'
    if index.is_file():
        return sorted(set(json.loads(index.read_text())['weight_map'].values()))
    return ['model.safetensors']


TOKENIZER_FILES = ('tokenizer.json', 'tokenizer.model')  # what AutoTokenizer needs (fast, or sentencepiece)


class ModelFolderError(DhaTrainError, ValueError):
    """A model folder that cannot be loaded: the message names the folder and what is wrong."""


def _hash_file(digest, path: Path):
    """``digest`` updated with the bytes of ``path``, read in 1 MiB blocks (model files are gigabytes)."""
    with path.open('rb') as handle:
        for block in iter(lambda: handle.read(1 << 20), b''):
            digest.update(block)
    return digest


def file_sha256(path: str | Path) -> str:
    return _hash_file(hashlib.sha256(), Path(path)).hexdigest()


def folder_digest(folder: str | Path, skip: tuple[str, ...] = ('README.md',)) -> str:
    """sha256 over a model folder's files (names and bytes, in name order; the model card left out): a model and
    tokenizer identity that changes when any weight, config or tokenizer file does, whatever the folder is called."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file() and p.name not in skip):
        digest.update(path.name.encode() + b'\0')
        _hash_file(digest, path)
    return digest.hexdigest()


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def missing_tokenizer_note(folder: str | Path, source: str | Path) -> str | None:
    """The line a command that wrote ``folder`` prints when it could copy no tokenizer from ``source``."""
    if has_tokenizer(folder):
        return None
    return (f'note: {folder} has no tokenizer ({source} has none to copy); `dha-train eval` and `export-gguf` need '
            f"one: copy the source model's tokenizer files ({', '.join(TOKENIZER_FILES)}, tokenizer_config.json) "
            'into it')


# `dha-train plan` builds a run without loading a weight: inside ``weights_optional()`` a folder holding only
# config.json passes (everything else is still checked), wherever in the run's assembly the folder is checked.
_WEIGHTS_OPTIONAL: ContextVar[bool] = ContextVar('weights_optional', default=False)


@contextmanager
def weights_optional() -> Iterator[None]:
    token = _WEIGHTS_OPTIONAL.set(True)
    try:
        yield
    finally:
        _WEIGHTS_OPTIONAL.reset(token)


def _check_safetensors(path: Path, where: str) -> None:
    size = path.stat().st_size
    try:
        with path.open('rb') as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise ModelFolderError(f'{where}: {path.name} is truncated ({size} bytes, no safetensors header)')
            (header_size,) = struct.unpack('<Q', head)
            if header_size > size - 8:
                raise ModelFolderError(f'{where}: {path.name} is truncated or not a safetensors file (its header '
                                       f'claims {header_size} bytes, the file has {size})')
            header = json.loads(handle.read(header_size))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFolderError(f'{where}: {path.name} is unreadable as safetensors ({exc})') from exc
    end = max((entry['data_offsets'][1] for name, entry in header.items() if name != '__metadata__'), default=0)
    expected = 8 + header_size + end
    if size < expected:
        raise ModelFolderError(f'{where}: {path.name} is truncated ({size:,} of {expected:,} bytes; an interrupted '
                               'copy?)')


def check_model_folder(folder: str | Path, *, who: str, model_types: tuple[str, ...] = LLAMA_MODEL_TYPES) -> dict:
    """The folder's config as a dict, after the checks in the module docstring; ``who`` names the command."""
    folder = Path(folder)
    config_file = folder / 'config.json'
    if not folder.is_dir():
        raise InputNotFoundError(f'{who}: model folder {folder} does not exist')
    if not config_file.is_file():
        raise InputNotFoundError(f'{who}: no HF config.json in {folder}')
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFolderError(f'{who}: {config_file} is not a readable JSON config ({exc})') from exc
    model_type = config.get('model_type')
    if model_type not in model_types:
        raise ModelFolderError(f"{who}: {folder} holds a '{model_type}' model; this takes "
                               f"{', '.join(model_types)} folders")
    if _WEIGHTS_OPTIONAL.get() and not any((folder / name).is_file() for name in _SINGLE_FILES + _INDEX_FILES):
        return config
    for index_name in _INDEX_FILES:
        index_file = folder / index_name
        if index_file.is_file():
            try:
                shards = sorted(set(json.loads(index_file.read_text())['weight_map'].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise ModelFolderError(f'{who}: {index_file} is not a readable shard index ({exc})') from exc
            missing = [shard for shard in shards if not (folder / shard).is_file()]
            if missing:
                raise ModelFolderError(f'{who}: {folder}: the shard index names {len(missing)} missing shard(s): '
                                       f'{", ".join(missing[:3])}')
            for shard in shards:
                if shard.endswith('.safetensors'):
                    _check_safetensors(folder / shard, f'{who}: {folder}')
            return config
    for name in _SINGLE_FILES:
        if (folder / name).is_file():
            if name.endswith('.safetensors'):
                _check_safetensors(folder / name, f'{who}: {folder}')
            return config
    raise ModelFolderError(f'{who}: {folder} has a config.json but no weights beside it (expected '
                           f'{" or ".join(_SINGLE_FILES)}, or a shard index)')


def load_model_config(folder: str | Path, *, who: str, model_types: tuple[str, ...] = LLAMA_MODEL_TYPES) -> PretrainedConfig:
    """The folder's config, after ``check_model_folder``, built with the project's own or transformers' classes and
    none of the config's code keys (``dha_train.untrusted.config_from_dict``)."""
    config = check_model_folder(folder, who=who, model_types=model_types)
    try:
        return config_from_dict(config, where=f'{who}: {folder}', model_types=model_types)
    except UntrustedDataError as exc:
        raise ModelFolderError(str(exc)) from None


def load_causal_lm(folder: str | Path, *, who: str, config: PretrainedConfig | None = None,
                   model_types: tuple[str, ...] = LLAMA_MODEL_TYPES, **kwargs):
    """The folder's model with ``load_model_config``'s config (or ``config``, built by it and then adjusted by the caller),
    in the class that config maps to; ``trust_remote_code=False``, no hub."""
    config = config if config is not None else load_model_config(folder, who=who, model_types=model_types)
    return AutoModelForCausalLM.from_pretrained(str(folder), config=config, local_files_only=True,
                                                trust_remote_code=False, **kwargs)


def load_llama_config(folder: str | Path, *, who: str) -> LlamaConfig:
    """A source folder's config read as a ``LlamaConfig`` (what ``LlamaConfig.from_pretrained`` reads), after
    ``check_model_folder`` and without the config's code keys, so none travels into the folders written from it."""
    config = check_model_folder(folder, who=who)
    try:
        _, fields = config_fields(config, where=f'{who}: {folder}')
    except UntrustedDataError as exc:
        raise ModelFolderError(str(exc)) from None
    return LlamaConfig.from_dict(fields)

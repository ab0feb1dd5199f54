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
- a sharded index (``*.safetensors.index.json`` / ``pytorch_model.bin.index.json``) naming a shard that is missing;
- a name from data that would make a path outside the folder: every shard an index names passes
  ``dha_train.untrusted.plain_name`` with the folder (no ``..``, not absolute, no separator, no link leading out), as do
  the weight files themselves, before anything is opened. ``weight_files`` is the one reader of a folder's weight files
  (in transformers' own order of preference), and everything that reads weights (``safetensors_files``,
  ``safetensors_shards``, ``folder_digest``) reads them through it; transformers' ``from_pretrained`` reads the same
  index in the same folder, after the check;
- a safetensors header that is not what safetensors reads (a list, an entry that is not an object, a dtype safetensors
  has not, offsets that do not match the shape), and a config whose sizes are not whole numbers or ask for more
  parameters than the weights hold (``dha_train.weight_sizes``), before any model is built.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, PretrainedConfig

from dha_train import families
from dha_train.errors import DhaTrainError, InputNotFoundError
from dha_train.untrusted import MODEL_TYPES, UntrustedDataError, config_fields, config_from_dict, plain_name
from dha_train.weight_sizes import check_config_sizes, check_parameter_budget

# The model types the project reads (``dha_train.untrusted.MODEL_TYPES``). Commands that need a plain source model
# pass ``model_types=SOURCE_MODEL_TYPES``, the families of ``dha_train.families``.
LLAMA_MODEL_TYPES = MODEL_TYPES
SOURCE_MODEL_TYPES = families.supported()
_SINGLE_FILES = ('model.safetensors', 'pytorch_model.bin')


# The files a folder's weights are read from, in the order transformers' ``from_pretrained`` prefers them.
WEIGHT_FILES = ('model.safetensors', 'model.safetensors.index.json', 'pytorch_model.bin',
                'pytorch_model.bin.index.json')
SAFETENSORS_INDEX = 'model.safetensors.index.json'


def _at(who: str | None, path: Path) -> str:
    """How a refusal names ``path``: after the command (``who``) when there is one."""
    return f'{who}: {path}' if who else str(path)


def _shard_map(folder: Path, index_name: str, who: str | None) -> dict[str, str]:
    """An index's ``weight_map`` (weight name -> shard file), every shard a plain name inside ``folder``
    (``plain_name``), refused in one line otherwise; no shard is opened."""
    index_file = folder / plain_name(index_name, _at(who, folder), 'a shard index', folder=folder)
    try:
        index = json.loads(index_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ModelFolderError(f'{_at(who, index_file)} is not a readable shard index ({exc})') from exc
    weight_map = index.get('weight_map') if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFolderError(f'{_at(who, index_file)} is not a shard index (no weight_map object of weight names '
                               'and shard files)')
    for name, shard in weight_map.items():
        plain_name(shard, f'{_at(who, index_file)}: weight {name!r:.80}', 'a weight shard', folder=folder)
    return weight_map


def weight_files(folder: str | Path, who: str | None = None) -> list[str]:
    """The files a folder's weights are read from, as transformers picks them (``WEIGHT_FILES``' order): the shards of
    an index, or the single file, each a plain name inside the folder (``_shard_map``, ``plain_name``); [] when it has
    none. The one reader of a folder's weight files; ``who`` (the command) heads a refusal."""
    folder = Path(folder)
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            if name.endswith('.index.json'):
                return sorted(set(_shard_map(folder, name, who).values()))
            return [plain_name(name, _at(who, folder), 'a weight file', folder=folder)]
    return []


def safetensors_shards(folder: str | Path, who: str | None = None) -> dict[str, str] | None:
    """A sharded safetensors folder's index (weight name -> shard file, every name checked by ``_shard_map``), or
    None when the weights are one file."""
    folder = Path(folder)
    if (folder / 'model.safetensors').is_file() or not (folder / SAFETENSORS_INDEX).is_file():
        return None
    return _shard_map(folder, SAFETENSORS_INDEX, who)


def safetensors_files(folder: str | Path, who: str | None = None) -> list[str]:
    """The safetensors files holding a folder's weights (``weight_files``), else ``['model.safetensors']`` (which the
    caller finds missing)."""
    files = weight_files(folder, who)
    return files if files and all(name.endswith('.safetensors') for name in files) else ['model.safetensors']


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
    tokenizer identity that changes when any weight, config or tokenizer file does, whatever the folder is called.
    The weights the model loads from are files of the folder (``weight_files`` refuses an index naming others), so
    the digest covers them; a file linked from outside the folder is refused, not read."""
    folder = Path(folder)
    weight_files(folder)
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name not in skip):
        plain_name(path.name, str(folder), 'a file', folder=folder)
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


# Bits per value of every dtype safetensors reads (its own names).
SAFETENSORS_DTYPE_BITS = {'BOOL': 8, 'U8': 8, 'I8': 8, 'F8_E5M2': 8, 'F8_E4M3': 8, 'F8_E8M0': 8, 'I16': 16, 'U16': 16,
                          'F16': 16, 'BF16': 16, 'I32': 32, 'U32': 32, 'F32': 32, 'I64': 64, 'U64': 64, 'F64': 64,
                          'C64': 64}
SAFETENSORS_HEADER_LIMIT = 100_000_000  # safetensors' own limit on a header's bytes


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_span(name: Any, entry: Any) -> tuple[int, int] | str:
    """A header entry's (begin, end) when it is one safetensors reads (a known dtype, a shape of whole numbers, and
    offsets exactly as long as they say); else what is wrong with it."""
    if not isinstance(name, str) or not isinstance(entry, dict):
        return f'entry {name!r:.60} is a {type(entry).__name__}, not a tensor object'
    dtype, shape, offsets = entry.get('dtype'), entry.get('shape'), entry.get('data_offsets')
    if dtype not in SAFETENSORS_DTYPE_BITS:
        return f'tensor {name!r:.60} has dtype {dtype!r:.20}, not a safetensors dtype'
    if not (isinstance(shape, list) and all(_whole(n) for n in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(_whole(n) for n in offsets)):
        return f'tensor {name!r:.60} has shape {shape!r:.40} and offsets {offsets!r:.40}, not whole numbers'
    values = 1
    for n in shape:
        values *= n
    begin, end = offsets
    if end - begin != values * SAFETENSORS_DTYPE_BITS[dtype] // 8:
        return (f'tensor {name!r:.60} declares {shape} {dtype} ({values * SAFETENSORS_DTYPE_BITS[dtype] // 8:,} '
                f'bytes) over {end - begin:,} bytes')
    return begin, end


def _check_safetensors(path: Path, where: str) -> None:
    """A safetensors file as safetensors reads it: its header a JSON object of tensor entries (``_entry_span``) whose
    offsets follow each other from 0 to the end of the file; nothing but the header is read."""
    size = path.stat().st_size
    try:
        with path.open('rb') as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise ModelFolderError(f'{where}: {path.name} is truncated ({size} bytes, no safetensors header)')
            (header_size,) = struct.unpack('<Q', head)
            if header_size > SAFETENSORS_HEADER_LIMIT:
                raise ModelFolderError(f'{where}: {path.name} claims a {header_size:,}-byte header, more than '
                                       f'safetensors reads ({SAFETENSORS_HEADER_LIMIT:,}); not read')
            if header_size > size - 8:
                raise ModelFolderError(f'{where}: {path.name} is truncated or not a safetensors file (its header '
                                       f'claims {header_size} bytes, the file has {size})')
            header = json.loads(handle.read(header_size))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ModelFolderError(f'{where}: {path.name} is unreadable as safetensors ({exc})') from exc
    if not isinstance(header, dict):
        raise ModelFolderError(f'{where}: {path.name} has a safetensors header that is a {type(header).__name__}, '
                               'not an object of tensors')
    if not isinstance(header.get('__metadata__', {}), dict):
        raise ModelFolderError(f'{where}: {path.name} has __metadata__ that is not an object')
    spans = []
    for name, entry in header.items():
        if name != '__metadata__':
            span = _entry_span(name, entry)
            if isinstance(span, str):
                raise ModelFolderError(f'{where}: {path.name}: its {span}; not a safetensors file dha-train reads')
            spans.append(span)
    spans.sort()
    if any(begin != end for (_, end), (begin, _) in zip([(0, 0), *spans], spans)):
        raise ModelFolderError(f'{where}: {path.name}: its tensors\' offsets overlap or leave gaps; not a '
                               'safetensors file dha-train reads')
    expected = 8 + header_size + (spans[-1][1] if spans else 0)
    if size < expected:
        raise ModelFolderError(f'{where}: {path.name} is truncated ({size:,} of {expected:,} bytes; an interrupted '
                               'copy?)')
    if size > expected:
        raise ModelFolderError(f'{where}: {path.name} is {size:,} bytes, more than the {expected:,} its header '
                               'places; not a safetensors file dha-train reads')


def _read_config(folder: Path, who: str, model_types: tuple[str, ...]) -> dict:
    """config.json as a dict of an allowed model type with whole-number sizes (``check_config_sizes``)."""
    config_file = folder / 'config.json'
    if not folder.is_dir():
        raise InputNotFoundError(f'{who}: model folder {folder} does not exist')
    if not config_file.is_file():
        raise InputNotFoundError(f'{who}: no HF config.json in {folder}')
    plain_name(config_file.name, f'{who}: {folder}', 'the config', folder=folder)
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ModelFolderError(f'{who}: {config_file} is not a readable JSON config ({exc})') from exc
    if not isinstance(config, dict):
        raise ModelFolderError(f'{who}: {config_file} holds a JSON {type(config).__name__}, not a config object')
    model_type = config.get('model_type')
    if model_type not in model_types:
        raise ModelFolderError(f"{who}: {folder} holds a '{model_type!s:.40}' model; this takes "
                               f"{', '.join(model_types)} folders")
    check_config_sizes(config, f'{who}: {config_file}')
    return config


def _checked_folder(folder: Path, who: str, model_types: tuple[str, ...]) -> tuple[dict, int | None]:
    """The folder's config as a dict and the bytes of the weight files it loads from (None: it has none, inside
    ``weights_optional``), after the checks in the module docstring."""
    config = _read_config(folder, who, model_types)
    where = f'{who}: {folder}'
    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        if _WEIGHTS_OPTIONAL.get():
            return config, None
        raise ModelFolderError(f'{who}: {folder} has a config.json but no weights beside it (expected '
                               f'{" or ".join(_SINGLE_FILES)}, or a shard index)')
    for name in present:  # each file or index transformers may read, not only the one it prefers
        if name.endswith('.index.json'):
            files = sorted(set(_shard_map(folder, name, who).values()))
        else:
            files = [plain_name(name, where, 'a weight file', folder=folder)]
        missing = [shard for shard in files if not (folder / shard).is_file()]
        if missing:
            raise ModelFolderError(f'{where}: the shard index names {len(missing)} missing shard(s): '
                                   f'{", ".join(missing[:3])}')
        for file in files:
            if file.endswith('.safetensors'):
                _check_safetensors(folder / file, where)
    return config, sum((folder / name).stat().st_size for name in weight_files(folder, who))


def check_model_folder(folder: str | Path, *, who: str, model_types: tuple[str, ...] = LLAMA_MODEL_TYPES) -> dict:
    """The folder's config as a dict, after the checks in the module docstring; ``who`` names the command."""
    return _checked_folder(Path(folder), who, model_types)[0]


def _built_config(folder: str | Path, who: str, model_types: tuple[str, ...], build) -> PretrainedConfig:
    """``build(config dict)`` after ``_checked_folder``, with the model it describes counted against the weights
    beside it (``check_parameter_budget``) before anything is built for real; refusals are ModelFolderErrors."""
    config_dict, weight_bytes = _checked_folder(Path(folder), who, model_types)
    where = f'{who}: {Path(folder) / "config.json"}'
    try:
        config = build(config_dict, where)
        if weight_bytes is not None:
            check_parameter_budget(config, weight_bytes, where)
    except UntrustedDataError as exc:
        raise ModelFolderError(str(exc)) from None
    return config


def load_model_config(folder: str | Path, *, who: str, model_types: tuple[str, ...] = LLAMA_MODEL_TYPES) -> PretrainedConfig:
    """The folder's config, after ``check_model_folder``, built with the project's own or transformers' classes and
    none of the config's code keys (``dha_train.untrusted.config_from_dict``), its model no larger than its weights."""
    return _built_config(folder, who, model_types,
                         lambda config, where: config_from_dict(config, where=where, model_types=model_types))


def load_causal_lm(folder: str | Path, *, who: str, config: PretrainedConfig | None = None,
                   model_types: tuple[str, ...] = LLAMA_MODEL_TYPES, **kwargs):
    """The folder's model with ``load_model_config``'s config (or ``config``, built by it and then adjusted by the caller),
    in the class that config maps to; ``trust_remote_code=False``, no hub."""
    config = config if config is not None else load_model_config(folder, who=who, model_types=model_types)
    return AutoModelForCausalLM.from_pretrained(str(folder), config=config, local_files_only=True,
                                                trust_remote_code=False, **kwargs)


def load_source_config(folder: str | Path, *, who: str) -> PretrainedConfig:
    """A source folder's config in its family's own config class (``dha_train.families``: LLaMA, Mistral, Qwen2,
    Qwen3, Gemma 3), after ``check_model_folder`` and without the config's code keys, so none travels into the
    folders written from it; its model no larger than its weights. Another model type is refused in one line naming
    the supported families."""
    def build(config: dict, where: str) -> PretrainedConfig:
        model_type, fields = config_fields(config, where=where, model_types=SOURCE_MODEL_TYPES)
        family = families.get(model_type, where)
        try:
            return family.config_class.from_dict(fields)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise UntrustedDataError(f'{where}: not a valid {model_type} config ({type(exc).__name__}: {exc})') from exc
    return _built_config(folder, who, SOURCE_MODEL_TYPES, build)

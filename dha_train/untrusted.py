"""What a checkpoint, a model folder or a tokenizer folder holds becomes an object here, and only through allow-lists.

Checkpoint and folder contents are data. transformers and Composer would let some of that data act: a config's
``trust_remote_code``, ``auto_map`` and ``_name_or_path`` make transformers import code (from the folder, another
folder, or a Hub repository), an unknown ``model_type`` sends Composer to ``AutoConfig.from_pretrained`` on the
config's own ``_name_or_path``, a tokenizer config's ``tokenizer_class`` names a class, and Composer writes a
checkpoint's tokenizer entries under file names the checkpoint chooses (``.py`` included). So:

- **configs** (``config_from_dict``): ``model_type`` must be one of the families the project reads and writes
  (``MODEL_TYPES``); an ``auto_map`` may name only the project's own modeling file for that type (what its exports
  carry, for users without dha_train), since a folder whose ``auto_map`` names other code means a model other than
  the class its type names, and loading it as that class would silently be another model: refused;
  ``trust_remote_code``, ``auto_map`` and ``_name_or_path`` are then dropped and the config is built by
  ``AutoConfig.for_model`` with the project's own classes registered. Nothing a config names is imported.
- **tokenizers** (``check_tokenizer_config``): ``tokenizer_config.json``'s ``tokenizer_class`` must name a tokenizer
  class of transformers itself; ``dha_train.tokenizer_files`` loads every tokenizer from its own copy of a folder's
  tokenizer files, with no ``auto_map`` and no ``*_file`` key, so nothing a tokenizer folder names is opened or run.
- **tokenizer files carried in a checkpoint** (``write_tokenizer_entries``): base names from ``TOKENIZER_FILE_NAMES``
  only, each with its own extension, written by the project into a folder of its own; anything else is refused in one
  line before any file is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

import dha_train.models  # noqa: F401  (registers dha_llama, moh_llama and mla_llama with AutoConfig)
from dha_train import families
from dha_train.errors import DhaTrainError

# The model types the project reads: the source families of the family layer (dha_train.families), its own classes
# (DHA/AsymGQA, MoH, MLA; a fused-checkpoint `dha_llama` is a DHA model too) and transformers' DeepseekV3 (MLA in
# DeepSeek's format).
MODEL_TYPES = (*families.supported(), *families.OWN_MODEL_TYPES, 'deepseek_v3')

# Config keys that make transformers import code, or name where to fetch a config from: never taken from data.
CODE_KEYS = ('trust_remote_code', 'auto_map', '_name_or_path')

# The files a tokenizer folder may be restored with from a checkpoint, by base name (each its own extension).
TOKENIZER_FILE_NAMES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'added_tokens.json',
                        'vocab.json', 'vocab.txt', 'merges.txt', 'tokenizer.model', 'chat_template.jinja')
# What each extension's content is in Composer's saved state (``.txt``: the file's lines).
_CONTENT_TYPES = {'.json': (dict, list), '.txt': (list,), '.model': (bytes,), '.jinja': (str,)}
TOKENIZER_CONFIG = 'tokenizer_config.json'


class UntrustedDataError(DhaTrainError, ValueError):
    """Data from a checkpoint or a folder that would name code, a class outside the allow-list, or a path: refused."""


def plain_name(name: Any, where: str, what: str = 'a file name', *, folder: str | Path | None = None,
               subfolders: bool = False) -> str:
    """``name``, read from a folder's own data (an MDS ``index.json``, a shard index, a tokenizer config), when it is a
    plain base name inside that folder: a non-empty string with no path separator, not ``.`` or ``..``, no NUL, not
    absolute. ``subfolders``: a relative path of such names (``part-00000/shard.00000.mds``: an MDS index that
    streaming's ``merge_index`` wrote). ``folder``: the folder it is read in; the path must also resolve inside it
    (no link inside leads out). Anything else is refused before a path is built from it: the one rule every reader of
    a name from data calls, so that nothing outside the folder is opened, written or downloaded because data named it.
    """
    parts = name.split('/') if isinstance(name, str) and subfolders else [name]
    if not isinstance(name, str) or not all(_plain_part(part) for part in parts):
        raise UntrustedDataError(f'{where}: {what} {name!r:.120} is not a plain file name inside its folder '
                                 '(no .., not absolute, no folders but those of an MDS index); dha-train opens nothing it names')
    if folder is not None:
        root = Path(folder).resolve()
        target = (root / name).resolve()
        if not (target.is_relative_to(root) or _hub_cache_blob(Path(folder), name, target)):
            raise UntrustedDataError(f'{where}: {what} {name!r:.120} leads out of {folder} through a link; '
                                     'dha-train opens nothing outside the folder')
    return name


def _hub_cache_blob(folder: Path, name: str, target: Path) -> bool:
    """A Hugging Face hub cache snapshot (``models--org--name/snapshots/<revision>/``) holds its files as links to
    ``../../blobs/<hash>``: the same model repository's own store, so a link from the snapshot straight into it (and
    nowhere else) stays inside the folder the user named."""
    snapshots = folder.absolute().parent
    if snapshots.name != 'snapshots' or '/' in name:
        return False
    link = folder / name
    blobs = (snapshots.parent / 'blobs').resolve()
    return link.is_symlink() and target.parent == blobs and target.is_file()


def _plain_part(part: Any) -> bool:
    return (isinstance(part, str) and part not in ('', '.', '..') and not any(c in part for c in '/\\\0')
            and not Path(part).is_absolute())


def _shipped_auto_map(model_type: str) -> dict[str, str]:
    """The ``auto_map`` the project's own export of ``model_type`` writes (its modeling file's config and causal-LM
    classes, as ``register_for_auto_class`` names them); {} for transformers' own types."""
    config_class = CONFIG_MAPPING[model_type]
    if not config_class.__module__.startswith('dha_train.'):
        return {}
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    return {auto: f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"
            for auto, cls in (('AutoConfig', config_class), ('AutoModelForCausalLM', model_class))}


def _check_auto_map(auto_map: Any, model_type: str, where: str) -> None:
    shipped = _shipped_auto_map(model_type)
    foreign = ({key: value for key, value in auto_map.items() if shipped.get(key) != value}
               if isinstance(auto_map, Mapping) else auto_map)
    if foreign:
        raise UntrustedDataError(f'{where}: its auto_map names code dha-train does not ship ({foreign!r:.120}); '
                                 f"dha-train never runs a folder's code and will not load it as a plain {model_type} "
                                 f'model (it may be another model): remove auto_map if it is one')


def config_fields(config: Mapping[str, Any], *, where: str,
                  model_types: tuple[str, ...] = MODEL_TYPES) -> tuple[str, dict[str, Any]]:
    """``(model_type, fields)`` of a config's dict after the checks of the module docstring: ``model_type`` from
    ``model_types``, an ``auto_map`` only of the project's own modeling file, the keys of ``CODE_KEYS`` dropped.
    ``where`` names the source in the refusal."""
    if not isinstance(config, Mapping):
        raise UntrustedDataError(f'{where}: the model config is a {type(config).__name__}, not a mapping')
    model_type = config.get('model_type')
    if model_type not in model_types:
        raise UntrustedDataError(f"{where}: holds a {model_type!r} model; dha-train reads only "
                                 f"{', '.join(model_types)} configs and never imports a config's own code")
    if any(not isinstance(key, str) for key in config):
        raise UntrustedDataError(f'{where}: the model config has a key that is not a string')
    if config.get('auto_map') is not None:
        _check_auto_map(config['auto_map'], model_type, where)
    return model_type, {key: value for key, value in config.items() if key not in CODE_KEYS and key != 'model_type'}


def config_from_dict(config: Mapping[str, Any], *, where: str,
                     model_types: tuple[str, ...] = MODEL_TYPES) -> PretrainedConfig:
    """A transformers config built from ``config`` (a config.json's or a checkpoint's dict) by ``AutoConfig.for_model``
    with the project's own classes, after ``config_fields``."""
    model_type, fields = config_fields(config, where=where, model_types=model_types)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise UntrustedDataError(f'{where}: not a valid {model_type} config ({type(exc).__name__}: {exc})') from exc


def tokenizer_class_allowed(name: str) -> bool:
    """``name`` is a tokenizer class of transformers, or its fast variant is (AutoTokenizer takes ``name + 'Fast'``
    first; the slow class is a placeholder where its library, e.g. sentencepiece, is not installed)."""
    if not name.isidentifier():
        return False
    candidates = (getattr(transformers, name, None), getattr(transformers, f'{name}Fast', None))
    return any(isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) for cls in candidates)


def check_tokenizer_config(config: Any, where: str) -> None:
    """Refuse a tokenizer config that names a class outside transformers' own tokenizers."""
    if not isinstance(config, Mapping):
        raise UntrustedDataError(f'{where}: {TOKENIZER_CONFIG} is not a JSON object')
    name = config.get('tokenizer_class')
    if name is not None and not (isinstance(name, str) and tokenizer_class_allowed(name)):
        raise UntrustedDataError(f'{where}: {TOKENIZER_CONFIG} names tokenizer_class {name!r}, which is not a '
                                 'tokenizer class of transformers; dha-train loads no other class')


def _tokenizer_file(name: Any, entry: Any, where: str) -> tuple[str, Any]:
    """The base name and content of one Composer tokenizer entry (``{name: {'file_extension', 'content'}}``)."""
    if not isinstance(entry, Mapping) or not isinstance(name, str) or not isinstance(entry.get('file_extension'), str):
        raise UntrustedDataError(f'{where}: tokenizer entry {name!r} is not a file name with an extension and content')
    extension = entry['file_extension']
    file_name = name if name.endswith(extension) else name + extension  # Composer wrote both forms
    if file_name not in TOKENIZER_FILE_NAMES or Path(file_name).suffix != extension:
        raise UntrustedDataError(f'{where}: its tokenizer names a file {file_name!r}; dha-train restores only '
                                 f"{', '.join(TOKENIZER_FILE_NAMES)} (base names, no folders) and wrote nothing")
    content = entry.get('content')
    wanted = _CONTENT_TYPES[extension]
    if not isinstance(content, wanted) or (extension == '.txt' and not all(isinstance(line, str) for line in content)):
        raise UntrustedDataError(f'{where}: its tokenizer file {file_name} holds a {type(content).__name__}, not '
                                 f'the content of a {extension} file')
    if file_name == TOKENIZER_CONFIG:
        check_tokenizer_config(content, where)
    return file_name, content


def check_tokenizer_entries(entries: Any, where: str) -> dict[str, Any]:
    """``{file name: content}`` of a Composer checkpoint's tokenizer entries, every one checked (``_tokenizer_file``);
    nothing is written."""
    if not isinstance(entries, Mapping):
        raise UntrustedDataError(f'{where}: its tokenizer state is a {type(entries).__name__}, not a mapping')
    return dict(_tokenizer_file(name, entry, where) for name, entry in entries.items())


def write_tokenizer_entries(entries: Any, folder: str | Path, where: str) -> list[str]:
    """Write a Composer checkpoint's tokenizer entries into ``folder`` (the caller's own, fresh folder) once every one
    has passed ``check_tokenizer_entries``: nothing is written unless all pass. Returns the file names written."""
    files = check_tokenizer_entries(entries, where)
    folder = Path(folder)
    for file_name, content in files.items():
        path = folder / file_name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content, encoding='utf-8')
        elif file_name.endswith('.txt'):
            path.write_text(''.join(f'{line}\n' for line in content), encoding='utf-8')
        else:
            path.write_text(json.dumps(content), encoding='utf-8')
    return sorted(files)

"""Every tokenizer the project loads, it loads from a folder of its own: nothing a tokenizer folder (or what lies
beside a GGUF) names is opened, imported or asked about on stdin.

transformers reads more of a tokenizer folder than its files: ``tokenizer_config.json``'s ``auto_map`` names code,
its ``vocab_file`` / ``tokenizer_file`` / any ``*_file`` key names a file anywhere on the machine and wins over the
folder's own (``init_inputs`` too: a slow tokenizer's first argument is its vocabulary file), and without a
``tokenizer_class`` it falls back to the model config's, which may be ``AutoProcessor``: that reads the folder again
and asks "run the custom code? [y/N]" on stdin. So ``load_tokenizer_folder``:

- copies the files of ``TOKENIZER_FILE_NAMES`` (plain base names inside the folder, regular files, each at most
  ``MAX_FILE_BYTES``) into a fresh temporary folder, and nothing else (no ``config.json``, no ``.py``);
- writes the copy's ``tokenizer_config.json`` without ``auto_map``, ``init_inputs`` and every ``*_file`` /
  ``*_files`` key (the files are found by their base names in the copy, so nothing is lost);
- refuses, in one line, a ``tokenizer_class`` outside transformers' tokenizers or a ``processor_class`` outside
  its processors, in ``tokenizer_config.json`` and in the model config (the folder's ``config.json`` and the config
  object the caller built);
- loads with ``AutoTokenizer`` from the copy, ``local_files_only=True, trust_remote_code=False``, passing a model
  config the project built, so transformers never reads the folder's ``config.json``.

``load_gguf_tokenizer`` does the same for a GGUF's own tokenizer: the fresh folder holds only a link to the one file
(``gguf_alone``, which ``import-gguf`` also loads the weights through), so no ``tokenizer_config.json``,
``config.json``, ``generation_config.json`` or ``.py`` beside the GGUF is read. The copy is removed once the tokenizer
is built: the paths a tokenizer keeps (a slow tokenizer's ``vocab_file``, which ``save_pretrained`` copies) name the
checked files of the folder itself, and ``name_or_path`` is the folder or file the user named.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.processing_utils import ProcessorMixin

from dha_train.untrusted import (
    TOKENIZER_CONFIG,
    TOKENIZER_FILE_NAMES,
    UntrustedDataError,
    check_tokenizer_config,
    plain_name,
    tokenizer_class_allowed,
)

MODEL_CONFIG = 'config.json'
# Far above any real tokenizer file (a 256k-vocabulary tokenizer.json is about 35 MB): a bigger one is refused.
MAX_FILE_BYTES = 256 * 2 ** 20
# tokenizer_config.json keys that name code or positional arguments, dropped from the copy with every *_file(s) key.
DROPPED_KEYS = ('auto_map', 'init_inputs')
GGUF_NAME = 'model.gguf'


def _read_bounded(path: Path, name: str, where: str) -> bytes:
    """The bytes of the folder's file ``name`` (``path``): a plain name resolving inside the folder, a regular file
    (a link is followed only inside the folder), at most ``MAX_FILE_BYTES``."""
    plain_name(name, where, 'a tokenizer file', folder=path.parent)
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise UntrustedDataError(f'{where}: {path} is not a regular file; dha-train reads tokenizer files only')
        with path.open('rb') as handle:  # read(n) reserves n bytes up front: ask for the file's size, bounded
            data = handle.read(min(os.fstat(handle.fileno()).st_size, MAX_FILE_BYTES) + 1)
    except OSError as exc:
        raise UntrustedDataError(f'{where}: cannot read {path} ({exc.strerror or type(exc).__name__})') from None
    if len(data) > MAX_FILE_BYTES:
        raise UntrustedDataError(f'{where}: {path} is larger than {MAX_FILE_BYTES >> 20} MiB, more than any '
                                 'tokenizer file; dha-train does not read it')
    return data


def _json_object(data: bytes, path: Path, where: str) -> dict:
    try:
        value = json.loads(data.decode('utf-8'))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UntrustedDataError(f'{where}: {path} is not readable JSON ({type(exc).__name__})') from None
    if not isinstance(value, dict):
        raise UntrustedDataError(f'{where}: {path} is a JSON {type(value).__name__}, not an object')
    return value


def _without_paths(value: Any) -> Any:
    """``value`` without the keys of ``DROPPED_KEYS`` and every ``*_file`` / ``*_files`` key, at any depth
    (``sp_model_kwargs`` may carry a ``model_file``)."""
    if isinstance(value, Mapping):
        return {key: _without_paths(item) for key, item in value.items()
                if not (isinstance(key, str) and (key in DROPPED_KEYS or key.endswith(('_file', '_files'))))}
    if isinstance(value, list):
        return [_without_paths(item) for item in value]
    return value


def _processor_class_allowed(name: str) -> bool:
    cls = getattr(transformers, name, None) if name.isidentifier() else None
    return tokenizer_class_allowed(name) or (isinstance(cls, type) and issubclass(cls, ProcessorMixin))


def check_named_classes(fields: Mapping[str, Any], where: str, source: str) -> None:
    """Refuse a config (``source``: a model config, or a tokenizer_config.json) whose ``tokenizer_class`` is not a
    tokenizer class of transformers, or whose ``processor_class`` is neither that nor a processor class of
    transformers (AutoTokenizer falls back to a model config's class; ``AutoProcessor`` reads the folder's code)."""
    for key, allowed in (('tokenizer_class', tokenizer_class_allowed), ('processor_class', _processor_class_allowed)):
        name = fields.get(key)
        if name is not None and not (isinstance(name, str) and allowed(name)):
            raise UntrustedDataError(f'{where}: {source} names {key} {name!r:.80}, which is not a '
                                     f"{key.split('_')[0]} class of transformers; dha-train loads no other class")


def _model_config(folder: Path, where: str, config: PretrainedConfig | None) -> PretrainedConfig:
    """The model config the tokenizer is loaded with: ``config`` (built by the caller), else transformers' own config
    class of the folder's ``model_type`` with its defaults and the checked ``tokenizer_class`` (what AutoTokenizer
    takes from a config); both after ``check_named_classes``, as is the folder's config.json."""
    path = folder / MODEL_CONFIG
    fields = _json_object(_read_bounded(path, MODEL_CONFIG, where), path, where) if os.path.lexists(path) else {}
    check_named_classes(fields, where, str(path))
    if config is not None:
        check_named_classes(vars(config), where, 'its model config')
        return config
    model_type = fields.get('model_type')
    built = PretrainedConfig()
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        try:
            built = CONFIG_MAPPING[model_type]()
        except (TypeError, ValueError, KeyError, AttributeError):
            pass  # a type that needs arguments: AutoTokenizer then goes by tokenizer_class alone
    built.tokenizer_class = fields.get('tokenizer_class')
    return built


def _copy_tokenizer_files(folder: Path, copy: Path, where: str) -> None:
    """The allowed tokenizer files of ``folder`` into ``copy``, ``tokenizer_config.json`` checked and without paths."""
    for name in TOKENIZER_FILE_NAMES:
        path = folder / name
        if not os.path.lexists(path):
            continue
        data = _read_bounded(path, name, where)
        if name == TOKENIZER_CONFIG:
            tokenizer_config = _json_object(data, path, where)
            check_tokenizer_config(tokenizer_config, where)
            check_named_classes(tokenizer_config, where, str(path))
            try:
                data = json.dumps(_without_paths(tokenizer_config), indent=2).encode()
            except RecursionError:
                raise UntrustedDataError(f'{where}: {path} is nested too deeply for a tokenizer config') from None
        (copy / name).write_bytes(data)


@contextmanager
def _own_folder(prefix: str) -> Iterator[Path]:
    """A fresh temporary folder of the project's own, removed after (the tokenizer keeps no path into it)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        yield Path(folder)


def _load_from_own_folder(copy: Path, source: Path | None, name_or_path: Path, config: PretrainedConfig | None,
                          **extra: Any):
    """AutoTokenizer on ``copy``, the project's own folder. A path the tokenizer keeps into it (a slow tokenizer's
    ``vocab_file``, which ``save_pretrained`` copies) names the same base name in ``source``, the folder whose checked
    file was copied (None: nothing), so that the copy can go at once."""
    if config is not None:
        extra['config'] = config
    tokenizer = AutoTokenizer.from_pretrained(str(copy), local_files_only=True, trust_remote_code=False, **extra)
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise UntrustedDataError(f'{name_or_path}: loaded as a {type(tokenizer).__name__}, not a tokenizer')
    for holder in (vars(tokenizer), tokenizer.init_kwargs):
        for key, value in list(holder.items()):
            if isinstance(value, str) and os.path.dirname(value) == str(copy):
                holder[key] = None if source is None else str(source / os.path.basename(value))
    tokenizer.name_or_path = tokenizer.init_kwargs['name_or_path'] = str(name_or_path)
    return tokenizer


def load_tokenizer_folder(folder: str | Path, where: str, config: PretrainedConfig | None = None):
    """The tokenizer of a local folder, loaded from the project's own copy of its tokenizer files (module docstring).
    ``config``: the folder's model config, already built safely (``untrusted.config_from_dict``)."""
    folder = Path(folder)
    model_config = _model_config(folder, where, config)
    with _own_folder('dha-tokenizer-') as copy:
        _copy_tokenizer_files(folder, copy, where)
        return _load_from_own_folder(copy, folder, folder, model_config)


def _link_alone(path: Path, folder: Path) -> Path:
    link = folder / GGUF_NAME
    link.symlink_to(path.resolve())
    return link


@contextmanager
def gguf_alone(path: str | Path) -> Iterator[Path]:
    """A link to the GGUF ``path``, alone in a fresh folder (removed after): what transformers' GGUF loader is given,
    so that nothing beside the file (a ``config.json``, ``tokenizer_config.json``, ``adapter_config.json``, code) is
    read. Pass the link itself, absolute, as ``gguf_file``."""
    with _own_folder('dha-gguf-') as folder:
        yield _link_alone(Path(path), folder)


def load_gguf_tokenizer(path: str | Path):
    """The GGUF ``path``'s own tokenizer, loaded through ``gguf_alone``. It keeps no path to the file (transformers
    would name the GGUF itself as a slow tokenizer's vocabulary file, and save it as ``tokenizer.model``)."""
    with gguf_alone(path) as link:
        return _load_from_own_folder(link.parent, None, Path(path), None, gguf_file=str(link))

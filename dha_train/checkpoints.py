"""Checking a Composer checkpoint before anything loads it, and loading one so that its data cannot act.

Composer 0.32.1 resumes with ``torch.load(weights_only=False)`` and torch.distributed.checkpoint (torch 2.7) reads a
sharded folder's ``.metadata`` and non-tensor items with plain pickle. Importing this module replaces each of those
reads, for Composer, for export and for the pre-check alike, with one checked read whose object is the one used:

- **whole files**: Composer's ``_torch_load_with_validation`` becomes ``torch_load`` (``weights_only=True`` with
  exactly ``SAFE_GLOBALS``), so the file is checked at the moment Composer loads it, local or downloaded;
- **``.metadata``**: ``FileSystemReader.read_metadata`` unpickles with ``MetadataUnpickler`` (the DCP metadata
  classes of ``METADATA_GLOBALS``, no BUILD on a class or a function, shard files named by base name) and returns that
  object; torch's plain-pickle read never runs;
- **non-tensor items**: ``DefaultLoadPlanner.load_bytes`` keeps the object ``check_byte_item`` unpickled;
- **numpy**: the RNG state's arrays are rebuilt from a fresh plain dtype (``dha_train.checkpoint_pickles``): a
  dtype re-stated with fields, object type or flags is refused, so no array can read raw bytes as pointers;
- **tar archives**: Composer would extract one (``download_checkpoint``); refused, local or remote;
- **declared sizes** (``dha_train.checkpoint_sizes``): ``.metadata``'s tensors must be backed by their chunks' stored
  bytes and its ``planner_data`` must spell its own keys, before export's gather allocates anything; every tensor of
  a whole file must fit its storage (no stride of 0), and a model state must hold tensors only.

Before a run hands Composer a local ``load_path`` or the checkpoint autoresume found, ``check_checkpoint`` refuses
with one line naming the path anything that is not a whole Composer checkpoint: a truncated file (a torch.save file is
a zip archive, and a cut one has lost its central directory at the end), a text or other foreign file, a torch.save of
something else, a dangling latest link, a sharded folder whose ``.metadata`` or shard files are missing or short, and
everything the readers above refuse. For a file the check unpickles ``data.pkl`` with ``mmap=True``: the tensor data is
mapped, not read, so a 7B checkpoint is not read twice. ``load_composer_state`` (export) is the same load and keeps
the mapped tensors.

Not checked: bit flips inside tensor data (that would mean reading every byte).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from composer.checkpoint import load as composer_checkpoint_load
from composer.utils import checkpoint as composer_checkpoint
from composer.utils.file_helpers import is_tar
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from dha_train.checkpoint_pickles import (
    SAFE_GLOBALS,
    SHARDED_METADATA,
    CheckpointError,
    MetadataUnpickler,
    UnsafeCheckpointError,
)
from dha_train.checkpoint_sizes import metadata_size_problem, tensor_size_problem
from dha_train.untrusted import UntrustedDataError, check_tokenizer_entries, config_fields, plain_name
from dha_train.weight_sizes import check_config_sizes

LATEST = 'latest-rank0.pt'  # Composer's link to the newest checkpoint in a save_folder (rank 0's)


def _refused_type(exc: Exception) -> str | None:
    """The type torch's weights_only unpickler refused: 'GLOBAL os.system ...' or 'Can only build ..., but got
    <class 'x.Y'>'."""
    refused = re.search(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>", str(exc))
    return (refused.group(1) or refused.group(2)) if refused else None


def read_checked_metadata(path: str | Path) -> dcp_metadata.Metadata:
    """A sharded folder's ``.metadata``, unpickled once by ``MetadataUnpickler``, with every shard file it names a
    plain file name inside the folder (Composer downloads remote shards to those names)."""
    with open(Path(path) / SHARDED_METADATA, 'rb') as metadata_file:
        metadata = MetadataUnpickler(metadata_file).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f'its {SHARDED_METADATA} holds a {type(metadata).__name__}, not DCP metadata')
    for info in (metadata.storage_data or {}).values():
        try:  # the one rule for a name from data (a remote folder's shards are downloaded to these names too)
            plain_name(getattr(info, 'relative_path', None), f'its {SHARDED_METADATA}', 'shard file')
        except UntrustedDataError as exc:
            raise UnsafeCheckpointError(str(exc)) from None
    problem = metadata_size_problem(metadata)
    if problem is not None:
        raise UnsafeCheckpointError(f'its {SHARDED_METADATA} {problem}; dha-train allocates nothing its bytes do not '
                                    'back')
    return metadata


def _read_metadata_checked(self: FileSystemReader) -> dcp_metadata.Metadata:
    """``FileSystemReader.read_metadata`` as ``read_checked_metadata``: the object checked is the object returned;
    torch's plain-pickle read never runs (its two bookkeeping lines follow)."""
    metadata = read_checked_metadata(self.path)
    if getattr(metadata, 'storage_meta', None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    metadata.storage_meta.load_id = getattr(self, 'load_id', None)
    return metadata


def _unwrapped(exc: BaseException) -> BaseException:
    """torch re-raises an unpickler error as a page-long UnpicklingError (``from None``); ours is its context."""
    return exc.__context__ if isinstance(exc.__context__, UnsafeCheckpointError) else exc


def check_byte_item(raw: bytes, name: str) -> Any:
    """Unpickle a DCP non-tensor item as dha-train allows (weights_only, ``SAFE_GLOBALS``) and return it; a refused
    type raises ``UnsafeCheckpointError`` naming it, as does a tensor in it larger than its storage."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            item = torch.load(io.BytesIO(raw), weights_only=True)
    except pickle.UnpicklingError as exc:
        ours = _unwrapped(exc)
        what = str(ours) if ours is not exc else f"names {_refused_type(exc) or 'an object weights_only refuses'}"
        raise UnsafeCheckpointError(f'its item {name}: {what}, not one of the types a checkpoint of `dha-train train` '
                                    'holds; dha-train refuses to unpickle it') from None
    problem = tensor_size_problem(item)
    if problem is not None:
        raise UnsafeCheckpointError(f'its item {name}: {problem}')
    return item


def _load_bytes_checked(self: DefaultLoadPlanner, read_item, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` keeping the object ``check_byte_item`` unpickled (torch's own read, with
    ``weights_only=False``, never runs)."""
    item = check_byte_item(value.read(), read_item.dest_index.fqn)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], item)
    else:
        self.state_dict[read_item.dest_index.fqn] = item


def _checked_whole_file_load(checkpoint_filepath: str | Path, map_location: str = 'cpu') -> Any:
    """Composer's whole-file load (``_torch_load_with_validation``) as ``torch_load``: checked where it is read."""
    return _load(Path(checkpoint_filepath), mmap=False)


def refuse_tar(path: str, setting: str = '') -> None:
    """Refuse a tar archive as a checkpoint (Composer would extract it, names and links as the archive says)."""
    if is_tar(path):
        raise CheckpointError(f'{setting}{path} is a tar archive; dha-train loads whole-file (.pt) and sharded '
                              'checkpoints, never extracts an archive: extract it yourself and give the .pt file')


def _refusing_tar_download(download_checkpoint):
    """Composer's ``download_checkpoint``, calling ``refuse_tar`` before anything is downloaded or extracted."""
    def checked(path: str, *args, **kwargs):
        refuse_tar(path)
        return download_checkpoint(path, *args, **kwargs)
    checked.dha_train_checked = True
    return checked


def install_checked_loading() -> None:
    """Replace every read Composer and torch.distributed.checkpoint make of a checkpoint with the checked one (see the
    module docstring); idempotent."""
    FileSystemReader.read_metadata = _read_metadata_checked
    DefaultLoadPlanner.load_bytes = _load_bytes_checked
    for module in (composer_checkpoint, composer_checkpoint_load):
        module._torch_load_with_validation = _checked_whole_file_load
    if not getattr(composer_checkpoint.download_checkpoint, 'dha_train_checked', False):
        composer_checkpoint.download_checkpoint = _refusing_tar_download(composer_checkpoint.download_checkpoint)


install_checked_loading()


def _incomplete(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f'cannot read checkpoint {path} (corrupted or incomplete?): {why}')


def _existing(path: Path) -> Path:
    if path.is_symlink() and not path.exists():
        raise CheckpointError(f'{path} links to {os.readlink(path)}, which does not exist')
    if not path.exists():
        raise CheckpointError(f'checkpoint not found: {path}')
    return path


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint file, a sharded checkpoint folder, or a save_folder (its latest checkpoint)."""
    path = _existing(Path(path))
    if path.is_dir() and not (path / SHARDED_METADATA).is_file():
        latest = path / LATEST
        if not latest.is_symlink() and not latest.exists():
            raise CheckpointError(f'{path} is neither a checkpoint nor a save_folder with a {LATEST} link')
        path = _existing(latest)
    return path.resolve()


def torch_load(path: str | Path, *, mmap: bool = False) -> Any:
    """``torch.load`` as dha-train reads every checkpoint itself: weights_only, plus exactly ``SAFE_GLOBALS``."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        try:
            return torch.load(path, map_location='cpu', weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            ours = _unwrapped(exc)
            if ours is not exc:
                raise ours from None
            raise


def _load(path: Path, mmap: bool, shown: Path | None = None) -> dict:
    """``torch_load`` with its failures as one-line CheckpointErrors naming ``shown`` (default: ``path``), and every
    tensor of it no larger than its storage (``tensor_size_problem``)."""
    shown = shown or path
    try:
        state = torch_load(path, mmap=mmap)
    except Exception as exc:  # torch raises many types for corrupt or foreign files
        if isinstance(exc, UnsafeCheckpointError):
            raise UnsafeCheckpointError(f'{shown}: {exc}; dha-train refuses it') from None
        refused = _refused_type(exc)
        if refused:
            raise CheckpointError(
                f'{shown} holds a {refused} object, not one of the types a checkpoint of '
                '`dha-train train` holds: dha-train reads checkpoints with torch.load(weights_only=True) and refuses '
                'it') from exc
        # torch's weights-only errors are a page long; their one informative line names what it could not unpickle.
        detail = re.search(r'WeightsUnpickler error: (.*)', str(exc))
        lines = str(exc).strip().splitlines()
        reason = detail.group(1) if detail else lines[0] if lines else ''
        raise _incomplete(shown, f'{type(exc).__name__}: {reason}') from exc
    problem = tensor_size_problem(state)
    if problem is not None:
        raise CheckpointError(f'{shown}: {problem}')
    return state


def _check_state(state: Any, path: Path) -> dict:
    if not isinstance(state, dict) or not isinstance(state.get('state'), dict) or 'model' not in state['state']:
        raise CheckpointError(f'{path} is not a Composer checkpoint (no state.model)')
    model = state['state']['model']
    if not isinstance(model, dict):
        raise CheckpointError(f'{path}: its model state is a {type(model).__name__}, not a mapping of weights')
    for name, value in model.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f'{path}: its model state holds a {type(value).__name__} as weight {name!r:.80}, '
                                  'not a tensor')
    timestamp = state['state'].get('timestamp')
    timestamp = timestamp.get('Timestamp', timestamp) if isinstance(timestamp, dict) else {}  # as Composer saves it
    for name, value in (timestamp.items() if isinstance(timestamp, dict) else ()):
        check_time_counter(name, value, path)
    check_hf_metadata(state, path)
    return state


# Composer's timestamp counters (``Timestamp.state_dict``): Composer's resume and export's token count read each one as a
# whole number
TIME_COUNTERS = ('iteration', 'epoch', 'batch', 'sample', 'token', 'epoch_in_iteration', 'token_in_iteration',
                 'batch_in_epoch', 'sample_in_epoch', 'token_in_epoch')


def check_time_counter(name: str, value: Any, path: Path) -> None:
    """Refuse ``state.timestamp``'s counter ``name`` (a whole file's, or a sharded folder's item) unless it is a whole
    number of at least 0."""
    if name in TIME_COUNTERS and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise CheckpointError(f'{path}: its timestamp\'s {name} is {value!r:.40}, not a whole number of at least 0')


def check_hf_metadata(state: dict, path: Path) -> None:
    """The Hugging Face config and tokenizer files a checkpoint carries (``state.integrations.huggingface``) pass
    ``dha_train.untrusted``'s checks: an allowed model type with no foreign code, tokenizer files by allowed base
    name. Nothing is built or written; resume never uses them, export and eval build them through the same checks."""
    integrations = state['state'].get('integrations')
    hf_state = integrations.get('huggingface') if isinstance(integrations, dict) else None
    if hf_state is None:
        return
    try:
        if not isinstance(hf_state, dict):
            raise UntrustedDataError(f'{path}: its Hugging Face metadata is a {type(hf_state).__name__}, not a dict')
        model = hf_state.get('model')
        config = model.get('config') if isinstance(model, dict) else None
        if config is not None:
            where = f'{path} (its Hugging Face config)'
            content = config.get('content') if isinstance(config, dict) else config
            config_fields(content, where=where)
            check_config_sizes(content, where)
        if hf_state.get('tokenizer'):
            check_tokenizer_entries(hf_state['tokenizer'], str(path))
    except UntrustedDataError as exc:
        raise CheckpointError(str(exc)) from None


def _check_archive(path: Path) -> None:
    """The cheap part: the zip central directory (at the end of the file) and torch's ``data.pkl`` entry."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise _incomplete(path, f'it is not a whole torch.save file ({exc})') from exc
    size = path.stat().st_size
    beyond = [e.filename for e in entries if e.header_offset + e.compress_size > size]
    if beyond:
        raise _incomplete(path, f'its entry {beyond[0]} ends past the end of the file')
    if not any(e.filename.endswith('/data.pkl') for e in entries):
        raise CheckpointError(f'{path} is a zip archive but not a torch.save file (no data.pkl)')


def _load_file(path: Path) -> dict:
    _check_archive(path)
    return _check_state(_load(path, mmap=True), path)


def _check_sharded(path: Path) -> None:
    """A sharded (torch.distributed.checkpoint) folder: its .metadata, and every shard file long enough for it."""
    if not (path / SHARDED_METADATA).is_file():
        hint = f'; its {LATEST} link names the latest checkpoint' if (path / LATEST).is_symlink() else ''
        raise CheckpointError(f'{path} is a folder but not a sharded checkpoint (no {SHARDED_METADATA} file){hint}')
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
        ends: dict[str, int] = {}
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # pickle raises many types for a corrupt or foreign file
        raise _incomplete(path, f'its {SHARDED_METADATA} is unreadable ({type(exc).__name__}: {exc})') from exc
    for name, end in sorted(ends.items()):
        shard = path / name
        if not shard.is_file():
            raise _incomplete(path, f'its shard file {name} is missing')
        if shard.stat().st_size < end:
            raise _incomplete(path, f'its shard file {name} is {shard.stat().st_size} bytes but {SHARDED_METADATA} '
                                    f'places data up to byte {end}')
    if not any(key.startswith('state.model.') for key in metadata.state_dict_metadata):
        raise CheckpointError(f'{path} is not a Composer checkpoint (no state.model)')
    _check_byte_items(path, metadata)


def _check_folder(path: Path) -> None:
    """``_check_sharded``, naming the folder when it refuses a pickle that would run code."""
    try:
        _check_sharded(path)
    except UnsafeCheckpointError as exc:
        raise CheckpointError(f'{path}: {exc}') from None


def _check_byte_items(path: Path, metadata: dcp_metadata.Metadata) -> None:
    """Unpickle every non-tensor item of a sharded folder as loading will (``check_byte_item``)."""
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        with open(path / info.relative_path, 'rb') as shard:
            shard.seek(info.offset)
            raw = shard.read(info.length)
        try:
            item = check_byte_item(raw, index.fqn)
        except UnsafeCheckpointError:
            raise
        except Exception as exc:  # a torn or foreign item
            raise _incomplete(path, f'its item {index.fqn} is unreadable ({type(exc).__name__}: {exc})') from exc
        if index.fqn.startswith('state.timestamp.Timestamp.'):
            check_time_counter(index.fqn.rsplit('.', 1)[1], item, path)


def check_checkpoint(path: str | Path) -> Path:
    """Refuse ``path`` (a checkpoint file or sharded folder, as Composer's load_path takes) unless it is a whole
    Composer checkpoint; returns it resolved. Reads the zip directory and the pickle, not the tensor data."""
    path = _existing(Path(path)).resolve()
    if path.is_dir():
        _check_folder(path)
    else:
        _load_file(path)
    return path


def load_composer_state(path: str | Path) -> dict:
    """Load a whole Composer checkpoint (file, sharded folder, or a save_folder's latest) as the nested dict Composer
    saved, with ``weights_only=True``. A file's tensors stay mapped from disk until used."""
    path = resolve_checkpoint(path)
    if not path.is_dir():
        return _load_file(path)
    _check_folder(path)
    with tempfile.TemporaryDirectory() as tmp:  # gather the shards into one state dict
        gathered = Path(tmp) / 'gathered.pt'
        try:
            dcp_to_torch_save(str(path), str(gathered))
        except Exception as exc:  # torch raises many types for corrupt shard files
            raise _incomplete(path, f'{type(exc).__name__}: {exc}') from exc
        return _check_state(_load(gathered, mmap=False, shown=path), path)

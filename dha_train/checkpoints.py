"""Checking a Composer checkpoint before anything loads it, and loading one without running arbitrary pickle code.

Composer 0.32.1 resumes with ``torch.load(weights_only=False)``, i.e. plain pickle. Before a run hands it a
``load_path`` or the checkpoint autoresume found, ``check_checkpoint`` refuses with one line naming the path anything
that is not a whole Composer checkpoint: a truncated file (a torch.save file is a zip archive, and a cut one has lost
its central directory at the end), a text or other foreign file, a torch.save of something else, a dangling latest
link, a sharded folder whose ``.metadata`` or shard files are missing or short. For a file the check reads the zip
directory and unpickles ``data.pkl`` with ``weights_only=True, mmap=True``: the tensor data is mapped, not read, so a
7B checkpoint is not read twice, and a pickle naming anything but tensors, plain data and ``SAFE_GLOBALS`` is refused
before Composer unpickles it. ``load_composer_state`` (export) is the same load and keeps the mapped tensors.

Sharded folders run no code either: importing this module replaces torch.distributed.checkpoint's two plain-pickle
reads, for this check and for Composer and export alike (Composer 0.32.1 and torch 2.7 execute whatever a
``.metadata`` or a non-tensor item names): ``FileSystemReader.read_metadata`` first unpickles ``.metadata`` allowing
only the DCP metadata classes, tensor sizes, dtypes and layouts and paths (``METADATA_GLOBALS``), and
``DefaultLoadPlanner.load_bytes`` first reads each non-tensor item with ``weights_only=True`` and ``SAFE_GLOBALS``;
torch's own read runs only on what passed (the same pickle then builds nothing else), whichever torch version. The check
reads every non-tensor item of a sharded folder this way too (they are small), so a folder naming anything else is
refused in one line before Composer sees it.

Not checked: bit flips inside tensor data (that would mean reading every byte).
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from composer.utils import checkpoint as composer_checkpoint
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.torch_version import TorchVersion

from dha_train.errors import DhaTrainError, OutputExistsError

LATEST = 'latest-rank0.pt'  # Composer's link to the newest checkpoint in a save_folder (rank 0's)
# Composer's default save_filename as rank 0 writes it (dha-train sets no other): ep{epoch}-ba{batch}-rank0.pt
_RANK0_CHECKPOINT = re.compile(r'ep(\d+)-ba(\d+)-rank0\.pt')
SHARDED_METADATA = '.metadata'

# numpy's array rebuilder (numpy._core.multiarray._reconstruct in numpy 2, numpy.core.multiarray's in numpy 1).
_np_reconstruct = np.zeros(0).__reduce__()[0]

# Every non-tensor type a Composer 0.32.1 checkpoint written by `dha-train train` holds, as
# torch.serialization.get_unsafe_globals_in_checkpoint lists them for full and sharded (gathered) checkpoints with
# algorithms, callbacks and evaluators. weights_only=True allows these and nothing else beyond tensors and plain data.
SAFE_GLOBALS: list[Any] = [
    datetime.timedelta,  # state.timestamp: the wall-clock times
    TorchVersion,  # state.metadata: the torch version that wrote the checkpoint
    # rng[*].numpy: numpy's global RNG state, a uint32 array. Its dtype unpickles as np.dtype('u4'), an instance of
    # numpy.dtypes.UInt32DType, which torch must also be allowed to build.
    np.ndarray, np.dtype, type(np.dtype(np.uint32)),
    # numpy's array rebuilder, under the name numpy 2 pickles it with and the name numpy 1 does (the numpy pin allows
    # both, and a checkpoint may move between them).
    (_np_reconstruct, 'numpy._core.multiarray._reconstruct'),
    (_np_reconstruct, 'numpy.core.multiarray._reconstruct'),
]


# What a torch.distributed.checkpoint ``.metadata`` (torch 2.7, as Composer 0.32.1 writes it) names: its dataclasses,
# the storage info of the filesystem writer, tensor sizes, dtypes and layouts, and the checkpoint's path.
METADATA_GLOBALS = frozenset({
    *(('torch.distributed.checkpoint.metadata', name) for name in (
        'Metadata', 'MetadataIndex', 'StorageMeta', 'TensorStorageMetadata', 'BytesStorageMetadata',
        'ChunkStorageMetadata', 'TensorProperties', '_MEM_FORMAT_ENCODING')),
    ('torch.distributed.checkpoint.filesystem', '_StorageInfo'),
    ('torch', 'Size'), ('torch.serialization', '_get_layout'),
    ('pathlib', 'PosixPath'), ('pathlib', 'WindowsPath'), ('pathlib', 'PurePosixPath'), ('pathlib', 'PureWindowsPath'),
})


class CheckpointError(DhaTrainError, ValueError):
    """The checkpoint is missing, unreadable, or not a dha_train/Composer checkpoint."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint that names code to run: refused before anything of it runs."""


def _refused_type(exc: Exception) -> str | None:
    """The type torch's weights_only unpickler refused: 'GLOBAL os.system ...' or 'Can only build ..., but got
    <class 'x.Y'>'."""
    refused = re.search(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>", str(exc))
    return (refused.group(1) or refused.group(2)) if refused else None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` building only ``METADATA_GLOBALS`` and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (module == 'torch' and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f'its {SHARDED_METADATA} names {module}.{name}, which a torch.distributed.checkpoint '
                                    'metadata file does not hold; dha-train refuses to unpickle it')


def _checked_metadata_reader(read_metadata):
    """``FileSystemReader.read_metadata`` that first unpickles the ``.metadata`` file with ``_MetadataUnpickler``:
    torch's own read (plain pickle) then only ever sees a file that builds nothing else."""
    def checked(self: FileSystemReader) -> dcp_metadata.Metadata:
        with open(Path(self.path) / SHARDED_METADATA, 'rb') as metadata_file:
            _MetadataUnpickler(metadata_file).load()
        return read_metadata(self)
    checked.dha_train_checked = True
    return checked


def check_byte_item(raw: bytes, name: str) -> None:
    """Unpickle a DCP non-tensor item as dha-train allows (weights_only, ``SAFE_GLOBALS``); a refused type raises
    ``UnsafeCheckpointError`` naming it."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            torch.load(io.BytesIO(raw), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"its item {name} names {_refused_type(exc) or 'an object weights_only refuses'}, "
                                    'not one of the types a checkpoint of `dha-train train` holds; dha-train refuses '
                                    'to unpickle it') from None


def _checked_load_bytes(load_bytes):
    """``DefaultLoadPlanner.load_bytes`` that hands torch's own load (``weights_only=False``) only an item that
    ``check_byte_item`` accepted: the same pickle then builds nothing beyond ``SAFE_GLOBALS``."""
    def checked(self: DefaultLoadPlanner, read_item, value: io.BytesIO) -> None:
        raw = value.read()
        check_byte_item(raw, read_item.dest_index.fqn)
        load_bytes(self, read_item, io.BytesIO(raw))
    checked.dha_train_checked = True
    return checked


def install_safe_sharded_loading() -> None:
    """Check what torch.distributed.checkpoint unpickles before it does (see the module docstring); idempotent."""
    if not getattr(FileSystemReader.read_metadata, 'dha_train_checked', False):
        FileSystemReader.read_metadata = _checked_metadata_reader(FileSystemReader.read_metadata)
    if not getattr(DefaultLoadPlanner.load_bytes, 'dha_train_checked', False):
        DefaultLoadPlanner.load_bytes = _checked_load_bytes(DefaultLoadPlanner.load_bytes)


install_safe_sharded_loading()


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
        return torch.load(path, map_location='cpu', weights_only=True, mmap=mmap)


def _load(path: Path, mmap: bool, shown: Path | None = None) -> dict:
    """``torch_load`` with its failures as one-line CheckpointErrors naming ``shown`` (default: ``path``)."""
    try:
        return torch_load(path, mmap=mmap)
    except Exception as exc:  # torch raises many types for corrupt or foreign files
        shown = shown or path
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


def _check_state(state: Any, path: Path) -> dict:
    if not isinstance(state, dict) or not isinstance(state.get('state'), dict) or 'model' not in state['state']:
        raise CheckpointError(f'{path} is not a Composer checkpoint (no state.model)')
    return state


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
            check_byte_item(raw, index.fqn)
        except UnsafeCheckpointError:
            raise
        except Exception as exc:  # a torn or foreign item
            raise _incomplete(path, f'its item {index.fqn} is unreadable ({type(exc).__name__}: {exc})') from exc


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


# ----------------------------------------------------------------------------------------------------------------
# Saving: whole files only, and no save folder Composer would refuse once the model is built
# ----------------------------------------------------------------------------------------------------------------


def save_checkpoints_atomically() -> None:
    """Have Composer write each whole-file checkpoint under a hidden temporary name in its folder and rename it into
    place once complete (idempotent; rank 0 writes these files).

    Composer 0.32.1 writes the final name directly, so a save cut off by SIGTERM (preemption, scancel, Ctrl-C: its
    handler exits at once) or by a full disk left a torn ``ep*-ba*-rank0.pt`` beside the intact previous checkpoint
    that latest-rank0.pt still names, and Composer then refused the autoresume (a later checkpoint is in the folder).
    A killed save now leaves nothing; a SIGKILL at worst a hidden ``.partial-*`` file, which nothing reads. Sharded
    checkpoints are torch.distributed.checkpoint folders, not covered: one cut off lacks its ``.metadata`` (written
    last) or has short shard files, and ``check_checkpoint`` refuses it.
    """
    write = composer_checkpoint._write_checkpoint_file
    if getattr(write, 'renames_into_place', False):
        return

    def write_then_rename(state_dict: dict[str, Any], filename: str) -> None:
        folder, name = os.path.split(filename)
        # The same suffix: Composer picks tar or compressed formats from it.
        partial = os.path.join(folder, f'.partial-{os.getpid()}-{name}')
        try:
            write(state_dict, partial)
            os.replace(partial, filename)
        finally:
            if os.path.lexists(partial):
                os.remove(partial)

    write_then_rename.renames_into_place = True  # type: ignore[attr-defined]
    composer_checkpoint._write_checkpoint_file = write_then_rename


def checkpoint_time(path: str | Path) -> tuple[int, int] | None:
    """The (epoch, batch) a Composer checkpoint's name records (``ep0-ba12-rank0.pt``), or None for another name."""
    match = re.search(r'ep(\d+)-ba(\d+)', Path(path).name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _listed(paths: list[Path]) -> str:
    return ', '.join(p.name for p in paths[:4]) + (f' and {len(paths) - 4} more' if len(paths) > 4 else '')


def _is_whole(path: Path) -> bool:
    try:
        check_checkpoint(path)
    except CheckpointError:
        return False
    return True


def refuse_later_checkpoints(folder: Path, start: Path | None, setting: str) -> None:
    """Refuse a save folder that holds rank-0 checkpoints later than ``start``, the checkpoint the run resumes from
    (None: it starts from scratch). Composer refuses the same folder, but only at fit start, once everything is built,
    with a traceback. ``setting`` (autoresume, load_path or save_folder) is how the run chose ``start``. Reads only;
    the message says what to change in the folder."""
    if start is None:
        epoch = batch = 0
    elif (time := checkpoint_time(start)) is None:
        return  # a load_path named otherwise: its time is known only once loaded, and Composer checks then
    else:
        epoch, batch = time
    later = []
    for path in folder.iterdir():
        match = _RANK0_CHECKPOINT.fullmatch(path.name)
        if match and (int(match.group(1)) > epoch or int(match.group(2)) > batch):
            later.append(path)
    if not later:
        return
    later.sort(key=lambda p: checkpoint_time(p) or (0, 0))
    if start is None and setting != 'autoresume':
        raise OutputExistsError(
            f'save_folder {folder} already holds checkpoints ({_listed(later)}) and this run starts from scratch; '
            'set autoresume: true (with their run_name) to resume them, save_overwrite: true to replace them, or '
            'choose another save_folder')
    if start is None:
        whole = next((p for p in reversed(later) if _is_whole(p)), None)
        hint = (f'point {LATEST} at {whole.name}, the newest whole one, to resume from it' if whole is not None else
                'none of them is a whole checkpoint: move them away to start again')
        raise CheckpointError(
            f'autoresume: {folder} holds checkpoints ({_listed(later)}) but no {LATEST} link to resume from (a run '
            f'killed while it saved?); {hint}. Nothing in {folder} was changed')
    if setting != 'autoresume':
        raise CheckpointError(
            f'{setting}: save_folder {folder} holds {_listed(later)}, later than {start.name}, which the run starts '
            'from; Composer refuses to train into a folder holding later checkpoints: move them away, set '
            f'save_overwrite: true to replace them, or choose another save_folder. Nothing in {folder} was changed')
    verdicts = []
    for path in later[:4]:
        if _is_whole(path):
            verdicts.append(f'{path.name} is a whole checkpoint: point {LATEST} at it to resume from there, or '
                            'delete it')
        else:
            verdicts.append(f'{path.name} is incomplete (a save cut off by a kill or a full disk?): delete it to '
                            f'resume from {start.name}')
    raise CheckpointError(
        f'autoresume: {folder} holds {_listed(later)}, later than {start.name}, which {LATEST} names and the run '
        f'would resume from; Composer refuses to train into a folder holding later checkpoints. '
        f'{"; ".join(verdicts)}. Nothing in {folder} was changed')

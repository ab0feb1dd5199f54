"""Where the repository's recipes live, and writing output folders and files safely."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from dha_train.errors import DhaTrainError, InputNotFoundError, OutputExistsError, disk_error

REPO_ROOT = Path(__file__).resolve().parents[1]
YAMLS = REPO_ROOT / 'yamls'


def recipe_path(name: str) -> Path:
    """``'pretrain/tiny.yaml'`` -> the file under the repository's ``yamls/``."""
    path = YAMLS / name
    if not path.is_file():
        raise InputNotFoundError(f'recipe {name} not found under {YAMLS}; install dha_train editable from its '
                                'repository (pip install -e .)')
    return path


def refuse_nonempty(out_dir: str | Path, overwrite: bool) -> None:
    """An existing, non-empty output folder is replaced only when asked to."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(f'{out_dir} exists and is not empty; pass --overwrite to replace it')


def check_writable(folder: str | Path, what: str = '', staged: bool = False) -> None:
    """Refuse, before any work, an output folder this process cannot write: a probe file is created (with one byte)
    and removed in ``folder``, or in its nearest existing parent when it does not exist yet (nothing is created).
    ``staged``: the folder is written as a temporary sibling and renamed into place (``staged_folder``, data prep),
    so its parent is what must be writable. ``what`` names the setting in the message (``'--out'``, ``'save_folder'``).
    """
    folder = Path(folder)
    start = folder.absolute().parent if staged else folder
    existing = next((p for p in (start, *start.absolute().parents) if p.exists()), None)
    label = f'{what} {folder}' if what else str(folder)
    if existing is None or not existing.is_dir():
        raise DhaTrainError(f'{label}: {existing} is not a folder')
    try:
        handle, probe = tempfile.mkstemp(prefix='.dha-train-write-probe-', dir=existing)
        try:
            os.write(handle, b'\0')
        finally:
            os.close(handle)
            os.unlink(probe)
    except OSError as exc:  # the probe's own name would only confuse: name the folder, and the parent it lies in
        where = f' ({existing} is where it would be written)' if existing != folder else ''
        error = disk_error(OSError(exc.errno, exc.strerror), label, note=where)
        if error is None:
            raise
        raise error from None


@contextlib.contextmanager
def staged_folder(out_dir: str | Path, overwrite: bool = False):
    """Yield a temporary sibling folder to write into; on success it replaces ``out_dir``, on failure it is removed.

    A failed export or conversion therefore never leaves a half-written folder, nor deletes the old one. A write the
    disk refuses (full, read-only, not writable) becomes a one-line ``DiskError`` naming ``out_dir``.
    """
    out_dir = Path(out_dir)
    refuse_nonempty(out_dir, overwrite)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f'.{out_dir.name}.', dir=out_dir.parent))
    except OSError as exc:
        error = disk_error(OSError(exc.errno, exc.strerror), out_dir, note='; nothing was written')
        if error is None:
            raise
        raise error from None
    existed = out_dir.exists()
    try:
        yield staging
        replace_folder(staging, out_dir)
    except Exception as exc:
        error = disk_error(exc, out_dir, note=f'; {out_dir} was left as it was' if existed else '; nothing was written')
        if error is None:
            raise
        raise error from exc
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def replace_folder(new: Path, out_dir: Path) -> None:
    """Rename the finished ``new`` to ``out_dir`` (its sibling); an old ``out_dir`` is deleted only once the new one is
    in place, and put back if that rename fails."""
    if not out_dir.exists():
        new.rename(out_dir)
        return
    old = out_dir.with_name(f'.{out_dir.name}.old-{os.getpid()}')
    out_dir.rename(old)
    try:
        new.rename(out_dir)
    except BaseException:
        old.rename(out_dir)
        raise
    shutil.rmtree(old)


def write_file_atomically(path: str | Path, content: str | bytes) -> Path:
    """Write ``content`` (text as UTF-8, or bytes) to ``path`` as checkpoints are written: into a new file under a
    hidden temporary name in the same folder, then ``os.replace``d onto ``path``. A link already at ``path`` (a user's,
    or one that came with a downloaded folder) is replaced by the file, never written through, and a write cut off
    leaves ``path`` as it was. The temporary name is created exclusively (``O_EXCL``: never an existing file or link)
    with the usual permissions (0666 less the umask); it is removed if anything fails."""
    path = Path(path)
    data = content.encode('utf-8') if isinstance(content, str) else bytes(content)
    temporary = path.with_name(f'.{path.name}.{os.getpid()}-{secrets.token_hex(4)}.partial')
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, 'O_NOFOLLOW', 0) | getattr(os, 'O_CLOEXEC', 0)
    handle = os.open(temporary, flags, 0o666)
    try:
        with os.fdopen(handle, 'wb') as stream:
            stream.write(data)
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)
    return path

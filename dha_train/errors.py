"""The one base of every error a user can cause (bad config, data, checkpoint, head map, arguments), and the one
place an operating-system failure the user's disk causes (full, read-only, not writable) becomes such an error.

``dha-train`` and ``python -m dha_train.train`` print ``user_error(exc)`` as one line (exit 2); any other exception
is a bug and keeps its traceback. Imports nothing of the project, so every layer above ``ops`` may use it.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path


class DhaTrainError(Exception):
    """A problem with the user's input, with the offending key, path or value named in the message."""


class OutputExistsError(DhaTrainError, FileExistsError):
    """An output folder or file exists and would be replaced without being asked to."""


class InputNotFoundError(DhaTrainError, FileNotFoundError):
    """A model, data or recipe path that was given does not exist."""


class DiskError(DhaTrainError, OSError):
    """Writing an output failed because of the disk: full, over quota, read-only, or not writable by this user."""


# errno -> what it says about the disk. Anything else an OSError can mean stays a bug (with its traceback).
DISK_PROBLEMS = {
    errno.ENOSPC: 'the disk is full (no space left on device)',
    errno.EDQUOT: 'the disk quota is exceeded',
    errno.EROFS: 'the file system is read-only',
    errno.EACCES: 'permission denied',
    errno.EPERM: 'operation not permitted',
}
# Rust's std::io::Error ends its message with "(os error N)": safetensors and tokenizers raise their own exception
# types (not OSError) with it, e.g. "Error while serializing: I/O error: No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r'\(os error (\d+)\)')


def disk_problem(exc: BaseException) -> str | None:
    """What ``exc`` says about the disk (see ``DISK_PROBLEMS``), or None when it is no such failure."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None:
        match = _RUST_OS_ERROR.search(str(exc))
        code = int(match.group(1)) if match else None
    return DISK_PROBLEMS.get(code)


def disk_error(exc: BaseException, folder: str | Path | None = None, note: str = '') -> DiskError | None:
    """A one-line ``DiskError`` for an operation the disk refused, naming ``folder`` (when given: the output or save
    folder the user chose, which was being written) and the file it failed on; None when ``exc`` is no such failure.
    """
    problem = disk_problem(exc)
    if problem is None:
        return None
    filename = getattr(exc, 'filename', None)
    if folder is not None:
        message = f'cannot write {folder}: {problem}'
        if filename is not None and Path(filename) != Path(folder):
            message += f' (writing {filename})'
    else:
        message = f'{filename}: {problem}' if filename is not None else problem
    return DiskError(message + note)


def user_error(exc: BaseException) -> DhaTrainError | None:
    """The error the user is shown for ``exc``: itself when it is a ``DhaTrainError``, a ``DiskError`` when the disk
    refused a write, else None (a bug: let it raise with its traceback)."""
    if isinstance(exc, DhaTrainError):
        return exc
    return disk_error(exc)


class EvalError(DhaTrainError, ValueError):
    """Bad arguments to `dha-train eval` / `compare`: named before anything heavy runs."""

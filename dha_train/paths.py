"""Where the repository's recipes live, and writing output folders safely."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from dha_train.errors import InputNotFoundError, OutputExistsError

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


@contextlib.contextmanager
def staged_folder(out_dir: str | Path, overwrite: bool = False):
    """Yield a temporary sibling folder to write into; on success it replaces ``out_dir``, on failure it is removed.

    A failed export or conversion therefore never leaves a half-written folder, nor deletes the old one.
    """
    out_dir = Path(out_dir)
    refuse_nonempty(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f'.{out_dir.name}.', dir=out_dir.parent))
    try:
        yield staging
        if out_dir.exists():
            shutil.rmtree(out_dir)
        shutil.move(str(staging), out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)

"""Saving checkpoints: whole files written atomically, and no save folder Composer would refuse once the model is
built (``refuse_later_checkpoints`` says what to change in it, before anything is built). Reading and checking a
checkpoint is ``dha_train.checkpoints``."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from composer.utils import checkpoint as composer_checkpoint

from dha_train.checkpoints import LATEST, CheckpointError, check_checkpoint
from dha_train.errors import OutputExistsError

# Composer's default save_filename as rank 0 writes it (dha-train sets no other): ep{epoch}-ba{batch}-rank0.pt
_RANK0_CHECKPOINT = re.compile(r'ep(\d+)-ba(\d+)-rank0\.pt')


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

"""Checking MDS shards against the sizes and hashes their ``index.json`` records, before a run reads them.

``dha-train data prep`` records an xxh64 hash of every shard file (``prep.SHARD_HASH``). streaming checks such hashes
only when it downloads or decompresses a shard (``Stream(validate_hash=...)``): shards read in place from a local
folder are never checked, and a mismatch found while downloading stops streaming's download thread, which ends the
epoch early and leaves the message in a logged traceback. So the loaders check local splits here, with streaming's
own index parser and hash functions, before any process trains: the ranks of a node share the files, and every rank
gets the same one-line error naming the bad file. ``dha-train data verify`` runs the same check on a whole data folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from composer.utils import dist
from streaming.base.format import reader_from_json
from streaming.base.format.base.reader import FileInfo
from streaming.base.hashing import get_hash, get_hashes

from dha_train.config import ConfigError
from dha_train.data.prep import SHARD_HASH
from dha_train.errors import DhaTrainError

AUTO = 'auto'
INDEX = 'index.json'


class CorruptShardError(DhaTrainError, ValueError):
    """A shard file is missing, has the wrong size, or fails its recorded hash; the message names the file."""


@dataclass(frozen=True)
class ShardFile:
    label: str  # what it belongs to, for the message: 'domain github' or 'github/train'
    path: Path
    info: FileInfo  # bytes and hashes as index.json records them
    algorithm: str | None  # None: compare the size only (the index records no hash, or hashing is off)


def _algorithm(recorded: dict[str, str], validate_hash: str, index: Path, where: str) -> str | None:
    if validate_hash == AUTO:
        if SHARD_HASH in recorded:
            return SHARD_HASH
        return min(recorded) if recorded else None
    if validate_hash not in recorded:
        raise ConfigError(f'{where}: the {validate_hash} hash was asked for, but {index} records none for its shards '
                          f'(it records: {", ".join(sorted(recorded)) or "none"}); ask for auto or one of those')
    return validate_hash


def split_files(label: str, local: str | Path, validate_hash: str | None, where: str) -> list[ShardFile]:
    """The shard files of the MDS split in ``local`` (raw, and zip if compressed) that are on disk, to be checked.

    A shard with neither its raw nor its compressed file present is listed as missing (its path is the raw one).
    """
    local = Path(local)
    index = local / INDEX
    try:
        shards = json.loads(index.read_text())['shards']
    except FileNotFoundError as exc:
        raise CorruptShardError(f'{where}: no MDS index at {index}') from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptShardError(f'{where}: {index} is not a readable MDS index ({type(exc).__name__}: {exc})') from exc
    files = []
    for shard in shards:
        reader = reader_from_json(str(local), None, shard)
        for raw, zipped in reader.file_pairs:
            present = [info for info in (raw, zipped) if info is not None and (local / info.basename).is_file()]
            for info in present or [raw]:
                algorithm = None if validate_hash is None else _algorithm(info.hashes, validate_hash, index, where)
                files.append(ShardFile(label, local / info.basename, info, algorithm))
    return files


def file_problem(file: ShardFile) -> str | None:
    """Why ``file`` does not match its index entry, or None when it does."""
    where = f'shard {file.path} ({file.label})'
    try:
        size = file.path.stat().st_size
    except FileNotFoundError:
        return f'{where} is missing'
    if size != file.info.bytes:
        return f'{where} is {size} bytes but index.json records {file.info.bytes}: it is truncated or was overwritten'
    if file.algorithm is None:
        return None
    digest = get_hash(file.algorithm, file.path.read_bytes())
    expected = file.info.hashes[file.algorithm]
    if digest != expected:
        return (f'{where} fails its {file.algorithm} check (index.json records {expected}, the file hashes to '
                f'{digest}): the file is corrupted')
    return None


def check_files(files: Sequence[ShardFile], where: str) -> None:
    """Check every file, the ranks of each node sharing them; raise the same CorruptShardError on every rank.

    Every rank must call this with the same files (it gathers the findings of all ranks).
    """
    mine = files[dist.get_local_rank()::dist.get_local_world_size()]
    found = [problem for problem in map(file_problem, mine) if problem]
    problems = list(dict.fromkeys(p for rank_problems in dist.all_gather_object(found) for p in rank_problems))
    if problems:
        more = f' (and {len(problems) - 1} more bad shard file(s))' if len(problems) > 1 else ''
        raise CorruptShardError(f'{where}: {problems[0]}{more}; copy the data again or re-run `dha-train data prep`')


def check_splits(splits: Iterable[tuple[str, str | Path]], validate_hash: str | None, where: str) -> int:
    """Check the local MDS splits ``(label, folder)`` against their index.json; returns how many files were checked.

    ``validate_hash``: 'auto' (the hash each file records, ``SHARD_HASH`` first; sizes only where none is recorded),
    an algorithm every file must record, or None (no check at all).
    """
    if validate_hash is None:
        return 0
    files = [file for label, local in splits for file in split_files(label, local, validate_hash, where)]
    check_files(files, where)
    return len(files)


def streaming_hash(validate_hash: str | None) -> str | None:
    """What to hand ``streaming.Stream(validate_hash=...)`` for a remote stream: only an algorithm named outright.

    With 'auto' the remote index is not downloaded yet, so which hashes it records is unknown.
    """
    return None if validate_hash in (None, AUTO) else validate_hash


def verify_data(root: str | Path, validate_hash: str = AUTO) -> list[tuple[str, int, set[str | None]]]:
    """Check every ``<domain>/<split>/index.json`` split under ``root`` (or ``root`` itself if it is one split).

    Returns ``(split, files, algorithms used)`` per split; raises CorruptShardError naming the first bad file.
    """
    if validate_hash != AUTO and validate_hash not in get_hashes():
        raise ConfigError(f"data verify: --hash '{validate_hash}' is neither auto nor a hash streaming knows "
                          f"({', '.join(sorted(get_hashes()))})")
    root = Path(root)
    if (root / INDEX).is_file():
        indexes = [root / INDEX]
    else:
        indexes = sorted(root.glob(f'*/*/{INDEX}'))
    if not indexes:
        raise CorruptShardError(f'data verify: no MDS index under {root} (expected <domain>/<split>/{INDEX})')
    report, files = [], []
    for index in indexes:
        label = str(index.parent.relative_to(root)) if index.parent != root else root.name
        split = split_files(label, index.parent, validate_hash, 'data verify')
        report.append((label, len(split), {file.algorithm for file in split}))
        files.extend(split)
    check_files(files, 'data verify')
    return report

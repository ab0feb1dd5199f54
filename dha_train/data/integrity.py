"""Checking MDS shards against the sizes and hashes their ``index.json`` records, before a run reads them.

``dha-train data prep`` records an xxh64 hash of every shard file (``prep.SHARD_HASH``). streaming checks such hashes
only when it downloads or decompresses a shard (``Stream(validate_hash=...)``): shards read in place from a local
folder are never checked, and a mismatch found while downloading stops streaming's download thread, which ends the
epoch early and leaves the message in a logged traceback. So the loaders check local splits here, with streaming's
own index parser and hash functions, before any process trains: the ranks of a node share the files, and every rank
gets the same one-line error naming the bad file. ``dha-train data verify`` runs the same check on a whole data folder.

Every file name an index gives passes ``untrusted.plain_name`` first (``index_shards``, the one reader of an index
here): streaming joins those names to the split folder to read, to decompress into and to download to, so a name
with ``..``, an absolute one, or a link in the folder leading out would let a data folder write or read any file.
A remote split's index is downloaded by the project (``fetch_index``) and checked before streaming sees it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from composer.utils import dist
from streaming.base.format import reader_from_json
from streaming.base.format.base.reader import FileInfo, Reader
from streaming.base.hashing import get_hash, get_hashes
from streaming.base.storage import CloudDownloader
from streaming.base.util import retry

from dha_train.config import ConfigError
from dha_train.data.prep import SHARD_HASH
from dha_train.errors import DhaTrainError, InputNotFoundError
from dha_train.untrusted import plain_name

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


def index_shards(local: str | Path, where: str, index: str | Path | None = None,
                 source: str | None = None) -> list[Reader]:
    """The shard readers of the split in ``local``, parsed from its index.json (``index``: a copy of it not yet in
    place, one just downloaded from ``source``) by streaming's own parser, once every file name the index gives (the
    raw and zip file of every file pair of every shard, whatever its format) has passed ``plain_name`` inside
    ``local``. Subfolders are allowed: the merged indexes data prep writes name ``<NNNNN>-<stem>/shard.00000.mds``.
    Nothing is opened but the index."""
    local = Path(local)
    index = Path(index) if index is not None else local / INDEX
    source = source or str(index)
    try:
        obj = json.loads(index.read_text())
        if obj.get('version') != 2:  # streaming reads only version 2 (and only asserts it per shard)
            raise ValueError(f"version {obj.get('version')!r}, not 2")
        readers = [reader_from_json(str(local), None, shard) for shard in obj['shards']]
    except FileNotFoundError as exc:
        raise CorruptShardError(f'{where}: no MDS index at {source}') from exc
    except (OSError, ValueError, KeyError, TypeError, AttributeError, AssertionError) as exc:
        raise CorruptShardError(f'{where}: {source} is not a readable MDS index ({type(exc).__name__}: {exc})') from exc
    for reader in readers:
        for info in (info for pair in reader.file_pairs for info in pair if info is not None):
            plain_name(info.basename, f'{where}: {source}', 'shard file', folder=local, subfolders=True)
    return readers


def fetch_index(local: str | Path, remote: str, where: str, *, timeout: float, attempts: int) -> None:
    """Bring a remote split's index.json into ``local`` as streaming would (its downloader, by the local leader of
    each node), but checked by ``index_shards`` before it is moved into place: streaming then finds it and downloads
    no index of its own, so no shard is fetched, read or written on the word of an unchecked index. An index already
    in ``local`` (an earlier run's cache) is left for the caller's ``index_shards``. Every rank raises the same error.
    """
    local = Path(local)
    failure: DhaTrainError | None = None
    if dist.get_local_rank() == 0 and not (local / INDEX).exists():
        source = os.path.join(remote, INDEX)  # where streaming's Stream._download_file would fetch it from
        partial = local / f'{INDEX}.tmp-{os.getpid()}'
        try:
            downloader = CloudDownloader.get(remote)
            partial.unlink(missing_ok=True)
            retry(clean_up_fn=downloader.clean_up, num_attempts=attempts)(
                lambda: downloader.download(source, str(partial), timeout))()
            index_shards(local, where, index=partial, source=source)
            os.replace(partial, local / INDEX)
        except DhaTrainError as exc:
            failure = exc
        except Exception as exc:  # streaming's downloaders raise their clients' errors (botocore, OSError, ...)
            reason = (str(exc).strip().splitlines() or [''])[0][:300]  # its first line: the refusal is one line
            failure = InputNotFoundError(f'{where}: cannot download {source} into {local} '
                                         f'({type(exc).__name__}: {reason})')
        finally:
            partial.unlink(missing_ok=True)
    failures = [found for found in dist.all_gather_object(failure) if found is not None]
    if failures:
        raise failures[0]


def split_files(label: str, local: str | Path, validate_hash: str | None, where: str) -> list[ShardFile]:
    """The shard files of the MDS split in ``local`` (raw, and zip if compressed) that are on disk, to be checked.

    A shard with neither its raw nor its compressed file present is listed as missing (its path is the raw one).
    """
    local = Path(local)
    index = local / INDEX
    files = []
    for reader in index_shards(local, where):
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


def check_splits(splits: Iterable[tuple[str, str | Path, str | None]], validate_hash: str | None, where: str, *,
                 timeout: float = 60.0, attempts: int = 2) -> int:
    """Check the MDS splits ``(label, local folder, remote or None)`` before any streaming dataset exists; returns how
    many shard files were checked against their index.json.

    Every split's index names only files inside its folder (``index_shards``; a remote's index is downloaded and
    checked first, ``fetch_index`` with streaming's ``timeout`` and ``attempts``), whatever ``validate_hash`` says.
    The shard files of splits read in place are then checked: ``validate_hash`` 'auto' (the hash each file records,
    ``SHARD_HASH`` first; sizes only where none is recorded), an algorithm every file must record, or None (none).
    """
    splits = list(splits)
    for _, local, remote in splits:
        if remote is not None:
            fetch_index(local, remote, where, timeout=timeout, attempts=attempts)
        index_shards(local, where)
    if validate_hash is None:
        return 0
    files = [file for label, local, remote in splits if remote is None
             for file in split_files(label, local, validate_hash, where)]
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

"""RedPajama JSONL inputs of ``dha-train data prep``: finding the files and their domains, and reading their lines.

An input file is data: every line is read with a length limit (``MAX_LINE_BYTES`` by default, ``--max-line-bytes``),
from the decompressed stream in bounded pieces, so a small archive that expands into one line of gigabytes costs at
most the limit in memory. A line longer than the limit, or one that fails to parse for any reason (malformed JSON,
bad UTF-8, nesting too deep for the parser, too large to hold), is a bad line named ``file:line``.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import zstandard

from dha_train.data.domains import DOMAINS, domain_of
from dha_train.errors import DhaTrainError

SUFFIXES = ('.jsonl', '.jsonl.gz', '.jsonl.zst')
# The longest line (one document's JSON) data prep reads. RedPajama's longest documents, whole books, are a few MiB;
# a longer line is a bad line, and no more than this much of it is ever held.
MAX_LINE_BYTES = 64 << 20
# How much of a too-long line is read at a time while passing over it.
_SKIP_CHUNK = 1 << 20


class DataPrepError(DhaTrainError, ValueError):
    """Bad input to data prep: the message names the file (and line) or option at fault."""


# ----------------------------------------------------------------------------------------------------------------
# Reading RedPajama JSONL
# ----------------------------------------------------------------------------------------------------------------


def is_jsonl(path: Path) -> bool:
    return path.name.endswith(SUFFIXES)


def _open_binary(path: Path, stack: contextlib.ExitStack) -> IO[bytes]:
    """A buffered binary stream over the decompressed file (read by ``_bounded_lines``).

    Lines are decoded one at a time (by ``json.loads``), so a bad byte is reported with its line number.
    """
    raw = stack.enter_context(open(path, 'rb'))
    if path.name.endswith('.gz'):
        return stack.enter_context(gzip.GzipFile(fileobj=raw))
    if path.name.endswith('.zst'):
        # RedPajama's .zst files may hold several frames (the tests write two); never stop at a frame boundary.
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return stack.enter_context(io.BufferedReader(reader))
    return raw


def _bounded_lines(stream: IO[bytes], max_line_bytes: int) -> Iterator[bytes | None]:
    """Every line of ``stream``, or None for a line longer than ``max_line_bytes`` (newline not counted): it is read
    past in ``_SKIP_CHUNK`` pieces, never held whole (``readline(n)`` reads at most ``n`` bytes)."""
    while line := stream.readline(max_line_bytes + 1):
        if len(line) <= max_line_bytes or line.endswith(b'\n'):
            yield line
            continue
        rest = line
        while rest and not rest.endswith(b'\n'):  # read past the rest of the line, a piece at a time
            rest = stream.readline(_SKIP_CHUNK)
        yield None


def _size(limit: int) -> str:
    return f'{limit >> 20} MiB' if limit >= 1 << 20 and limit % (1 << 20) == 0 else f'{limit:,} bytes'


def _text_of(line: bytes) -> str:
    """The ``text`` field of one JSONL line; ValueError says why the line is unusable."""
    try:
        record = json.loads(line)
    except UnicodeDecodeError as exc:  # JSON is UTF-8 text (json.loads also takes UTF-16/32 with their BOM or NULs)
        raise ValueError(f'line is not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1}: '
                         f'{exc.reason})') from None
    except ValueError as exc:  # JSONDecodeError
        raise ValueError(f'malformed JSON line ({exc})') from None
    except Exception as exc:  # RecursionError (deep nesting), MemoryError: whatever the parser fails on is bad data
        raise ValueError(f'JSON line the parser cannot read ({type(exc).__name__}: {exc})') from None
    if not isinstance(record, dict) or not isinstance(record.get('text'), str):
        raise ValueError('line has no string "text" field')
    return record['text']


def iter_texts(path: str | Path, skip_bad_lines: bool = False, bad_lines: list[int] | None = None,
               max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[str]:
    """Yield the documents' texts of one RedPajama JSONL file in file order.

    Blank lines are ignored. A bad line (one longer than ``max_line_bytes``, or one ``_text_of`` refuses) raises
    DataPrepError naming ``path:line``; with ``skip_bad_lines`` it is skipped instead and its 1-based line number
    appended to ``bad_lines``.
    """
    path = Path(path)
    with contextlib.ExitStack() as stack:
        try:
            lines = _bounded_lines(_open_binary(path, stack), max_line_bytes)
            for line_number, line in enumerate(lines, start=1):
                if line is not None and line.isspace():  # blank (isspace: no copy of a long line)
                    continue
                try:
                    if line is None:
                        raise ValueError(f'line is longer than {_size(max_line_bytes)} (--max-line-bytes)')
                    text = _text_of(line)
                except ValueError as exc:
                    if not skip_bad_lines:
                        raise DataPrepError(f'{path}:{line_number}: {exc}; pass --skip-bad-lines to skip such lines') from exc
                    if bad_lines is not None:
                        bad_lines.append(line_number)
                    continue
                yield text
        except (OSError, EOFError, zstandard.ZstdError) as exc:  # truncated or corrupt archives: name the file
            raise DataPrepError(f'{path}: cannot read the file ({type(exc).__name__}: {exc})') from exc


# ----------------------------------------------------------------------------------------------------------------
# Finding inputs and their domains
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputFile:
    index: int  # position in the sorted input list; names the MDS sub-folder so merged indexes keep this order
    path: Path
    domain: str


def collect_inputs(inputs: Iterable[str | Path], domain: str | None = None) -> list[InputFile]:
    """Every input file, sorted by path, each with its domain. Fails before any tokenizing on an unknown domain."""
    # file -> the folder above which domain_of looks no further. For a folder input that is its parent, so
    # `--input .../book` means book; for a file input, its grandparent, so only its own folder and name count.
    # Paths are absolute, not resolved: hub caches symlink files to blobs named by hash.
    inputs = list(inputs)
    found: dict[Path, Path] = {}
    for item in inputs:
        item = Path(item).absolute()
        if item.is_dir():
            for path in sorted(p for p in item.rglob('*') if p.is_file() and is_jsonl(p)):
                found.setdefault(path, item.parent)
        elif item.is_file():
            if not is_jsonl(item):
                raise DataPrepError(f'input {item} is not a RedPajama file (expected one of {", ".join(SUFFIXES)})')
            found.setdefault(item, item.parent.parent)
        else:
            raise DataPrepError(f'input not found: {item}')
    if not found:
        listed = ', '.join(str(i) for i in inputs) or '(none given)'
        raise DataPrepError(f'no {"/".join(SUFFIXES)} files found in: {listed}')
    if domain is not None and domain not in DOMAINS:
        raise DataPrepError(f'unknown --domain {domain!r}; valid domains: {", ".join(DOMAINS)}')

    files: list[InputFile] = []
    unknown: list[Path] = []
    for index, path in enumerate(sorted(found)):
        file_domain = domain or domain_of(path, found[path])
        if file_domain is None:
            unknown.append(path)
        else:
            files.append(InputFile(index, path, file_domain))
    if unknown:
        shown = '\n  '.join(str(p) for p in unknown[:10])
        if len(unknown) > 10:
            shown += f'\n  ... and {len(unknown) - 10} more'
        raise DataPrepError(
            f'cannot tell the domain of {len(unknown)} input file(s):\n  {shown}\n'
            f'Put each file under a folder named after its domain or start its name with "<domain>_" / "<domain>-", '
            f'or force one with --domain. Valid domains: {", ".join(DOMAINS)}'
        )
    return files

"""RedPajama JSONL (.jsonl, .jsonl.gz, .jsonl.zst) -> tokenized, packed MDS shards, one folder per domain and split.

Layout written (behind ``dha-train data prep``)::

    <out>/manifest.json
    <out>/<domain>/train/index.json          merged index: the whole split for streaming.StreamingDataset
    <out>/<domain>/train/<NNNNN>-<stem>/     one MDS sub-folder per input file, in packing order
    <out>/<domain>/val/...                   only when --val-tokens > 0

Packing follows llm-foundry: each document becomes BOS + ids + EOS on a rolling buffer per input file, the buffer
is cut into samples of exactly ``seq_len`` tokens, and the final partial buffer of each file is dropped.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import zstandard
from streaming import MDSWriter
from streaming.base.util import merge_index
from tqdm import tqdm

from dha_train.data.domains import DOMAINS, domain_of
from dha_train.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from dha_train.errors import DhaTrainError, InputNotFoundError, disk_error
from dha_train.paths import check_writable, replace_folder

SPLITS = ('train', 'val')
SUFFIXES = ('.jsonl', '.jsonl.gz', '.jsonl.zst')
TOKENS_COLUMN = 'tokens'
MANIFEST_NAME = 'manifest.json'
MANIFEST_VERSION = 1
# Every shard's hash goes into index.json. xxh64: xxhash is a dependency of mosaicml-streaming itself (no extra
# package), and at about 11 GB/s per core it is ~7x faster than sha1, so checking a shard costs less than reading it
# from disk. These hashes catch corruption (bad copies, truncation, bit rot), not tampering.
SHARD_HASH = 'xxh64'

# Tokenizer batches are bounded by characters too, so a file of whole books does not hold gigabytes at once.
_BATCH_DOCS = 1024
_BATCH_CHARS = 4 << 20
# How many bad line numbers a report quotes per file.
_QUOTED_BAD_LINES = 5


class DataPrepError(DhaTrainError, ValueError):
    """Bad input to data prep: the message names the file (and line) or option at fault."""


def default_workers() -> int:
    return min(8, os.cpu_count() or 1)


def token_dtype_for(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every token id of a vocabulary this size."""
    return 'uint16' if vocab_size <= 1 << 16 else 'uint32'


# ----------------------------------------------------------------------------------------------------------------
# Reading RedPajama JSONL
# ----------------------------------------------------------------------------------------------------------------


def is_jsonl(path: Path) -> bool:
    return path.name.endswith(SUFFIXES)


def _open_binary_lines(path: Path, stack: contextlib.ExitStack) -> IO[bytes]:
    """A binary, line-iterable stream over the decompressed file.

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


def _text_of(line: bytes) -> str:
    """The ``text`` field of one JSONL line; ValueError says why the line is unusable."""
    try:
        record = json.loads(line)
    except UnicodeDecodeError as exc:  # JSON is UTF-8 text (json.loads also takes UTF-16/32 with their BOM or NULs)
        raise ValueError(f'line is not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1}: '
                         f'{exc.reason})') from None
    except ValueError as exc:  # JSONDecodeError
        raise ValueError(f'malformed JSON line ({exc})') from None
    if not isinstance(record, dict) or not isinstance(record.get('text'), str):
        raise ValueError('line has no string "text" field')
    return record['text']


def iter_texts(path: str | Path, skip_bad_lines: bool = False, bad_lines: list[int] | None = None) -> Iterator[str]:
    """Yield the documents' texts of one RedPajama JSONL file in file order.

    Blank lines are ignored. A malformed line raises DataPrepError naming ``path:line``; with ``skip_bad_lines`` it is
    skipped instead and its 1-based line number appended to ``bad_lines``.
    """
    path = Path(path)
    with contextlib.ExitStack() as stack:
        try:
            lines = _open_binary_lines(path, stack)
            for line_number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
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


def _batches(texts: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


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


# ----------------------------------------------------------------------------------------------------------------
# Packing one file (runs in a worker process)
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileJob:
    file: InputFile
    out_root: str  # the temporary output folder
    seq_len: int
    val_samples: int  # leading samples of this file's packed stream that go to val (0 unless first of its domain)
    token_dtype: str
    compression: str | None
    skip_bad_lines: bool

    @property
    def subfolder(self) -> str:
        stem = self.file.path.name
        for suffix in SUFFIXES[::-1]:  # longest first
            stem = stem.removesuffix(suffix)
        return f'{self.file.index:05d}-{re.sub(r"[^A-Za-z0-9._-]", "_", stem)}'


@dataclass
class FileResult:
    index: int
    path: str
    domain: str
    subfolder: str
    input_tokens: int = 0  # ids + BOS + EOS of every document
    samples: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    documents: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))  # by where BOS lands
    dropped_tail_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    skipped_lines: int = 0
    bad_line_numbers: list[int] = field(default_factory=list)  # the first few, for the report
    val_shortfall_samples: int = 0


_worker_tokenizer: Any = None


def _init_worker(tokenizer_path: str, in_pool: bool) -> None:
    """Load the tokenizer once per process (the pool initializer, or called in-process when there is one worker)."""
    global _worker_tokenizer
    if in_pool:  # several processes each running Rust's thread pool would oversubscribe the cores
        os.environ['TOKENIZERS_PARALLELISM'] = 'false'
    _worker_tokenizer = load_tokenizer(tokenizer_path)
    # Whole documents are tokenized and then packed, so the model's context length does not apply; without this,
    # transformers warns about every document longer than it.
    _worker_tokenizer.model_max_length = sys.maxsize


def _pack_file(job: FileJob) -> FileResult:
    """Tokenize, pack and write one input file; the first ``job.val_samples`` samples go to val, the rest to train."""

    tokenizer = _worker_tokenizer
    bos, eos, seq_len = tokenizer.bos_token_id, tokenizer.eos_token_id, job.seq_len
    val_quota_tokens = job.val_samples * seq_len
    result = FileResult(index=job.file.index, path=str(job.file.path), domain=job.file.domain,
                        subfolder=job.subfolder)
    bad_lines: list[int] = []
    buffer: list[int] = []
    written = 0

    with contextlib.ExitStack() as stack:
        writers: dict[str, Any] = {}

        def writer_for(split: str):
            # Created on first sample, so a split this file adds nothing to gets no empty sub-folder.
            if split not in writers:
                folder = Path(job.out_root, job.file.domain, split, job.subfolder)
                writers[split] = stack.enter_context(
                    MDSWriter(out=str(folder), columns={TOKENS_COLUMN: f'ndarray:{job.token_dtype}'},
                              compression=job.compression, hashes=[SHARD_HASH])
                )
            return writers[split]

        texts = iter_texts(job.file.path, job.skip_bad_lines, bad_lines)
        for batch in _batches(texts):
            # split_special_tokens: a literal "<s>" in a web page is text, not a document boundary.
            encoded = tokenizer(batch, add_special_tokens=False, split_special_tokens=True,
                                return_attention_mask=False, return_token_type_ids=False)['input_ids']
            for ids in encoded:
                result.documents['val' if result.input_tokens < val_quota_tokens else 'train'] += 1
                buffer.append(bos)
                buffer.extend(ids)
                buffer.append(eos)
                result.input_tokens += len(ids) + 2
            full = len(buffer) // seq_len
            if full:
                samples = np.asarray(buffer[:full * seq_len], dtype=job.token_dtype).reshape(full, seq_len)
                del buffer[:full * seq_len]
                for sample in samples:
                    writer_for('val' if written < job.val_samples else 'train').write({TOKENS_COLUMN: sample})
                    written += 1

    result.samples['val'] = min(written, job.val_samples)
    result.samples['train'] = written - result.samples['val']
    result.dropped_tail_tokens['val' if written < job.val_samples else 'train'] = len(buffer)
    result.val_shortfall_samples = job.val_samples - result.samples['val']
    result.skipped_lines = len(bad_lines)
    result.bad_line_numbers = bad_lines[:_QUOTED_BAD_LINES]
    return result


# ----------------------------------------------------------------------------------------------------------------
# Orchestration
# ----------------------------------------------------------------------------------------------------------------


def _check_out(out: Path, overwrite: bool, files: list[InputFile], tokenizer: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataPrepError(f'--out {out} exists and is not a folder')
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise DataPrepError(f'output folder {out} already exists and is not empty; pass --overwrite to replace it')
    check_writable(out, '--out', staged=True)  # written as a sibling <out>.tmp-<pid>, renamed into place
    # Replacing --out deletes it, so it must not hold what this run reads.
    resolved = out.resolve()
    for path in [tokenizer.resolve(), *(f.path.resolve() for f in files)]:
        if path == resolved or resolved in path.parents:
            raise DataPrepError(f'--out {out} contains the input {path}; choose an output folder outside the inputs')


def _run_jobs(jobs: list[FileJob], tokenizer_path: str, workers: int, progress: bool) -> list[FileResult]:

    results: list[FileResult] = []
    documents = tokens = 0
    bar = tqdm(total=len(jobs), unit='file', desc='data prep', disable=not progress)
    with bar, contextlib.ExitStack() as stack:
        if workers == 1:  # in-process: no start-up cost, and the tokenizer may use every core
            _init_worker(tokenizer_path, in_pool=False)
            outcomes: Iterator[FileResult] = map(_pack_file, jobs)
        else:
            # spawn: the parent may hold threads (tqdm, torch, Rust) that make fork unsafe.
            pool = stack.enter_context(
                multiprocessing.get_context('spawn').Pool(workers, _init_worker, (tokenizer_path, True))
            )
            # Largest files first, so one big file started last does not leave the other workers idle.
            by_size = sorted(jobs, key=lambda job: job.file.path.stat().st_size, reverse=True)
            outcomes = pool.imap_unordered(_pack_file, by_size)
        try:
            for result in outcomes:
                results.append(result)
                documents += sum(result.documents.values())
                tokens += result.input_tokens
                bar.set_postfix(documents=f'{documents:,}', tokens=f'{tokens:,}')
                bar.update()
        except DataPrepError as exc:
            # Drop the worker's remote traceback: the message already names the file and line.
            raise DataPrepError(str(exc)) from None
    return sorted(results, key=lambda r: r.index)


def _merge_split_indexes(root: Path, results: list[FileResult]) -> None:
    """Write ``<domain>/<split>/index.json`` listing the per-file sub-folders in sorted input order."""

    parts: dict[Path, list[str]] = {}
    for result in sorted(results, key=lambda r: r.index):
        for split in SPLITS:
            if result.samples[split]:
                split_dir = root / result.domain / split
                parts.setdefault(split_dir, []).append(str(split_dir / result.subfolder / 'index.json'))
    for split_dir, index_files in parts.items():
        with _quiet_merge_logs():
            merge_index(index_files, str(split_dir), keep_local=True)


@contextlib.contextmanager
def _quiet_merge_logs() -> Iterator[None]:
    """merge_index warns about its temporary folder and the existing split folder on every call: routine here."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def _build_manifest(results: list[FileResult], *, seq_len: int, tokenizer_path: Path, tokenizer: Any,
                    token_dtype: str, compression: str | None, val_tokens: int, val_samples: int) -> dict[str, Any]:
    domains: dict[str, dict[str, Any]] = {}
    for result in results:
        entry = domains.setdefault(result.domain, {
            'files': 0, 'documents': 0, 'input_tokens': 0, 'skipped_lines': 0,
            'val_samples_requested': val_samples, 'val_shortfall_samples': 0,
            **{split: {'samples': 0, 'tokens': 0, 'files': 0, 'documents': 0, 'dropped_tail_tokens': 0}
               for split in SPLITS},
            'sources': [],
        })
        entry['files'] += 1
        entry['documents'] += sum(result.documents.values())
        entry['input_tokens'] += result.input_tokens
        entry['skipped_lines'] += result.skipped_lines
        entry['val_shortfall_samples'] += result.val_shortfall_samples
        for split in SPLITS:
            stats = entry[split]
            stats['samples'] += result.samples[split]
            stats['tokens'] += result.samples[split] * seq_len
            stats['files'] += result.samples[split] > 0
            stats['documents'] += result.documents[split]
            stats['dropped_tail_tokens'] += result.dropped_tail_tokens[split]
        entry['sources'].append({
            'path': result.path,
            'samples': result.samples,
            'documents': sum(result.documents.values()),
            'input_tokens': result.input_tokens,
            'dropped_tail_tokens': sum(result.dropped_tail_tokens.values()),
            'skipped_lines': result.skipped_lines,
        })
    if val_tokens == 0:
        for entry in domains.values():
            del entry['val']
    return {
        'version': MANIFEST_VERSION,
        'seq_len': seq_len,
        'tokenizer': str(tokenizer_path.resolve()),
        'vocab_size': len(tokenizer),
        'tokenizer_fingerprint': tokenizer_fingerprint(tokenizer),
        'bos_token_id': tokenizer.bos_token_id,
        'eos_token_id': tokenizer.eos_token_id,
        'column': TOKENS_COLUMN,
        'token_dtype': token_dtype,
        'compression': compression,
        'shard_hashes': [SHARD_HASH],
        'val_tokens': val_tokens,
        'domains': dict(sorted(domains.items())),
    }


def _report_and_check(results: list[FileResult], manifest: dict[str, Any], seq_len: int) -> None:
    for result in results:
        if result.skipped_lines:
            lines = ', '.join(map(str, result.bad_line_numbers))
            more = ', ...' if result.skipped_lines > len(result.bad_line_numbers) else ''
            print(f'data prep: skipped {result.skipped_lines} bad line(s) in {result.path} (lines {lines}{more})',
                  file=sys.stderr)
    for domain, entry in manifest['domains'].items():
        if entry['skipped_lines']:
            print(f'data prep: domain {domain}: skipped {entry["skipped_lines"]} bad line(s) in total', file=sys.stderr)
        if entry['val_shortfall_samples']:
            warnings.warn(
                f'VAL SPLIT SHORT for domain {domain}: its first file holds only {entry["val"]["samples"]} of the '
                f'{entry["val_samples_requested"]} requested val samples of {seq_len} tokens '
                f'({entry["val_shortfall_samples"]} missing); use a larger first file or lower --val-tokens',
                stacklevel=3,
            )
        if entry['input_tokens'] == 0:
            paths = [source['path'] for source in entry['sources']]
            shown = ', '.join(paths[:3]) + (f' and {len(paths) - 3} more' if len(paths) > 3 else '')
            raise DataPrepError(f'domain {domain} has no documents: its {len(paths)} file(s) hold none (empty, or '
                                f'every line skipped?): {shown}')
        if entry['train']['samples'] == 0:
            raise DataPrepError(
                f'domain {domain} has no train samples: its {entry["files"]} file(s) hold {entry["input_tokens"]} '
                f'tokens, {entry["val"]["tokens"] if "val" in entry else 0} of them went to val and '
                f'{entry["train"]["dropped_tail_tokens"]} were a dropped tail shorter than --seq-len {seq_len}; '
                f'add data or lower --seq-len / --val-tokens'
            )


def prep_redpajama(
    inputs: Iterable[str | Path],
    out: str | Path,
    tokenizer: str | Path,
    seq_len: int,
    val_tokens: int = 0,
    workers: int | None = None,
    overwrite: bool = False,
    skip_bad_lines: bool = False,
    domain: str | None = None,
    progress: bool = True,
    compression: str | None = None,
) -> dict[str, Any]:
    """Tokenize and pack RedPajama JSONL files into MDS shards per domain and split; returns the manifest.

    ``inputs`` are folders (searched recursively) and/or files. The domain of each file comes from its folder or
    file-name prefix (see ``domain_of``) unless ``domain`` forces one. Per domain, the first ``ceil(val_tokens /
    seq_len)`` samples of the domain's first file (sorted by path) form the val split. ``compression`` is an MDS
    compression name such as ``'zstd'``, or None. ``workers`` defaults to ``min(8, cpu count)``.
    """
    inputs = list(inputs)
    out, tokenizer_path = Path(out).resolve(), Path(tokenizer)
    workers = default_workers() if workers is None else workers
    if seq_len < 1:
        raise DataPrepError(f'--seq-len must be at least 1, got {seq_len}')
    if val_tokens < 0:
        raise DataPrepError(f'--val-tokens must be >= 0, got {val_tokens}')
    if workers < 1:
        raise DataPrepError(f'--workers must be at least 1, got {workers}')

    files = collect_inputs(inputs, domain)
    _check_out(out, overwrite, files, tokenizer_path)
    hf_tokenizer = load_tokenizer(tokenizer_path)
    token_dtype = token_dtype_for(len(hf_tokenizer))
    val_samples = math.ceil(val_tokens / seq_len)

    tmp = out.with_name(f'{out.name}.tmp-{os.getpid()}')
    firsts = {f.domain: f for f in reversed(files)}  # files are sorted, so this keeps each domain's first file
    jobs = [
        FileJob(file=f, out_root=str(tmp), seq_len=seq_len, token_dtype=token_dtype, compression=compression,
                val_samples=val_samples if firsts[f.domain] is f else 0, skip_bad_lines=skip_bad_lines)
        for f in files
    ]
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run whose process id this one reuses
    try:
        tmp.mkdir(parents=True)
        results = _run_jobs(jobs, str(tokenizer_path), min(workers, len(jobs)), progress)
        manifest = _build_manifest(results, seq_len=seq_len, tokenizer_path=tokenizer_path, tokenizer=hf_tokenizer,
                                   token_dtype=token_dtype, compression=compression, val_tokens=val_tokens,
                                   val_samples=val_samples)
        _report_and_check(results, manifest, seq_len)
        _merge_split_indexes(tmp, results)
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + '\n')
        replace_folder(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        error = disk_error(exc, out, note=f'; {out} was left as it was' if out.exists() else '; nothing was written')
        if error is None:
            raise
        raise error from exc
    return manifest


def read_manifest(out: str | Path) -> dict[str, Any]:
    path = Path(out) / MANIFEST_NAME
    if not path.is_file():
        raise InputNotFoundError(f'no {MANIFEST_NAME} in {out}: not a folder written by `dha-train data prep`')
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------------------------
# Command line: `dha-train data prep ...`
# ----------------------------------------------------------------------------------------------------------------

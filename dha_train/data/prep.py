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

import bisect
import contextlib
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
from typing import Any

import numpy as np
from streaming import MDSWriter
from streaming.base.util import merge_index
from tqdm import tqdm

from dha_train.data.redpajama import MAX_LINE_BYTES, SUFFIXES, DataPrepError, InputFile, collect_inputs, iter_texts
from dha_train.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from dha_train.errors import InputNotFoundError, disk_error
from dha_train.paths import check_writable, replace_folder

SPLITS = ('train', 'val')
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


def default_workers() -> int:
    return min(8, os.cpu_count() or 1)


def token_dtype_for(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every token id of a vocabulary this size."""
    return 'uint16' if vocab_size <= 1 << 16 else 'uint32'


# ----------------------------------------------------------------------------------------------------------------
# Packing one file (runs in a worker process)
# ----------------------------------------------------------------------------------------------------------------


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




@dataclass(frozen=True)
class FileJob:
    file: InputFile
    out_root: str  # the temporary output folder
    seq_len: int
    val_samples: int  # leading samples of this file's packed stream that go to val (0 unless first of its domain)
    token_dtype: str
    compression: str | None
    skip_bad_lines: bool
    max_line_bytes: int = MAX_LINE_BYTES

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
    # per val sample, the file's document its first token belongs to: intervals resample documents, not cuts
    val_sample_documents: list[int] = field(default_factory=list)


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
    val_document_starts: list[int] = []  # stream offset of each document's BOS while the val quota is open

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

        texts = iter_texts(job.file.path, job.skip_bad_lines, bad_lines, job.max_line_bytes)
        for batch in _batches(texts):
            # split_special_tokens: a literal "<s>" in a web page is text, not a document boundary.
            encoded = tokenizer(batch, add_special_tokens=False, split_special_tokens=True,
                                return_attention_mask=False, return_token_type_ids=False)['input_ids']
            for ids in encoded:
                result.documents['val' if result.input_tokens < val_quota_tokens else 'train'] += 1
                if result.input_tokens < val_quota_tokens:
                    val_document_starts.append(result.input_tokens)
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
    result.val_sample_documents = [bisect.bisect_right(val_document_starts, sample * seq_len) - 1
                                   for sample in range(result.samples['val'])]
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
        if result.val_sample_documents:  # only a domain's first file holds val samples
            entry['val']['sample_documents'] = result.val_sample_documents
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
    max_line_bytes: int = MAX_LINE_BYTES,
) -> dict[str, Any]:
    """Tokenize and pack RedPajama JSONL files into MDS shards per domain and split; returns the manifest.

    ``inputs`` are folders (searched recursively) and/or files. The domain of each file comes from its folder or
    file-name prefix (see ``domain_of``) unless ``domain`` forces one. Per domain, the first ``ceil(val_tokens /
    seq_len)`` samples of the domain's first file (sorted by path) form the val split. ``compression`` is an MDS
    compression name such as ``'zstd'``, or None. ``workers`` defaults to ``min(8, cpu count)``. A line longer than
    ``max_line_bytes`` is a bad line (``redpajama.iter_texts``).
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
    if max_line_bytes < 1:
        raise DataPrepError(f'--max-line-bytes must be at least 1, got {max_line_bytes}')

    files = collect_inputs(inputs, domain)
    _check_out(out, overwrite, files, tokenizer_path)
    hf_tokenizer = load_tokenizer(tokenizer_path)
    token_dtype = token_dtype_for(len(hf_tokenizer))
    val_samples = math.ceil(val_tokens / seq_len)

    tmp = out.with_name(f'{out.name}.tmp-{os.getpid()}')
    firsts = {f.domain: f for f in reversed(files)}  # files are sorted, so this keeps each domain's first file
    jobs = [
        FileJob(file=f, out_root=str(tmp), seq_len=seq_len, token_dtype=token_dtype, compression=compression,
                val_samples=val_samples if firsts[f.domain] is f else 0, skip_bad_lines=skip_bad_lines,
                max_line_bytes=max_line_bytes)
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

"""The quickstart's embedded corpus: RedPajama-format JSONL built from the Python standard library.

Every machine that runs dha_train has the standard library, so the quickstart needs no download:

- ``github``: the stdlib's ``.py`` sources, one document per file;
- ``wikipedia`` (the prose domain): each module's docstrings (module, classes, functions), one document per module.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from dha_train.data.redpajama import is_jsonl, iter_texts

CODE_DOMAIN, PROSE_DOMAIN = 'github', 'wikipedia'
DEFAULT_MAX_BYTES_PER_DOMAIN = 4_000_000
# Small files let data prep spread the corpus over several worker processes.
MAX_FILE_BYTES = 1_000_000
# Modules documented in fewer characters than this read as stubs, not prose.
MIN_DOCSTRING_CHARS = 200

# Tests, the IDLE app and the retired 2to3 tool are not representative library code; config-* holds build scripts.
_SKIPPED_FOLDERS = {'site-packages', 'dist-packages', 'test', 'tests', 'idlelib', 'lib2to3', '__pycache__'}


def stdlib_sources(stdlib: Path | None = None) -> dict[str, str]:
    """Relative path -> source text of the standard library's modules, sorted by path; undecodable files skipped."""
    stdlib = Path(stdlib or sysconfig.get_paths()['stdlib'])
    sources: dict[str, str] = {}
    for path in sorted(stdlib.rglob('*.py')):
        relative = path.relative_to(stdlib)
        if any(part in _SKIPPED_FOLDERS or part.startswith('config-') for part in relative.parts[:-1]):
            continue
        if relative.name.startswith('_sysconfigdata'):  # this machine's build settings, not library code
            continue
        try:
            sources[relative.as_posix()] = path.read_text(encoding='utf-8')
        except (UnicodeDecodeError, OSError):
            continue
    return sources


def module_docstrings(source: str) -> str:
    """The module's, classes' and functions' docstrings in source order, joined by blank lines ('' if unparsable)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ''
    nodes = [tree] + sorted(
        (n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))),
        key=lambda n: (n.lineno, n.col_offset),
    )
    docstrings = (ast.get_docstring(node, clean=True) for node in nodes)  # clean=True applies inspect.cleandoc
    return '\n\n'.join(d for d in docstrings if d)


def _select(documents: list[tuple[str, dict]], max_bytes: int | None, rng: random.Random) -> list[tuple[str, dict]]:
    """Shuffle the documents and keep those that fit under ``max_bytes`` (UTF-8 bytes of text).

    Shuffling spreads a capped corpus over the whole library rather than its alphabetical start, and puts a
    representative sample at the front, where data prep takes the val split from.
    """
    order = list(documents)
    rng.shuffle(order)
    if max_bytes is None:
        return order
    chosen, total = [], 0
    for text, meta in order:
        size = len(text.encode('utf-8'))
        if total + size <= max_bytes:
            chosen.append((text, meta))
            total += size
    return chosen


def _write_jsonl_files(documents: list[tuple[str, dict]], folder: Path, domain: str) -> list[Path]:
    """Write ``<domain>_stdlib_NNN.jsonl`` files of at most ~MAX_FILE_BYTES each, replacing earlier ones."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f'{domain}_stdlib_*.jsonl'):
        stale.unlink()
    files: list[Path] = []
    chunk: list[str] = []
    chunk_bytes = 0

    def flush() -> None:
        path = folder / f'{domain}_stdlib_{len(files):03d}.jsonl'
        path.write_text(''.join(chunk), encoding='utf-8')
        files.append(path)

    for text, meta in documents:
        line = json.dumps({'text': text, 'meta': meta}, ensure_ascii=False) + '\n'
        size = len(line.encode('utf-8'))
        if chunk and chunk_bytes + size > MAX_FILE_BYTES:
            flush()
            chunk, chunk_bytes = [], 0
        chunk.append(line)
        chunk_bytes += size
    if chunk:
        flush()
    return files


def build_stdlib_corpus(
    out_dir: str | Path,
    max_bytes_per_domain: int | None = DEFAULT_MAX_BYTES_PER_DOMAIN,
    seed: int = 0,
) -> dict[str, dict[str, int]]:
    """Write the stdlib corpus as ``<out_dir>/github/*.jsonl`` and ``<out_dir>/wikipedia/*.jsonl``.

    Deterministic for a given Python installation, ``max_bytes_per_domain`` (None: no cap) and ``seed``.
    Returns per domain: documents, bytes (UTF-8 text bytes) and files.
    """
    out_dir = Path(out_dir)
    sources = stdlib_sources()
    if not sources:
        raise RuntimeError(f'no standard-library sources found under {sysconfig.get_paths()["stdlib"]}')
    code = [(text, {'path': path, 'language': 'Python', 'source': 'python-stdlib'}) for path, text in sources.items()]
    prose = []
    for path, text in sources.items():
        docstrings = module_docstrings(text)
        if len(docstrings) >= MIN_DOCSTRING_CHARS:
            prose.append((docstrings, {'path': path, 'title': _module_name(path), 'source': 'python-stdlib'}))

    stats: dict[str, dict[str, int]] = {}
    for domain, documents in ((CODE_DOMAIN, code), (PROSE_DOMAIN, prose)):
        # One generator per domain: the code selection does not shift the prose selection.
        chosen = _select(documents, max_bytes_per_domain, random.Random(f'{seed}-{domain}'))
        files = _write_jsonl_files(chosen, out_dir / domain, domain)
        stats[domain] = {
            'documents': len(chosen),
            'bytes': sum(len(text.encode('utf-8')) for text, _ in chosen),
            'files': len(files),
        }
    return stats


def _module_name(relative_path: str) -> str:
    name = relative_path.removesuffix('.py').replace('/', '.')
    return name.removesuffix('.__init__')


def iter_corpus_texts(corpus_dir: str | Path) -> Iterator[str]:
    """Every document's text under ``corpus_dir`` (any RedPajama JSONL format), files in sorted path order."""
    for path in sorted(p for p in Path(corpus_dir).rglob('*') if p.is_file() and is_jsonl(p)):
        yield from iter_texts(path)

"""The texts benches score on and no stage trains on, as documents: ``/usr/share/doc``'s plain-text documentation,
vim's help, the Rust book, any folder or glob of HTML and text files; and how they become a held-out split of many
documents (``tokenize_documents``: each capped, each val sequence labelled with its document by `data prep`), so
every loss interval can take documents, not consecutive cuts of one, as its independent units.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import html
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Sequence
from html.parser import HTMLParser
from pathlib import Path

from dha_train.data.prep import prep_redpajama

HELDOUT_DOMAIN = 'book'  # the data folder's label for the held-out text (prep needs one of the RedPajama names)
HELDOUT_SOURCE = Path('/usr/share/doc')
# /usr/share/doc folders about Python would overlap the training corpus (the stdlib's docstrings).
_HELDOUT_SKIP = re.compile(r'python|pip|setuptools|numpy|scipy', re.IGNORECASE)
# The texts benches score on besides /usr/share/doc, as file globs (``text_files``): vim's help files, the validation
# text recipes and conversion defaults are chosen on (`bench fusion`, `bench mla-zero`); the Rust book's chapters (its
# one-page print.html, which repeats every chapter, and its index pages left out), held out from training and choosing.
VALIDATION_GLOB = '/usr/share/vim/vim*/doc/*.txt'
# Two more validation texts of other kinds, for defaults that must hold across texts (`bench mla-zero`): C headers
# (code in another language than the calibration's Python) and npm's bundled Markdown documentation.
HEADERS_GLOB = '/usr/include/**/*.h'
MARKDOWN_GLOB = '/usr/lib/node_modules/**/*.md'
BOOK_GLOB = '~/.rustup/toolchains/*/share/doc/rust/html/book/ch*.html'
_HELDOUT_NAMES = re.compile(r'^(readme|news|changes|changelog|faq|todo|authors|thanks|history|usage|manual)',
                            re.IGNORECASE)


def heldout_documents(root: Path = HELDOUT_SOURCE, max_bytes: int = 2_000_000, seed: int = 0,
                      max_document_chars: int | None = None) -> list[tuple[str, dict]]:
    """Plain-text documentation under ``root`` (READMEs, NEWS, changelogs, .txt/.md/.rst, gzipped or not),
    deduplicated by content, licence/copyright files and Python-related folders left out; shuffled with ``seed``
    (the val split is taken from the front) and capped at ``max_bytes`` of text, each document counted as its first
    ``max_document_chars`` (what ``tokenize_documents`` keeps)."""
    seen, documents = set(), []
    for path in sorted(p for p in root.rglob('*') if p.is_file()):
        relative = path.relative_to(root)
        name = path.name.removesuffix('.gz')
        if _HELDOUT_SKIP.search(relative.parts[0]) or name.lower().startswith(('copyright', 'license', 'licence')):
            continue
        if Path(name).suffix.lower() not in ('.txt', '.md', '.rst') and not _HELDOUT_NAMES.match(name):
            continue
        try:
            raw = gzip.decompress(path.read_bytes()) if path.name.endswith('.gz') else path.read_bytes()
            text = raw.decode('utf-8')
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        digest = hashlib.sha256(raw).hexdigest()
        if len(text) < 500 or digest in seen:
            continue
        seen.add(digest)
        documents.append((text, {'path': str(path), 'source': str(root)}))
    random.Random(seed).shuffle(documents)
    chosen, total = [], 0
    for text, meta in documents:
        if total >= max_bytes:
            break
        chosen.append((text, meta))
        total += len(text[:max_document_chars].encode('utf-8'))
    return chosen


# --- texts any bench scores: HTML pages and plain text files -----------------------------------------------------
class _VisibleText(HTMLParser):
    """An HTML page's visible text, paragraph breaks kept, navigation, scripts and styles left out."""

    HIDDEN = ('script', 'style', 'nav', 'head')
    BLOCKS = ('p', 'pre', 'h1', 'h2', 'h3', 'h4', 'li', 'div', 'tr')

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag, attrs):
        self.hidden += tag in self.HIDDEN

    def handle_endtag(self, tag):
        if tag in self.HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        if tag in self.BLOCKS:
            self.parts.append('\n')

    def handle_data(self, data):
        if not self.hidden:
            self.parts.append(data)


def text_files(where: str) -> list[Path]:
    """The files a text is made of: every file under a folder, or the files a glob (``~`` expanded) matches."""
    where = os.path.expanduser(where)
    if Path(where).is_dir():
        return sorted(p for p in Path(where).rglob('*') if p.is_file())
    return sorted(Path(p) for p in glob.glob(where, recursive=True) if Path(p).is_file())


def text_documents(files: Sequence[Path], min_chars: int = 2000, seed: int = 0) -> list[tuple[str, dict]]:
    """The visible text of every HTML file and the text of every .txt, .md, .rst, .pod, .pm or .h file of at least
    ``min_chars``, deduplicated, shuffled with ``seed`` (the val split is taken from the front, so it is not the first files)."""
    documents, seen = [], set()
    for path in files:
        suffix = path.suffix.lower()
        if suffix not in ('.html', '.htm', '.txt', '.md', '.rst', '.pod', '.pm', '.h'):
            continue
        try:
            raw = path.read_text(encoding='utf-8')
        except (OSError, UnicodeDecodeError):
            continue
        if suffix in ('.html', '.htm'):
            parser = _VisibleText()
            parser.feed(raw)
            raw = html.unescape(''.join(parser.parts))
        text = re.sub(r'\n\s*\n+', '\n\n', raw).strip()
        if len(text) >= min_chars and text not in seen:
            seen.add(text)
            documents.append((text, {'path': str(path)}))
    random.Random(seed).shuffle(documents)
    return documents


# A scored text's independent units are its documents: at least this many in a split for a 95% interval to say
# something beyond them (the figures test holds docs/results to it), none more than a few percent of its tokens.
MIN_DOCUMENTS = 64
DOCUMENTS_PER_SPLIT = 96  # each document capped at this fraction of the split's tokens, so a full split has ~96
MIN_DOCUMENT_TOKENS = 16  # ... but never cut below this many tokens
CHARS_PER_TOKEN = 3.5  # an estimate for English text and code, where no tokenizer has measured it


def share_cap_chars(val_tokens: int, chars_per_token: float = CHARS_PER_TOKEN) -> int:
    """About 1/DOCUMENTS_PER_SPLIT of a split of ``val_tokens``, in characters."""
    return int(chars_per_token * max(MIN_DOCUMENT_TOKENS, val_tokens / DOCUMENTS_PER_SPLIT)) + 1


def measured_chars_per_token(texts: Sequence[str], tokenizer: Path, sample_chars: int = 100_000) -> float:
    """Characters per token of ``tokenizer`` on the first ``sample_chars`` of ``texts``."""
    from dha_train.data.tokenizer import load_tokenizer

    sample, total = [], 0
    for text in texts:
        if total >= sample_chars:
            break
        sample.append(text[:sample_chars - total])
        total += len(sample[-1])
    encode = load_tokenizer(str(tokenizer))
    encode.model_max_length = sys.maxsize  # a sample, not a model input: no length warning
    tokens = sum(len(ids) for ids in encode(sample, add_special_tokens=False)['input_ids'])
    return total / max(tokens, 1)


def document_cap_chars(lengths: Sequence[int], val_tokens: int, chars_per_token: float) -> int | None:
    """The characters kept of each document (of ``lengths`` characters) for a split of ``val_tokens``: about
    1/DOCUMENTS_PER_SPLIT of its tokens, or more where the documents are too few to fill twice the split at that cap
    (the least that does, within a factor of 2; None, no cap, when even whole they do not)."""
    needed = 2 * chars_per_token * val_tokens
    if sum(lengths) <= needed:
        return None
    cap = share_cap_chars(val_tokens, chars_per_token)
    while sum(min(length, cap) for length in lengths) < needed:
        cap *= 2
    return cap


def split_units(domain: dict, say=print) -> dict:
    """How many documents a tokenized val split's sequences come from and the largest one's share of them (from the
    documents `data prep` records for each sequence), printed with a warning under MIN_DOCUMENTS."""
    documents = domain['val'].get('sample_documents') or []
    counts = [documents.count(d) for d in sorted(set(documents))]
    units = {'sequences': len(documents), 'documents': len(counts),
             'largest_document_share': round(max(counts) / len(documents), 4) if counts else None}
    if len(counts) < MIN_DOCUMENTS:
        say(f'warning: the held-out split has {len(counts)} documents (fewer than {MIN_DOCUMENTS}): its intervals '
            'say little beyond them')
    return units


def folder_units(root: Path) -> dict:
    """``split_units`` of a tokenized text folder's val split (the domain of fewest documents), read back from the
    manifest `data prep` wrote: what a results file records of a text scored on."""
    manifest = json.loads((Path(root) / 'manifest.json').read_text())
    units = [split_units(domain, say=lambda message: None) for domain in manifest['domains'].values()
             if domain.get('val', {}).get('sample_documents')]
    return min(units, key=lambda entry: entry['documents']) if units else {'sequences': 0, 'documents': 0}


def tokenize_documents(documents: list[tuple[str, dict]], out: Path, tokenizer: Path, name: str, *, seq_len: int,
                       val_tokens: int, say=print) -> dict:
    """``documents`` as one JSONL file under the held-out domain label, each cut to ``document_cap_chars`` (so the split's sequences come from many documents: a few long ones would fill it
    alone, and their consecutive cuts are not independent), tokenized into ``out / 'data'`` with a val split of ``val_tokens``; the JSONL is removed
    after. Returns that domain's manifest, with ``units`` (``split_units``)."""
    corpus = out / 'corpus' / HELDOUT_DOMAIN
    corpus.mkdir(parents=True, exist_ok=True)
    chars_per_token = measured_chars_per_token([text for text, _ in documents], tokenizer)
    cap = document_cap_chars([len(text) for text, _ in documents], val_tokens, chars_per_token)
    with (corpus / f'{name}.jsonl').open('w', encoding='utf-8') as handle:
        for text, meta in documents:
            handle.write(json.dumps({'text': text[:cap], 'meta': meta}, ensure_ascii=False) + '\n')
    manifest = prep_redpajama([out / 'corpus'], out / 'data', tokenizer, seq_len=seq_len, val_tokens=val_tokens,
                              overwrite=True, domain=HELDOUT_DOMAIN, progress=False)
    shutil.rmtree(out / 'corpus')
    domain = manifest['domains'][HELDOUT_DOMAIN]
    return {**domain, 'units': {**split_units(domain, say), 'document_cap_chars': cap,
                                'chars_per_token': round(chars_per_token, 3)}}

"""Data prep: RedPajama JSONL(.gz/.zst) -> packed MDS per domain, checked against an independent tokenization."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import zstandard

from dha_train.commands.data_prep import add_prep_arguments, run_prep_from_args
from dha_train.data.corpus import build_stdlib_corpus, iter_corpus_texts
from dha_train.data.prep import DataPrepError, iter_texts, prep_redpajama, read_manifest, token_dtype_for
from dha_train.data.tokenizer import BOS_TOKEN, EOS_TOKEN, train_byte_level_bpe

SEQ_LEN = 64
VAL_TOKENS = 100  # -> ceil(100 / 64) = 2 val samples per domain
VAL_SAMPLES = math.ceil(VAL_TOKENS / SEQ_LEN)

# Each domain is recognised a different way: by folder (github), by nested folder (github/sub), by file-name
# prefix with "_", "-" and "." separators (arxiv, wikipedia), and by a folder again with a multi-frame .zst (book).
SAMPLE_FILES = {
    'github/part-000.jsonl': 'github',
    'github/sub/part-001.jsonl.gz': 'github',
    'mixed/arxiv_000.jsonl.zst': 'arxiv',
    'mixed/arxiv-001.jsonl': 'arxiv',
    'mixed/wikipedia.000.jsonl.gz': 'wikipedia',
    'mixed/wikipedia_001.jsonl.zst': 'wikipedia',
    'book/b.jsonl.zst': 'book',
    'book/c.jsonl': 'book',
}

_WORDS = [
    'the', 'model', 'attention', 'head', 'Straße', 'naïve', 'café', '日本語', 'данные', 'λόγος', '🙂', 'x = 1;',
    'def f(a):', 'return', '{"k": [1, 2]}', 'mixed-Case', '  indented', 'tab\tseparated', '€100', '<s>', '</s>',
]


def _random_text(rng: random.Random) -> str:
    n_words = rng.choice([1, 5, 30, 120, 400])
    return ''.join(rng.choice(_WORDS) + rng.choice([' ', ' ', '\n', '']) for _ in range(n_words)).strip()


def _write_lines(path: Path, lines: list[str]) -> None:
    """Write text lines, compressed by suffix; a .zst file gets two frames, as RedPajama's sometimes have."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = ''.join(line + '\n' for line in lines).encode('utf-8')
    if path.name.endswith('.gz'):
        path.write_bytes(gzip.compress(data))
    elif path.name.endswith('.zst'):
        half = len(data) // 2
        compressor = zstandard.ZstdCompressor()
        path.write_bytes(compressor.compress(data[:half]) + compressor.compress(data[half:]))
    else:
        path.write_bytes(data)


def _record(text: str, index: int) -> str:
    return json.dumps({'text': text, 'meta': {'index': index}}, ensure_ascii=False)


def _redpajama_sample(root: Path, seed: int = 0) -> dict[Path, list[str]]:
    """Write SAMPLE_FILES under ``root``; returns each file's documents (blank lines in the files are not documents)."""
    rng = random.Random(seed)
    documents: dict[Path, list[str]] = {}
    for relative in SAMPLE_FILES:
        texts = [_random_text(rng) for _ in range(rng.randint(15, 30))]
        texts[3] = ''  # an empty document is still BOS + EOS
        lines = [_record(text, i) for i, text in enumerate(texts)]
        lines.insert(5, '   ')  # whitespace-only lines are ignored, not errors
        lines.insert(9, '')
        documents[root / relative] = texts
        _write_lines(root / relative, lines)
    return documents


class _Reference:
    """The packing a correct prep must produce, computed with the raw `tokenizers` library rather than HF's wrapper."""

    def __init__(self, tokenizer_dir: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / 'tokenizer.json'))
        self.tokenizer.encode_special_tokens = True  # a literal "<s>" in a document is text
        self.bos = self.tokenizer.token_to_id(BOS_TOKEN)
        self.eos = self.tokenizer.token_to_id(EOS_TOKEN)

    def stream(self, texts: list[str]) -> list[int]:
        """The whole packed stream of one file, before cutting: BOS + ids + EOS per document."""
        stream: list[int] = []
        for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False):
            stream += [self.bos, *encoding.ids, self.eos]
        return stream

    def split_documents(self, stream: list[int]) -> tuple[list[str], list[int]]:
        """Decode the complete BOS..EOS documents of a stream; also return the ids of a trailing partial one."""
        texts: list[str] = []
        start = 0
        while start < len(stream):
            assert stream[start] == self.bos, f'expected BOS at {start}'
            if self.eos not in stream[start + 1:]:
                return texts, stream[start + 1:]
            end = stream.index(self.eos, start + 1)
            ids = stream[start + 1:end]
            assert self.bos not in ids
            texts.append(self.tokenizer.decode(ids, skip_special_tokens=False))
            start = end + 1
        return texts, []


def _read_split(split_dir: Path) -> np.ndarray:
    """All samples of a split in order, read the way training reads them."""
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=str(split_dir), shuffle=False, batch_size=1)
    return np.stack([dataset[i]['tokens'] for i in range(len(dataset))])


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob('*')) if p.is_file()}


@pytest.fixture(scope='module')
def sample(tmp_path_factory) -> dict:
    """A RedPajama sample, a 512-token BPE trained on it, and one prep of it through a 2-process pool."""
    base = tmp_path_factory.mktemp('prep')
    documents = _redpajama_sample(base / 'redpajama')
    tokenizer_dir = base / 'tokenizer'
    train_byte_level_bpe((t for texts in documents.values() for t in texts), tokenizer_dir, vocab_size=512)
    out = base / 'mds'
    manifest = prep_redpajama([base / 'redpajama'], out, tokenizer_dir, SEQ_LEN, val_tokens=VAL_TOKENS, workers=2,
                              progress=False)
    return {'base': base, 'documents': documents, 'tokenizer': tokenizer_dir, 'out': out, 'manifest': manifest,
            'reference': _Reference(tokenizer_dir)}


def _files_of(sample: dict, domain: str) -> list[Path]:
    return sorted(p for p, d in ((sample['base'] / 'redpajama' / r, d) for r, d in SAMPLE_FILES.items()) if d == domain)


def test_manifest_token_counts_match_closed_form(sample):
    manifest, reference = sample['manifest'], sample['reference']
    assert read_manifest(sample['out']) == manifest
    assert manifest['seq_len'] == SEQ_LEN
    assert manifest['token_dtype'] == 'uint16'
    assert manifest['vocab_size'] == 512
    assert (manifest['bos_token_id'], manifest['eos_token_id']) == (reference.bos, reference.eos)
    assert sorted(manifest['domains']) == sorted(set(SAMPLE_FILES.values()))
    for domain, entry in manifest['domains'].items():
        lengths = [len(reference.stream(sample['documents'][path])) for path in _files_of(sample, domain)]
        assert entry['input_tokens'] == sum(lengths)
        assert entry['documents'] == sum(len(sample['documents'][p]) for p in _files_of(sample, domain))
        assert entry['train']['samples'] + entry['val']['samples'] == sum(n // SEQ_LEN for n in lengths)
        assert entry['train']['tokens'] + entry['val']['tokens'] == sum(n // SEQ_LEN * SEQ_LEN for n in lengths)
        assert entry['train']['dropped_tail_tokens'] + entry['val']['dropped_tail_tokens'] == sum(
            n % SEQ_LEN for n in lengths)
        assert entry['val']['samples'] == VAL_SAMPLES and entry['val_shortfall_samples'] == 0
        assert entry['skipped_lines'] == 0


def test_mds_samples_decode_back_to_the_source_documents(sample):
    reference, manifest = sample['reference'], sample['manifest']
    for domain in manifest['domains']:
        val = _read_split(sample['out'] / domain / 'val')
        train = _read_split(sample['out'] / domain / 'train')
        assert val.dtype == np.uint16 and val.shape == (VAL_SAMPLES, SEQ_LEN)
        assert len(train) == manifest['domains'][domain]['train']['samples']
        # Train samples follow the sorted input files; the first file's stream continues right after val.
        per_file = [val.reshape(-1).tolist()] + [[] for _ in _files_of(sample, domain)[1:]]
        offset = 0
        for i, path in enumerate(_files_of(sample, domain)):
            expected = reference.stream(sample['documents'][path])
            n_train = len(expected) // SEQ_LEN - (VAL_SAMPLES if i == 0 else 0)
            per_file[i] += train[offset:offset + n_train].reshape(-1).tolist()
            offset += n_train
        assert offset == len(train)

        for path, stream in zip(_files_of(sample, domain), per_file):
            expected = reference.stream(sample['documents'][path])
            assert len(expected) - len(stream) < SEQ_LEN  # only the tail is dropped
            assert stream == expected[:len(stream)]
            texts, partial = reference.split_documents(stream)
            source = sample['documents'][path]
            assert texts == source[:len(texts)]
            if len(texts) < len(source):
                assert partial == reference.stream([source[len(texts)]])[1:len(partial) + 1]


def test_manifest_split_documents_and_files_match_the_mds(sample):
    reference = sample['reference']
    for domain, entry in sample['manifest']['domains'].items():
        first = _files_of(sample, domain)[0]
        positions, position = [], 0  # where each document's BOS lands in the first file's stream
        for text in sample['documents'][first]:
            positions.append(position)
            position += len(reference.stream([text]))
        val_docs = sum(p < VAL_SAMPLES * SEQ_LEN for p in positions)
        assert entry['val']['documents'] == val_docs
        # each val sample's document: the last one whose BOS is at or before the sample's first token
        assert entry['val']['sample_documents'] == [max(d for d, p in enumerate(positions) if p <= k * SEQ_LEN)
                                                    for k in range(VAL_SAMPLES)]
        assert entry['train']['documents'] == entry['documents'] - val_docs
        assert entry['val']['files'] == 1 and entry['train']['files'] == len(_files_of(sample, domain))
        assert [s['path'] for s in entry['sources']] == [str(p.resolve()) for p in _files_of(sample, domain)]

        # The merged index lists the per-file sub-folders in sorted input order.
        index = json.loads((sample['out'] / domain / 'train' / 'index.json').read_text())
        folders = [shard['raw_data']['basename'].split('/')[0] for shard in index['shards']]
        assert folders == sorted(folders) and len(set(folders)) == len(_files_of(sample, domain))


def test_pool_and_in_process_runs_write_identical_bytes(sample, tmp_path):
    out = tmp_path / 'again'
    prep_redpajama([sample['base'] / 'redpajama'], out, sample['tokenizer'], SEQ_LEN, val_tokens=VAL_TOKENS,
                   workers=1, progress=False)
    assert _tree_bytes(out) == _tree_bytes(sample['out'])


@pytest.mark.parametrize('name, workers', [('arxiv_bad.jsonl', 1), ('arxiv_bad.jsonl.gz', 2)])
def test_malformed_line_names_file_and_line(sample, tmp_path, name, workers):
    lines = [_record('fine', 0), '', _record('also fine', 1), '{"text": "cut off', _record('after', 2)]
    _write_lines(tmp_path / 'in' / name, lines)
    _write_lines(tmp_path / 'in' / 'arxiv_good.jsonl', [_record('x' * 50, 0)])
    with pytest.raises(DataPrepError, match=rf'{name}:4: malformed JSON line'):
        prep_redpajama([tmp_path / 'in'], tmp_path / 'out', sample['tokenizer'], 8, workers=workers, progress=False)
    assert not (tmp_path / 'out').exists()
    assert [p.name for p in tmp_path.iterdir()] == ['in']  # no temporary folder left behind


def test_line_without_text_is_an_error(tmp_path):
    _write_lines(tmp_path / 'c4_0.jsonl', [_record('ok', 0), json.dumps({'meta': {}})])
    with pytest.raises(DataPrepError, match=r'c4_0.jsonl:2: line has no string "text" field'):
        list(iter_texts(tmp_path / 'c4_0.jsonl'))


def test_skip_bad_lines_skips_and_counts(sample, tmp_path, capsys):
    good = [_random_text(random.Random(i)) for i in range(12)]
    lines = [_record(t, i) for i, t in enumerate(good)]
    lines[2:2] = ['not json', '{"text": 5}']
    _write_lines(tmp_path / 'in' / 'c4-000.jsonl.gz', lines)
    manifest = prep_redpajama([tmp_path / 'in'], tmp_path / 'out', sample['tokenizer'], 16, skip_bad_lines=True,
                              workers=1, progress=False)
    entry = manifest['domains']['c4']
    assert entry['skipped_lines'] == 2 and entry['sources'][0]['skipped_lines'] == 2
    assert entry['documents'] == len(good)
    assert entry['input_tokens'] == len(sample['reference'].stream(good))
    err = capsys.readouterr().err
    assert 'skipped 2 bad line(s)' in err and '(lines 3, 4)' in err


def test_refuses_to_overwrite_then_replaces(sample, tmp_path):
    _write_lines(tmp_path / 'in' / 'github' / 'a.jsonl', [_record('print(1)\n' * 40, 0)])
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'keep.txt').write_text('old')
    with pytest.raises(DataPrepError, match=rf'{out}.*--overwrite'):
        prep_redpajama([tmp_path / 'in'], out, sample['tokenizer'], 8, workers=1, progress=False)
    assert (out / 'keep.txt').read_text() == 'old'

    # A failing run with overwrite=True leaves the old output alone.
    _write_lines(tmp_path / 'in' / 'github' / 'b.jsonl', ['{broken'])
    with pytest.raises(DataPrepError, match='b.jsonl:1'):
        prep_redpajama([tmp_path / 'in'], out, sample['tokenizer'], 8, workers=1, overwrite=True, progress=False)
    assert (out / 'keep.txt').read_text() == 'old'

    (tmp_path / 'in' / 'github' / 'b.jsonl').unlink()
    prep_redpajama([tmp_path / 'in'], out, sample['tokenizer'], 8, workers=1, overwrite=True, progress=False)
    assert not (out / 'keep.txt').exists() and (out / 'manifest.json').is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['in', 'out']


def test_unknown_domain_is_an_early_error(sample, tmp_path):
    _write_lines(tmp_path / 'in' / 'misc' / 'notes.jsonl', [_record('hello', 0)])
    with pytest.raises(DataPrepError, match=r'notes\.jsonl[\s\S]*arxiv, book, c4, common_crawl'):
        prep_redpajama([tmp_path / 'in'], tmp_path / 'out', sample['tokenizer'], 8, workers=1, progress=False)
    assert not (tmp_path / 'out').exists()
    manifest = prep_redpajama([tmp_path / 'in'], tmp_path / 'out', sample['tokenizer'], 1, domain='stackexchange',
                              workers=1, progress=False)
    assert list(manifest['domains']) == ['stackexchange']


def test_no_input_files_is_an_error(sample, tmp_path):
    (tmp_path / 'empty').mkdir()
    with pytest.raises(DataPrepError, match='no .*files found'):
        prep_redpajama([tmp_path / 'empty'], tmp_path / 'out', sample['tokenizer'], 8, progress=False)


def test_short_first_file_warns_and_records_val_shortfall(sample, tmp_path):
    _write_lines(tmp_path / 'in' / 'book' / 'a.jsonl', [_record('', 0)])  # BOS + EOS: 1 of 2 val samples
    _write_lines(tmp_path / 'in' / 'book' / 'b.jsonl', [_record('many words ' * 30, 0)])
    with pytest.warns(UserWarning, match='VAL SPLIT SHORT for domain book'):
        manifest = prep_redpajama([tmp_path / 'in'], tmp_path / 'out', sample['tokenizer'], 2, val_tokens=4,
                                  workers=1, progress=False)
    entry = manifest['domains']['book']
    assert entry['val_samples_requested'] == 2 and entry['val']['samples'] == 1
    assert entry['val_shortfall_samples'] == 1
    assert entry['train']['samples'] > 0


def test_domain_without_train_samples_is_an_error(sample, tmp_path):
    _write_lines(tmp_path / 'in' / 'arxiv_0.jsonl', [_record('short', 0)])
    with pytest.raises(DataPrepError, match='domain arxiv has no train samples'):
        prep_redpajama([tmp_path / 'in'], tmp_path / 'out', sample['tokenizer'], 512, workers=1, progress=False)
    assert not (tmp_path / 'out').exists()


def test_command_line_options(sample, tmp_path, capsys):
    parser = add_prep_arguments(argparse.ArgumentParser())
    args = parser.parse_args(['--input', str(sample['base'] / 'redpajama' / 'book'), '--out', str(tmp_path / 'o'),
                              '--tokenizer', str(sample['tokenizer']), '--seq-len', '32', '--val-tokens', '32',
                              '--workers', '1', '--compression', 'zstd'])
    manifest = run_prep_from_args(args)
    assert manifest['compression'] == 'zstd' and manifest['domains']['book']['val']['samples'] == 1
    assert 'book' in capsys.readouterr().out
    assert len(_read_split(tmp_path / 'o' / 'book' / 'train')) == manifest['domains']['book']['train']['samples']


def test_token_dtype_fits_the_vocabulary():
    assert token_dtype_for(65536) == 'uint16'
    assert token_dtype_for(65537) == 'uint32'


def test_stdlib_corpus_is_deterministic_capped_and_has_both_domains(tmp_path):
    cap = 150_000
    stats = build_stdlib_corpus(tmp_path / 'a', max_bytes_per_domain=cap, seed=3)
    build_stdlib_corpus(tmp_path / 'b', max_bytes_per_domain=cap, seed=3)
    assert _tree_bytes(tmp_path / 'a') == _tree_bytes(tmp_path / 'b')
    assert set(stats) == {'github', 'wikipedia'}
    for domain, domain_stats in stats.items():
        texts = list(iter_corpus_texts(tmp_path / 'a' / domain))
        assert len(texts) == domain_stats['documents'] > 5
        assert sum(len(t.encode('utf-8')) for t in texts) == domain_stats['bytes'] <= cap
        assert domain_stats['bytes'] > cap // 2  # the cap is used, not just respected
    code = [json.loads(line) for line in (tmp_path / 'a' / 'github' / 'github_stdlib_000.jsonl').open()]
    assert all(r['meta']['language'] == 'Python' and r['meta']['path'].endswith('.py') for r in code)
    assert not any({'test', 'tests', 'idlelib', 'lib2to3'} & set(Path(r['meta']['path']).parts) for r in code)
    assert all(len(text) >= 200 for text in iter_corpus_texts(tmp_path / 'a' / 'wikipedia'))
    # A capped corpus samples the whole library, not just its alphabetical start.
    assert sorted(r['meta']['path'] for r in code) != [r['meta']['path'] for r in code]


def test_the_stdlib_corpus_command_writes_what_data_prep_reads_and_refuses_a_used_folder(tmp_path, tokenizer_dir,
                                                                                         capsys):
    """`dha-train data corpus` (the first-hour data with no download) writes both domains as JSONL that `data prep`
    tokenizes, within the byte cap; a folder with files in it is refused."""
    from dha_train.cli import main
    from dha_train.data.prep import prep_redpajama
    assert main(['data', 'corpus', str(tmp_path / 'corpus'), '--max-bytes', '40000']) == 0
    for domain in ('github', 'wikipedia'):
        texts = [json.loads(line)['text'] for path in (tmp_path / 'corpus' / domain).glob('*.jsonl')
                 for line in path.read_text().splitlines()]
        assert texts and sum(len(text.encode()) for text in texts) <= 40000
    prep_redpajama([tmp_path / 'corpus'], tmp_path / 'data', tokenizer_dir, seq_len=64, val_tokens=0, workers=1,
                   progress=False)
    assert sorted(json.loads((tmp_path / 'data' / 'manifest.json').read_text())['domains']) == ['github', 'wikipedia']
    assert main(['data', 'corpus', str(tmp_path / 'corpus')]) == 2
    assert 'is not empty' in capsys.readouterr().err

"""Bad input, end to end: every case runs the command a user would type, in this process (`dha_train.cli.main`, or
`dha_train.train.main` for `python -m dha_train.train RECIPE`), and must end with exit status 2 and exactly one line
on stderr, ``dha-train: error: ...``, naming what is wrong; no traceback; and every file the case set up (inputs, old
outputs, save folders) byte for byte as it was, with no temporary folder left behind.

docs/bad-input.md lists these cases; ``pytest tests/test_bad_input.py -s`` prints each message as a table row.

Full disk and read-only folders are real: a 64 KiB tmpfs, and a tmpfs remounted read-only (mounting needs root;
without it the read-only cases use a chmod 555 folder and the full-disk cases are skipped). A SIGTERM during a save
is the one case that needs a process of its own (``test_sigterm_during_a_save_...``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from dha_train.checkpoints import LATEST, check_checkpoint
from dha_train.model_card import RUN_RECORD
from helpers import REPO, TINY_MAP, latest_checkpoint_batch, tiny_recipe, write_recipe, write_redpajama_jsonl

GITHUB_SHARD = Path('github', 'train', '00000-github_0', 'shard.00000.mds')
# tqdm's progress bar (data prep) draws on stderr, frames separated by carriage returns; it is not an error line.
_PROGRESS_FRAME = re.compile(r'^data prep: +\d+%\|')


# ----------------------------------------------------------------------------------------------------------------
# Shared inputs: one real checkpoint, one tiny MHA folder, data tokenized with another tokenizer
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def trained(tmp_path_factory, data_root, tokenizer_dir) -> Path:
    """The save folder of a real 1-batch run: ep0-ba1-rank0.pt and latest-rank0.pt -> it."""
    from dha_train.config import load_config
    from dha_train.train import close_trainer, train

    folder = tmp_path_factory.mktemp('trained') / 'ckpt'
    close_trainer(train(load_config(tiny_recipe(data_root, tokenizer_dir, max_duration='1ba', save_interval='1ba',
                                                save_folder=str(folder), run_name='bad-input'))))
    assert os.readlink(folder / LATEST) == 'ep0-ba1-rank0.pt'
    return folder


@pytest.fixture(scope='module')
def mha_dir(tmp_path_factory) -> Path:
    """A tiny MHA LLaMA folder: 2 layers, 4 heads of 16."""
    folder = tmp_path_factory.mktemp('mha') / 'mha'
    LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4,
                                 max_position_embeddings=64)).save_pretrained(folder)
    return folder


@pytest.fixture(scope='module')
def other_data(tmp_path_factory) -> Path:
    """A data folder written by data prep with another 384-token tokenizer than the session's."""
    from dha_train.data.prep import prep_redpajama
    from dha_train.data.tokenizer import train_byte_level_bpe

    root = tmp_path_factory.mktemp('other')
    train_byte_level_bpe(['zebra quartz jumps over the lazy vexing fjord ' * 20, 'sphinx of black quartz'] * 40,
                         root / 'tokenizer', vocab_size=384)
    raw = write_redpajama_jsonl(root / 'raw', docs_per_domain=40)
    prep_redpajama([raw], root / 'data', root / 'tokenizer', seq_len=64, workers=1, progress=False)
    return root / 'data'


# ----------------------------------------------------------------------------------------------------------------
# Read-only folders and a full disk
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _mounts():
    """Mount tmpfs file systems; every one is unmounted (and chmod'ed folders restored) on the way out."""
    mounted: list[Path] = []
    chmodded: list[Path] = []

    def mount(path: Path, *, size: str = '64k', read_only: bool = False,
              fill: Callable[[Path], None] | None = None) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            if not read_only:
                pytest.skip('a full disk is a 64 KiB tmpfs, and mounting one needs root')
            if fill is not None:
                fill(path)
            path.chmod(0o555)  # root would ignore this; anyone else cannot write the folder
            chmodded.append(path)
            return path
        done = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f'cannot mount a tmpfs here: {done.stderr.strip()}')
        mounted.append(path)
        if fill is not None:
            fill(path)
        if read_only:
            subprocess.run(['mount', '-o', 'remount,ro', str(path)], check=True)
        return path

    try:
        yield mount
    finally:
        for path in reversed(mounted):
            if subprocess.run(['umount', str(path)], capture_output=True).returncode:
                subprocess.run(['umount', '-l', str(path)], check=True)
        for path in chmodded:
            path.chmod(0o755)


# ----------------------------------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    tmp: Path
    data_root: Path
    tokenizer_dir: Path
    request: pytest.FixtureRequest
    mount: Callable[..., Path]
    watched: list[Path] = field(default_factory=list)  # shared inputs the case reads: also must not change

    def fixture(self, name: str) -> Path:
        path = self.request.getfixturevalue(name)
        self.watched.append(path)
        return path

    def recipe(self, *overrides: str, **top_level) -> list[str]:
        """`python -m dha_train.train` arguments: the tiny recipe (with ``top_level`` keys replaced) + overrides."""
        recipe = tiny_recipe(self.data_root, self.tokenizer_dir, **top_level)
        return [str(write_recipe(self.tmp / 'recipe.yaml', recipe)), *overrides]

    def copy(self, source: Path, name: str) -> Path:
        target = self.tmp / name
        shutil.copytree(source, target, symlinks=True)
        return target

    def prep(self, *extra: str, inputs: Path | None = None, out: Path | None = None,
             tokenizer: Path | None = None) -> list[str]:
        """`dha-train data prep` arguments; the inputs default to two domains of 300 documents (~190 KB)."""
        if inputs is None:
            inputs = write_redpajama_jsonl(self.tmp / 'raw')
        return ['data', 'prep', '--input', str(inputs), '--out', str(out or self.tmp / 'out'), '--tokenizer',
                str(tokenizer or self.tokenizer_dir), '--seq-len', '64', '--workers', '1', *extra]


@dataclass(frozen=True)
class Case:
    name: str  # the docs/bad-input.md table's "bad input"
    entry: str  # 'dha-train' (dha_train.cli.main) or 'train' (dha_train.train.main)
    setup: Callable[[Ctx], list[str]]  # builds the bad input under ctx.tmp; returns the command's arguments
    expected: str  # a fragment of the message; {tmp} is the case's folder


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _gqa_of(ctx) -> Path:
    """A mean-pool conversion of the tiny MHA folder (2 of its 4 K/V heads)."""
    from dha_train.conversion.mean_pool import convert_checkpoint
    from dha_train.models.head_map import HeadMap

    return convert_checkpoint(ctx.fixture('mha_dir'), ctx.tmp / 'gqa', HeadMap.gqa(2, 4, 2, 16))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _jsonl(ctx: Ctx, content: bytes) -> Path:
    path = ctx.tmp / 'raw' / 'c4' / 'c4_0.jsonl'
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    return ctx.tmp / 'raw'


def _file(ctx: Ctx, name: str, content: str | bytes) -> Path:
    path = ctx.tmp / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _head_map_json(ctx: Ctx, text: str) -> Path:
    return _file(ctx, 'head_map.json', text)


def _wrong_layers_map(ctx: Ctx) -> Path:
    return TINY_MAP.save(ctx.tmp / 'head_map.json')  # 2 layers; the recipe's model gets 3


def _six_head_map(ctx: Ctx) -> Path:
    layer = {'key': [0, 0, 1, 1, 2, 2], 'value': [0, 0, 1, 1, 2, 2]}
    return _head_map_json(ctx, json.dumps({'head_dim': 16, 'layers': [layer, layer]}))


def _old_output(folder: Path) -> Path:
    """A folder holding what a previous run left: the failed run must not touch it."""
    folder.mkdir()
    (folder / 'keep.txt').write_text('the previous output\n')
    return folder


def _save_folder_with_a_torn_checkpoint(ctx: Ctx) -> list[str]:
    """A save killed mid-write by Composer 0.32.1 (before dha-train renamed checkpoints into place) left a torn
    ep0-ba2-rank0.pt beside the intact ba1 that latest-rank0.pt names."""
    folder = ctx.copy(ctx.fixture('trained'), 'ckpt')
    shutil.copy(folder / 'ep0-ba1-rank0.pt', folder / 'ep0-ba2-rank0.pt')
    _truncate(folder / 'ep0-ba2-rank0.pt')
    return ctx.recipe(save_folder=str(folder), run_name='bad-input', autoresume=True)


CASES = [
    # --- the recipe (YAML) and its overrides ---------------------------------------------------------------------
    Case('unknown key in the recipe (a typo)', 'train',
         lambda ctx: ctx.recipe(max_durration='2ba'),
         "unknown config key 'max_durration'; did you mean 'max_duration'?"),
    Case('unknown key in a key=value override', 'train',
         lambda ctx: ctx.recipe('optimizer.lrr=0.1'),
         "unknown config key 'optimizer.lrr'; did you mean 'lr'?"),
    Case('value of the wrong type', 'train',
         lambda ctx: ctx.recipe(global_train_batch_size='eight'),
         "global_train_batch_size: must be int, got str 'eight'"),
    Case('duration that is not a Composer time string', 'train',
         lambda ctx: ctx.recipe(max_duration='5 bananas'),
         "max_duration: '5 bananas' is not a Composer time string"),
    Case('override without "="', 'train',
         lambda ctx: ctx.recipe('optimizer.lr'),
         "overrides must look like key=value, got: ['optimizer.lr']"),
    Case('recipe file that does not exist', 'train',
         lambda ctx: [str(ctx.tmp / 'nope.yaml')],
         'config file not found: {tmp}/nope.yaml'),
    Case('recipe that is not valid YAML', 'train',
         lambda ctx: [str(_file(ctx, 'r.yaml', 'max_duration: [2ba\nseed: 1\n'))],
         "{tmp}/r.yaml: not valid YAML: did not find expected ',' or ']' at line 2, column 5"),
    Case('recipe that is not UTF-8', 'train',
         lambda ctx: [str(_file(ctx, 'r.yaml', b'seed: caf\xe9\n'))],
         '{tmp}/r.yaml: not UTF-8 text (byte 0xe9: invalid continuation byte)'),
    # --- model, tokenizer, head map ---------------------------------------------------------------------------------
    Case('model vocabulary smaller than its tokenizer', 'train',
         lambda ctx: ctx.recipe('model.config.vocab_size=100'),
         'has 384 tokens but the model has vocab_size=100'),
    Case('head map JSON that is malformed', 'train',
         lambda ctx: ctx.recipe(algorithms={'head_fusion': {'head_map': str(_head_map_json(ctx, '{"layers": ['))}}),
         'algorithms.head_fusion: head map {tmp}/head_map.json is not a head map JSON file (Expecting value'),
    Case('head map of another model (2 layers for 3)', 'train',
         lambda ctx: ctx.recipe('model.config.num_hidden_layers=3',
                                algorithms={'head_fusion': {'head_map': str(_wrong_layers_map(ctx))}}),
         'head map does not fit the model: 2 layers vs num_hidden_layers=3'),
    Case('head map of another model (6 heads for 4)', 'dha-train',
         lambda ctx: ['convert', str(ctx.fixture('mha_dir')), str(ctx.tmp / 'out'), '--head-map',
                      str(_six_head_map(ctx))],
         'head map does not fit the model: 6 query heads vs num_attention_heads=4'),
    Case('KV budget that is not a whole number of heads', 'dha-train',
         lambda ctx: ['search', str(ctx.fixture('mha_dir')), str(ctx.tmp / 'out'), '--method', 'neighbour',
                      '--kv-budget', '0.3'],
         'search: kv_budget 0.3 of the 4 K/V heads of each layer is 1.2 heads, not a whole number; use a multiple '
         'of 1/4 (0.25)'),
    Case('KV budget out of range', 'dha-train',
         lambda ctx: ['search', str(ctx.fixture('mha_dir')), str(ctx.tmp / 'out'), '--method', 'neighbour',
                      '--kv-budget', '1.5'],
         'search: kv_budget must be in (0, 1], got 1.5'),
    Case('more KV heads than the source has', 'dha-train',
         lambda ctx: ['convert', str(ctx.fixture('mha_dir')), str(ctx.tmp / 'out'), '--kv-heads', '5'],
         '--kv-heads 5: 5 K/V heads per layer: the source has 4, so give 1..4'),
    # --- training data ---------------------------------------------------------------------------------------------
    Case('a domain the data does not have', 'train',
         lambda ctx: ctx.recipe(train_loader={'root': str(ctx.data_root), 'streams': {'arxiv': {}}}),
         "train_loader.streams.arxiv: no MDS index at '{data_root}/arxiv/train/index.json' (domains with a 'train' "
         "split under {data_root}: ['github', 'wikipedia'])"),
    Case('data tokenized with another tokenizer', 'train',
         lambda ctx: ctx.recipe(train_loader={'root': str(ctx.fixture('other_data'))}),
         "token ids differ from the model's tokenizer"),
    Case('a flipped byte in a shard', 'train',
         lambda ctx: ctx.recipe(train_loader={'root': str(_flipped(ctx))}),
         'train_loader: shard {tmp}/data/' + str(GITHUB_SHARD) + ' (domain github) fails its xxh64 check'),
    # --- checkpoints and the save folder ---------------------------------------------------------------------------
    Case('truncated checkpoint as load_path', 'train',
         lambda ctx: ctx.recipe(load_path=str(_truncated_checkpoint(ctx))),
         'load_path: cannot read checkpoint {tmp}/ckpt/ep0-ba1-rank0.pt (corrupted or incomplete?): it is not a '
         'whole torch.save file'),
    Case('save folder that is read-only', 'train',
         lambda ctx: ctx.recipe(save_folder=str(ctx.mount(ctx.tmp / 'ro', read_only=True) / 'ckpt')),
         'cannot write save_folder {tmp}/ro/ckpt: '),
    Case('save folder with a checkpoint torn by a kill', 'train',
         _save_folder_with_a_torn_checkpoint,
         'autoresume: {tmp}/ckpt holds ep0-ba2-rank0.pt, later than ep0-ba1-rank0.pt, which latest-rank0.pt names '
         'and the run would resume from; Composer refuses to train into a folder holding later checkpoints. '
         'ep0-ba2-rank0.pt is incomplete (a save cut off by a kill or a full disk?): delete it to resume from '
         'ep0-ba1-rank0.pt'),
    Case("save folder holding another run's checkpoints", 'train',
         lambda ctx: ctx.recipe(save_folder=str(ctx.copy(ctx.fixture('trained'), 'ckpt'))),
         'save_folder {tmp}/ckpt already holds checkpoints (ep0-ba1-rank0.pt) and this run starts from scratch; set '
         'autoresume: true'),
    # --- data prep ---------------------------------------------------------------------------------------------------
    Case('data prep: input that does not exist', 'dha-train',
         lambda ctx: ctx.prep(inputs=ctx.tmp / 'nope'),
         'input not found: {tmp}/nope'),
    Case('data prep: an empty input file', 'dha-train',
         lambda ctx: ctx.prep(inputs=_jsonl(ctx, b'')),
         'domain c4 has no documents: its 1 file(s) hold none (empty, or every line skipped?): '
         '{tmp}/raw/c4/c4_0.jsonl'),
    Case('data prep: a line that is not UTF-8', 'dha-train',
         lambda ctx: ctx.prep(inputs=_jsonl(ctx, b'{"text": "fine"}\n{"text": "caf\xe9"}\n')),
         '{tmp}/raw/c4/c4_0.jsonl:2: line is not UTF-8 text (byte 0xe9 at column 14: invalid continuation byte); '
         'pass --skip-bad-lines to skip such lines'),
    Case('data prep: a folder with no tokenizer as --tokenizer', 'dha-train',
         lambda ctx: ctx.prep(tokenizer=_old_output(ctx.tmp / 'tok')),
         'no tokenizer in {tmp}/tok: it has none of tokenizer.json, tokenizer_config.json'),
    Case('data prep: output folder exists', 'dha-train',
         lambda ctx: ctx.prep(out=_old_output(ctx.tmp / 'out')),
         'output folder {tmp}/out already exists and is not empty; pass --overwrite to replace it'),
    Case('data prep: output folder on a read-only disk', 'dha-train',
         lambda ctx: ctx.prep(out=ctx.mount(ctx.tmp / 'ro', read_only=True) / 'out'),
         'cannot write --out {tmp}/ro/out: '),
    Case('data prep: the disk fills up (old output kept)', 'dha-train',
         lambda ctx: ctx.prep('--overwrite', out=ctx.mount(ctx.tmp / 'full', fill=lambda p: _old_output(p / 'out'))
                              / 'out'),
         'cannot write {tmp}/full/out: the disk is full (no space left on device); {tmp}/full/out was left as it was'),
    # --- model folders (convert, refit, eval, search, align and model.pretrained_path share one check) -------------
    Case('convert: a model folder with config.json but no weights', 'dha-train',
         lambda ctx: ['convert', str(_damaged_model(ctx, 'no weights')), str(ctx.tmp / 'out'), '--kv-heads', '2'],
         'convert: {tmp}/mha has a config.json but no weights beside it'),
    Case('convert: a truncated model.safetensors (an interrupted copy)', 'dha-train',
         lambda ctx: ['convert', str(_damaged_model(ctx, 'truncated')), str(ctx.tmp / 'out'), '--kv-heads', '2'],
         'convert: {tmp}/mha: model.safetensors is truncated'),
    Case('convert: a shard index naming a missing shard', 'dha-train',
         lambda ctx: ['convert', str(_damaged_model(ctx, 'missing shard')), str(ctx.tmp / 'out'), '--kv-heads', '2'],
         'convert: {tmp}/mha: the shard index names 1 missing shard(s): model-00002-of-00002.safetensors'),
    Case('convert: a config of another architecture', 'dha-train',
         lambda ctx: ['convert', str(_damaged_model(ctx, 'other architecture')), str(ctx.tmp / 'out'), '--kv-heads',
                      '2'],
         "convert: {tmp}/mha holds a 'gpt2' model"),
    Case('eval: a truncated model.safetensors', 'dha-train',
         lambda ctx: ['eval', str(_damaged_model(ctx, 'truncated')), '--tasks', 'piqa', '--limit', '2'],
         'eval: {tmp}/mha: model.safetensors is truncated'),
    Case('eval: a model folder with no tokenizer', 'dha-train',
         lambda ctx: ['eval', str(ctx.fixture('mha_dir')), '--tasks', 'piqa', '--limit', '2'],
         'has no tokenizer (tokenizer.json or tokenizer.model)'),
    Case('refit: source and converted swapped (the "converted" caches more)', 'dha-train',
         lambda ctx: ['refit', str(_gqa_of(ctx)), str(ctx.fixture('mha_dir')), str(ctx.tmp / 'out'),
                      '--data', str(ctx.data_root)],
         "refit: the converted model caches 512 bytes per token (bf16), more than the source's 256"),
    Case('refit: a converted folder with no weights', 'dha-train',
         lambda ctx: ['refit', str(ctx.fixture('mha_dir')), str(_damaged_model(ctx, 'no weights')),
                      str(ctx.tmp / 'out'), '--data', str(ctx.data_root)],
         'refit (converted): {tmp}/mha has a config.json but no weights beside it'),
    # --- export ------------------------------------------------------------------------------------------------------
    Case('export: truncated checkpoint', 'dha-train',
         lambda ctx: ['export', str(_truncated_checkpoint(ctx)), str(ctx.tmp / 'hf')],
         'cannot read checkpoint {tmp}/ckpt/ep0-ba1-rank0.pt (corrupted or incomplete?): it is not a whole '
         'torch.save file'),
    Case('export: output folder exists', 'dha-train',
         lambda ctx: ['export', str(ctx.fixture('trained')), str(_old_output(ctx.tmp / 'hf'))],
         '{tmp}/hf exists and is not empty; pass --overwrite to replace it'),
    Case('export: output folder on a read-only disk', 'dha-train',
         lambda ctx: ['export', str(ctx.fixture('trained')), str(ctx.mount(ctx.tmp / 'ro', read_only=True) / 'hf')],
         'cannot write {tmp}/ro/hf: '),
    Case('export: the disk fills up (old output kept)', 'dha-train',
         lambda ctx: ['export', str(ctx.fixture('trained')),
                      str(ctx.mount(ctx.tmp / 'full', fill=lambda p: _old_output(p / 'hf')) / 'hf'), '--overwrite'],
         'cannot write {tmp}/full/hf: the disk is full (no space left on device); {tmp}/full/hf was left as it was'),
]


def _damaged_model(ctx: Ctx, damage: str) -> Path:
    """A copy of the tiny MHA folder with one thing wrong, as an interrupted copy or a wrong download leaves it."""
    folder = ctx.copy(ctx.fixture('mha_dir'), 'mha')
    weights = folder / 'model.safetensors'
    if damage == 'no weights':
        weights.unlink()
    elif damage == 'truncated':
        _truncate(weights)
    elif damage == 'missing shard':
        weights.rename(folder / 'model-00001-of-00002.safetensors')
        names = ['model.embed_tokens.weight', 'lm_head.weight']
        (folder / 'model.safetensors.index.json').write_text(json.dumps({'metadata': {}, 'weight_map': {
            names[0]: 'model-00001-of-00002.safetensors', names[1]: 'model-00002-of-00002.safetensors'}}))
    elif damage == 'other architecture':
        config = json.loads((folder / 'config.json').read_text())
        (folder / 'config.json').write_text(json.dumps({**config, 'model_type': 'gpt2'}))
    return folder


def _flipped(ctx: Ctx) -> Path:
    data = ctx.copy(ctx.data_root, 'data')
    _flip_byte(data / GITHUB_SHARD)
    return data


def _truncated_checkpoint(ctx: Ctx) -> Path:
    path = ctx.copy(ctx.fixture('trained'), 'ckpt') / 'ep0-ba1-rank0.pt'
    _truncate(path)
    return path


def _snapshot(*folders: Path) -> dict[str, str]:
    """Every entry under ``folders`` (hidden ones too): a link's target, a file's size and sha256, a folder."""
    entries = {}
    for folder in folders:
        for path in sorted(folder.rglob('*')):
            if path.is_symlink():
                entries[str(path)] = f'-> {os.readlink(path)}'
            elif path.is_file():
                entries[str(path)] = f'{path.stat().st_size} {hashlib.sha256(path.read_bytes()).hexdigest()}'
            else:
                entries[str(path)] = 'folder'
    return entries


def _error_lines(err: str) -> list[str]:
    """stderr's lines, without data prep's progress-bar frames."""
    frames = (frame for line in err.splitlines() for frame in line.split('\r'))
    return [frame for frame in frames if frame.strip() and not _PROGRESS_FRAME.match(frame)]


@pytest.mark.parametrize('case', CASES, ids=[case.name for case in CASES])
def test_bad_input_is_one_line_and_changes_nothing(case, tmp_path, data_root, tokenizer_dir, request, capfd):
    from dha_train.cli import main as cli_main
    from dha_train.train import main as train_main

    with _mounts() as mount:
        ctx = Ctx(tmp_path, data_root, tokenizer_dir, request, mount)
        argv = case.setup(ctx)
        before = _snapshot(tmp_path, data_root, *ctx.watched)
        capfd.readouterr()
        # Log records reach stderr as they would for a user (Python's last-resort handler prints WARNING and up).
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        logging.getLogger().addHandler(handler)
        try:
            status = (cli_main if case.entry == 'dha-train' else train_main)(argv)
        finally:
            logging.getLogger().removeHandler(handler)
        out, err = capfd.readouterr()
        after = _snapshot(tmp_path, data_root, *ctx.watched)

    expected = case.expected.format(tmp=tmp_path, data_root=data_root)
    lines = _error_lines(err)
    print(f'\nBAD-INPUT-ROW | {case.name} | {lines[-1] if lines else err!r}')
    assert 'Traceback' not in out + err
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith('dha-train: error: '), err
    assert expected in lines[0]
    assert after == before  # nothing the user had was changed, and nothing (no staging folder) was left behind


def test_a_line_that_is_not_utf8_is_skipped_and_counted_with_skip_bad_lines(tmp_path, tokenizer_dir, capfd):
    from dha_train.cli import main
    from dha_train.data.prep import read_manifest

    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=20)
    path = raw / 'github' / 'github_0.jsonl'
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b''.join([*lines[:2], b'{"text": "caf\xe9"}\n', *lines[2:]]))
    assert main(['data', 'prep', '--input', str(raw), '--out', str(tmp_path / 'out'), '--tokenizer', str(tokenizer_dir),
                 '--seq-len', '64', '--workers', '1', '--skip-bad-lines']) == 0
    assert f'data prep: skipped 1 bad line(s) in {path} (lines 3)' in capfd.readouterr().err
    domains = read_manifest(tmp_path / 'out')['domains']
    assert domains['github']['skipped_lines'] == 1 and domains['github']['documents'] == 20
    assert domains['wikipedia']['skipped_lines'] == 0


# ----------------------------------------------------------------------------------------------------------------
# SIGTERM during a save
# ----------------------------------------------------------------------------------------------------------------

# Runs `python -m dha_train.train` with torch.save slowed down for the batch-2 checkpoint: it writes that file in
# 64 KiB pieces, 50 ms apart, after touching SAVE_STARTED, so a SIGTERM sent then lands in the middle of the save.
_SLOW_SAVE_ENTRY = '''
import io, os, runpy, sys, time
from pathlib import Path
import torch

started, save = Path(os.environ['SAVE_STARTED']), torch.save

def slow_save(obj, f, *args, **kwargs):
    if 'ba2-' not in os.path.basename(str(getattr(f, 'name', f))):
        return save(obj, f, *args, **kwargs)
    buffer = io.BytesIO()
    save(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    started.write_text(str(getattr(f, 'name', f)))
    for start in range(0, len(data), 1 << 16):
        f.write(data[start:start + (1 << 16)])
        f.flush()
        time.sleep(0.05)

torch.save = slow_save
sys.argv = ['dha_train.train', *sys.argv[1:]]
runpy.run_module('dha_train.train', run_name='__main__', alter_sys=True)
'''


@pytest.mark.slow  # two fresh interpreters import Composer and train a few batches: about 25 s on 2 cores
def test_sigterm_during_a_save_leaves_whole_checkpoints_and_autoresume_goes_on(tmp_path, data_root, tokenizer_dir):
    folder = tmp_path / 'ckpt'
    recipe = write_recipe(tmp_path / 'recipe.yaml', tiny_recipe(
        data_root, tokenizer_dir, max_duration='3ba', save_interval='1ba', save_folder=str(folder),
        run_name='sigterm', autoresume=True))
    entry = tmp_path / 'slow_save_entry.py'
    entry.write_text(_SLOW_SAVE_ENTRY)
    started = tmp_path / 'save-started'
    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': '1', 'SAVE_STARTED': str(started)}

    log = tmp_path / 'killed.log'
    with log.open('w') as handle:
        proc = subprocess.Popen([sys.executable, str(entry), str(recipe)], stdout=handle, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO)
        deadline = time.monotonic() + 240
        while not started.exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, 'the batch-2 save never started'
            time.sleep(0.02)
        time.sleep(0.1)  # two of its 64 KiB pieces are written
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=60)  # no hang
    assert status != 0, log.read_text()[-3000:]
    assert 'Traceback' not in log.read_text()

    # The save was cut off: no torn file under a checkpoint's name, no partial file left, and the link names the
    # whole batch-1 checkpoint.
    assert sorted(p.name for p in folder.iterdir()) == sorted(['dha_train_config.json', RUN_RECORD, 'ep0-ba1-rank0.pt',
                                                               LATEST])
    assert latest_checkpoint_batch(folder) == 1
    check_checkpoint(folder / LATEST)

    resumed = subprocess.run([sys.executable, '-m', 'dha_train.train', str(recipe)], capture_output=True, text=True,
                             env=env, cwd=REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert 'dha_train: run sigterm starts at batch 1 of 3ba' in resumed.stdout
    assert latest_checkpoint_batch(folder) == 3
    for batch in (1, 2, 3):
        check_checkpoint(folder / f'ep0-ba{batch}-rank0.pt')

"""Helpers shared by the test modules (fixtures live in conftest.py): tiny recipes, real `composer -n N` launches on
free ports, a planted-group MHA model, the tiny DHA head map, reading an offline W&B run."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import wandb
import yaml
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from wandb.proto import wandb_internal_pb2
from wandb.sdk.internal import datastore

from dha_train.bench_support import free_port  # noqa: F401  (the tests' launches take their ports from it too)
from dha_train.models.head_map import HeadMap

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 64

_WORDS = ('attention head key value query fusion group budget layer token model weight train loss gradient '
          'sample shard stream domain batch checkpoint resume export search merge mean pool kernel').split()


def synthetic_document(rng: random.Random, domain: str) -> str:
    """Text with enough structure to learn quickly: repeated templates over a small vocabulary."""
    if domain == 'github':
        name = rng.choice(_WORDS)
        return '\n'.join(f'def {name}_{i}(x):\n    return x * {rng.randint(1, 9)} + {name}' for i in range(rng.randint(2, 8)))
    return ' '.join(f'The {rng.choice(_WORDS)} of the {rng.choice(_WORDS)} is {rng.choice(_WORDS)}.'
                    for _ in range(rng.randint(3, 15)))


def write_redpajama_jsonl(root: Path, docs_per_domain: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    for domain in ('github', 'wikipedia'):
        folder = root / domain
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / f'{domain}_0.jsonl').open('w') as handle:
            for i in range(docs_per_domain):
                handle.write(json.dumps({'text': synthetic_document(rng, domain), 'meta': {'id': i}}) + '\n')
    return root


def tiny_recipe(data_root: Path, tokenizer_dir: Path, **overrides) -> dict:
    """A tiny LLaMA recipe over the session data; keyword overrides replace top-level keys."""
    recipe = {
        'variables': {'data_root': str(data_root)},
        'run_name': 'tiny-test',
        'seed': 7,
        'model': {
            'tokenizer': str(tokenizer_dir),
            'config': {'vocab_size': 384, 'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 2,
                       'num_attention_heads': 4, 'num_key_value_heads': 4, 'max_position_embeddings': SEQ_LEN},
        },
        'train_loader': {'root': '${variables.data_root}',
                         'streams': {'github': {'proportion': 0.6}, 'wikipedia': {'proportion': 0.4}}},
        'optimizer': {'lr': 3.0e-3},
        'scheduler': {'t_warmup': '2ba'},
        'max_duration': '12ba',
        'global_train_batch_size': 8,
        'device_train_microbatch_size': 4,
        'console_log_interval': '1ba',
    }
    recipe.update(overrides)
    return recipe


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


TRAIN_ENTRY = ('-m', 'dha_train.train')
# The same entry point plus the `record_samples_for_tests` callback (which samples each rank trained on).
RECORDING_ENTRY = (str(REPO / 'tests' / 'scripts' / 'train_recording_samples.py'),)


def composer_command(nproc: int, recipe: Path, *overrides: str, port: int | None = None,
                     entry: tuple[str, ...] = TRAIN_ENTRY) -> list[str]:
    port = free_port() if port is None else port
    return [sys.executable, '-m', 'composer.cli.launcher', '-n', str(nproc), '--master_port', str(port),
            *entry, str(recipe), *overrides]


def run_composer(nproc: int, recipe: Path, *overrides: str, log: Path, port: int | None = None, timeout: int = 300,
                 entry: tuple[str, ...] = TRAIN_ENTRY):
    """A real `composer -n N` launch (gloo on CPU); returns the completed process with its output in ``log``."""
    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': '1'}
    with log.open('w') as handle:
        done = subprocess.run(composer_command(nproc, recipe, *overrides, port=port, entry=entry), stdout=handle,
                              stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout)
    return done


def latest_checkpoint_batch(save_folder: Path) -> int | None:
    """The batch of the checkpoint ``latest-rank0.pt`` points to, or None before the first checkpoint."""
    try:  # Composer replaces the link at each save, so it can vanish between a check and a read: read it once
        target = os.readlink(save_folder / 'latest-rank0.pt')
    except OSError:  # no link yet, or it is being replaced
        return None
    match = re.search(r'ba(\d+)', target)
    return int(match.group(1)) if match else None


def launch_and_kill_after_checkpoint(recipe: Path, save_folder: Path, *overrides: str, log: Path,
                                     port: int | None = None, at_least: int, nproc: int = 2,
                                     entry: tuple[str, ...] = TRAIN_ENTRY, deadline_s: float = 240) -> int:
    """Launch `composer -n nproc`, SIGKILL the whole process group as soon as a checkpoint at batch >= ``at_least``
    exists (within ``deadline_s``), and return the batch the run would resume from."""
    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': '1'}
    with log.open('w') as handle:
        proc = subprocess.Popen(composer_command(nproc, recipe, f'save_folder={save_folder}', *overrides, port=port,
                                                 entry=entry),
                                stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + deadline_s
        while (latest_checkpoint_batch(save_folder) or 0) < at_least:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, 'no checkpoint appeared in time'
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return latest_checkpoint_batch(save_folder)


def stopped_after(save_folder: Path, batch: int, into: Path) -> Path:
    """A copy of a finished run's ``save_folder`` as the run left it right after saving its checkpoint at ``batch``:
    the later checkpoints removed and Composer's ``latest-rank*.pt`` links pointing at that one. A resume from it
    replays the rest of the run (a SIGKILLed run's folder, without launching a run to kill)."""
    shutil.copytree(save_folder, into, symlinks=True)
    for entry in into.iterdir():
        found = re.search(r'-ba(\d+)', entry.name)
        if found and not entry.name.startswith('latest-') and int(found.group(1)) > batch:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    links = sorted(into.glob('latest-rank*.pt'))
    assert links, f'{save_folder} has no latest-rank*.pt link'
    for link in links:
        target = re.sub(r'-ba\d+', f'-ba{batch}', os.readlink(link))
        assert (into / target).exists(), f'{save_folder} has no checkpoint at batch {batch} ({target})'
        link.unlink()
        link.symlink_to(target)
    return into


def logged(log: str, metric: str) -> list[float]:
    """Every value of ``metric`` in a run's console log (Composer's ``<metric>: <value>`` lines), in order; e.g.
    ``Train transfer/mse`` or ``metrics/eval_github/LanguageCrossEntropy``."""
    return [float(value) for value in re.findall(rf'{re.escape(metric)}: ([0-9.e+-]+)', log)]


def global_batches(samples: Path, first: int = 0, end: int = 10 ** 9) -> dict[int, list[str]]:
    """Batch index -> the sorted sample hashes of that global batch, over every rank, for batches in [first, end)."""
    batches: dict[int, list[str]] = {}
    for rank_file in sorted(samples.glob('rank*.jsonl')):
        for line in rank_file.read_text().splitlines():
            record = json.loads(line)
            if first <= record['batch'] < end:
                batches.setdefault(record['batch'], []).extend(record['samples'])
    return {batch: sorted(hashes) for batch, hashes in sorted(batches.items())}


def save_tiny_llama(folder: Path, tokenizer_dir: Path, seed: int = 0, **config) -> LlamaConfig:
    """A random LLaMA of the test vocabulary (hidden 64, 2 layers, 8 heads unless ``config`` says otherwise) saved
    with the session's tokenizer as an HF folder; returns its config."""
    torch.manual_seed(seed)
    llama = LlamaConfig(**{'vocab_size': 384, 'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 2,
                           'num_attention_heads': 8, 'num_key_value_heads': 8, 'max_position_embeddings': SEQ_LEN,
                           **config})
    LlamaForCausalLM(llama).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return llama


def launcher_env(port: int | None = None, **extra: str) -> dict[str, str]:
    """The environment the launch/*.sh chains run under in tests: this interpreter's dha-train and composer
    launcher (on a free port unless ``port`` is given), one thread per process, plus ``extra`` variables."""
    return {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': '1',
            'DHA_TRAIN': f'{sys.executable} -m dha_train.cli',
            'COMPOSER': f'{sys.executable} -m composer.cli.launcher --master_port {port or free_port()}', **extra}


HEADS, HEAD_DIM, LAYERS = 8, 8, 2
PNG = b'\x89PNG'


def planted_mha(path, seed: int = 0, query_heads: int = HEADS) -> list[dict[str, list[list[int]]]]:
    """A tiny MHA LLaMA whose K heads (and, with another shuffle, V heads) form two planted groups of four near-copies.
    ``query_heads`` = 16 makes it GQA: 16 query heads share the 8 planted K/V heads (query head h reads h // 2).

    Returns the planted groups (of the K/V heads) per layer: {'key': partition, 'value': partition}.
    """
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=384, hidden_size=HEADS * HEAD_DIM, intermediate_size=128,
                         num_hidden_layers=LAYERS, num_attention_heads=query_heads, num_key_value_heads=HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    truth = []
    with torch.no_grad():
        for layer in model.model.layers:
            planted = {}
            for kind, projection in (('key', layer.self_attn.k_proj), ('value', layer.self_attn.v_proj)):
                labels = (torch.arange(HEADS) // 4)[torch.randperm(HEADS, generator=generator)]
                heads = projection.weight.view(HEADS, HEAD_DIM, -1)
                base = heads[:2].clone()
                noise = 0.05 * base.std() * torch.randn(heads.shape, generator=generator)
                projection.weight.copy_((base[labels] + noise).reshape_as(projection.weight))
                planted[kind] = [torch.nonzero(labels == g).flatten().tolist() for g in range(2)]
                planted[kind].sort()
            truth.append(planted)
    model.save_pretrained(path)
    return truth


# 4 heads: K grouped {0,2},{1,3} and V {0,1},{2,3} in layer 0; K {0,1,2,3} and V {0,3},{1,2} in layer 1.
TINY_MAP = HeadMap.dha([[[0, 2], [1, 3]], [[0, 1, 2, 3]]], [[[0, 1], [2, 3]], [[0, 3], [1, 2]]], num_heads=4,
                       head_dim=16)


def fusion_recipe(tmp_path, data_root, tokenizer_dir, **overrides):
    head_map = TINY_MAP.save(tmp_path / 'head_map.json')
    recipe = tiny_recipe(data_root, tokenizer_dir, max_duration='120ba', seed=11,
                         optimizer={'lr': 1.0e-3}, scheduler={'t_warmup': '4ba', 'alpha_f': 0.1},
                         algorithms={'head_fusion': {'head_map': str(head_map), 'omega_lr': 0.05,
                                                     'lambda_lr': 1.0, 'margin_warmup_steps': 10}})
    recipe['model']['config'].update(num_attention_heads=4, num_key_value_heads=4)
    recipe.update(overrides)
    return recipe


def wandb_history_keys(run_file) -> dict[str, list[float]]:
    """Read the offline .wandb record log the way `wandb sync` does and collect the history values."""

    # run.finish() returns before the wandb-core service has written and closed the file (a 0-byte
    # file was seen); teardown waits for the service to exit, which closes every stream.
    wandb.teardown()
    store = datastore.DataStore()
    store.open_for_scan(str(run_file))
    values: dict[str, list[float]] = {}
    while True:
        data = store.scan_data()
        if data is None:
            break
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof('record_type') == 'history':
            for item in record.history.item:
                key = item.key or '/'.join(item.nested_key)
                values.setdefault(key, []).append(json.loads(item.value_json))
    return values


# The start of a script run where dha_train cannot be imported: the editable install's finder is dropped before
# anything else, and an importable dha_train stops it.
WITHOUT_DHA_TRAIN = textwrap.dedent('''
    import sys
    sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]
    sys.path[:] = [p for p in sys.path if '__editable__' not in p]
    try:
        import dha_train
    except ImportError:
        pass
    else:
        raise SystemExit('dha_train is importable: ' + str(dha_train.__path__))
''')
_REMOTE_LOAD = WITHOUT_DHA_TRAIN + textwrap.dedent('''
    import json
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(model).__module__.startswith('transformers_modules.'), type(model).__module__
    with torch.no_grad():
        logits = model(torch.tensor(json.loads(sys.argv[2])), use_cache=False).logits
    torch.save(logits, sys.argv[3])
''')


def logits_without_dha_train(folder: Path, input_ids: torch.Tensor, tmp_path: Path) -> torch.Tensor:
    """Logits of an exported folder (copied elsewhere) loaded with trust_remote_code in a fresh interpreter where
    dha_train cannot be imported and the hub is offline: what a user's inference stack sees."""
    copy = shutil.copytree(folder, tmp_path / 'exported-copy')
    env = {key: value for key, value in os.environ.items() if key not in ('PYTHONPATH', 'PYTHONHOME')}
    env.update(PYTHONNOUSERSITE='1', HF_HOME=str(tmp_path / 'hf_home'), HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1')
    out_file = tmp_path / 'remote-logits.pt'
    result = subprocess.run(
        [sys.executable, '-c', _REMOTE_LOAD, str(copy), json.dumps(input_ids.tolist()), str(out_file)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return torch.load(out_file)


def mixed_text_lines() -> list[str]:
    """A few hundred lines of mixed text to tokenize: Python code (a stdlib module's source), its docstrings' prose,
    digits in many forms, and non-ASCII text (accents, Greek, Cyrillic, CJK, emoji), with odd whitespace."""
    import inspect
    import json.decoder
    import textwrap

    code = inspect.getsource(json.decoder).splitlines()[:180]
    prose = [line.strip() for line in (textwrap.__doc__ or '').splitlines() + inspect.getdoc(random.Random).splitlines()
             if line.strip()]
    digits = ['3.14159265358979', '2026-11-26T15:19:05Z', '1,234,567.89', '0x1F 0b1011 0o777', '12345678901234567890',
              'v1.2.3-rc4', '+44 (0)20 7946 0958', '1e-9 vs 1E+12', '99% of 100', 'x = [1, 22, 333, 4444]']
    foreign = ['Größenwahn führt über Straßen', 'déjà vu, naïve café, œuvre', 'Ελληνικά γράμματα', 'Русский текст тут',
               '日本語のテキストです', '中文分词测试', '한국어 문장', 'emoji 🎉🚀 and ✓ ✗', 'tab\tseparated\tcolumns',
               '  leading and trailing spaces  ', 'mixed: naïve 42 日本 🎉 code()']
    return code + prose + digits * 3 + foreign * 3


def folder_snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (hidden ones too, so a left-behind staging file shows): size and sha256."""
    import hashlib

    return {str(p): (f'{p.stat().st_size} {hashlib.sha256(p.read_bytes()).hexdigest()}' if p.is_file() else 'folder')
            for p in sorted(Path(folder).rglob('*'))}


def refused_in_one_line(argv: list[str], folder: Path, capfd) -> str:
    """Run ``dha-train`` with ``argv``; assert exit 2, one ``dha-train: error:`` line, no traceback, and ``folder``
    unchanged (no output, no staging file or folder left behind). Returns the line."""
    from dha_train.cli import main

    before = folder_snapshot(folder)
    capfd.readouterr()
    status = main(argv)
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert 'Traceback' not in out + err
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith('dha-train: error: '), err
    assert folder_snapshot(folder) == before
    return lines[0]


def set_grouped_random_omega(projections, seed: int = 5) -> None:
    """Random fusion weights that agree within every group (what Fusion converges to), in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pair in projections:
            for projection in pair:
                omega = torch.rand(projection.omega.shape, generator=generator)
                for row in projection.members.tolist():
                    omega[row] = omega[row].mean(dim=0)
                projection.omega.copy_(omega)


def save_tiny_smollm2_shape(folder: Path, tokenizer_dir: Path) -> Path:
    """A tiny GQA LLaMA shaped as SmolLM2 (9 query heads over 3 K/V heads, 2 layers), saved with the test tokenizer:
    the source the bench tests run on."""
    config = LlamaConfig(vocab_size=384, hidden_size=9 * 8, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=8, max_position_embeddings=512,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder

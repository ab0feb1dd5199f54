"""Kept checkpoints (tests/fixtures/checkpoints/<version>/, written by tests/fixtures/make_checkpoint_fixtures.py)
must resume and export with every later commit.

Each version holds a DHA Fusion run stopped mid-way (2-process FSDP2, sharded: lambda, omegas, margin step) and an
aligned-GQA pruning run with distillation (1 process, whole file: gates, their RNG, the density schedule). A change
that breaks one of them changes the checkpoint format: it needs a migration in the loading code (the untagged
checkpoints of methods.py are one), not a new fixture in place of the old one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import SEQ_LEN, run_composer, write_redpajama_jsonl

FIXTURES = Path(__file__).resolve().parent / 'fixtures' / 'checkpoints'
VERSIONS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
KEPT_AT, RESUMED_TO = 6, 10
ALGORITHM = {'fusion': 'HeadFusion', 'pruning': 'KVHeadTransfer'}

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _kept(version: str, kind: str) -> Path:
    found = sorted((FIXTURES / version / kind).glob(f'ep*-ba{KEPT_AT}*'))
    assert len(found) == 1, found
    return found[0]


def _algorithm_state(state: dict, name: str) -> dict:
    return next(saved for algorithm, saved in state['state']['algorithms'] if algorithm == name)


def _digest(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob('*') if p.is_file())
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


@pytest.fixture(scope='module', params=VERSIONS)
def version_data(request, tmp_path_factory):
    """The version's fixture folder and data prepared with its own tokenizer by today's `data prep`."""
    from dha_train.data.prep import prep_redpajama

    fixture = FIXTURES / request.param
    tmp = tmp_path_factory.mktemp(f'compat-{request.param}')
    data = tmp / 'data'
    prep_redpajama([write_redpajama_jsonl(tmp / 'raw')], data, fixture / 'tokenizer', seq_len=SEQ_LEN,
                   val_tokens=8 * SEQ_LEN, workers=1, progress=False)
    return fixture, data


@pytest.mark.parametrize('kind', ['fusion', 'pruning'])
def test_kept_checkpoint_resumes_where_it_stopped_and_exports(version_data, kind, tmp_path):
    from dha_train.checkpoints import load_composer_state
    from dha_train.export import export_hf

    fixture, data = version_data
    kept = _kept(fixture.name, kind)
    before = _digest(kept)
    kept_state = load_composer_state(kept)
    log = tmp_path / 'resume.txt'
    done = run_composer(1, fixture / kind / 'recipe.yaml', f'variables.fixture={fixture}',
                        f'variables.data_root={data}', f'load_path={kept}', f'save_folder={tmp_path / "ckpt"}',
                        f'max_duration={RESUMED_TO}ba', f'save_interval={RESUMED_TO}ba', log=log)
    text = log.read_text()
    assert done.returncode == 0, text[-4000:]
    assert f'starts at batch {KEPT_AT} of {RESUMED_TO}ba' in text
    assert _digest(kept) == before  # the kept files are read, never written

    final = load_composer_state(tmp_path / 'ckpt')
    kept_algorithm = _algorithm_state(kept_state, ALGORITHM[kind])
    final_algorithm = _algorithm_state(final, ALGORITHM[kind])
    # The algorithm's state carried on from the kept one: its first KEPT_AT history entries are the kept ones.
    assert len(kept_algorithm['history']) == KEPT_AT and len(final_algorithm['history']) == RESUMED_TO
    assert final_algorithm['history'][:KEPT_AT] == kept_algorithm['history']
    if kind == 'fusion':
        assert kept_algorithm['step'] == KEPT_AT and final_algorithm['step'] == RESUMED_TO
        assert kept_algorithm['lam'] > 0  # mid-way: the multiplier had risen
    else:
        assert kept_algorithm['frozen_at'] is None and final_algorithm['frozen_at'] == int(0.8 * RESUMED_TO)

    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    out = export_hf(tmp_path / 'ckpt', tmp_path / 'hf')
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    expected_type = {'fusion': 'dha_llama', 'pruning': 'llama'}[kind]
    assert model.config.model_type == expected_type


def test_kept_fusion_checkpoint_exports_as_it_is(version_data, tmp_path):
    """Export straight from the kept mid-way Fusion checkpoint (omegas averaged per group) to the compact DHA model
    of the kept head map."""
    from dha_train.export import export_hf

    fixture, _ = version_data
    out = export_hf(_kept(fixture.name, 'fusion'), tmp_path / 'hf')
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert model.config.model_type == 'dha_llama'
    # TINY_MAP's compact heads: K 2 and V 2 in layer 0, K 1 and V 2 in layer 1
    assert [(len(set(layer['key'])), len(set(layer['value']))) for layer in model.config.head_map['layers']] == \
        [(2, 2), (1, 2)]
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()

"""`dha-train export` folders load where users run them: a DHA, an MoH, an MLA and a plain GQA export, loaded with
``trust_remote_code=True`` in transformers 5.x (its own virtual environment, without dha_train) give the project's
4.5x tokens, logits, attention weights and greedy generations, and 5.x's cached generate equals uncached decoding.

The 5.x environment is made on first use and kept (``DHA_TRANSFORMERS5_VENV``, default ``.cache/transformers5-venv``):
``python -m venv`` plus tests/requirements-transformers5.txt, with a ``.pth`` line that puts the project venv's
site-packages after its own, so transformers 5.x shadows 4.5x while torch and numpy are the project's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from composer.models import HuggingFaceModel
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import export_probe
from dha_train.algorithms.head_fusion import HeadFusion
from dha_train.algorithms.mixture_of_heads import MixtureOfHeads
from dha_train.cli import main
from dha_train.conversion.mla import MlaSettings, convert_to_mla
from dha_train.data.tokenizer import load_tokenizer
from helpers import REPO, TINY_MAP

pytestmark = pytest.mark.slow

REQUIREMENTS = REPO / 'tests' / 'requirements-transformers5.txt'
VENV = Path(os.environ.get('DHA_TRANSFORMERS5_VENV', REPO / '.cache' / 'transformers5-venv'))
# pip's words for a registry it cannot reach (urllib3 / socket errors), as opposed to a bad pin.
UNREACHABLE = ('NewConnectionError', 'ConnectTimeoutError', 'ReadTimeoutError', 'Max retries exceeded',
               'Temporary failure in name resolution', 'Name or service not known', 'Network is unreachable',
               'Connection refused', 'ProxyError')
PROMPTS = ['def merge_1(x):\n    return', 'The budget of the layer is']
NEW_TOKENS = 8


def project_site_packages() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths['purelib'], paths['platlib']]))


def transformers5_python() -> Path:
    """The 5.x environment's python, made (or remade, when the pins or the project venv changed) on first use."""
    python = VENV / 'bin' / 'python'
    stamp = VENV / 'dha_train-installed.txt'
    wanted = '\n'.join([REQUIREMENTS.read_text(), *project_site_packages(), sys.version])
    if python.exists() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    subprocess.run([sys.executable, '-m', 'venv', '--clear', str(VENV)], check=True, capture_output=True)
    own_site = subprocess.run([python, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
                              check=True, capture_output=True, text=True).stdout.strip()
    # site adds the lines of a .pth after the folder that holds it: the project's packages come second.
    (Path(own_site) / 'dha_train_project_venv.pth').write_text('\n'.join(project_site_packages()) + '\n')
    install = [python, '-m', 'pip', 'install', '--disable-pip-version-check', '--no-input', '-r', str(REQUIREMENTS)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        output = done.stdout + done.stderr
        why = output
        if not any(word in output for word in UNREACHABLE):
            # Without retries left pip names a connection error only at -vv: ask again why.
            again = subprocess.run([*install, '-vv'], capture_output=True, text=True, timeout=900)
            why = again.stdout + again.stderr
        unreachable = [line.strip() for line in why.splitlines() if any(word in line for word in UNREACHABLE)]
        if unreachable:
            pytest.skip(f'the package registry is unreachable, so {REQUIREMENTS.name} cannot be installed: '
                        f'{unreachable[-1][:300]}')
        pytest.fail(f'pip install -r {REQUIREMENTS.name} failed:\n{output[-4000:]}')
    stamp.write_text(wanted)  # last: an interrupted install is redone next time
    return python


def tiny_llama(heads: int, kv_heads: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    # A wide init keeps the logits apart, so greedy tokens do not hinge on rounding; no EOS, so every generation
    # runs its full length.
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def trained_models(tmp_path: Path) -> dict[str, LlamaForCausalLM]:
    """Tiny models as the training stages leave them, one per export kind."""
    dha = tiny_llama(4, 4)  # TINY_MAP's heads
    HeadFusion(head_map=str(TINY_MAP.save(tmp_path / 'head_map.json'))).apply_surgery(dha)
    # 2 shared + top 2 of 6 routed heads: two sequences use at most 6 of the 8 heads, and with one extra attention
    # call costing nothing every decode step takes the sparse (active heads only) path.
    moh = tiny_llama(8, 8)
    MixtureOfHeads(router='learned', shared_heads=2, top_k=2).apply_surgery(moh)
    moh.config.moh_decode_merge_elements = 1
    # MLA from a GQA source: 1 of 4 RoPE pairs kept per K/V head, half the cache (plain SVD: no data needed)
    tiny_llama(4, 2).save_pretrained(tmp_path / 'mla-source')
    convert_to_mla(tmp_path / 'mla-source', tmp_path / 'mla-converted', MlaSettings(
        cache_fraction=0.5, rope_pairs=1, pair_criterion='uniform', factorisation='weight', rank_step=1))
    mla = AutoModelForCausalLM.from_pretrained(tmp_path / 'mla-converted').eval()
    return {'dha': dha, 'moh': moh, 'gqa': tiny_llama(4, 2), 'mla': mla}


def write_composer_checkpoint(model, tokenizer, path: Path) -> Path:
    """What Composer's checkpointer saves of a HuggingFaceModel: the weights and the HF metadata export reads."""
    wrapped = HuggingFaceModel(model, tokenizer=tokenizer)
    torch.save({'state': {'model': wrapped.state_dict(),
                          'integrations': {'huggingface': wrapped.get_metadata()}}}, path)
    return path


@pytest.fixture(scope='module')
def exports(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp('exports')
    tokenizer = load_tokenizer(tokenizer_dir)
    folders = {}
    for name, model in trained_models(tmp).items():
        checkpoint = write_composer_checkpoint(model, tokenizer, tmp / f'{name}.pt')
        assert main(['export', str(checkpoint), str(tmp / name)]) == 0
        folders[name] = tmp / name
    return folders


def test_exports_load_and_generate_alike_in_transformers_4_and_5(exports, tmp_path):
    assert json.loads((exports['dha'] / 'config.json').read_text())['model_type'] == 'dha_llama'
    assert json.loads((exports['moh'] / 'config.json').read_text())['model_type'] == 'moh_llama'
    assert json.loads((exports['gqa'] / 'config.json').read_text())['model_type'] == 'llama'
    assert json.loads((exports['mla'] / 'config.json').read_text())['model_type'] == 'mla_llama'
    python = transformers5_python()

    env = {key: value for key, value in os.environ.items() if key not in ('PYTHONPATH', 'PYTHONHOME')}
    # One thread: the models are tiny, and spinning threads only contend for the shared cores.
    env.update(PYTHONNOUSERSITE='1', HF_HOME=str(tmp_path / 'hf_home'), HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1',
               OMP_NUM_THREADS='1')
    out = tmp_path / 'transformers5.pt'
    done = subprocess.run([python, export_probe.__file__, json.dumps({k: str(v) for k, v in exports.items()}),
                           json.dumps(PROMPTS), str(NEW_TOKENS), str(out)],
                          cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    new = torch.load(out, weights_only=False)

    environment = new.pop('environment')
    assert environment['transformers'].startswith('5.'), environment
    assert environment['transformers_file'].startswith(str(VENV)), environment
    assert environment['torch_file'] == torch.__file__, environment  # the project's torch, not a second one
    assert not environment['dha_train_importable']

    # MLA's cache: the latent in the key slot (one "head"), the rotated key dims of its 2 K/V heads in the value slot
    kv_heads = {'dha': TINY_MAP.kv_heads(), 'moh': [(8, 8)] * 2, 'gqa': [(2, 2)] * 2, 'mla': [(1, 2)] * 2}
    for name, folder in exports.items():
        ours, theirs = export_probe.probe(str(folder), PROMPTS, NEW_TOKENS), new[name]
        if name != 'gqa':  # the modeling file copied into the folder, not dha_train's
            assert theirs['model_class'].startswith('transformers_modules.'), theirs['model_class']
        assert torch.equal(theirs['input_ids'], ours['input_ids']), name
        assert (ours['input_ids'] == 0).any(), 'the prompts should need padding'
        torch.testing.assert_close(theirs['logits'], ours['logits'], rtol=0, atol=1e-4, msg=name)
        assert len(theirs['attentions']) == len(ours['attentions']) == 2, name
        for layer, (got, expected) in enumerate(zip(theirs['attentions'], ours['attentions'])):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=f'{name} layer {layer}')
        assert torch.equal(theirs['sequences'], ours['sequences']), name
        assert torch.equal(theirs['sequences'], theirs['argmax_sequences']), name
        assert torch.equal(ours['sequences'], ours['argmax_sequences']), name
        assert theirs['cache_heads'] == ours['cache_heads'] == kv_heads[name], name
        if name in ('dha', 'mla'):  # refused with a ValueError that says why, in both versions
            for refusal in (theirs['static_cache_sequences'], ours['static_cache_sequences']):
                assert isinstance(refusal, str) and 'static' in refusal, refusal
        else:
            assert torch.equal(theirs['static_cache_sequences'], ours['sequences']), name
            assert torch.equal(ours['static_cache_sequences'], ours['sequences']), name

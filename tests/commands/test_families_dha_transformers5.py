"""DHA folders of every source family load in transformers 5.x with ``trust_remote_code`` (its own environment,
without dha_train; see test_export_transformers5.py): the modeling file and its family table give 4.5x's logits and
greedy generations, with a cache of the head map's compact heads (5.x fills Gemma's non-persistent buffers through
the family's own initialiser)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
import torch
from family_models import FAMILY_NAMES, logits_of
from test_export_transformers5 import transformers5_python
from test_families_dha import DHA_MAP, _random_dha

from helpers import WITHOUT_DHA_TRAIN

pytestmark = pytest.mark.slow

NEW_TOKENS = 9  # 5 + 9 positions: past the window of 6 on Gemma's sliding layer

_LOAD = WITHOUT_DHA_TRAIN + textwrap.dedent('''
    import json
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    assert transformers.__version__.startswith('5.'), transformers.__version__
    request = torch.load(sys.argv[1])
    answers = {}
    for name, folder in json.loads(sys.argv[3]).items():
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith('transformers_modules.'), type(model).__module__
        prompt = request['prompt']
        with torch.no_grad():
            logits = model(request['ids'], use_cache=False).logits
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=int(request['new']),
                             do_sample=False, use_cache=True, return_dict_in_generate=True, pad_token_id=0)
        cache = out.past_key_values
        heads = [(cache.layers[i].keys.shape[1], cache.layers[i].values.shape[1]) for i in range(len(cache.layers))]
        answers[name] = {'logits': logits, 'sequences': out.sequences, 'heads': heads}
    torch.save(answers, sys.argv[2])
''')


def test_dha_folders_of_every_family_run_alike_in_transformers_5(tmp_path):
    python = transformers5_python()
    torch.manual_seed(1)  # logits_of's ids
    request = {'ids': torch.randint(0, 384, (2, 12)), 'new': NEW_TOKENS,
               'prompt': torch.randint(0, 384, (2, 5), generator=torch.Generator().manual_seed(3))}
    folders, expected = {}, {}
    for model_type in FAMILY_NAMES:
        model = _random_dha(model_type)
        model.save_pretrained(tmp_path / model_type)
        prompt = request['prompt']
        expected[model_type] = (logits_of(model), model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=0))
        folders[model_type] = str(tmp_path / model_type)
    torch.save(request, tmp_path / 'request.pt')
    env = {key: value for key, value in os.environ.items() if key not in ('PYTHONPATH', 'PYTHONHOME')}
    env.update(PYTHONNOUSERSITE='1', HF_HOME=str(tmp_path / 'hf_home'), HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1')
    done = subprocess.run([str(python), '-c', _LOAD, str(tmp_path / 'request.pt'), str(tmp_path / 'answers.pt'),
                           json.dumps(folders)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    answers = torch.load(tmp_path / 'answers.pt')
    for model_type, (logits, sequences) in expected.items():
        theirs = answers[model_type]
        torch.testing.assert_close(theirs['logits'], logits, rtol=0, atol=1e-5, msg=model_type)
        assert torch.equal(theirs['sequences'], sequences), model_type
        assert theirs['heads'] == DHA_MAP.kv_heads(), model_type

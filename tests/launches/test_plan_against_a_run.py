"""`dha-train plan` against reality on CPU: the plan of a small recipe at world size 2 against the peak growth of
resident memory per rank of a real `composer -n 2` FSDP2 run (gloo) of the same recipe, model, micro-batch and
precision (fp32, what a CPU run trains in).

The model is sized so that its tensors dominate a rank's memory (226M parameters: 1.8 GB of sharded weights,
gradients and Adam state per rank, plus the activations of 2 x 64 tokens), against a few hundred MB that the plan
does not model on CPU (gloo's buffers, Composer's and streaming's Python state, the allocator's pages). The
tolerance is 15% either way: about twice the ~0.2 GB of what is not modelled, over the ~1.9 GB peak, which PyTorch's
own tests hold its tracker within 10% of a GPU's peak (no allocator rounding on CPU with every large tensor mapped
on its own). Measured (2026-11-27): plan 2.04 GiB, each rank's growth 2.10 GiB (+2.9%)."""

from __future__ import annotations

import json
import os

import pytest

from dha_train.plan import plan_recipe
from helpers import REPO, composer_command, tiny_recipe, write_recipe

pytestmark = pytest.mark.slow

MODEL = {'vocab_size': 384, 'hidden_size': 1536, 'intermediate_size': 4096, 'num_hidden_layers': 8,
         'num_attention_heads': 12, 'num_key_value_heads': 12, 'max_position_embeddings': 64}
MEASURING_ENTRY = (str(REPO / 'tests' / 'scripts' / 'train_measuring_rss.py'),)


def test_the_plan_of_a_run_is_within_15_percent_of_its_resident_memory_growth(data_root, tokenizer_dir, tmp_path):
    import subprocess

    recipe = tiny_recipe(data_root, tokenizer_dir, max_duration='2ba', global_train_batch_size=4,
                         device_train_microbatch_size=2, precision='fp32',
                         fsdp={'enabled': True, 'state_dict_type': 'sharded'}, save_folder=None)
    recipe['model']['config'] = MODEL
    recipe['train_loader']['num_workers'] = 0  # the loader's memory stays in the rank (none is modelled)
    path = write_recipe(tmp_path / 'recipe.yaml', recipe)
    plan = plan_recipe(str(path), (), world_size=2, gpu='80', search_largest=False)
    assert plan['precision'] == 'fp32' and plan['layers'] == 8

    out = tmp_path / 'rss'
    env = {**os.environ, 'RSS_OUT': str(out), 'MALLOC_MMAP_THRESHOLD_': '131072', 'OMP_NUM_THREADS': '1',
           'PYTHONUNBUFFERED': '1'}
    log = tmp_path / 'run.log'
    with log.open('w') as handle:
        done = subprocess.run(composer_command(2, path, entry=MEASURING_ENTRY), stdout=handle,
                              stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, log.read_text()[-3000:]
    growth = [(lambda r: (r['peak_mib'] - r['before_mib']) / 1024)(json.loads((out / f'rank{rank}.json').read_text()))
              for rank in range(2)]
    print(f"PLAN-VS-RUN plan {plan['peak_gib']:.3f} GiB {plan['by_category_gib']}; measured growth per rank "
          f"{[round(g, 3) for g in growth]} GiB")
    for rank_growth in growth:
        assert rank_growth == pytest.approx(plan['peak_gib'], rel=0.15)

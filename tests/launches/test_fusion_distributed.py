"""HeadFusion under the platform's FSDP2 path with 2 real processes: the fusion model at init equals MHA. (A fusion
run killed with SIGKILL and auto-resumed exactly, and elastically on fewer ranks: test_eight_rank_rehearsal.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, free_port, fusion_recipe, write_recipe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]



def _fsdp_fusion_recipe(tmp_path, data_root, tokenizer_dir, **overrides):
    recipe = fusion_recipe(tmp_path, data_root, tokenizer_dir, fsdp={'enabled': True, 'state_dict_type': 'sharded'},
                           **overrides)
    recipe['callbacks'] = {'fusion_monitor': {}}
    return recipe


def test_fsdp2_fusion_model_at_init_equals_mha(tmp_path, data_root, tokenizer_dir):
    recipe = write_recipe(tmp_path / 'fusion.yaml', _fsdp_fusion_recipe(tmp_path, data_root, tokenizer_dir))
    out = tmp_path / 'result.json'
    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': '1'}
    done = subprocess.run([sys.executable, '-m', 'composer.cli.launcher', '-n', '2', '--master_port', str(free_port()),
                           str(REPO / 'tests/scripts/fusion_fsdp_init.py'), str(recipe), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result['world_size'] == 2 and result['fused_projections'] == 4
    assert result['fsdp'].startswith('FSDP') and result['omega_is_sharded'] == 'DTensor'  # really sharded
    assert result['max_abs_diff'] <= 1e-5, result
    assert result['fusion_loss'] == pytest.approx((1 + 4 / 7) / 2, rel=1e-6)  # the Kronecker init's loss

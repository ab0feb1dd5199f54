"""model.load_on_rank0 with 2 real processes (FSDP2 on gloo): rank 0 reads the pretrained folder, rank 1 builds the
model on the meta device, Composer broadcasts rank 0's weights while sharding, and training follows exactly the
losses of the old path where every rank loads the whole model. The algorithms whose surgery runs at Event.INIT
(before sharding, so on rank 1's meta model) and the distillation teacher go through the same path."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from helpers import SEQ_LEN, TINY_MAP, run_composer, tiny_recipe, write_recipe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BATCHES = 3
# One case keeps the suite short: it loads a plain pretrained LLaMA as every other launch does (they all take the
# rank-0 path now) and adds the two things that must work on the meta device. Progressive fusion splits the head-map
# groups by head distance at INIT, which rank 1 cannot compute without weights; its new fusion weights are made on the
# meta device there. The teacher is loaded at FIT_START and sharded like the student.
CASES = {
    'progressive_fusion_and_teacher': lambda tmp_path, pretrained: {
        'head_fusion': {'head_map': str(TINY_MAP.save(tmp_path / 'head_map.json')), 'progressive': [2]},
        'distillation': {'teacher_path': str(pretrained), 'top_k': 8}},
}


def _pretrained(path, tokenizer_dir):
    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN)
    LlamaForCausalLM(config).save_pretrained(path)  # safetensors
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def _train(tmp_path, data_root, tokenizer_dir, algorithms: dict, load_on_rank0: bool):
    run = tmp_path / f'load_on_rank0_{load_on_rank0}'
    run.mkdir()
    recipe = tiny_recipe(data_root, tokenizer_dir, max_duration=f'{BATCHES}ba', fsdp={'enabled': True},
                         algorithms=algorithms, callbacks={'memory_probe': {'out': str(run / 'memory')}})
    recipe['model'] = {'pretrained_path': str(tmp_path / 'pretrained'), 'load_on_rank0': load_on_rank0}
    done = run_composer(2, write_recipe(run / 'recipe.yaml', recipe), log=run / 'log.txt')
    log = (run / 'log.txt').read_text()
    assert done.returncode == 0, log[-4000:]
    losses = [float(x) for x in re.findall(r'loss/train/total: ([-+0-9.eEnaif]+)', log)]
    assert len(losses) == BATCHES, log[-4000:]
    ranks = [json.loads((run / 'memory' / f'rank{rank}.json').read_text()) for rank in (0, 1)]
    return losses, ranks


@pytest.mark.parametrize('case', sorted(CASES))
def test_rank1_builds_on_meta_and_trains_exactly_like_every_rank_loading(case, tmp_path, data_root, tokenizer_dir):
    pretrained = _pretrained(tmp_path / 'pretrained', tokenizer_dir)
    algorithms = CASES[case](tmp_path, pretrained)
    new_losses, new_ranks = _train(tmp_path, data_root, tokenizer_dir, algorithms, load_on_rank0=True)
    old_losses, old_ranks = _train(tmp_path, data_root, tokenizer_dir, algorithms, load_on_rank0=False)

    assert [rank['built_on_meta'] for rank in new_ranks] == [False, True]
    assert all(rank['sync_module_states'] for rank in new_ranks)  # Composer broadcast from rank 0
    assert [rank['built_on_meta'] for rank in old_ranks] == [False, False]
    assert not any(rank['sync_module_states'] for rank in old_ranks)
    # Rank 1's weights came from rank 0 (uninitialised memory would not give these losses), at every step.
    assert new_losses == pytest.approx(old_losses, rel=1e-6, abs=1e-6), (new_losses, old_losses)

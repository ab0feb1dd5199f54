"""`dha-train plan`: the per-rank peak of a recipe on fake tensors under a fake process group. Checked against an
independent FSDPMemTracker run of the same model, micro-batch and checkpointing; a recipe that cannot fit is refused
in one line; the closed forms (checkpoint bytes, FLOPs per token, wall time) hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dha_train.cli import main
from dha_train.plan import GIB, plan_recipe
from helpers import REPO

RECIPE = REPO / 'yamls' / 'pretrain' / 'llama2_7b_cpt.yaml'
# LLaMA-2-7B's width, vocabulary and sequence, 2 layers: the plan's arithmetic at the real shapes, in seconds
SHAPE = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 4096,
         'intermediate_size': 11008, 'num_hidden_layers': 2, 'num_attention_heads': 32, 'num_key_value_heads': 32,
         'vocab_size': 32000, 'max_position_embeddings': 4096, 'tie_word_embeddings': False}


@pytest.fixture
def config_only(tmp_path):
    folder = tmp_path / 'llama-2-layers'
    folder.mkdir()
    (folder / 'config.json').write_text(json.dumps(SHAPE))  # no weights, no tokenizer: a plan needs neither
    return folder


def _overrides(folder, tmp_path, *extra):
    return [f'variables.model_path={folder}', f'variables.data_root={tmp_path / "no-data"}',
            f'variables.save_root={tmp_path / "ckpt"}', *extra]


def _independent_peak(world_size: int, microbatch: int) -> int:
    """The same model under FSDPMemTracker, built without dha_train: HF from its config, Composer's own activation
    checkpointing wrapper, torch's fully_shard with bf16 parameters, torch's AdamW."""
    import torch.distributed as dist
    from composer.distributed.activation_checkpointing import apply_ac
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group('fake', rank=0, world_size=world_size, store=FakeStore())
    try:
        mesh = init_device_mesh('cpu', (world_size,))
        config = LlamaConfig(**{k: v for k, v in SHAPE.items() if k not in ('architectures', 'model_type')})
        config._attn_implementation = 'sdpa'
        with FakeTensorMode():
            model = LlamaForCausalLM(config)
            for layer in model.model.layers:
                layer._activation_checkpointing = True
            apply_ac(model, True, False, check_fn=lambda module: getattr(module, '_activation_checkpointing', False))
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            tracker = FSDPMemTracker(model, optimizer)
            with tracker:
                for step in range(2):
                    ids = torch.randint(0, config.vocab_size, (microbatch, config.max_position_embeddings))
                    # the outputs stay referenced through backward, as Composer's state.outputs keeps them
                    outputs = model(input_ids=ids, labels=ids, use_cache=False)
                    outputs.loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    del outputs
                    if step == 0:
                        tracker.reset_mod_stats()
            return next(iter(tracker.get_tracker_snapshot('peak').values()))['Total']
    finally:
        dist.destroy_process_group()


def test_the_plan_equals_an_independent_tracker_run_and_its_closed_forms(config_only, tmp_path):
    plan = plan_recipe(str(RECIPE), _overrides(config_only, tmp_path, 'global_train_batch_size=16',
                                                         'device_train_microbatch_size=2'),
                       world_size=8, gpu='a100-80g')
    # in a process of its own: an in-process run earlier in the session leaves Composer's process group behind
    done = subprocess.run([sys.executable, __file__, '8', '2'], capture_output=True, text=True,
                          env={**os.environ, 'PYTHONPATH': os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    independent = int(done.stdout.split()[-1]) / GIB
    assert plan['microbatch'] == 2 and plan['activation_checkpointing'] and plan['precision'] == 'amp_bf16'
    assert plan['peak_gib'] == pytest.approx(independent, rel=0.01), (plan['peak_gib'], independent)  # issue: 10%
    parameters = 2 * 32000 * 4096 + 2 * (4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096) + 4096
    assert plan['parameters'] == parameters
    # fp32 weights + Adam's two moments, summed over the 8 ranks' shards
    assert plan['checkpoint_gib'] * GIB == pytest.approx(12 * parameters, rel=1e-3)
    assert plan['flops_per_token'] == 6 * parameters + 12 * 2 * 32 * 128 * 4096
    assert plan['tokens_per_s'] == pytest.approx(0.4 * 312e12 * 8 / plan['flops_per_token'])
    assert plan['wall_hours'] == pytest.approx(5000 * 16 * 4096 / plan['tokens_per_s'] / 3600)
    assert plan['fits'] and plan['largest_microbatch'] == 2  # the per-rank batch is 2
    categories = plan['by_category_gib']
    assert categories['optimizer'] == pytest.approx(8 * parameters / 8 / GIB, rel=0.02)  # two fp32 moments, 1/8
    assert categories['teacher'] == 0


def test_a_recipe_that_cannot_fit_is_refused_in_one_line(tmp_path, capsys):
    llama2_7b = tmp_path / 'llama-2-7b'  # all 32 layers (tracked at 3 and 4, extrapolated)
    llama2_7b.mkdir()
    (llama2_7b / 'config.json').write_text(json.dumps({**SHAPE, 'num_hidden_layers': 32}))
    code = main(['plan', str(RECIPE), *_overrides(llama2_7b, tmp_path, 'global_train_batch_size=512',
                                                  'device_train_microbatch_size=64')])
    captured = capsys.readouterr()
    assert code == 2
    error = captured.err.strip().splitlines()
    assert len(error) == 1 and 'does not fit on A100 80GB' in error[0]  # 64 x 4096 a rank: 193 GiB
    assert 'use device_train_microbatch_size=16' in error[0]  # what to change: the largest that fits
    assert 'DOES NOT FIT' in captured.out


def test_bad_plan_settings_are_one_line_errors(config_only, tmp_path, capsys):
    for extra, message in ((['--world-size', '3'], 'not divisible by --world-size 3'),
                           (['--gpu', 'v100'], '--gpu must be one of'),
                           (['--mfu', '1.5'], '--mfu must be in'),
                           (['--seq-len', '8192'], '--seq-len must be in 1..4096')):
        assert main(['plan', str(RECIPE), *_overrides(config_only, tmp_path), *extra]) == 2
        assert message in capsys.readouterr().err


if __name__ == '__main__':
    print(_independent_peak(int(sys.argv[1]), int(sys.argv[2])))


def test_the_default_sequence_is_the_data_folders_and_the_models_context_without_one(config_only, tmp_path,
                                                                                     data_root):
    """A user who prepared data at seq 256 for a model of context 4096 gets a plan at 256 without --seq-len."""
    import json

    from dha_train.config import load_config
    from dha_train.plan import _data_seq_len
    prepared = json.loads((data_root / 'manifest.json').read_text())['seq_len']
    with_data = load_config(str(RECIPE), [f'variables.model_path={config_only}', f'variables.data_root={data_root}',
                                          f'variables.save_root={tmp_path / "ckpt"}'])
    assert _data_seq_len(with_data) == prepared != SHAPE['max_position_embeddings']
    assert _data_seq_len(load_config(str(RECIPE), _overrides(config_only, tmp_path))) is None  # no folder: context


def test_attention_flops_read_deepseeks_query_key_and_value_widths():
    """DeepSeek's format scores with qk_nope + qk_rope wide heads and mixes values v_head_dim wide; transformers'
    DeepseekV3Config sets head_dim to qk_rope_head_dim, which counted a fraction of both products."""
    from transformers import DeepseekV3Config

    from dha_train.plan import flops_per_token

    config = DeepseekV3Config(hidden_size=576, num_attention_heads=9, num_hidden_layers=30, qk_nope_head_dim=64,
                              qk_rope_head_dim=32, v_head_dim=64, kv_lora_rank=96, q_lora_rank=None)
    assert config.head_dim == 32
    assert flops_per_token(config, 1000, 0, 256) == 6 * 1000 + 2 * 30 * 9 * (96 * 256 * 3 + 64 * 256 * 3)

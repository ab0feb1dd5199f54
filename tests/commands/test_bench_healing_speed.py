"""`dha-train bench healing-speed` on a tiny source: every arm runs the same two healing stages on the same batches,
its time split into launch, data, compute and end, and the arms' loss curves agree."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.commands.bench.healing_speed import HealingSpeedSettings, run_healing_speed_bench
from helpers import SEQ_LEN

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_every_arm_trains_the_same_curve_and_its_seconds_add_up(tmp_path, tokenizer_dir, data_root):
    torch.manual_seed(0)
    source = tmp_path / 'source'
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(source)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(source)
    settings = HealingSpeedSettings(out=str(tmp_path / 'bench'), source=str(source), batches=3, microbatches=(4,),
                                    train_data=str(data_root), seq_len=SEQ_LEN, batch=4, microbatch=2,
                                    val_tokens=4 * SEQ_LEN)
    results = run_healing_speed_bench(settings)
    assert list(results['arms']) == ['fsdp-1p', 'fsdp-2p', 'plain-1p', 'plain-1p-mb4']
    for name, arm in results['arms'].items():
        assert list(arm['stages']) == ['transfer', 'kl']
        for stage in arm['stages'].values():
            assert stage['tokens'] == 3 * 4 * SEQ_LEN
            assert len(stage['losses']) == 3 and all(loss > 0 for loss in stage['losses'])
            parts = stage['launch_s'] + stage['data_s'] + stage['compute_s'] + stage['fit_other_s'] + stage['end_s']
            assert min(stage['launch_s'], stage['data_s'], stage['compute_s'], stage['end_s']) > 0
            assert parts == pytest.approx(stage['seconds'], rel=0.05)
        # the same batches from the same start. In one process at the same micro-batch, FSDP2 or not: one loss
        # curve. Two processes group a batch's sequences into other micro-batches, as another micro-batch size does:
        # the same objective, whose normalised MSE and KL are means over micro-batches, so near the same curve
        same_grouping = arm['processes'] == 1 and arm['microbatch'] == results['microbatch']
        for stage, difference in arm['loss_curve_max_relative_difference'].items():
            assert difference < (1e-5 if same_grouping else 0.05), (name, stage, difference)
        assert arm['chain']['tokens'] == 2 * 3 * 4 * SEQ_LEN
    assert results['arms']['fsdp-1p']['chain']['speedup'] == 1.0

"""MLA end to end: launch/mla.sh converts a tiny GQA LLaMA to multi-head latent attention (calibrated, half its
cache), continues pre-training with 2 processes (FSDP2, gloo) with distillation from the source (the optional part:
the teacher is sharded next to the MLA student), and the export loads with trust_remote_code in a process without
dha_train, giving the logits the project's class gives."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import REPO, launcher_env, logged, logits_without_dha_train, save_tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

def test_convert_then_ct_with_two_processes_then_export_loads_without_the_package(tmp_path, data_root,
                                                                                   tokenizer_dir):
    from dha_train.export import export_hf

    source = tmp_path / 'tiny-gqa'
    save_tiny_llama(source, tokenizer_dir, num_key_value_heads=4)

    env = launcher_env(MLA_ARGS='--rope-pairs 1 --tokens 512 --batch-size 4 --rank-step 4')
    save_root = tmp_path / 'runs'
    done = subprocess.run(
        ['bash', 'launch/mla.sh', str(source), '0.5', str(data_root), str(save_root), '2', 'yamls/mla/tiny_ct.yaml',
         'max_duration=8ba', 'eval_interval=8ba', 'save_interval=4ba', 'console_log_interval=4ba',
         f'algorithms.distillation.teacher_path={source}', 'algorithms.distillation.lm_weight=1.0'],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]

    init = AutoModelForCausalLM.from_pretrained(save_root / 'tiny-gqa-mla0.5-init').config
    assert init.model_type == 'mla_llama'
    cached = sum(init.mla_ranks) + 2 * 4 * 2 * 1  # latents + 1 rotated pair of each of the 4 K/V heads, 2 layers
    assert cached <= 0.5 * 2 * 2 * 4 * 8
    evals = logged(log, 'metrics/eval_github/LanguageCrossEntropy')
    assert len(evals) == 2 and all(math.isfinite(v) for v in evals) and evals[1] < evals[0], evals
    kl = logged(log, 'distill/kl')
    assert kl and all(math.isfinite(v) and v >= 0 for v in kl), log[-4000:]

    exported = export_hf(save_root / 'tiny-gqa-mla0.5-ct', tmp_path / 'hf')
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    assert type(model).__name__ == 'MlaLlamaForCausalLM' and model.config.mla_ranks == init.mla_ranks
    ids = torch.randint(0, 384, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits

    torch.testing.assert_close(logits_without_dha_train(exported, ids, tmp_path), expected, rtol=0, atol=1e-5)

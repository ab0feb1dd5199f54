"""TransMLA's own converter for `bench mla-zero`: run unchanged from a checkout, in a subprocess, on the calibration
rows the project's conversions read; its folder adopted as transformers' ``DeepseekV3ForCausalLM`` (its latent norm
set aside) and checked against its own classes; and the (RoPE key width, FreqFold) settings its converter accepts."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from dha_train.bench_runner import model_config
from dha_train.config import ConfigError
from dha_train.evaluation import load_model

TRANSMLA_DEFAULTS = (64, 4)  # (qk_mqa_dim, freqfold): its one 64-dim shared RoPE key, the fold its scripts pass
CALIBRATION_BATCH = 8  # rows per calibration batch, for every row (TransMLA's loader included)


def calibration_sequences(source: Path, data: Path, tokens: int, batch_size: int, seed: int) -> torch.Tensor:
    """The token rows the project's conversions calibrate on (``calibration.calibrate`` over
    ``calibration_batches`` with the same data, batch size and seed: whole rows until ``tokens``)."""
    from dha_train.calibration import calibration_batches

    rows, count = [], 0
    stream = calibration_batches(source, model_config(source), data=str(data), split='train', batch_size=batch_size,
                                 seed=seed, who='bench mla-zero')
    try:
        for batch in stream:
            ids = batch['input_ids']
            needed = -(-(tokens - count) // ids.shape[1])
            rows.append(ids[:needed])
            count += rows[-1].numel()
            if count >= tokens:
                break
    finally:
        stream.close()
    if count < tokens:
        raise ConfigError(f'bench mla-zero: the calibration data gave {count} tokens, fewer than {tokens}')
    return torch.cat(rows)


def check_transmla(checkout: Path) -> Path:
    """The folder TransMLA's converter runs from (``<checkout>/transmla``, holding ``transmla/converter.py``)."""
    for candidate in (checkout / 'transmla', checkout):
        if (candidate / 'transmla' / 'converter.py').is_file():
            return candidate
    raise ConfigError(f'bench mla-zero: --transmla {checkout} is not a TransMLA checkout (no transmla/converter.py '
                      'under it or its transmla/ folder)')


def run_transmla(checkout: Path, python: str, source: Path, sequences: Path, out: Path, rank: int,
                 rope_dim: int, freq_fold: int, reference: Path) -> None:
    """TransMLA's ``converter.main`` in a subprocess (its modules import each other by bare name, and it copies
    modeling files by paths relative to its folder), fed ``sequences`` as its calibration loader. Then, in the same
    subprocess, its converted model through its own classes, taken from the checkout (never from the folder it
    wrote): the logits of the first two calibration rows, saved to ``reference``, which ``adopt_transmla`` must
    reproduce."""
    folder = check_transmla(checkout)
    classes = folder / 'transmla' / 'transformers'
    program = f'''
import argparse, shutil, sys, torch
sys.path.insert(0, {str(folder / 'transmla')!r})
import converter
ids = torch.load({str(sequences)!r})
step = {CALIBRATION_BATCH}
batches = [{{'input_ids': ids[i:i + step], 'attention_mask': torch.ones_like(ids[i:i + step])}} for i in range(0, len(ids), step)]
converter.get_dataset_loader = lambda tokenizer, **kwargs: (batches, None)
converter.main(argparse.Namespace(
    model_path={str(source)!r}, save_path={str(out)!r}, dtype='fp32', device='cpu', cal_dataset='local',
    cal_nsamples=len(ids), cal_batch_size=step, cal_max_seqlen=ids.shape[1], seed=42, ppl_eval_batch_size=0,
    freqfold='{freq_fold}', collapse='auto', qk_mqa_dim={rope_dim}, q_lora_rank=None,
    kv_lora_rank={rank}, balance_kv_ratio=1.0, use_qkv_norm=False, deepseek_style=False))
# its classes as one package, copied from the checkout
import pathlib
package = pathlib.Path({str(reference.parent / 'transmla_classes')!r})
package.mkdir(exist_ok=True)
(package / '__init__.py').write_text('')
for name in ('llama/configuration_llamamla.py', 'llama/modeling_llamamla.py', 'mla.py'):
    shutil.copy(pathlib.Path({str(classes)!r}) / name, package)
sys.path.insert(0, str(package.parent))
from transmla_classes.configuration_llamamla import LlamaMLAConfig
from transmla_classes.modeling_llamamla import LlamaMLAForCausalLM
config = LlamaMLAConfig.from_pretrained({str(out)!r})
model = LlamaMLAForCausalLM.from_pretrained({str(out)!r}, config=config, torch_dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(input_ids=ids[:2]).logits
torch.save({{'input_ids': ids[:2], 'logits': logits}}, {str(reference)!r})
shutil.rmtree(package)
'''
    done = subprocess.run([python, '-c', program], cwd=folder, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f'bench mla-zero: TransMLA\'s converter failed (exit {done.returncode}):\n'
                           f'{done.stderr[-3000:]}')


def transmla_deepseek_config(source_config, transmla: dict):
    """The ``DeepseekV3Config`` transformers' own class computes TransMLA's model with, once its latent norm is set
    aside (``set_latent_norm_aside``): the source's sizes, dense MLPs, TransMLA's latent and RoPE widths, its RoPE
    base, interleaved RoPE (its attention rotates interleaved pairs). Only numbers are read from its config."""
    from transformers import DeepseekV3Config

    numbers = {key: transmla[key] for key in ('kv_lora_rank', 'qk_rope_head_dim', 'qk_nope_head_dim', 'v_head_dim',
                                              'rope_theta', 'rms_norm_eps')}
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in numbers.values()) or (
            transmla.get('q_lora_rank') is not None or transmla.get('rope_scaling') is not None):
        raise RuntimeError(f'bench mla-zero: TransMLA wrote a config this bench does not read: {numbers}, '
                           f'q_lora_rank {transmla.get("q_lora_rank")!r}, rope_scaling {transmla.get("rope_scaling")!r}')
    c = source_config
    return DeepseekV3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_attention_heads, n_shared_experts=1,
        n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
        first_k_dense_replace=c.num_hidden_layers, q_lora_rank=None, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rope_scaling=None, rope_interleave=True,
        attention_bias=False, attention_dropout=c.attention_dropout, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        initializer_range=c.initializer_range, torch_dtype='float32', **numbers)


def set_latent_norm_aside(model) -> None:
    """Each layer's latent norm replaced by the identity: TransMLA's latent has none (``use_qkv_norm`` off, as its
    scripts run it)."""
    for layer in model.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()


def adopt_transmla(written: Path, out: Path, source: Path, reference: Path, tolerance: float = 1e-3) -> dict:
    """TransMLA's folder as one this project loads without its code: our config (``transmla_deepseek_config``), its
    weights with a unit latent-norm weight per layer (set aside when scored), the source's tokenizer. The model is
    checked against TransMLA's own: the largest logit difference on the reference rows must be under ``tolerance``
    (float32), or the bench stops."""
    from safetensors.torch import load_file, save_file

    transmla = json.loads((written / 'config.json').read_text())
    config = transmla_deepseek_config(model_config(source), transmla)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    weights = load_file(str(written / 'model.safetensors'))
    for layer in range(config.num_hidden_layers):
        weights[f'model.layers.{layer}.self_attn.kv_a_layernorm.weight'] = torch.ones(config.kv_lora_rank)
    save_file(weights, str(out / 'model.safetensors'), metadata={'format': 'pt'})
    for name in ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json'):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    model, _ = load_model(out)
    set_latent_norm_aside(model)
    expected = torch.load(reference)
    with torch.no_grad():
        logits = model(input_ids=expected['input_ids']).logits
    difference = float((logits - expected['logits']).abs().max())
    if not difference < tolerance:
        raise RuntimeError(f'bench mla-zero: {out} does not compute TransMLA\'s model: its logits differ from '
                           f'TransMLA\'s own by up to {difference:.3g} (tolerance {tolerance})')
    return {'reference_max_abs_logit_difference': difference}


def transmla_candidates(head_dim: int, rope_dims: Sequence[int], folds: Sequence[int],
                        numbers: int) -> list[tuple[int, int]]:
    """The (RoPE key width, FreqFold) settings TransMLA's converter accepts for a head of ``head_dim`` at a budget of
    ``numbers`` cached numbers: the width divides the head (its ``collapse`` is head_dim / width), the fold is a
    multiple of that collapse and divides the head's pairs, and a latent rank is left."""
    chosen = []
    for width in rope_dims:
        if width < 1 or head_dim % width or width >= numbers:
            continue
        collapse = head_dim // width
        chosen += [(width, fold) for fold in folds
                   if fold >= 1 and fold % collapse == 0 and (head_dim // 2) % fold == 0]
    return chosen


def choose_on_validation(search: Sequence[dict]) -> dict:
    """The search entry with the lowest validation loss (the first of equals)."""
    return min(search, key=lambda entry: entry['loss']['validation'])

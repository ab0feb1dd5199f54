"""`dha-train bench mla-zero` and what it is built from: per-layer attention errors that isolate each layer, the
calibration sequences TransMLA is fed (the ones the project's conversions calibrate on), the text folders, TransMLA's
settings search, the adoption of its folder without its code, and a small run on a tiny GQA LLaMA (TransMLA stood in by
a checkout whose converter writes a DeepSeek-layout model without latent norm, sharper the further its width and fold
are from 4 and 2, and whose own classes compute that model)."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.calibration import calibrate, calibration_batches
from dha_train.commands.bench.mla_zero import MlaZeroSettings, run_mla_zero_bench
from dha_train.commands.bench.mla_zero_rows import paired_rows
from dha_train.commands.bench.transmla_runner import (
    adopt_transmla,
    calibration_sequences,
    check_transmla,
    choose_on_validation,
    run_transmla,
    transmla_candidates,
)
from dha_train.config import ConfigError
from dha_train.evaluation import attention_output_errors
from dha_train.harness import LOCAL_TASK, build_local_task
from dha_train.heldout_texts import text_documents, text_files
from helpers import SEQ_LEN, save_tiny_smollm2_shape, write_redpajama_jsonl


def _tiny(layers: int = 3, heads: int = 4, kv_heads: int = 2, head_dim: int = 8, vocab: int = 96) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=48,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def test_attention_output_errors_are_each_layers_own_error():
    teacher = _tiny()
    same = copy.deepcopy(teacher)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    assert max(attention_output_errors(teacher, same, ids)) < 1e-6

    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student.model.layers[1].self_attn.q_proj.weight.mul_(1.7)
    errors = attention_output_errors(teacher, student, ids)
    # the layers before and after the changed one read the teacher's inputs: no error reaches them
    assert errors[0] < 1e-6 and errors[2] < 1e-6
    # layer 1's error in closed form: both attentions on the teacher's normed input to that layer (causal, no mask)
    with torch.no_grad():
        hidden = teacher(input_ids=ids, output_hidden_states=True).hidden_states[1]
        normed = teacher.model.layers[1].input_layernorm(hidden)
        positions = torch.arange(ids.shape[1])[None]
        rope = teacher.model.rotary_emb(normed, positions)
        want, _ = teacher.model.layers[1].self_attn(hidden_states=normed, position_embeddings=rope, attention_mask=None)
        got, _ = student.model.layers[1].self_attn(hidden_states=normed, position_embeddings=rope, attention_mask=None)
    expected = float((got - want).norm() / want.norm())
    assert expected > 1e-3
    assert math.isclose(errors[1], expected, rel_tol=1e-5)


def test_attention_output_errors_refuse_models_of_other_depths():
    with pytest.raises(Exception, match='layers'):
        attention_output_errors(_tiny(layers=2), _tiny(layers=3), torch.zeros(1, 4, dtype=torch.long))


def test_text_documents_keep_visible_text_of_html_and_text_files(tmp_path):
    body = 'Ownership rules &amp; borrowing. ' * 80
    (tmp_path / 'ch01.html').write_text(f'<html><head><title>t</title></head><body><nav>Menu Next</nav>'
                                        f'<script>var x = 1;</script><p>{body}</p><pre>fn main() {{}}</pre></body>')
    (tmp_path / 'notes.txt').write_text('plain text line\n' * 200)
    (tmp_path / 'perlfaq.pod').write_text('=head1 NAME\n\nHow do I read a file?\n' * 80)
    (tmp_path / 'short.md').write_text('too short')
    (tmp_path / 'code.py').write_text('x = 1\n' * 1000)
    (tmp_path / 'sub').mkdir()
    (tmp_path / 'sub' / 'copy.txt').write_text('plain text line\n' * 200)  # the same text twice is kept once
    found = text_documents(text_files(str(tmp_path)))
    documents = dict((meta['path'].rsplit('/', 1)[1], text) for text, meta in found)
    assert sorted(documents) == ['ch01.html', 'notes.txt', 'perlfaq.pod']
    # a glob picks files: only the chapters; ** reaches into folders
    assert [meta['path'] for _, meta in text_documents(text_files(str(tmp_path / 'ch*.html')))] == [
        str(tmp_path / 'ch01.html')]
    assert text_files(str(tmp_path / '**' / '*.txt')) == [tmp_path / 'notes.txt', tmp_path / 'sub' / 'copy.txt']
    page = documents['ch01.html']
    assert 'Ownership rules & borrowing.' in page and 'fn main() {}' in page
    assert 'Menu' not in page and 'var x' not in page and '<p>' not in page


def test_the_calibration_sequences_are_the_rows_the_conversions_calibrate_on(tmp_path, tokenizer_dir, data_root):
    model = _tiny(vocab=384, layers=1)
    model.config.max_position_embeddings = 512
    model.save_pretrained(tmp_path / 'tiny')
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / 'tiny')
    tokens = 5 * SEQ_LEN + 7  # not whole rows: the last row is taken whole, as calibrate runs it
    fed = []
    model.register_forward_pre_hook(lambda module, args, kwargs: fed.append(kwargs['input_ids']), with_kwargs=True)
    batches = calibration_batches(tmp_path / 'tiny', model.config, data=str(data_root), split='train', batch_size=4,
                                  seed=5)
    calibrate(model, batches, num_tokens=tokens, kinds=('input',), sample_tokens=0, seed=5)
    sequences = calibration_sequences(tmp_path / 'tiny', data_root, tokens, batch_size=4, seed=5)
    assert torch.equal(sequences, torch.cat(fed))
    assert sequences.shape == (6, SEQ_LEN)
    with pytest.raises(ConfigError, match='fewer than'):
        calibration_sequences(tmp_path / 'tiny', data_root, 10 ** 7, batch_size=4, seed=5)


def test_a_folder_without_transmlas_converter_is_refused(tmp_path):
    with pytest.raises(ConfigError, match='not a TransMLA checkout'):
        check_transmla(tmp_path)
    (tmp_path / 'transmla' / 'transmla').mkdir(parents=True)
    (tmp_path / 'transmla' / 'transmla' / 'converter.py').write_text('')
    assert check_transmla(tmp_path) == tmp_path / 'transmla'


def test_transmla_settings_are_those_its_converter_accepts():
    # SmolLM2's 64-dim heads at a third (128 numbers): a width of w collapses 64 / w dims, so the fold is a multiple
    # of that; the fold divides the head's 32 pairs; a width that fills the budget leaves no latent
    assert transmla_candidates(64, (16, 32, 64), (2, 4, 8), numbers=128) == [
        (16, 4), (16, 8), (32, 2), (32, 4), (32, 8), (64, 2), (64, 4), (64, 8)]
    assert transmla_candidates(64, (48, 64), (2, 3, 4), numbers=64) == []
    assert transmla_candidates(8, (2, 4, 8), (2, 4), numbers=16) == [(2, 4), (4, 2), (4, 4), (8, 2), (8, 4)]


def test_transmla_is_chosen_on_validation_alone():
    search = [{'qk_rope_head_dim': 64, 'loss': {'validation': 4.2, 'heldout_fresh': 3.0}},
              {'qk_rope_head_dim': 32, 'loss': {'validation': 4.1, 'heldout_fresh': 3.9}},
              {'qk_rope_head_dim': 16, 'loss': {'validation': 4.1, 'heldout_fresh': 3.5}}]
    assert choose_on_validation(search) is search[1]  # lowest on validation, the first of equals; held-out unread


def test_paired_rows_are_each_row_minus_the_reference_on_the_same_sequences(tmp_path):
    import json

    from dha_train.data.prep import MANIFEST_NAME

    reference = {'label': 'TransMLA', 'budget': 'kv1', 'sequence_losses': {'fresh': {'d': [3.0, 4.0, 5.0, 6.0]}}}
    better = {'label': 'ours', 'budget': 'kv1', 'sequence_losses': {'fresh': {'d': [2.9, 3.8, 4.7, 5.6]},
                                                                      'book': {'d': [1.0, 2.0]}}}
    other_budget = {**better, 'label': 'ours kv2', 'budget': 'kv2'}
    texts = {}
    for text, documents in (('fresh', [0, 1, 2, 3]), ('book', [0, 1])):  # each sequence its own document
        (tmp_path / text).mkdir()
        (tmp_path / text / MANIFEST_NAME).write_text(json.dumps({'domains': {'d': {'val': {
            'sample_documents': documents}}}}))
        texts[text] = tmp_path / text
    paired = paired_rows([reference, better, other_budget], reference, texts, seed=0)
    assert [(entry['row'], entry['text']) for entry in paired] == [('ours', 'fresh')]  # one text in common
    assert math.isclose(paired[0]['difference'], -0.25)
    low, high = paired[0]['ci95']
    assert -0.4 <= low <= -0.25 <= high <= -0.1
    # two sequences of one document move together: resampled as one, the interval covers only the two documents' means
    (tmp_path / 'fresh' / MANIFEST_NAME).write_text(json.dumps({'domains': {'d': {'val': {
        'sample_documents': [0, 0, 1, 1]}}}}))
    (entry,) = paired_rows([reference, better], reference, texts, seed=0)
    assert {round(v, 6) for v in entry['ci95']} <= {-0.15, -0.35, -0.25}


# A stand-in for TransMLA's checkout: its converter writes a DeepseekV3-layout model with no latent norm and
# TransMLA's config keys (auto_map to its own modeling file, qk_latent_layernorm off), its sharpness set by the width
# and fold (the closer to a 4-dim key with fold 2, the lower the loss); its "own classes" compute that model.
FAKE_CONVERTER = """
import json
import shutil
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig

get_dataset_loader = None  # the bench replaces it with its calibration rows


def main(args):
    batches, _ = get_dataset_loader(None)
    assert sum(len(batch['input_ids']) for batch in batches) == args.cal_nsamples
    source = LlamaConfig.from_pretrained(args.model_path)
    config = DeepseekV3Config(
        vocab_size=source.vocab_size, hidden_size=source.hidden_size, intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers, num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_attention_heads, n_routed_experts=1, n_shared_experts=1, num_experts_per_tok=1,
        n_group=1, topk_group=1, first_k_dense_replace=source.num_hidden_layers, kv_lora_rank=args.kv_lora_rank,
        q_lora_rank=None, qk_rope_head_dim=args.qk_mqa_dim, qk_nope_head_dim=source.head_dim,
        v_head_dim=source.head_dim, rope_theta=source.rope_theta, rms_norm_eps=source.rms_norm_eps,
        max_position_embeddings=source.max_position_embeddings, tie_word_embeddings=source.tie_word_embeddings,
        rope_interleave=True, rope_scaling=None)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    for layer in model.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    with torch.no_grad():
        model.model.norm.weight.fill_(1 + 100 * (0.05 * abs(args.qk_mqa_dim - 4) + 0.02 * int(args.freqfold)))
    model.save_pretrained(args.save_path)
    written = json.loads((Path(args.save_path) / 'config.json').read_text())
    written.update(auto_map={'AutoConfig': 'configuration_llamamla.LlamaMLAConfig',
                             'AutoModelForCausalLM': 'modeling_llamamla.LlamaMLAForCausalLM'},
                   qk_latent_layernorm=False, architectures=['LlamaMLAForCausalLM'])
    (Path(args.save_path) / 'config.json').write_text(json.dumps(written))
    for name in Path(args.model_path).iterdir():
        if name.name.startswith(('tokenizer', 'special_tokens')):
            shutil.copy(name, args.save_path)
"""
FAKE_MODELING = """
import torch
from transformers import DeepseekV3ForCausalLM


class LlamaMLAForCausalLM(DeepseekV3ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn.kv_a_layernorm = torch.nn.Identity()
"""


def write_fake_transmla(root):
    package = root / 'transmla' / 'transmla'
    (package / 'transformers' / 'llama').mkdir(parents=True)
    (package / 'converter.py').write_text(FAKE_CONVERTER)
    (package / 'transformers' / 'llama' / 'configuration_llamamla.py').write_text(
        'from transformers import DeepseekV3Config as LlamaMLAConfig\n')
    (package / 'transformers' / 'llama' / 'modeling_llamamla.py').write_text(FAKE_MODELING)
    (package / 'transformers' / 'mla.py').write_text('')
    return root


def test_transmlas_folder_is_adopted_without_its_code_and_checked_against_its_own_classes(tmp_path, tokenizer_dir):
    import sys

    source = save_tiny_smollm2_shape(tmp_path / 'gqa', tokenizer_dir)
    checkout = write_fake_transmla(tmp_path / 'checkout')
    sequences = tmp_path / 'calibration.pt'
    torch.save(torch.randint(0, 384, (4, 16), generator=torch.Generator().manual_seed(0)), sequences)
    run_transmla(checkout, sys.executable, source, sequences, tmp_path / 'written', rank=12, rope_dim=4, freq_fold=2,
                 reference=tmp_path / 'reference.pt')
    assert 'auto_map' in json.loads((tmp_path / 'written' / 'config.json').read_text())
    check = adopt_transmla(tmp_path / 'written', tmp_path / 'adopted', source, tmp_path / 'reference.pt')
    assert check['reference_max_abs_logit_difference'] < 1e-5
    adopted = json.loads((tmp_path / 'adopted' / 'config.json').read_text())
    assert 'auto_map' not in adopted and adopted['kv_lora_rank'] == 12 and adopted['qk_rope_head_dim'] == 4
    assert not list((tmp_path / 'adopted').glob('*.py'))
    # a reference its model does not compute (here: another model's logits) stops the bench
    reference = torch.load(tmp_path / 'reference.pt')
    torch.save({**reference, 'logits': reference['logits'] * 1.01}, tmp_path / 'reference.pt')
    with pytest.raises(RuntimeError, match="does not compute TransMLA's model"):
        adopt_transmla(tmp_path / 'written', tmp_path / 'again', source, tmp_path / 'reference.pt')


def numbers_at_kv1(rope_dim: int) -> int:
    return 2 * 3 * 8 // 3 - rope_dim  # the tiny shape's K+V numbers a token, a third of them, less the RoPE key


@pytest.mark.slow
def test_bench_mla_zero_scores_every_row_on_every_text_at_its_budget(tmp_path, tokenizer_dir, data_root):
    save_tiny_smollm2_shape(tmp_path / 'gqa', tokenizer_dir)
    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=120, seed=4)
    task = build_local_task(raw, tmp_path / 'task', examples=4, fewshot_examples=1, max_words=60)
    for name in ('validation', 'headers', 'markdown', 'book', 'fresh'):
        (tmp_path / name).mkdir()
        for index in range(12):  # documents of 2,000+ characters, enough that the split's cuts span several
            (tmp_path / name / f'{index}.txt').write_text(f'{name} text number {index}. ' * 120)
    write_fake_transmla(tmp_path / 'transmla')
    settings = MlaZeroSettings(
        out=str(tmp_path / 'bench'), budgets=('kv1',), rows=('deepseek', 'mean_pool_refit', 'transmla'),
        validation=str(tmp_path / 'validation'), book=str(tmp_path / 'book'), fresh=str(tmp_path / 'fresh'),
        headers=str(tmp_path / 'headers'), markdown=str(tmp_path / 'markdown'), transmla_rope_dims=(4, 8), transmla_folds=(2, 4), tokens=2 * SEQ_LEN,
        text_tokens=2 * SEQ_LEN, text_seq_len=SEQ_LEN, limit=4, tasks=(LOCAL_TASK,), include=(str(task),),
        source=str(tmp_path / 'gqa'), device='cpu', train_data=str(data_root), seq_len=SEQ_LEN,
        val_tokens=2 * SEQ_LEN, isolate_stages=False)
    without = run_mla_zero_bench(settings)
    assert [row['label'] for row in without['rows']] == ['teacher', 'DeepSeek layout kv1', 'mean-pool + refit kv1']
    assert without['skipped'] == [{'row': 'transmla', 'budget': 'kv1', 'reason': 'no --transmla checkout given'}]
    copy = tmp_path / 'docs' / 'mla_zero.json'
    settings = replace(settings, transmla=str(tmp_path / 'transmla'), results=str(copy))
    results = run_mla_zero_bench(settings)
    # --results: the same bytes as the bench's own results.json, in a folder it makes
    assert copy.read_bytes() == (tmp_path / 'bench' / 'mla_zero' / 'results.json').read_bytes()
    rows = {row['label']: row for row in results['rows']}
    chosen = 'TransMLA 4-dim key, fold 2 (chosen on validation) kv1'
    assert list(rows) == ['teacher', 'DeepSeek layout kv1', 'mean-pool + refit kv1', chosen]
    # every accepted setting was converted and scored; the least perturbed one is lowest on validation
    search = results['transmla_search']
    assert [(e['qk_rope_head_dim'], e['freq_fold']) for e in search] == [(4, 2), (4, 4), (8, 2), (8, 4)]
    assert [e['chosen'] for e in search] == [True, False, False, False]
    assert all(e['reference_max_abs_logit_difference'] < 1e-4 for e in search)  # each the converter's own model
    assert search[0]['loss']['validation'] < min(e['loss']['validation'] for e in search[1:])
    assert rows[chosen]['chosen_on'] == 'validation' and rows[chosen]['kv_lora_rank'] == numbers_at_kv1(4)
    # its row is the searched model, scored the same way: the search's texts, then the rest
    assert set(search[0]['loss']) == {'validation'}
    assert {text: rows[chosen]['loss'][text] for text in search[0]['loss']} == search[0]['loss']
    # the project's rows against TransMLA's chosen setting, on every text, each difference from the sequences
    paired = {(e['row'], e['text']): e for e in results['paired']}
    every_text = {'validation', 'validation_headers', 'validation_markdown', 'heldout_doc', 'heldout_book',
                  'heldout_fresh'}
    assert set(paired) == {(row, text) for row in ('DeepSeek layout kv1', 'mean-pool + refit kv1')
                           for text in every_text}
    entry = paired[('DeepSeek layout kv1', 'heldout_fresh')]
    assert math.isclose(entry['difference'], rows['DeepSeek layout kv1']['loss']['heldout_fresh']
                        - rows[chosen]['loss']['heldout_fresh'], abs_tol=1e-9)
    assert entry['ci95'][0] <= entry['difference'] <= entry['ci95'][1]
    numbers = 2 * 3 * 8
    assert rows['teacher']['numbers'] == numbers and rows['DeepSeek layout kv1']['numbers'] == numbers // 3
    # the DeepSeek latent and its RoPE key fill the budget exactly
    deepseek = rows['DeepSeek layout kv1']
    assert deepseek['kv_lora_rank'] + deepseek['qk_rope_head_dim'] == numbers // 3
    for row in results['rows']:
        assert set(row['loss']) == every_text, row['label']
        assert all(math.isfinite(value) for value in row['loss'].values())
        assert all(row['loss_ci95'][text] > 0 for text in row['loss'])
        assert len(row['layer_errors']) == 2 and row['accuracy'][LOCAL_TASK] is not None
    assert max(rows['teacher']['layer_errors']) < 1e-6
    assert min(deepseek['layer_errors']) > 1e-3  # a third of the cache is not the source
    # the three texts are three folders, and none is the calibration data
    texts = results['texts']
    assert str(tmp_path / 'book') in texts['heldout_book'] and str(tmp_path / 'validation') in texts['validation']
    assert str(tmp_path / 'fresh') in texts['heldout_fresh']
    with pytest.raises(ConfigError, match='--book'):
        run_mla_zero_bench(replace(settings, book=str(tmp_path / 'no-such-book')))
    with pytest.raises(ConfigError, match='no TransMLA setting'):
        run_mla_zero_bench(replace(settings, transmla_rope_dims=(3,)))
    # run again: every stage is reused, the figures are the same
    again = run_mla_zero_bench(settings)
    assert [row['loss'] for row in again['rows']] == [row['loss'] for row in results['rows']]
    # fewer texts and no tasks: the same scores for the texts kept (each text its own stage), no accuracy
    with pytest.raises(ConfigError, match='needs validation'):
        run_mla_zero_bench(replace(settings, texts=('heldout_fresh',)))
    narrow = run_mla_zero_bench(replace(settings, texts=('validation', 'heldout_fresh'), tasks=()))
    for row, full in zip(narrow['rows'], results['rows'], strict=True):
        assert row['loss'] == {text: full['loss'][text] for text in ('validation', 'heldout_fresh')}
        assert row['accuracy'] == {} and row['layer_errors'] == full['layer_errors']


@pytest.mark.slow
def test_the_fixed_default_is_the_candidate_lowest_over_the_validation_texts(tmp_path, tokenizer_dir, data_root):
    # the tiny GQA shape (3 K/V heads of 8) at a third holds no whole 32-value block: the candidates are the
    # unrounded split's two balances, each asked for by name, and the former default (energy) is one of them
    save_tiny_smollm2_shape(tmp_path / 'gqa', tokenizer_dir)
    for name in ('validation', 'headers', 'markdown', 'fresh'):
        (tmp_path / name).mkdir()
        for index in range(12):
            (tmp_path / name / f'{index}.txt').write_text(f'{name} text number {index}. ' * 120)
    settings = MlaZeroSettings(
        out=str(tmp_path / 'bench'), budgets=('kv1',), rows=('deepseek_candidates',),
        validation=str(tmp_path / 'validation'), headers=str(tmp_path / 'headers'),
        markdown=str(tmp_path / 'markdown'), fresh=str(tmp_path / 'fresh'), tokens=2 * SEQ_LEN,
        text_tokens=2 * SEQ_LEN, text_seq_len=SEQ_LEN, tasks=(), source=str(tmp_path / 'gqa'), device='cpu',
        train_data=str(data_root), seq_len=SEQ_LEN, val_tokens=2 * SEQ_LEN, isolate_stages=False,
        texts=('validation', 'validation_headers', 'validation_markdown', 'heldout_fresh'))
    results = run_mla_zero_bench(settings)
    entries = {entry['label']: entry for entry in results['deepseek_candidates']}
    assert set(entries) == {'unrounded split, feature_norm balance', 'unrounded split, energy balance'}
    assert entries['unrounded split, energy balance']['former_default']
    (summary,) = results['fixed_default']
    validation = ('validation', 'validation_headers', 'validation_markdown')
    assert summary['chosen_on'] == list(validation)
    means = {label: sum(entry['loss'][t] for t in validation) / 3 for label, entry in entries.items()}
    assert summary['mean_validation_loss'] == pytest.approx(means) and summary['chosen'] == min(means, key=means.get)
    # the other candidate against the former default on every text, the difference of the two rows' losses
    versus = {entry['text']: entry for entry in summary['against_former_default']}
    assert set(versus) == set(validation) | {'heldout_fresh'}
    other = entries['unrounded split, feature_norm balance']
    former = entries['unrounded split, energy balance']
    for text, entry in versus.items():
        assert entry['label'] == other['label']
        assert entry['difference'] == pytest.approx(other['loss'][text] - former['loss'][text], abs=1e-9)

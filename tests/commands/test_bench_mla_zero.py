"""`dha-train bench mla-zero` and what it is built from: per-layer attention errors that isolate each layer, the
calibration sequences TransMLA is fed (the ones the project's conversions calibrate on), the text folders, and a
small run on a tiny GQA LLaMA."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.bench_runner import text_documents, text_files
from dha_train.calibration import calibrate, calibration_batches
from dha_train.commands.bench.mla_zero import MlaZeroSettings, calibration_sequences, check_transmla, run_mla_zero_bench
from dha_train.config import ConfigError
from dha_train.evaluation import attention_output_errors
from dha_train.harness import LOCAL_TASK, build_local_task
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
    (tmp_path / 'short.md').write_text('too short')
    (tmp_path / 'code.py').write_text('x = 1\n' * 1000)
    (tmp_path / 'sub').mkdir()
    (tmp_path / 'sub' / 'copy.txt').write_text('plain text line\n' * 200)  # the same text twice is kept once
    found = text_documents(text_files(str(tmp_path)))
    documents = dict((meta['path'].rsplit('/', 1)[1], text) for text, meta in found)
    assert sorted(documents) == ['ch01.html', 'notes.txt']
    # a glob picks files: only the chapters
    assert [meta['path'] for _, meta in text_documents(text_files(str(tmp_path / 'ch*.html')))] == [
        str(tmp_path / 'ch01.html')]
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


@pytest.mark.slow
def test_bench_mla_zero_scores_every_row_on_every_text_at_its_budget(tmp_path, tokenizer_dir, data_root):
    save_tiny_smollm2_shape(tmp_path / 'gqa', tokenizer_dir)
    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=120, seed=4)
    task = build_local_task(raw, tmp_path / 'task', examples=4, fewshot_examples=1, max_words=60)
    for name in ('validation', 'book'):
        (tmp_path / name).mkdir()
        for index in range(3):
            (tmp_path / name / f'{index}.txt').write_text(f'{name} text number {index}. ' * 400)
    settings = MlaZeroSettings(
        out=str(tmp_path / 'bench'), budgets=('kv1',), rows=('deepseek', 'mean_pool_refit', 'transmla'),
        validation=str(tmp_path / 'validation'), book=str(tmp_path / 'book'), tokens=2 * SEQ_LEN,
        text_tokens=2 * SEQ_LEN, text_seq_len=SEQ_LEN, limit=4, tasks=(LOCAL_TASK,), include=(str(task),),
        source=str(tmp_path / 'gqa'), device='cpu', train_data=str(data_root), seq_len=SEQ_LEN,
        val_tokens=2 * SEQ_LEN, isolate_stages=False)
    results = run_mla_zero_bench(settings)
    rows = {row['label']: row for row in results['rows']}
    assert list(rows) == ['teacher', 'DeepSeek layout kv1', 'mean-pool + refit kv1']
    assert results['skipped'] == [{'row': 'transmla', 'budget': 'kv1', 'reason': 'no --transmla checkout given'}]
    numbers = 2 * 3 * 8
    assert rows['teacher']['numbers'] == numbers and rows['DeepSeek layout kv1']['numbers'] == numbers // 3
    # the DeepSeek latent and its RoPE key fill the budget exactly
    deepseek = rows['DeepSeek layout kv1']
    assert deepseek['kv_lora_rank'] + deepseek['qk_rope_head_dim'] == numbers // 3
    for row in results['rows']:
        assert set(row['loss']) == {'heldout_doc', 'validation', 'heldout_book'}, row['label']
        assert all(math.isfinite(value) for value in row['loss'].values())
        assert len(row['layer_errors']) == 2 and row['accuracy'][LOCAL_TASK] is not None
    assert max(rows['teacher']['layer_errors']) < 1e-6
    assert min(deepseek['layer_errors']) > 1e-3  # a third of the cache is not the source
    # the three texts are three folders, and none is the calibration data
    texts = results['texts']
    assert str(tmp_path / 'book') in texts['heldout_book'] and str(tmp_path / 'validation') in texts['validation']
    with pytest.raises(ConfigError, match='--book'):
        run_mla_zero_bench(replace(settings, book=str(tmp_path / 'no-such-book')))
    # run again: every stage is reused, the figures are the same
    again = run_mla_zero_bench(settings)
    assert [row['loss'] for row in again['rows']] == [row['loss'] for row in results['rows']]

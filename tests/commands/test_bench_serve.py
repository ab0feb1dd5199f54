"""Serving many sequences at once in llama.cpp, and a cache it can quantize: ``LlamaCppSequences`` (llama.cpp's batch
API, one K/V stream a sequence), ``convert --format deepseek --quantizable-cache``, export-gguf's note on a cache
llama.cpp cannot quantize, and ``dha-train bench serve`` on a stand-in for a bench real folder.

The models are tiny and of 32-dim heads, the size of one block of llama.cpp's quantized cache types, so that a q8_0
cache is possible at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from dha_train.cli import main
from dha_train.engine_process import EngineProcess
from dha_train.llama_cpp_engine import LlamaCppError, LlamaCppModel, LlamaCppSequences
from helpers import save_tiny_llama

pytestmark = pytest.mark.slow

LAYERS, HEAD_DIM, CONTEXT = 3, 32, 2048  # 768 bytes a token: 1.5 MiB, which llama.cpp prints exactly


@pytest.fixture(scope='module')
def models(tmp_path_factory, tokenizer_dir, data_root) -> dict[str, Path]:
    """A GQA source (4 query heads of 32 dims over 2 K/V heads), its f16 GGUF, and its DeepSeek-format conversions at
    half its cache: the unrounded split and the quantizable one."""
    root = tmp_path_factory.mktemp('serve_models')
    # initializer_range 0.1: logits far from uniform, so greedy decoding is decided by clear margins
    save_tiny_llama(root / 'gqa', tokenizer_dir, seed=3, num_hidden_layers=LAYERS, num_attention_heads=4,
                    num_key_value_heads=2, hidden_size=4 * HEAD_DIM, max_position_embeddings=CONTEXT,
                    initializer_range=0.1, rope_theta=500.0)
    convert = ['--method', 'mla', '--format', 'deepseek', '--cache-fraction', '0.5', '--data', str(data_root),
               '--tokens', '1024', '--batch-size', '4']
    # the unrounded split asked for by name (by default convert chooses between it and the quantizable one)
    assert main(['convert', str(root / 'gqa'), str(root / 'deepseek'), *convert, '--no-quantizable-cache']) == 0
    assert main(['convert', str(root / 'gqa'), str(root / 'deepseek_q'), *convert, '--quantizable-cache']) == 0
    assert main(['export-gguf', str(root / 'gqa'), str(root / 'gqa.gguf')]) == 0
    return {'gqa': root / 'gqa', 'deepseek': root / 'deepseek', 'deepseek_q': root / 'deepseek_q',
            'gqa.gguf': root / 'gqa.gguf'}


def test_sequences_decoded_together_each_decode_as_the_prompt_alone(models):
    """Every sequence holds its own copy of the prompt's cache and its own new tokens: three decoded together, each
    from its own first token after the prompt (so each reads a different context), and one decoded after them, give
    each the tokens greedy decoding gives that sequence alone; the cache is one stream's size per sequence."""
    prompt = list(range(5, 105))
    with EngineProcess(LlamaCppModel, models['gqa.gguf'], n_ctx=CONTEXT) as alone:
        expected = alone.greedy(prompt, 9)
        firsts = [expected[0], 200, 300]
        # each sequence alone: the prompt, its first token, then greedy
        alone_after = [alone.greedy(prompt + [first], 8) for first in firsts]
        single_mib = alone.kv_cache.k_mib + alone.kv_cache.v_mib
    assert alone_after[0] == expected[1:]
    # the three decode differently, so a sequence that read another's cache would decode another's tokens
    assert len({tuple(tokens) for tokens in alone_after}) == 3
    with EngineProcess(LlamaCppSequences, models['gqa.gguf'], sequences=3, context=CONTEXT, threads=1) as engine:
        assert engine.kv_cache.mib == pytest.approx(3 * single_mib, abs=0.011)
        assert engine.kv_mib_per_sequence == pytest.approx(single_mib, abs=0.011)
        assert engine.fill(prompt) > 0 and engine.next_token == expected[0]
        tokens_per_second, generated = engine.decode(3, 8, firsts)
        assert tokens_per_second > 0 and generated == alone_after
        # the new tokens are removed after a round: the next round reads the prompt's cache again
        assert engine.decode(1, 8, [engine.next_token])[1] == [expected[1:]]
        with pytest.raises(LlamaCppError, match='active sequences'):
            engine.decode(4, 1, [engine.next_token] * 4)


def test_a_q8_0_cache_holds_17_32nds_of_the_f16_bytes(models):
    """q8_0 stores 32 values in 34 bytes (32 one-byte values and an f16 scale), f16 in 64."""
    with EngineProcess(LlamaCppSequences, models['gqa.gguf'], sequences=2, context=4096, cache_type='f16', threads=1) as f16:
        f16_mib = f16.kv_cache.k_mib + f16.kv_cache.v_mib
    with EngineProcess(LlamaCppSequences, models['gqa.gguf'], sequences=2, context=4096, cache_type='q8_0', threads=1) as q8:
        assert q8.kv_cache.k_type == q8.kv_cache.v_type == 'q8_0'
        assert q8.kv_cache.k_mib + q8.kv_cache.v_mib == pytest.approx(f16_mib * 17 / 32, abs=0.011)


def test_the_quantizable_split_exports_a_cache_llama_cpp_quantizes(models, tmp_path, capsys):
    """The unrounded split at half of 128 numbers is a 20-dim key and a 44-dim latent: llama.cpp refuses a q8_0 cache
    for it, and export-gguf says so in one line. --quantizable-cache gives a 32-dim key and a 32-dim latent, whose
    q8_0 cache loads and scores the held-out text near the f16 cache."""
    default = AutoConfig.from_pretrained(models['deepseek'])
    quantizable = AutoConfig.from_pretrained(models['deepseek_q'])
    assert (default.kv_lora_rank, default.qk_rope_head_dim) == (44, 20)
    assert (quantizable.kv_lora_rank, quantizable.qk_rope_head_dim) == (32, 32)

    assert main(['export-gguf', str(models['deepseek']), str(tmp_path / 'default.gguf')]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if 'cannot quantize' in line]
    assert len(notes) == 1 and 'the V head (kv_lora_rank) 44 is not a multiple of 32' in notes[0]
    assert '--quantizable-cache' in notes[0]
    with pytest.raises(LlamaCppError, match='q8_0.*does not divide'):
        EngineProcess(LlamaCppSequences, tmp_path / 'default.gguf', sequences=1, context=CONTEXT, cache_type='q8_0')

    assert main(['export-gguf', str(models['deepseek_q']), str(tmp_path / 'quantizable.gguf')]) == 0
    assert 'cannot quantize' not in capsys.readouterr().out
    prompt = list(range(5, 69))
    logits = {}
    for cache_type in ('f16', 'q8_0'):
        with EngineProcess(LlamaCppModel, tmp_path / 'quantizable.gguf', n_ctx=CONTEXT, all_logits=True,
                           cache_type=cache_type) as engine:
            assert engine.kv_cache.k_type == cache_type
            logits[cache_type] = engine.logits(prompt)
    scale = abs(logits['f16']).max()
    assert abs(logits['q8_0'] - logits['f16']).max() < 0.05 * scale


def test_a_quantizable_split_that_the_budget_has_no_room_for_is_refused(models, tmp_path, capfd, data_root):
    from helpers import refused_in_one_line

    # a third of 128 numbers is 42, one whole 32-value block: no room for a latent and a key of a block each
    line = refused_in_one_line(['convert', str(models['gqa']), str(tmp_path / 'out'), '--method', 'mla', '--format',
                                'deepseek', '--cache-fraction', '0.3333', '--data', str(data_root),
                                '--quantizable-cache'], tmp_path, capfd)
    assert "the budget's 32 numbers per token and layer, in whole 32-value blocks" in line
    line = refused_in_one_line(['convert', str(models['gqa']), str(tmp_path / 'out'), '--method', 'mla', '--format',
                                'deepseek', '--cache-fraction', '0.5', '--data', str(data_root), '--quantizable-cache',
                                '--rope-pairs', '10'], tmp_path, capfd)
    assert '--rope-pairs 10 gives a 20-dim key' in line and '[32]' in line


def stand_in_bench_real(tmp_path: Path, data_root: Path, rows: list[dict]) -> Path:
    """A bench real results file holding ``rows`` and the held-out data of the test corpus."""
    results = tmp_path / 'real.json'
    results.write_text(json.dumps({'rows': rows, 'data': {'heldout': {'root': str(data_root),
                                                                       'domain_label': 'github'}}}))
    return results


def test_bench_serve_decodes_many_sequences_against_the_source_in_one_run(models, tmp_path, data_root, capsys):
    """`bench serve` on a stand-in for a bench real folder: the GQA source as the teacher and its DeepSeek-format
    conversion (the default, unquantizable split) as MLA at a third; ratios to the source at every count of
    sequences, the refused q8_0 cache recorded with llama.cpp's reason, capacity, targets and losses."""
    from dha_train.commands.bench.serve import MODELS

    rows = [{'label': 'teacher', 'method': 'teacher', 'budget': None, 'val_loss': 5.0,
             'hf_folder': str(models['gqa'])},
            {'label': 'MLA-DeepSeek kv1 +KL', 'method': 'mla_deepseek', 'budget': 'kv1', 'val_loss': 5.0,
             'hf_folder': str(models['deepseek'])}]
    results = stand_in_bench_real(tmp_path, data_root, rows)
    out = tmp_path / 'serve'
    assert main(['bench', 'serve', '--real', str(results), '--out', str(out), '--contexts', '32', '64',
                 '--sequences', '1', '2', '--decode-tokens', '4', '--repeats', '1', '--threads', '1',
                 '--cache-budget-mib', '1']) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / 'results.json').read_text())
    assert len(report['skipped']) == len(MODELS) - 2
    assert list(report['cache_unquantizable']) == ['MLA-DeepSeek 1/3']
    assert [(entry['model'], entry['cache_type']) for entry in report['refused']] == [('MLA-DeepSeek 1/3', 'q8_0')]
    assert 'does not divide' in report['refused'][0]['reason']
    assert {(row['model'], row['cache_type'], row['context'], row['sequences']) for row in report['rows']} == {
        ('source', cache, context, count) for cache in ('f16', 'q8_0') for context in (32, 64) for count in (1, 2)
    } | {('MLA-DeepSeek 1/3', 'f16', context, count) for context in (32, 64) for count in (1, 2)}
    for row in report['rows']:
        assert row['prompt_tps'] > 0 and row['decode_tps'] > 0
        assert row['kv_mib'] == pytest.approx(row['sequences'] * row['kv_mib_per_sequence'])
        if row['model'] == 'source':
            assert row['kv_mib_ratio'] == row['decode_tps_ratio'] == row['prompt_tps_ratio'] == 1.0
    capacity = {(entry['model'], entry['cache_type']): entry for entry in report['capacity']}
    for entry in capacity.values():
        assert entry['context'] == 64 and entry['sequences_fit'] == int(1 // entry['kv_mib_per_sequence'])
    assert [(t['model'], t['cache_type']) for t in report['targets'] if 'decode_met' in t] == [
        ('MLA-DeepSeek 1/3', 'f16')]
    assert any('overtakes_at' in t for t in report['targets'])
    losses = report['losses']
    assert losses['MLA-DeepSeek 1/3']['llama_cpp_f16_q8_0'] is None
    for name in ('source', 'MLA-DeepSeek 1/3'):
        assert losses[name]['llama_cpp_f16_f16'] == pytest.approx(losses[name]['hf_float32'], abs=2e-2)
    assert losses['source']['llama_cpp_f16_q8_0'] == pytest.approx(losses['source']['hf_float32'], abs=5e-2)
    assert '| MLA-DeepSeek 1/3 | f16 | f16 | 64 |' in printed and '| source | f16 | q8_0 |' in printed
    assert all(Path(plot).is_file() for plot in report['plots']) and len(report['plots']) == 4
    assert not (out / 'results.partial.json').exists()


def test_bench_serve_stopped_after_timing_keeps_what_it_timed(models, tmp_path, data_root, monkeypatch):
    """A run stopped after the timings (here by the HF loss failing) leaves every timed row in
    results.partial.json, marked incomplete, and no results.json."""
    from dha_train.commands.bench import serve

    def stopped(*args, **kwargs):
        raise RuntimeError('stopped here')

    monkeypatch.setattr(serve, '_hf_loss', stopped)
    rows = [{'label': 'teacher', 'method': 'teacher', 'budget': None, 'val_loss': 5.0,
             'hf_folder': str(models['gqa'])}]
    out = tmp_path / 'serve'
    settings = serve.ServeSettings(real=[str(stand_in_bench_real(tmp_path, data_root, rows))], out=str(out), contexts=[32, 64], sequences=[1, 2],
                                   cache_types=['f16'], decode_tokens=4, repeats=1, threads=1)
    with pytest.raises(RuntimeError, match='stopped here'):
        serve.run_serve_bench(settings)
    assert not (out / 'results.json').exists()
    partial = json.loads((out / 'results.partial.json').read_text())
    assert partial['complete'] is False
    assert sorted((row['context'], row['sequences']) for row in partial['rows']) == [(32, 1), (32, 2), (64, 1),
                                                                                      (64, 2)]
    assert all(row['decode_tps'] > 0 and row['decode_tps_ratio'] == 1.0 for row in partial['rows'])


def test_a_model_whose_engine_crashes_is_recorded_with_the_signal_and_the_bench_goes_on(models, tmp_path, data_root,
                                                                                       monkeypatch):
    """Each engine runs in its own process: the DeepSeek-format model's segfaulting at its first decoding step is
    an entry of 'crashed' naming SIGSEGV, its rows are left out, and the source is timed and the results written."""
    from dha_train.commands.bench import serve
    from engine_stand_ins import SequencesCrashingOnMla

    monkeypatch.setattr(serve, 'LlamaCppSequences', SequencesCrashingOnMla)
    rows = [{'label': 'teacher', 'method': 'teacher', 'budget': None, 'val_loss': 5.0,
             'hf_folder': str(models['gqa'])},
            {'label': 'MLA-DeepSeek kv1 +KL', 'method': 'mla_deepseek', 'budget': 'kv1', 'val_loss': 5.0,
             'hf_folder': str(models['deepseek'])}]
    out = tmp_path / 'serve'
    settings = serve.ServeSettings(real=[str(stand_in_bench_real(tmp_path, data_root, rows))], out=str(out),
                                   contexts=[32], sequences=[1], cache_types=['f16'], decode_tokens=4, repeats=1,
                                   threads=1, loss=False)
    report = serve.run_serve_bench(settings)
    assert [(entry['model'], entry['context']) for entry in report['crashed']] == [('MLA-DeepSeek 1/3', 32)]
    assert 'signal SIGSEGV' in report['crashed'][0]['reason']
    assert {row['model'] for row in report['rows']} == {'source'}
    assert report['rows'][0]['decode_tps'] > 0
    assert json.loads((out / 'results.json').read_text())['crashed'] == report['crashed']

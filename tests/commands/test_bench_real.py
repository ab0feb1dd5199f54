"""`dha-train bench real` on a tiny GQA LLaMA (9 query heads, 3 K/V heads, like SmolLM2), one training batch per
method and the offline local task: the rows, the KV budgets and the teacher's accuracy checked independently."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.commands.bench.real import RealSettings, run_real_bench
from dha_train.harness import LOCAL_TASK, build_local_task
from dha_train.methods import kv_cache_bytes
from dha_train.models.head_map import HeadMap
from helpers import SEQ_LEN, write_redpajama_jsonl

QUERY_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 8


def _tiny_gqa(path, tokenizer_dir):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=QUERY_HEADS * HEAD_DIM, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=QUERY_HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=512, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def _local_task_accuracy(model_dir, task_dir, limit):
    """stdlib_mc scored by hand: log-likelihood of ' ' + choice after the context (lm-eval's split of the joint
    encoding), acc and acc_norm (by the choice's characters) over the first ``limit`` documents."""
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    docs = [json.loads(line) for line in (task_dir / 'test.jsonl').read_text().splitlines()][:limit]
    right = right_norm = 0
    for doc in docs:
        scores = []
        for choice in doc['choices']:
            context = tokenizer(doc['context'], add_special_tokens=False)['input_ids']
            whole = tokenizer(doc['context'] + ' ' + choice, add_special_tokens=False)['input_ids']
            continuation = whole[len(context):]
            ids = torch.tensor([(context + continuation)[:-1]])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            positions = range(len(context) - 1, len(context) - 1 + len(continuation))
            scores.append(sum(float(logprobs[p, t]) for p, t in zip(positions, continuation)))
        lengths = np.array([float(len(choice)) for choice in doc['choices']])
        right += int(np.argmax(scores)) == doc['label']
        right_norm += int(np.argmax(np.array(scores) / lengths)) == doc['label']
    return right / len(docs), right_norm / len(docs)


@pytest.mark.slow
def test_bench_real_rows_budgets_and_teacher_accuracy(tmp_path, tokenizer_dir, data_root):
    source = _tiny_gqa(tmp_path / 'gqa', tokenizer_dir)
    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=200, seed=3)
    task = build_local_task(raw, tmp_path / 'task', examples=6, fewshot_examples=2, max_words=120)
    limit = 6
    # training data: the session's synthetic github + wikipedia shards; held-out: /usr/share/doc text
    settings = RealSettings(
        out=str(tmp_path / 'bench'), device='cpu', source=str(source), train_data=str(data_root),
        tokens=2 * 2 * SEQ_LEN, seq_len=SEQ_LEN, batch=2, limit=limit, val_tokens=4 * SEQ_LEN, calib_tokens=128,
        search_batches=1, eval_batch_size=4, tasks=[LOCAL_TASK], include=[str(task)], heal=False,
        isolate_stages=False, overrides={'threshold': 1.0e6})  # Fusion stops after its first batch: CT follows
    results = run_real_bench(settings)
    rows = {row['label']: row for row in results['rows']}
    teacher = LlamaConfig.from_pretrained(source)
    teacher_bytes = kv_cache_bytes(teacher)
    assert rows['teacher']['kv_bytes'] == teacher_bytes == 2 * 2 * KV_HEADS * HEAD_DIM * 4096 * 2

    # every converted row at its budget of the source's K+V cache; MoH keeps the source's cache
    expected = {'kv1': teacher_bytes // 3, 'kv2': 2 * teacher_bytes // 3, None: teacher_bytes}
    for row in results['rows'][1:]:
        assert row['kv_bytes'] == expected[row['budget']], row['label']
    methods = {(row['method'], row['budget']) for row in results['rows']}
    assert methods >= {('mean_pool', 'kv1'), ('mean_pool', 'kv2'), ('aligned_gqa', 'kv1'), ('asym_gqa', 'kv1'),
                       ('asym_gqa', 'kv2'), ('dha', 'kv1'), ('dha', 'kv2'), ('dha_servable', 'kv1'),
                       ('dha_servable', 'kv2'), ('mla', 'kv1'), ('mla', 'kv2'), ('moh', None)}
    # aligned GQA needs equal groups: 2 of 3 source heads is skipped, with the reason
    skipped = [s for s in results['skipped'] if s['method'] == 'aligned_gqa']
    assert [s['budget'] for s in skipped] == ['kv2'] and 'equal groups' in skipped[0]['reason']
    # the same training tokens for every trained row (DHA: fusion + CT)
    budget = results['settings']['training_tokens_per_method']
    assert budget == 2 * 2 * SEQ_LEN
    for row in results['rows']:
        zero_point = row['label'].endswith('@0') or row['method'] == 'teacher'
        if zero_point:
            assert row['tokens'] == 0
        elif not row['label'].endswith('post-fusion'):
            assert row['tokens'] == budget, row['label']
    # AsymGQA with one group per layer is the mean-pool model: the row says so and reuses its figures
    asym1 = rows['AsymGQA kv1 +CT']
    assert asym1['same_as'] == 'mean-pool kv1 +CT' and asym1['val_loss'] == rows['mean-pool kv1 +CT']['val_loss']
    # DHA's 0-token point is its Search map mean-pooled: at kv1 that is the mean-pool model
    assert rows['DHA kv1 @0']['same_as'] == 'mean-pool kv1 @0' and rows['DHA kv2 @0']['tokens'] == 0
    assert rows['DHA kv2 @0']['kv_bytes'] == expected['kv2']
    # the servable DHA: at kv1 DHA's only map, so DHA's rows; at kv2 one count per layer for K and V, from {1, 3}
    assert rows['DHA-servable kv1 @0']['same_as'] == 'DHA kv1 @0'
    assert rows['DHA-servable kv1 post-fusion']['val_loss'] == rows['DHA kv1 post-fusion']['val_loss']
    found = json.loads(next((tmp_path / 'bench' / 'runs').glob('*/dha-servable-kv2-search-*/DONE.json')).read_text())
    servable = HeadMap.load(found['head_map'])
    assert found['searched'] and servable.servable_problems() == []
    assert sorted(servable.kv_heads()) == [(1, 1), (3, 3)]  # 8 of the 12 K+V heads: one layer keeps 3, one 1
    assert [tuple(c) for c in rows['DHA-servable kv2 post-fusion']['kv_heads_per_layer']] == servable.kv_heads()
    # F1: DHA's CT continues on other batches than its Fusion saw (it once restarted the stream and replayed them)
    stages = dict(_finished_stages(tmp_path / 'bench'))
    fusion, ct = stages['dha-kv2-fusion']['batch_digests'], stages['dha-kv2-ct']['batch_digests']
    assert len(fusion) == rows['DHA kv2 post-fusion']['fusion_batches'] and len(fusion) + len(ct) == 2
    assert not set(fusion) & set(ct)
    labels = [row['label'] for row in results['rows']]
    assert labels.index('DHA kv2 +CT') \
        < labels.index('DHA-servable kv2 @0') < labels.index('MLA kv2 @0')

    # the teacher's accuracy, computed independently of lm-eval, on the same first `limit` documents
    acc, acc_norm = _local_task_accuracy(source, task, limit)
    assert rows['teacher']['metric'][LOCAL_TASK] == 'acc_norm'
    assert rows['teacher']['accuracy'][LOCAL_TASK] == pytest.approx(acc_norm)
    eval_file = next((tmp_path / 'bench' / 'runs').glob('*/eval/teacher-*/eval_results.json'))
    assert json.loads(eval_file.read_text())['scores'][LOCAL_TASK]['acc'] == pytest.approx(acc)

    saved = json.loads((tmp_path / 'bench' / 'results.json').read_text())
    assert [row['label'] for row in saved['rows']] == [row['label'] for row in results['rows']]
    assert saved['data']['heldout']['source'] != saved['data']['train']['source']
    for name in ('accuracy.png', 'loss.png'):
        assert (tmp_path / 'bench' / name).read_bytes()[:4] == b'\x89PNG'

    # re-running one method at one budget (its stages reused) writes that invocation's rows only, with the same
    # figures, and keeps the earlier file aside whole: results files are never merged
    again = run_real_bench(replace(settings, methods=('mla',), budgets=('kv2',)), command='dha-train bench real ...')
    assert [row['label'] for row in again['rows']] == ['teacher'] + [label for label in labels
                                                                     if label.startswith('MLA kv2')]
    assert again['command'] == 'dha-train bench real ...' and again['settings']['methods'] == ['mla']
    for row in again['rows']:
        assert (row['val_loss'], row['accuracy']) == (rows[row['label']]['val_loss'], rows[row['label']]['accuracy'])
    assert json.loads((tmp_path / 'bench' / 'results.replaced-1.json').read_text()) == saved


def _stage_name(folder, bench) -> str:
    """A stage folder's name without its key digest (data stages: data-train / data-heldout; evaluations: eval:)."""
    if folder.parent == bench:
        return '-'.join(folder.name.split('-')[:2])
    return ('eval:' if folder.parent.name == 'eval' else '') + folder.name.rsplit('-', 1)[0]


def _finished_stages(bench) -> list[tuple[str, dict]]:
    """Every finished stage under the bench folder: (its name without the key digest, its result)."""
    return [(_stage_name(path.parent, bench), json.loads(path.read_text())) for path in bench.rglob('DONE.json')]


def _stages_run(bench, settings) -> set[str]:
    """The stages a run of ``settings`` made anew (not reused)."""
    before = {path.parent for path in bench.rglob('DONE.json')}
    run_real_bench(settings)
    return {_stage_name(path.parent, bench) for path in bench.rglob('DONE.json') if path.parent not in before}


@pytest.mark.slow
def test_bench_real_healing_rows_refit_transfer_and_kl_at_the_ct_rows_tokens(tmp_path, tokenizer_dir, data_root):
    """Healing rows after a 0-token conversion: refit (0 tokens, lower refit errors), attention transfer and KL
    (together the CT row's tokens). Then re-runs with one setting changed each:
    exactly the stages that read it run again (the stage keys), and no two training stages replay each other's
    batches."""
    source = _tiny_gqa(tmp_path / 'gqa', tokenizer_dir)
    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=200, seed=3)
    task = build_local_task(raw, tmp_path / 'task', examples=4, fewshot_examples=2, max_words=120)
    bench = tmp_path / 'bench'
    settings = RealSettings(
        out=str(bench), device='cpu', source=str(source), train_data=str(data_root),
        tokens=2 * 4 * SEQ_LEN, seq_len=SEQ_LEN, batch=2, limit=4, val_tokens=4 * SEQ_LEN, calib_tokens=128,
        refit_tokens=512, search_batches=1, eval_batch_size=4, tasks=[LOCAL_TASK], include=[str(task)],
        methods=('mean_pool',), budgets=('kv1',), isolate_stages=False)
    results = run_real_bench(settings)
    rows = {row['label']: row for row in results['rows']}
    budget = results['settings']['training_tokens_per_method']
    assert rows['mean-pool kv1 +refit']['tokens'] == 0 and rows['mean-pool kv1 +refit']['stage'] == 'refit'
    assert rows['mean-pool kv1 +transfer']['tokens'] == budget // 2
    assert rows['mean-pool kv1 +KL']['tokens'] == rows['mean-pool kv1 +CT']['tokens'] == budget
    for label in ('+refit', '+transfer', '+KL'):
        assert rows[f'mean-pool kv1 {label}']['kv_bytes'] == rows['mean-pool kv1 @0']['kv_bytes']
    stages = dict(_finished_stages(bench))
    refit = stages['meanpool-kv1-refit']
    assert refit['mean_key_error_after'] < refit['mean_key_error_before']
    assert refit['mean_value_error_after'] < refit['mean_value_error_before']
    # each training stage draws its own batches: none replays another's (the fix of DHA's CT replaying Fusion)
    transfer, kl, ct = (stages[f'meanpool-kv1-{name}']['batch_digests'] for name in ('transfer', 'kl', 'ct'))
    assert len(transfer) == 2 and len(kl) == 2 and len(ct) == 4
    assert not set(transfer) & set(kl) and transfer[0] != ct[0] and kl[0] != ct[0]

    evals = {f'eval:mean-pool-kv1-{label}' for label in ('0', 'refit', 'transfer', 'kl', 'ct')} | {'eval:teacher'}
    # the same settings: every stage reused
    assert _stages_run(bench, settings) == set()
    # each setting re-runs exactly the stages that read it, and the evaluations of their models
    assert _stages_run(bench, replace(settings, refit_tokens=256)) == {
        'meanpool-kv1-refit', 'meanpool-kv1-transfer', 'meanpool-kv1-kl', 'eval:mean-pool-kv1-refit',
        'eval:mean-pool-kv1-transfer', 'eval:mean-pool-kv1-kl'}
    assert _stages_run(bench, replace(settings, transfer_fraction=0.75)) == {
        'meanpool-kv1-transfer', 'meanpool-kv1-kl', 'eval:mean-pool-kv1-transfer', 'eval:mean-pool-kv1-kl'}
    assert _stages_run(bench, replace(settings, microbatch=1)) == {
        'meanpool-kv1-transfer', 'meanpool-kv1-kl', 'meanpool-kv1-ct', 'eval:mean-pool-kv1-transfer',
        'eval:mean-pool-kv1-kl', 'eval:mean-pool-kv1-ct'}
    assert _stages_run(bench, replace(settings, eval_batch_size=2)) == evals
    # the control: the same seed and data give the same batches (the CT at micro-batch 1 saw the CT's batches)
    assert [stage['batch_digests'] for name, stage in _finished_stages(bench) if name == 'meanpool-kv1-ct'] == [ct, ct]
    # F2: another seed, and another model in the same folder, are new stages (the mean-pool conversion reads neither
    # a seed nor data, only the source)
    trained = {f'meanpool-kv1-{name}' for name in ('refit', 'transfer', 'kl', 'ct')}
    assert _stages_run(bench, replace(settings, seed=18)) == trained | evals
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig.from_pretrained(source)).save_pretrained(source)
    assert _stages_run(bench, replace(settings, heal=False)) == {
        'data-heldout', 'meanpool-kv1-convert', 'meanpool-kv1-ct', 'eval:teacher', 'eval:mean-pool-kv1-0',
        'eval:mean-pool-kv1-ct'}


@pytest.mark.slow
def test_moh_heals_by_attention_transfer_and_kl_from_the_surgery_without_a_refit(tmp_path, tokenizer_dir, data_root):
    """MoH pools no K/V head (``dha-train refit`` refuses it), so its healing starts at attention transfer on the
    surgery's model, then KL: rows at the CT row's tokens and the source's cache bytes, the MoH class and routing
    kept through both exports, and the layer-wise transfer loss going down."""
    source = _tiny_gqa(tmp_path / 'gqa', tokenizer_dir)
    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=200, seed=3)
    task = build_local_task(raw, tmp_path / 'task', examples=4, fewshot_examples=2, max_words=120)
    settings = RealSettings(
        out=str(tmp_path / 'bench'), device='cpu', source=str(source), train_data=str(data_root),
        tokens=2 * 4 * SEQ_LEN, seq_len=SEQ_LEN, batch=2, limit=4, val_tokens=4 * SEQ_LEN, eval_batch_size=4,
        tasks=[LOCAL_TASK], include=[str(task)], methods=('moh',), budgets=('kv1',), isolate_stages=False)
    results = run_real_bench(settings)
    rows = {row['label']: row for row in results['rows']}
    budget = results['settings']['training_tokens_per_method']
    assert [label for label in rows if label.startswith('MoH')] == [
        'MoH 7/9 @0', 'MoH 7/9 +transfer', 'MoH 7/9 +KL', 'MoH 7/9 +CT']
    assert rows['MoH 7/9 +transfer']['tokens'] == budget // 2
    assert rows['MoH 7/9 +KL']['tokens'] == rows['MoH 7/9 +CT']['tokens'] == budget
    assert rows['MoH 7/9 +transfer']['evaluation'] == 'intermediate' and rows['MoH 7/9 +KL']['evaluation'] == 'ranking'
    for label in ('@0', '+transfer', '+KL'):
        assert rows[f'MoH 7/9 {label}']['kv_bytes'] == rows['teacher']['kv_bytes'], label
    stages = dict(_finished_stages(tmp_path / 'bench'))
    assert 'moh-refit' not in stages
    for name in ('moh-transfer', 'moh-kl'):
        config = json.loads((Path(stages[name]['hf_folder']) / 'config.json').read_text())
        assert (config['model_type'], config['moh_shared_heads'], config['moh_top_k']) == ('moh_llama', 4, 3), name
    history = json.loads((Path(stages['moh-transfer']['hf_folder']).parent / 'history.json').read_text())['train']
    assert history[-1][1] < history[0][1]


def test_an_earlier_results_file_is_kept_aside_never_merged_or_overwritten(tmp_path):
    """Each results.json holds one invocation's rows: an earlier one is renamed, numbered, with its content intact."""
    from dha_train.commands.bench.real.report import set_aside_earlier

    path = tmp_path / 'results.json'
    assert set_aside_earlier(path) is None
    for number, label in ((1, 'first'), (2, 'second')):
        path.write_text(json.dumps({'rows': [{'label': label}]}))
        assert set_aside_earlier(path) == tmp_path / f'results.replaced-{number}.json'
        assert not path.exists()
    assert json.loads((tmp_path / 'results.replaced-1.json').read_text()) == {'rows': [{'label': 'first'}]}
    assert json.loads((tmp_path / 'results.replaced-2.json').read_text()) == {'rows': [{'label': 'second'}]}


def test_rows_get_intervals_and_paired_differences_from_their_documents(tmp_path, capsys):
    """``add_intervals``: each row that kept its documents gets its mean accuracy's 95% interval and paired
    differences from the teacher and from mean-pool at the same budget and stage; an identical row differs by exactly
    0, a row right on every document where the teacher was wrong differs significantly."""
    from dha_train.commands.bench.real.report import add_intervals, print_intervals

    def documents(name: str, accuracy: list[float], losses: list[float]) -> str:
        path = tmp_path / f'{name}.json'
        path.write_text(json.dumps({'tasks': {'piqa': [{'doc_id': i, 'acc': a} for i, a in enumerate(accuracy)]},
                                    'heldout_sequences': {'book': losses}}))
        return str(path)

    wrong = [0.0, 1.0] * 20
    right = [1.0] * 40
    losses = [3.0 + 0.01 * i for i in range(30)]

    def row(label, method, budget, accuracy, loss_shift):
        return {'label': label, 'method': method, 'budget': budget, 'tokens': 0, 'metric': {'piqa': 'acc'},
                'mean_accuracy': sum(accuracy) / len(accuracy), 'val_loss': 3.145 + loss_shift, 'val_loss_ci95': 0.01,
                'documents_file': documents(label, accuracy, [v + loss_shift for v in losses])}

    results = {'rows': [row('teacher', 'teacher', None, wrong, 0.0), row('mean-pool kv1 @0', 'mean_pool', 'kv1', wrong,
                                                                           0.5),
                        row('DHA kv1 @0', 'dha', 'kv1', right, 0.5), {'label': 'old row', 'method': 'dha',
                                                                       'budget': 'kv2', 'metric': {}}]}
    add_intervals(results, seed=1)
    rows = {r['label']: r for r in results['rows']}
    assert rows['mean-pool kv1 @0']['vs_teacher']['accuracy'] == [0.0, 0.0, 0.0]
    assert rows['mean-pool kv1 @0']['vs_teacher']['loss'] == pytest.approx([0.5, 0.5, 0.5])
    difference, low, high = rows['DHA kv1 @0']['vs_mean_pool']['accuracy']
    assert difference == pytest.approx(0.5) and 0 < low <= 0.5 <= high
    assert rows['DHA kv1 @0']['accuracy_ci95'] == 0.0 and 'vs_mean_pool' not in rows['mean-pool kv1 @0']
    assert 'accuracy_ci95' not in rows['old row']
    print_intervals(results)
    printed = capsys.readouterr().out
    assert '+0.500 [' in printed and ']*' in printed and 'old row' not in printed


def test_an_intermediate_row_pairs_with_the_teacher_on_the_documents_they_share(tmp_path):
    """A row scored on part of the sample is compared document by document (by index), not position by position:
    right on the odd documents, where the teacher is right too, it differs from the teacher by exactly 0."""
    from dha_train.commands.bench.real.report import add_intervals

    def row(label, method, scored: dict[int, float]):
        path = tmp_path / f'{method}.json'
        path.write_text(json.dumps({'tasks': {'piqa': [{'doc_id': i, 'acc': a} for i, a in scored.items()]},
                                    'heldout_sequences': {'book': [3.0, 3.1, 3.2]}}))
        return {'label': label, 'method': method, 'budget': None if method == 'teacher' else 'kv1', 'tokens': 0,
                'metric': {'piqa': 'acc'}, 'documents_file': str(path)}

    teacher = row('teacher', 'teacher', {i: float(i % 2) for i in range(40)})
    intermediate = row('mean-pool kv1 @0 +refit', 'mean_pool', {i: 1.0 for i in range(1, 40, 2)})
    add_intervals({'rows': [teacher, intermediate]}, seed=3)
    assert intermediate['vs_teacher']['accuracy'] == [0.0, 0.0, 0.0]
    assert intermediate['accuracy_ci95'] == 0.0



def test_a_chain_healing_the_same_model_as_an_earlier_one_is_recorded_same_as_it_and_not_trained(tmp_path):
    """Aligned GQA at one group refits to mean-pool's very weights (the record ranked both kv1 +KL rows, at 4.370
    each): a healing chain whose start holds the same model files as an earlier chain's (its card and refit report
    apart) takes that chain's rows ``same_as`` them, trains nothing and does not rank; a different model heals."""
    import shutil

    from dha_train.bench_runner import StageRunner
    from dha_train.commands.bench.real.report import ranking_groups

    def model_folder(name: str, seed: int) -> Path:
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / name)
        return tmp_path / name

    refits = {'meanpool-kv1': model_folder('meanpool-refit', 0), 'agqa-kv1': tmp_path / 'agqa-refit',
              'other-kv1': model_folder('other-refit', 1)}
    shutil.copytree(refits['meanpool-kv1'], refits['agqa-kv1'])
    for name, folder in refits.items():  # what differs between the two refits of one model: card and report
        (folder / 'README.md').write_text(f'# {name}\n')
        (folder / 'refit.json').write_text(json.dumps({'converted': f'{name}-convert'}))

    class Runner(StageRunner):  # the healing stages stubbed: each refit gives its folder, training is recorded
        def __init__(self):
            self.settings, self.batches = RealSettings(device='cpu'), 4
            self.rows, self.healing_starts, self.trained = [], {}, []

        def refit(self, name, converted, seed=None):
            return {'hf_folder': str(refits[name]), 'seconds': 1.0}

        def transfer(self, name, model, batches, seed=None):
            self.trained.append(f'{name}-transfer')
            return {'hf_folder': f'{name}-transfer', 'tokens': 2 * batches, 'seconds': 1.0}

        def distil(self, name, model, batches, seed=None):
            self.trained.append(f'{name}-kl')
            return {'hf_folder': f'{name}-kl', 'tokens': 2 * batches, 'seconds': 1.0}

        def evaluate(self, label, method, budget, hf, tokens, build_seconds, intermediate=False, **extra):
            self.rows.append({'label': label, 'method': method, 'budget': budget, 'tokens': tokens,
                              'val_loss': 4.0 - len(self.rows) / 10, 'accuracy_ci95': 0.02, 'hf_folder': str(hf),
                              'evaluation': 'intermediate' if intermediate else 'ranking', **extra})

    runner = Runner()
    for name, label, method in (('meanpool-kv1', 'mean-pool kv1', 'mean_pool'),
                                ('agqa-kv1', 'aligned GQA kv1', 'aligned_gqa'), ('other-kv1', 'MLA kv1', 'mla')):
        runner.heal(name, label, method, 'kv1', f'{name}-convert', 1.0)
    assert runner.trained == [f'{name}-{stage}' for name in ('meanpool-kv1', 'other-kv1') for stage in ('transfer', 'kl')]
    rows = {row['label']: row for row in runner.rows}
    for stage in ('+refit', '+transfer', '+KL'):
        aligned, pooled = rows[f'aligned GQA kv1 {stage}'], rows[f'mean-pool kv1 {stage}']
        assert aligned['same_as'] == pooled['label'] and aligned['method'] == 'aligned_gqa'
        assert (aligned['val_loss'], aligned['tokens'], aligned['hf_folder']) == (
            pooled['val_loss'], pooled['tokens'], pooled['hf_folder'])
        assert 'same_as' not in rows[f'MLA kv1 {stage}']
    assert [[row['label'] for row in group] for group in ranking_groups(runner.rows).values()] == [
        ['MLA kv1 +KL', 'mean-pool kv1 +KL']]


def test_intermediate_rows_get_fewer_documents_never_more_than_the_ranking_rows():
    from dha_train.bench_settings import resolve_settings
    from dha_train.config import ConfigError

    assert (resolve_settings(RealSettings(device='cpu')).limit,
            resolve_settings(RealSettings(device='cpu')).intermediate_limit) == (400, 100)
    assert resolve_settings(RealSettings(device='cpu', limit=40)).intermediate_limit == 40
    with pytest.raises(ConfigError, match='intermediate_limit .* must not exceed limit'):
        resolve_settings(RealSettings(device='cpu', limit=40, intermediate_limit=80))


def test_a_one_kv_head_source_takes_fractional_budgets_with_latent_rows_only(tmp_path, tokenizer_dir, data_root):
    """An MQA source (one K/V head, as Gemma 3 270M) at half its cache: the head-pooling methods are skipped with
    the reason (no whole number of heads), DeepSeek's format is skipped with the family layer's refusal (attention
    biases), MLA's row holds half the source's cache bytes; a budget at or above the source's cache is refused."""
    from dha_train.bench_settings import budget_fraction, budget_heads
    from dha_train.config import ConfigError

    assert budget_fraction('third', 1) == pytest.approx(1 / 3) and budget_fraction('kv1', 3) == pytest.approx(1 / 3)
    assert budget_heads('kv2', 3) == 2 and budget_heads('third', 3) == 1 and budget_heads('half', 3) is None
    assert budget_heads('half', 1) is None and budget_heads('half', 4) == 2

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=4 * HEAD_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=HEAD_DIM, max_position_embeddings=512,
                         attention_bias=True, tie_word_embeddings=True)
    source = tmp_path / 'mqa'
    LlamaForCausalLM(config).save_pretrained(source)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(source)
    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=200, seed=3)
    task = build_local_task(raw, tmp_path / 'task', examples=6, fewshot_examples=2, max_words=120)
    settings = RealSettings(
        out=str(tmp_path / 'bench'), device='cpu', source=str(source), train_data=str(data_root),
        tokens=2 * SEQ_LEN, seq_len=SEQ_LEN, batch=2, limit=4, val_tokens=4 * SEQ_LEN, calib_tokens=128,
        eval_batch_size=4, tasks=[LOCAL_TASK], include=[str(task)], heal=False, isolate_stages=False,
        methods=('mean_pool', 'mla', 'mla_deepseek'), budgets=('half',))
    with pytest.raises(ConfigError, match='kv1 is not below'):
        run_real_bench(replace(settings, budgets=('kv1',)))
    results = run_real_bench(settings)
    skipped = {entry['method']: entry['reason'] for entry in results['skipped']}
    assert 'not a whole number of heads' in skipped['mean_pool']
    assert 'attention_bias' in skipped['mla_deepseek'] or 'bias' in skipped['mla_deepseek']
    teacher = next(row for row in results['rows'] if row['method'] == 'teacher')
    mla = [row for row in results['rows'] if row['method'] == 'mla']
    assert {row['label'] for row in mla} == {'MLA half @0', 'MLA half +CT'}
    assert all(row['kv_bytes'] == teacher['kv_bytes'] // 2 for row in mla)
    assert 'latent (MLA) rows only' in results['budgets']['half']
    # --no-ct: the same stages, without the method's own-training row
    without_ct = run_real_bench(replace(settings, ct=False))
    assert [row['label'] for row in without_ct['rows'] if row['method'] == 'mla'] == ['MLA half @0']


def test_heal_points_must_increase_in_whole_batches_past_the_transfer():
    from dha_train.bench_settings import resolve_settings
    from dha_train.config import ConfigError

    base = RealSettings(device='cpu', tokens=4 * 2 * SEQ_LEN, seq_len=SEQ_LEN, batch=2)  # transfer: 2 batches
    assert resolve_settings(replace(base, heal_points=(3 * 2 * SEQ_LEN, 6 * 2 * SEQ_LEN))).heal_points
    for points in ((2 * 2 * SEQ_LEN, 6 * 2 * SEQ_LEN), (6 * 2 * SEQ_LEN, 3 * 2 * SEQ_LEN), (3 * 2 * SEQ_LEN + 1,)):
        with pytest.raises(ConfigError, match='--heal-points'):
            resolve_settings(replace(base, heal_points=points))


@pytest.mark.slow
def test_the_recovery_curve_scores_each_point_and_a_stopped_run_goes_on_from_the_last_point(tmp_path, tokenizer_dir,
                                                                                          data_root):
    """--heal-points: KL from the transfer to each point its own stage, from the previous point's export, on fresh
    batches; each point a ranking row at its healing tokens with its healing seconds; the summary and the plot. A
    run whose last point was lost runs that point's stage and evaluation alone."""
    source = _tiny_gqa(tmp_path / 'gqa', tokenizer_dir)
    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=200, seed=3)
    task = build_local_task(raw, tmp_path / 'task', examples=4, fewshot_examples=2, max_words=120)
    bench = tmp_path / 'bench'
    batch_tokens = 2 * SEQ_LEN
    points = (3 * batch_tokens, 5 * batch_tokens)
    settings = RealSettings(
        out=str(bench), device='cpu', source=str(source), train_data=str(data_root), tokens=4 * batch_tokens,
        seq_len=SEQ_LEN, batch=2, limit=4, val_tokens=4 * SEQ_LEN, calib_tokens=128, refit_tokens=512,
        eval_batch_size=4, tasks=[LOCAL_TASK], include=[str(task)], methods=('mean_pool',), budgets=('kv1',),
        ct=False, isolate_stages=False, heal_points=points)
    results = run_real_bench(settings)
    rows = {row['label']: row for row in results['rows']}
    first, second = (rows[f'mean-pool kv1 +KL {point}'] for point in points)
    assert 'mean-pool kv1 +KL' not in rows
    assert (first['tokens'], second['tokens']) == points
    assert first['evaluation'] == second['evaluation'] == 'ranking'
    assert 0 < first['healing_s'] < second['healing_s'] < second['wall_s']  # healing alone, not the conversion
    stages = dict(_finished_stages(bench))
    to_first, to_second = (stages[f'meanpool-kv1-kl-to-{point}'] for point in points)
    assert len(to_first['batch_digests']) == 1 and len(to_second['batch_digests']) == 2
    transfer = stages['meanpool-kv1-transfer']['batch_digests']
    assert not set(to_first['batch_digests']) & set(to_second['batch_digests']) and not set(transfer) & set(
        to_first['batch_digests'] + to_second['batch_digests'])
    (chain,) = results['recovery']
    assert chain['chain'] == 'mean_pool kv1' and [p['healing_tokens'] for p in chain['points']] == [0, *points]
    teacher = rows['teacher']['mean_accuracy']
    assert chain['points'][-1]['share_of_teacher'] == pytest.approx(second['mean_accuracy'] / teacher)
    assert set(chain['first_hours_at']) == {'90%', '95%'}
    assert (bench / 'recovery.png').is_file()
    # a run stopped before its last point: that point's stage and its evaluation run again, nothing else
    import shutil

    lost = {f'meanpool-kv1-kl-to-{points[1]}', f'eval:mean-pool-kv1-kl-{points[1]}'}
    for path in [path.parent for path in bench.rglob('DONE.json') if _stage_name(path.parent, bench) in lost]:
        shutil.rmtree(path)
    assert _stages_run(bench, settings) == lost


"""`dha-train eval` (lm-evaluation-harness on exported models, the offline local task, W&B) and `dha-train compare`."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.config import ConfigError
from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.evaluation import compare, run_eval
from dha_train.harness import LOCAL_TASK, EvalError, build_local_task, resolve_tasks
from dha_train.methods import kv_cache_bytes
from dha_train.models.head_map import HeadMap

WORDS = ('the module returns a value from each call and raises an error when the path does not exist or the '
         'file cannot be read because the stream was closed before the parser finished reading its header').split()
EXAMPLES = 24


def write_prose_corpus(root):
    """A corpus folder like the quickstart's: wikipedia/*.jsonl documents of short paragraphs."""
    rng = random.Random(0)
    (root / 'wikipedia').mkdir(parents=True)
    with (root / 'wikipedia' / 'docs.jsonl').open('w') as handle:
        for _ in range(30):
            paragraphs = [' '.join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))) for _ in range(4)]
            handle.write(json.dumps({'text': '\n\n'.join(paragraphs)}) + '\n')
    return root


@pytest.fixture(scope='module')
def models(tmp_path_factory, tokenizer_dir):
    """The same tiny LLaMA as plain MHA, standard GQA (2 K/V heads) and DHA (unequal K and V heads per layer)."""
    root = tmp_path_factory.mktemp('eval-models')
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(root / 'mha')
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(root / 'mha')
    gqa = convert_checkpoint(root / 'mha', root / 'gqa', HeadMap.gqa(2, 4, 2, 16))
    dha_map = HeadMap.dha(key_partitions=[[[0, 1], [2, 3]], [[0, 1, 2, 3]]],
                          value_partitions=[[[0], [1, 2, 3]], [[0, 2], [1], [3]]], num_heads=4, head_dim=16)
    dha = convert_checkpoint(root / 'mha', root / 'dha', dha_map)
    return {'mha': root / 'mha', 'gqa': gqa, 'dha': dha}


@pytest.fixture(scope='module')
def local_task(tmp_path_factory):
    root = tmp_path_factory.mktemp('local-task')
    return build_local_task(write_prose_corpus(root / 'corpus'), root / 'task', examples=EXAMPLES,
                            fewshot_examples=4)


def hand_accuracy(model_dir, task_dir) -> float:
    """Accuracy from the model's summed log-likelihood of each choice after the context (lm-eval's " " delimiter)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    correct = 0
    for line in (task_dir / 'test.jsonl').read_text().splitlines():
        doc = json.loads(line)
        context = tokenizer(doc['context'], add_special_tokens=False).input_ids
        scores = []
        for choice in doc['choices']:
            whole = tokenizer(doc['context'] + ' ' + choice, add_special_tokens=False).input_ids
            continuation = whole[len(context):]
            with torch.no_grad():
                logprobs = model(torch.tensor([whole[:-1]])).logits[0].log_softmax(-1)
            scores.append(sum(float(logprobs[len(context) - 1 + i, token]) for i, token in enumerate(continuation)))
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc['label'])
    return correct / EXAMPLES


def test_local_task_is_well_formed(local_task):
    docs = [json.loads(line) for line in (local_task / 'test.jsonl').read_text().splitlines()]
    assert len(docs) == EXAMPLES and all(len(d['choices']) == 4 and len(set(d['choices'])) == 4 for d in docs)
    assert all(0 <= d['label'] < 4 for d in docs) and len({d['label'] for d in docs}) > 1
    assert f'task: {LOCAL_TASK}' in (local_task / f'{LOCAL_TASK}.yaml').read_text()


@pytest.fixture(scope='module')
def evaluated(models, local_task, tmp_path_factory, data_root):
    """`run_eval` on the three exports with the local task; the DHA one also measures its validation loss and logs
    to an offline W&B run."""
    root = tmp_path_factory.mktemp('evaluated')
    results = {}
    for kind in ('dha', 'mha', 'gqa'):
        wandb = {'wandb_project': 'dha-tests', 'wandb_dir': str(root), 'data': data_root} if kind == 'dha' else {}
        results[kind] = run_eval(models[kind], suite='local', include=[local_task], out=root / kind, name=kind,
                                 **wandb)
    return root, results


@pytest.mark.parametrize('kind', ['dha', 'mha', 'gqa'])
def test_eval_accuracy_equals_a_hand_computation(models, local_task, evaluated, kind):
    root, results = evaluated
    result = results[kind]
    assert result['model_type'] == {'dha': 'dha_llama', 'mha': 'llama', 'gqa': 'llama'}[kind]
    assert result['scores'][LOCAL_TASK]['acc'] == pytest.approx(hand_accuracy(models[kind], local_task), abs=1e-9)
    saved = json.loads((root / kind / 'eval_results.json').read_text())
    assert saved['scores'] == result['scores']
    config = AutoModelForCausalLM.from_pretrained(models[kind], trust_remote_code=True).config
    heads = {'mha': 2 * 4 * 2, 'gqa': 2 * 2 * 2, 'dha': (2 + 2) + (1 + 3)}[kind]  # K + V heads over both layers
    assert saved['kv_cache_bytes_per_4096_tokens'] == kv_cache_bytes(config) == heads * 16 * 4096 * 2


def test_scoring_skips_lm_evals_environment_report_and_scores_alike(models, local_task, evaluated, monkeypatch):
    """lm-eval's environment report (torch's get_pretty_env_info: `pip list` and other programs, ~2 s a call) is not
    made while scoring, the scores are those of `run_eval`, and lm-eval's own function is back afterwards."""
    import lm_eval.evaluator
    import torch.utils.collect_env

    from dha_train.harness import score_tasks

    reports = []
    monkeypatch.setattr(torch.utils.collect_env, 'get_pretty_env_info', lambda: reports.append(1) or '')
    report = lm_eval.evaluator.add_env_info
    model = AutoModelForCausalLM.from_pretrained(models['gqa']).eval()
    scored = score_tasks(model, AutoTokenizer.from_pretrained(models['gqa']), {LOCAL_TASK: 0}, include=[local_task])
    assert reports == [] and lm_eval.evaluator.add_env_info is report
    assert scored['scores'][LOCAL_TASK]['acc'] == evaluated[1]['gqa']['scores'][LOCAL_TASK]['acc']
    lm_eval.evaluator.add_env_info({})  # the control: outside scoring the report is made
    assert reports == [1]


def test_validation_loss_is_the_token_mean_cross_entropy_of_the_val_split(models, evaluated, data_root):
    import numpy as np
    from streaming import StreamingDataset

    from dha_train.data.loaders import TOKENS_COLUMN

    model = AutoModelForCausalLM.from_pretrained(models['dha'], trust_remote_code=True).eval()
    per_domain = {}
    for domain in ('github', 'wikipedia'):
        dataset = StreamingDataset(local=str(data_root / domain / 'val'), shuffle=False, batch_size=1)
        total, count = 0.0, 0
        for sample in dataset:
            ids = torch.from_numpy(np.asarray(sample[TOKENS_COLUMN]).astype(np.int64))[None]
            with torch.no_grad():
                logits = model(ids).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction='sum'))
            count += ids.shape[1] - 1
        per_domain[domain] = total / count
    measured = evaluated[1]['dha']['val_loss_per_domain']
    for domain, loss in per_domain.items():
        assert measured[domain] == pytest.approx(loss, rel=1e-5)
    assert evaluated[1]['dha']['val_loss'] == pytest.approx(sum(per_domain.values()) / 2, rel=1e-5)


def test_offline_wandb_run_holds_the_eval_metrics(evaluated):
    from helpers import wandb_history_keys

    root, results = evaluated
    runs = list((root / 'wandb').glob('offline-run-*/run-*.wandb'))
    assert len(runs) == 1
    history = wandb_history_keys(runs[0])
    assert history[f'eval/{LOCAL_TASK}/acc'] == [pytest.approx(results['dha']['scores'][LOCAL_TASK]['acc'])]
    assert history['eval/kv_cache_bytes_per_4096_tokens'] == [results['dha']['kv_cache_bytes_per_4096_tokens']]
    assert history['eval/val_loss'] == [pytest.approx(results['dha']['val_loss'])]


def test_compare_tables_three_runs_and_writes_the_plot(evaluated, tmp_path, capsys):
    root, _ = evaluated
    summary = compare([root / kind for kind in ('mha', 'gqa', 'dha')], out=tmp_path / 'compare')
    table = capsys.readouterr().out
    assert all(name in table for name in ('mha', 'gqa', 'dha')) and LOCAL_TASK in table
    assert [row['kv_cache_bytes_per_4096_tokens'] for row in summary['runs']] == \
        [16 * 16 * 4096 * 2, 8 * 16 * 4096 * 2, 8 * 16 * 4096 * 2]
    assert (tmp_path / 'compare' / 'compare.png').stat().st_size > 10_000


def test_the_cli_command_runs_and_names_bad_input(models, local_task, tmp_path, capsys):
    from dha_train.cli import main

    assert main(['eval', str(models['gqa']), '--suite', 'local', '--include', str(local_task), '--limit', '4',
                 '--out', str(tmp_path / 'cli')]) == 0
    assert json.loads((tmp_path / 'cli' / 'eval_results.json').read_text())['scores'][LOCAL_TASK]['acc'] >= 0
    assert main(['compare', str(tmp_path / 'cli')]) == 2
    assert 'compare needs at least two runs' in capsys.readouterr().err


@pytest.mark.slow
def test_bad_arguments_are_named_before_loading_anything(tmp_path, local_task):
    with pytest.raises(EvalError, match='exactly one of a suite'):
        resolve_tasks(None, None, None)
    with pytest.raises(EvalError, match="unknown suite 'dhaa'"):
        resolve_tasks('dhaa', None, None)
    assert resolve_tasks('dha', None, None)['arc_challenge'] == 25 and resolve_tasks('dha', None, None)['boolq'] == 32
    with pytest.raises(EvalError, match='unknown lm-eval task'):
        run_eval(tmp_path / 'nowhere', tasks=['no_such_task_xyz'])
    with pytest.raises(EvalError, match=r'no offline data for lm-eval task\(s\): gsm8k \('):  # known, not shipped
        run_eval(tmp_path / 'nowhere', tasks=['gsm8k'])
    with pytest.raises(EvalError, match='built with `dha-train local-task'):
        run_eval(tmp_path / 'nowhere', suite='local')
    with pytest.raises(EvalError, match='model not found'):
        run_eval(tmp_path / 'nowhere', suite='local', include=[local_task])
    with pytest.raises(EvalError, match='no eval_results.json'):
        compare([tmp_path, tmp_path])


def test_lm_eval_at_end_of_a_training_stage_logs_the_scores(local_task, data_root, tokenizer_dir, tmp_path):
    """The end-of-stage callback evaluates the trained model and logs lm_eval/<task>/<metric>; per-domain
    validation loss at eval_interval comes from the stage's evaluators as in every recipe."""
    from dha_train.config import load_config
    from dha_train.train import close_trainer, train
    from helpers import tiny_recipe

    recipe = tiny_recipe(data_root, tokenizer_dir, max_duration='2ba', loggers={'in_memory': {}},
                         eval_loader={'root': str(data_root)}, eval_interval='2ba',
                         save_folder=str(tmp_path / 'ckpt'), save_interval='2ba',
                         callbacks={'lm_eval_at_end': {'suite': 'local', 'include': [str(local_task)], 'limit': 8}})
    trainer = train(load_config(recipe))
    try:
        memory = next(d for d in trainer.logger.destinations if type(d).__name__ == 'InMemoryLogger')
        callback = next(c for c in trainer.state.callbacks if type(c).__name__ == 'LmEvalAtEnd')
        accuracy = memory.data[f'lm_eval/{LOCAL_TASK}/acc'][-1][1]
        assert accuracy == callback.scores[LOCAL_TASK]['acc'] and 0.0 <= accuracy <= 1.0
        assert all(f'metrics/eval_{domain}/LanguageCrossEntropy' in memory.data for domain in ('github', 'wikipedia'))
    finally:
        close_trainer(trainer)
    # `dha-train eval` also takes the Composer checkpoint itself (exported to a temporary folder first).
    result = run_eval(tmp_path / 'ckpt', suite='local', include=[local_task], out=tmp_path / 'eval', limit=8)
    assert result['model_type'] == 'llama' and result['scores'][LOCAL_TASK]['acc'] == pytest.approx(accuracy)
    from dha_train import registry

    with pytest.raises(ConfigError, match='callbacks.lm_eval_at_end: give exactly one of a suite'):
        registry.callbacks.build('lm_eval_at_end', {})  # refused when the trainer is built, before training


def test_eval_adds_its_scores_to_the_card_of_a_folder_the_project_wrote(models, evaluated):
    """The DHA folder (written by `convert`) gets model-index entries equal to the scores and the held-out loss;
    the MHA folder, written by someone else, is left without a card."""
    from dha_train.model_card import read_model_card
    _, results = evaluated
    header, _ = read_model_card(models['dha'])
    index = header['model-index'][0]
    assert index['name'] == 'dha'
    by_task = {entry['dataset']['name']: {m['type']: m['value'] for m in entry['metrics']}
               for entry in index['results']}
    assert by_task[LOCAL_TASK]['acc'] == pytest.approx(results['dha']['scores'][LOCAL_TASK]['acc'])
    loss_entry = next(metrics for name, metrics in by_task.items() if name.startswith('held-out loss'))
    assert loss_entry['loss'] == pytest.approx(results['dha']['val_loss'])
    assert header['dha_train']['method'] == 'mean_pool'  # the rest of the card is kept
    assert not (models['mha'] / 'README.md').exists()


def test_each_held_out_sequence_loss_averages_to_the_validation_loss(models, evaluated, data_root):
    """``sequence_losses``: one loss per packed val sequence and domain, whose mean is the validation loss the
    Composer evaluators measured (every sequence has the same length); what intervals over sequences are taken from."""
    from dha_train.evaluation import load_model, sequence_losses

    model, tokenizer = load_model(models['dha'])
    losses = sequence_losses(model, tokenizer, data_root, batch_size=3)
    measured = evaluated[1]['dha']['val_loss_per_domain']
    assert set(losses) == {'github', 'wikipedia'}
    for domain, values in losses.items():
        assert len(values) > 3 and len(set(values)) == len(values)
        assert sum(values) / len(values) == pytest.approx(measured[domain], rel=1e-5)


def test_a_sampled_eval_with_data_records_each_sequence_and_the_interval(models, local_task, data_root, tmp_path):
    import json
    import math

    from dha_train.evaluation import DOCUMENTS_FILE

    result = run_eval(models['mha'], suite='local', include=[local_task], out=tmp_path, documents=8, data=data_root)
    saved = json.loads((tmp_path / DOCUMENTS_FILE).read_text())
    sequences, documents = saved['heldout_sequences'], saved['heldout_sequence_documents']
    means = [sum(values) / len(values) for values in sequences.values()]
    assert result['val_loss'] == pytest.approx(sum(means) / len(means), rel=1e-5)
    # the variance of each domain's mean with its documents as the units (consecutive cuts of one correlate):
    # n / (n - 1) x sum over documents of (its sum - mean x its count)^2 / sequences^2
    variances = []
    for domain, values in sequences.items():
        labels, mean = documents[domain], sum(values) / len(values)
        assert len(labels) == len(values) and labels == sorted(labels)  # packed in order, one document after another
        units = sorted(set(labels))
        residuals = [sum(v for v, d in zip(values, labels) if d == unit) - mean * labels.count(unit) for unit in units]
        variances.append(len(units) / (len(units) - 1) * sum(r * r for r in residuals) / len(values) ** 2)
        assert result['heldout_units'][domain] == {'sequences': len(values), 'documents': len(units),
                                                   'units': 'documents'}
    assert result['val_loss_ci95'] == pytest.approx(1.959964 * math.sqrt(sum(variances)) / len(means), rel=1e-5)


def test_a_smaller_document_sample_lies_inside_a_larger_one(models, local_task, tmp_path):
    """The sample is the first N of one seeded shuffle of the split: a row scored on fewer documents (bench real's
    intermediate rows) shares all of them with one scored on more, and the sample is not the split's first N."""
    import json

    from dha_train.evaluation import DOCUMENTS_FILE

    chosen = {}
    for count in (4, 9):
        run_eval(models['mha'], suite='local', include=[local_task], out=tmp_path / str(count), documents=count)
        scored = json.loads((tmp_path / str(count) / DOCUMENTS_FILE).read_text())['tasks']
        chosen[count] = {task: {doc['doc_id'] for doc in docs} for task, docs in scored.items()}
    for task, ids in chosen[4].items():
        assert len(ids) == 4 and ids < chosen[9][task]
    assert any(ids != set(range(4)) for ids in chosen[4].values())

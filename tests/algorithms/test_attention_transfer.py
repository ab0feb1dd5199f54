"""`attention_transfer` in one process: what INIT installs (one extra attention per layer, only the converted
attention trainable), teacher forcing (the wrapped model computes the source's logits), and the per-layer loss
against a by-hand normalised MSE."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dha_train.algorithms.attention_transfer import SOURCE_MODULE, AttentionTransfer
from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.models.head_map import HeadMap
from helpers import save_tiny_llama


def _models(tmp_path, tokenizer_dir):
    save_tiny_llama(tmp_path / 'source', tokenizer_dir, seed=11)
    source_map = HeadMap.from_hf_config(AutoConfig.from_pretrained(tmp_path / 'source'))
    convert_checkpoint(tmp_path / 'source', tmp_path / 'gqa', HeadMap.pooled(source_map, 2))
    source = AutoModelForCausalLM.from_pretrained(tmp_path / 'source').eval()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / 'gqa').eval()
    return source, converted


def test_init_adds_one_frozen_source_attention_per_layer_and_trains_only_the_converted_attention(tmp_path,
                                                                                              tokenizer_dir):
    source, converted = _models(tmp_path, tokenizer_dir)
    before = sum(p.numel() for p in converted.parameters())
    AttentionTransfer(str(tmp_path / 'source'))._install(SimpleNamespace(model=converted))
    source_attention = sum(p.numel() for layer in source.model.layers for p in layer.self_attn.parameters())
    assert sum(p.numel() for p in converted.parameters()) == before + source_attention  # not a second model
    for name, parameter in converted.named_parameters():
        assert parameter.requires_grad == ('self_attn' in name), name
    for layer, source_layer in zip(converted.model.layers, source.model.layers):
        for name, weight in getattr(layer, SOURCE_MODULE).state_dict().items():
            assert torch.equal(weight, source_layer.self_attn.state_dict()[name])


def test_the_stream_is_teacher_forced_and_the_loss_is_the_normalised_attention_mse(tmp_path, tokenizer_dir):
    source, converted = _models(tmp_path, tokenizer_dir)
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    # by hand: layer 0 of both models sees the same embeddings, so its attention outputs compare directly
    captured = {}
    hooks = [model.model.layers[0].self_attn.register_forward_hook(
        lambda module, args, output, key=key: captured.__setitem__(key, output[0].detach()))
        for key, model in (('source', source), ('converted', converted))]
    with torch.no_grad():
        source_logits = source(ids).logits
        converted(ids)
    for hook in hooks:
        hook.remove()
    expected = (captured['converted'] - captured['source']).pow(2).sum() / captured['source'].pow(2).sum()

    algorithm = AttentionTransfer(str(tmp_path / 'source'))
    algorithm._install(SimpleNamespace(model=converted))
    logits = converted(ids).logits
    torch.testing.assert_close(logits, source_logits, rtol=0, atol=1e-5)  # the source carries the residual stream
    errors = [getattr(layer, SOURCE_MODULE).transfer_mse for layer in converted.model.layers]
    torch.testing.assert_close(errors[0].detach(), expected, rtol=1e-5, atol=0)
    assert all(error.requires_grad and float(error) > 0 for error in errors)
    # the loss reaches only the converted attention
    torch.stack(errors).mean().backward()
    for name, parameter in converted.named_parameters():
        assert (parameter.grad is not None) == ('self_attn' in name), name


def test_activation_checkpointing_gives_the_same_layer_losses_and_gradients(tmp_path, tokenizer_dir):
    # the recipes at 7B/8B checkpoint every decoder layer: the hook runs again in the recomputation, which must
    # change neither the losses nor the gradients
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for checkpointing in (False, True):
        _, converted = _models(tmp_path / str(checkpointing), tokenizer_dir)
        AttentionTransfer(str(tmp_path / str(checkpointing) / 'source'))._install(SimpleNamespace(model=converted))
        if checkpointing:
            converted.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
        converted.train()
        calls = []
        getattr(converted.model.layers[0], SOURCE_MODULE).register_forward_hook(lambda *_: calls.append(1))
        converted(ids)
        errors = torch.stack([getattr(layer, SOURCE_MODULE).transfer_mse for layer in converted.model.layers])
        errors.mean().backward()
        assert len(calls) == (2 if checkpointing else 1)  # the recomputation did run the layer again
        grads = {name: p.grad.clone() for name, p in converted.named_parameters() if p.grad is not None}
        results.append((errors.detach(), grads))
    (plain_errors, plain_grads), (checkpointed_errors, checkpointed_grads) = results
    torch.testing.assert_close(checkpointed_errors, plain_errors, rtol=1e-6, atol=0)
    assert plain_grads.keys() == checkpointed_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_deepseek_format_student_is_taught_by_the_source_at_the_sources_own_positions(tmp_path, tokenizer_dir):
    """DeepSeek's layers pass position embeddings of their shared RoPE key (other width, other frequencies); the
    source attention must run with its own, or the teacher-forced stream would not be the source's."""
    from transformers import DeepseekV3ForCausalLM

    from dha_train.conversion.deepseek import deepseek_config, layer_weights
    from dha_train.ops.deepseek import shared_key_mix, strided_pairs
    from dha_train.ops.mla import pair_key_cross_energy

    save_tiny_llama(tmp_path / 'source', tokenizer_dir, seed=11)
    source = AutoModelForCausalLM.from_pretrained(tmp_path / 'source').eval()
    config = source.config
    dim = config.hidden_size // config.num_attention_heads
    student = DeepseekV3ForCausalLM(deepseek_config(config, rank=dim, pairs=1, stride=1)).eval()
    state = {name: tensor for name, tensor in source.state_dict().items() if '.self_attn.' not in name}
    for index, layer in enumerate(source.model.layers):
        cross = pair_key_cross_energy(layer.self_attn.k_proj.weight, None, config.num_key_value_heads, dim)
        weights = layer_weights(layer.self_attn, config, shared_key_mix(cross, strided_pairs(1, 1))[0], dim,
                                None, 'none', None, None)
        state.update({f'model.layers.{index}.self_attn.{name}': tensor for name, tensor in weights.items()})
    student.load_state_dict(state, strict=False)
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        source_logits = source(ids).logits
        assert not torch.allclose(student(ids).logits, source_logits, atol=1e-3)
    AttentionTransfer(str(tmp_path / 'source'))._install(SimpleNamespace(model=student))
    logits = student(ids).logits
    torch.testing.assert_close(logits, source_logits, rtol=0, atol=1e-5)
    errors = torch.stack([getattr(layer, SOURCE_MODULE).transfer_mse for layer in student.model.layers])
    assert bool(torch.isfinite(errors).all()) and float(errors.min()) > 0
    errors.mean().backward()
    assert all(parameter.grad is not None for name, parameter in student.named_parameters() if 'self_attn.kv_b' in name)


def test_each_layers_mse_trains_only_its_own_attention_with_and_without_the_carry(tmp_path, tokenizer_dir):
    """The loss is the LM term cancelled plus the mean layer MSE. Its gradient on layer l's converted attention must
    be d(MSE_l)/L alone, also in carry mode (FSDP2's, and any positive lm_weight's), where the stream carries
    gradient paths from every converted attention into the later layers."""
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(2))

    def gradients(carry: bool, only_layer: int | None) -> dict[str, torch.Tensor]:
        _, converted = _models(tmp_path / f'{carry}-{only_layer}', tokenizer_dir)
        algorithm = AttentionTransfer(str(tmp_path / f'{carry}-{only_layer}' / 'source'))
        algorithm._install(SimpleNamespace(model=converted))
        algorithm._carry = carry
        logits = converted(ids).logits
        lm = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        errors = torch.stack([getattr(layer, SOURCE_MODULE).transfer_mse for layer in converted.model.layers])
        loss = lm + (algorithm.lm_weight - 1.0) * lm + errors.mean() if only_layer is None else errors[only_layer]
        loss.backward()
        return {name: p.grad.clone() for name, p in converted.named_parameters() if p.grad is not None}

    totals = {carry: gradients(carry, None) for carry in (False, True)}
    layers = 1 + max(int(name.split('.')[2]) for name in totals[False])
    local = {}
    for index in range(layers):  # each layer's own MSE gradient, on that layer's converted attention
        prefix = f'model.layers.{index}.self_attn.'
        local.update({name: grad / layers for name, grad in gradients(False, index).items() if name.startswith(prefix)})
    for carry, total in totals.items():
        assert total.keys() == local.keys()
        for name, grad in local.items():
            torch.testing.assert_close(total[name], grad, rtol=1e-4, atol=1e-8, msg=f'carry={carry}: {name}')


def test_training_more_than_the_attention_is_refused_by_name():
    # the MSE would train embeddings, MLPs and norms through the stream, which is not teacher forcing
    import pytest

    from dha_train import registry
    from dha_train.config import ConfigError

    with pytest.raises(ConfigError, match="trainable must be 'attention'.*got 'all'"):
        registry.algorithms.build_all({'attention_transfer': {'source_path': 'unused', 'trainable': 'all'}})


def test_on_one_rank_without_fsdp_the_head_skips_the_logits_and_the_run_is_the_fsdp_run(tmp_path, tokenizer_dir,
                                                                                          data_root):
    """Without FSDP2's carry no gradient reaches the LM head, so at lm_weight 0 the head computes the last position
    only (healing's speed on CPU, issue 62): the per-batch losses and the trained attention must equal those of the
    same run under FSDP2 on one rank, which computes every position's logits and cancels their loss."""
    from composer.core import Callback
    from safetensors.torch import load_file

    from dha_train.export import export_hf
    from dha_train.stages import train_stage

    _models(tmp_path, tokenizer_dir)

    class LogitShapes(Callback):
        def __init__(self):
            self.shapes = []

        def after_forward(self, state, logger):
            self.shapes.append(tuple(state.outputs['logits'].shape))

    runs = {}
    for fsdp in (False, True):
        shapes = LogitShapes()
        save = tmp_path / f'run-{fsdp}'
        overrides = [f'variables.model_path={tmp_path / "gqa"}', f'variables.source_path={tmp_path / "source"}',
                     f'variables.data_root={data_root}', f'variables.save_root={save}', 'variables.steps=3ba',
                     'global_train_batch_size=4', 'device_train_microbatch_size=2',
                     'save_interval=3ba']
        trainer, config, history = train_stage('healing/tiny_transfer.yaml', overrides, None,
                                               extra_callbacks=[shapes], fsdp=fsdp)
        hf = export_hf(save / config.run_name, tmp_path / f'hf-{fsdp}')
        runs[fsdp] = ([loss for _, loss in history['train']], load_file(hf / 'model.safetensors'), shapes.shapes)
    (plain, plain_weights, plain_shapes), (sharded, sharded_weights, sharded_shapes) = runs[False], runs[True]
    assert {shape[1] for shape in plain_shapes} == {1} and {shape[1] for shape in sharded_shapes} == {64}
    assert len(plain) == 3 and all(loss > 0 for loss in plain)
    torch.testing.assert_close(torch.tensor(plain), torch.tensor(sharded), rtol=1e-5, atol=0)
    assert plain_weights.keys() == sharded_weights.keys()
    for name, weight in plain_weights.items():
        torch.testing.assert_close(weight, sharded_weights[name], rtol=1e-4, atol=1e-6, msg=name)
    trained = [name for name, weight in plain_weights.items()
               if 'self_attn' in name and not torch.equal(weight, load_file(tmp_path / 'gqa' / 'model.safetensors')[name])]
    assert trained  # the attention did train

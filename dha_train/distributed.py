"""The few places that must know about FSDP2 sharding, kept out of the model and algorithm code."""

from __future__ import annotations

import functools

import torch
from composer.distributed.fsdp2 import sync_module_states
from composer.utils import dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from dha_train.models.llama_layout import is_decoder_block


def unsharded(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter or buffer, gathered when FSDP2 holds it as a sharded DTensor (a collective:
    every rank must call it in the same order)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def device_mesh_of(model: nn.Module):
    """The device mesh FSDP2 sharded ``model``'s parameters on, or None when they are not sharded."""
    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            return parameter.device_mesh
    return None


def causal_lm_on_meta(config) -> nn.Module:
    """The HF causal LM of ``config`` (LLaMA, or the DHA / MoH class the config names) with every parameter and
    buffer on the meta device: no memory and no weights, for a rank that receives global rank 0's weights when FSDP2
    shards the model (Composer's ``sync_module_states``: it broadcasts every parameter and buffer)."""
    with torch.device('meta'):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # HF's rotary embedding keeps a second reference to its frequencies outside the module's buffers
    # (original_inv_freq, restored by dynamic RoPE) that no broadcast reaches: build those modules for real (they
    # are computed from the config, a few KB), so that reference is not a meta tensor.
    for name, module in list(model.named_modules()):
        if hasattr(module, 'original_inv_freq'):
            parent, _, child = name.rpartition('.')
            setattr(model.get_submodule(parent), child, type(module)(config=module.config))
    return model


def shard_blocks(model: nn.Module, mesh, **options) -> None:
    """FSDP2 as training wraps a model: one unit per decoder block (``is_decoder_block``) plus the root, with the
    ``fully_shard`` options given (``mp_policy``, ``reshard_after_forward``)."""
    for block in [module for module in model.modules() if is_decoder_block(module)]:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)


def shard_like(model: nn.Module, reference: nn.Module, weights_from_rank0: bool = False) -> nn.Module:
    """Shard ``model`` (a frozen teacher, say) as the run shards ``reference``: one FSDP2 unit per decoder block
    (the same predicate as training's wrap) plus the root, on the same device mesh. Unsharded runs: unchanged.

    ``weights_from_rank0``: only global rank 0's ``model`` holds weights (the other ranks built theirs with
    ``causal_lm_on_meta``); after sharding, Composer's ``sync_module_states`` fills every rank's shards from rank 0,
    the same way Composer prepares the trained model."""
    mesh = device_mesh_of(reference)
    if mesh is None:
        return model
    full_state_dict = {}
    if weights_from_rank0 and dist.get_global_rank() == 0:
        # Read before sharding, as Composer's own FSDP2 preparation does; on the CPU these are the weights themselves.
        full_state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=True))
    shard_blocks(model, mesh)
    if weights_from_rank0:
        sync_module_states(model, full_state_dict)
    return model


def reduce_scatter_averages(group, device: torch.device | str = 'cpu') -> bool:
    """Whether ``ReduceOp.AVG`` in a reduce-scatter on ``group`` really averages (a collective: every rank of the
    group calls it). gloo in torch 2.7 silently sums instead (pytorch/pytorch#162338). ``device`` is where FSDP2
    keeps the gradients it reduces: NCCL takes only CUDA tensors, and the probe must run on the backend FSDP uses."""
    ones = torch.ones(group.size(), dtype=torch.float32, device=device)
    out = torch.empty(1, dtype=torch.float32, device=device)
    torch.distributed.reduce_scatter_tensor(out, ones, op=torch.distributed.ReduceOp.AVG, group=group)
    return abs(float(out) - 1.0) < 1e-6


def average_fsdp_gradients(model: nn.Module) -> int:
    """Make FSDP2 average gradients over the ranks where the backend sums them, and return how many FSDP units
    needed it.

    FSDP2 reduce-scatters fp32 gradients with ``ReduceOp.AVG``, which gloo (CPU) runs as a sum: every gradient was
    the world size times the batch mean, so gradient clipping thresholds and Adam's eps meant different things with
    1 and with N processes, and a run resumed with another process count (elastic resume) changed course. The probe
    decides, so NCCL (which averages) is left alone and a torch that fixes gloo needs no change here. The division
    runs in FSDP2's own hook on each reduce-scatter output, before it is accumulated into the sharded gradient.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    patched, averages = 0, {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        param_group = module._get_fsdp_state()._fsdp_param_group
        if param_group is None:
            continue
        group = param_group.mesh_info.shard_process_group
        if group.size() == 1:
            continue
        if group not in averages:
            averages[group] = reduce_scatter_averages(group, param_group.device)
        if not averages[group]:
            module.set_all_reduce_hook(functools.partial(torch.Tensor.div_, other=group.size()))
            patched += 1
    return patched

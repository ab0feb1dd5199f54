"""The few places that must know about FSDP2 sharding, kept out of the model and algorithm code."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

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


def shard_like(model: nn.Module, reference: nn.Module) -> nn.Module:
    """Shard ``model`` (a frozen teacher, say) as the run shards ``reference``: one FSDP2 unit per decoder block
    (the same predicate as training's wrap) plus the root, on the same device mesh. Unsharded runs: unchanged."""
    mesh = device_mesh_of(reference)
    if mesh is None:
        return model
    for block in [module for module in model.modules() if is_decoder_block(module)]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model

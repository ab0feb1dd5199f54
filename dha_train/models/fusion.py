"""``FusedProjection``: the k_proj / v_proj of an MHA attention layer during DHA fusion (seed 000 Eq. 5).

It keeps the MHA projection weight (still trained, under its original state-dict name ``weight``) and the fusion
weights ``omega``; every forward mixes the weights (not the activations) and records the layer's fusion-loss terms
while the parameters are unsharded, so the loss is correct under FSDP2 and activation checkpointing alike.
"""

from __future__ import annotations

import torch
from torch import nn

from dha_train.ops.fusion import fuse_weight, kronecker_omega, pair_index


class FusedProjection(nn.Module):
    def __init__(self, linear: nn.Linear, members: torch.Tensor, head_dim: int):
        super().__init__()
        if linear.out_features != members.shape[0] * head_dim:
            raise ValueError(f'{linear.out_features} output rows are not {members.shape[0]} heads of {head_dim}')
        self.in_features, self.out_features, self.head_dim = linear.in_features, linear.out_features, head_dim
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer('members', members.to(linear.weight.device), persistent=True)
        self.omega = nn.Parameter(kronecker_omega(members, head_dim, dtype=torch.float32).to(linear.weight.device))
        self.pair_squares: torch.Tensor | None = None  # sum of squared omega differences over the fused pairs
        self.pair_elements = 0  # how many squared differences that sum holds
        self.set_fusion_pairs(members)

    def set_fusion_pairs(self, table: torch.Tensor) -> None:
        """The heads whose fusion weights the loss pulls together: rows of ``table`` (H, s) that are equal share a
        (sub-)group; the groups themselves, or a progressive-fusion stage's sub-groups (HeadFusion's checkpoint
        state holds those, so these buffers are not persistent). The pair indices are found once here, on the
        CPU, rather than in every forward (``nonzero`` would synchronise a GPU each time)."""
        device = self.members.device
        first, second = pair_index(table.cpu())
        self.register_buffer('fusion_pairs', table.to(device).clone(), persistent=False)
        self.register_buffer('pair_first', first.to(device), persistent=False)
        self.register_buffer('pair_second', second.to(device), persistent=False)
        self.pair_elements = int(first.numel()) * self.omega.shape[1] * self.omega.shape[2]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        omega = self.omega
        self.pair_squares = (omega[self.pair_first] - omega[self.pair_second]).square().sum()
        weight = fuse_weight(self.weight, omega.to(self.weight.dtype), self.members)
        bias = None if self.bias is None else fuse_weight(self.bias, omega.to(self.bias.dtype), self.members)
        return nn.functional.linear(hidden, weight, bias)

    def extra_repr(self) -> str:
        return (f'in_features={self.in_features}, out_features={self.out_features}, '
                f'group_size={self.members.shape[1]}')

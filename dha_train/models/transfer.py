"""``TransferProjection``: an MHA k_proj / v_proj while aligned GQA moves it onto merged group heads (seed 001
Eq. 25-28).

It keeps the original heads (``weight``, still trained, under its original state-dict name), the group heads
(``group_weight``, initialised by mean-pooling each contiguous group) and one hard-concrete gate per original head
(``log_alpha``). Head h uses W_h^apply = z_h W_h + (1 - z_h) W_group(h), mixed in weight space. Once the gates are
frozen (``frozen_gates``, a persistent buffer, so a resumed run keeps them) and all zero, the projection is exactly
the group heads: the export drops the originals and writes standard HF GQA. A projection with a bias (Qwen2's k/v)
mixes its bias the same way (``bias`` and ``group_bias``), since a bias is one more column of the projection.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from dha_train.ops.hard_concrete import (
    deterministic_gates,
    expected_l0,
    gate_noise,
    gates_from_noise,
    log_alpha_for_open_gates,
)

NOT_FROZEN = -1.0  # frozen_gates holds this until the gates freeze


class TransferProjection(nn.Module):
    def __init__(self, linear: nn.Linear, num_groups: int, head_dim: int, init_log_alpha: float | None = None):
        super().__init__()
        num_heads = linear.out_features // head_dim
        if num_heads * head_dim != linear.out_features or num_heads % num_groups:
            raise ValueError(f'{linear.out_features} output rows are not {num_groups} equal groups of '
                             f'{head_dim}-dim heads')
        self.in_features, self.num_heads, self.num_groups, self.head_dim = linear.in_features, num_heads, num_groups, \
            head_dim
        self.weight = linear.weight
        with torch.no_grad():
            pooled = linear.weight.reshape(num_groups, num_heads // num_groups, head_dim, -1).mean(dim=1)
        self.group_weight = nn.Parameter(pooled.reshape(num_groups * head_dim, -1).clone())
        self.bias = linear.bias
        self.group_bias = None
        if linear.bias is not None:
            with torch.no_grad():
                pooled_bias = linear.bias.reshape(num_groups, num_heads // num_groups, head_dim).mean(dim=1)
            self.group_bias = nn.Parameter(pooled_bias.reshape(-1).clone())
        # Open at the start (deterministic gate 1; 95% of sampled gates exactly 1): the model starts as the MHA model.
        start = log_alpha_for_open_gates(closed_probability=0.05) if init_log_alpha is None else init_log_alpha
        self.log_alpha = nn.Parameter(torch.full((num_heads,), start, dtype=torch.float32,
                                                 device=linear.weight.device))
        self.register_buffer('frozen_gates', torch.full((num_heads,), NOT_FROZEN, device=linear.weight.device))
        self.expected_density: torch.Tensor | None = None  # mean P(z != 0) of this forward, for the L0 loss
        # The gate noise's generator, set by KVHeadTransfer: one stream shared by every rank and checkpointed with
        # the algorithm (Composer does not restore the global RNG when a streaming run resumes mid-epoch).
        self.generator: torch.Generator | None = None
        self.noise: torch.Tensor | None = None  # the last forward's gate noise, reused by its checkpoint recompute

    @property
    def frozen(self) -> bool:
        if is_fake(self.frozen_gates):  # `dha-train plan` on fake tensors, which hold no values: a run starts open
            return False
        return bool((self.frozen_gates >= 0).all())

    def gates(self) -> torch.Tensor:
        if self.frozen:
            return self.frozen_gates
        if not self.training:
            return deterministic_gates(self.log_alpha)
        # Under activation checkpointing the backward pass runs this forward again. torch restores the global RNG
        # for that recompute, not this private stream, so a recompute (a forward inside a backward pass) reuses
        # the noise its forward drew: the same gates, and the stream advances once per forward either way.
        recomputing = torch._C._current_graph_task_id() != -1
        if self.noise is None or not recomputing:
            self.noise = gate_noise(self.log_alpha.shape, self.generator, self.log_alpha.device, self.log_alpha.dtype)
        return gates_from_noise(self.log_alpha, self.noise)

    def freeze(self, log_alpha: torch.Tensor, close: bool = True) -> int:
        """Fix the gates at their deterministic values for ``log_alpha`` (this projection's whole gate logits: the
        caller gathers them when FSDP2 shards them); with ``close``, every gate that is not yet 0 is set to 0 (the
        transfer's end point). Returns how many gates had to be closed by force."""
        with torch.no_grad():
            gates = deterministic_gates(log_alpha.float()).to(self.frozen_gates.device)
            forced = int((gates > 0).sum())
            self.frozen_gates.copy_(torch.zeros_like(gates) if close else gates)
        return forced

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.expected_density = expected_l0(self.log_alpha.float()).mean()
        z = self.gates().to(self.weight.dtype)[:, None, None]
        heads = self.weight.reshape(self.num_heads, self.head_dim, -1)
        groups = self.group_weight.reshape(self.num_groups, 1, self.head_dim, -1)
        groups = groups.expand(-1, self.num_heads // self.num_groups, -1, -1).reshape_as(heads)
        weight = z * heads + (1.0 - z) * groups
        bias = None
        if self.bias is not None:
            z_rows = z.reshape(self.num_heads, 1)
            group_bias = self.group_bias.reshape(self.num_groups, 1, self.head_dim)
            group_bias = group_bias.expand(-1, self.num_heads // self.num_groups, -1).reshape(self.num_heads, -1)
            bias = (z_rows * self.bias.reshape(self.num_heads, -1) + (1.0 - z_rows) * group_bias).reshape(-1)
        return nn.functional.linear(hidden, weight.reshape(self.num_heads * self.head_dim, -1), bias)

    def extra_repr(self) -> str:
        return (f'in_features={self.in_features}, heads={self.num_heads}, groups={self.num_groups}, '
                f'head_dim={self.head_dim}')


def transfer_to_gqa_state_dict(state_dict: dict[str, torch.Tensor], head_dim: int) -> tuple[dict[str, torch.Tensor],
                                                                                           int]:
    """A transfer model's state dict -> standard HF GQA weights (each k/v projection's group heads) and the K/V head
    count. Refuses unless every gate is frozen at 0: otherwise dropping the original heads would change the model."""
    gqa = dict(state_dict)
    groups = set()
    layer = 0
    while f'model.layers.{layer}.self_attn.k_proj.group_weight' in state_dict:
        for projection in ('k_proj', 'v_proj'):
            prefix = f'model.layers.{layer}.self_attn.{projection}.'
            gates = gqa.pop(prefix + 'frozen_gates')
            gqa.pop(prefix + 'log_alpha')
            if bool((gates != 0).any()):
                state = 'not frozen yet' if bool((gates < 0).any()) else f'{int((gates > 0).sum())} still open'
                raise ValueError(f'{prefix}: the transfer gates are {state}; the original heads are still in use, '
                                 'so the model cannot be exported as GQA (train past the freeze point)')
            gqa[prefix + 'weight'] = gqa.pop(prefix + 'group_weight')
            if prefix + 'group_bias' in gqa:
                gqa[prefix + 'bias'] = gqa.pop(prefix + 'group_bias')
            groups.add(gqa[prefix + 'weight'].shape[0] // head_dim)
        layer += 1
    if layer == 0:
        raise ValueError('no transfer projections (model.layers.<i>.self_attn.k_proj.group_weight) in the state dict')
    if len(groups) != 1:
        raise ValueError(f'K/V head counts differ across layers ({sorted(groups)}): not a standard GQA model')
    return gqa, groups.pop()

"""Hard-concrete gates for L0 regularisation (Louizos et al. 2018), as seed 001 section 3.5 uses them to move the
original K/V heads onto the merged group heads. Pure tensor maths.

A gate z in [0, 1] with parameter log_alpha: u ~ U(0, 1), s = sigmoid((log u - log(1 - u) + log_alpha) / beta),
z = clamp(s (zeta - gamma) + gamma, 0, 1). The stretch (gamma < 0 < 1 < zeta) puts point masses at exactly 0 and 1.
P(z != 0) = sigmoid(log_alpha - beta log(-gamma / zeta)) is the expected L0 norm, differentiable in log_alpha.
"""

from __future__ import annotations

import math

import torch

BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1


def gate_noise(shape: torch.Size, generator: torch.Generator | None = None, device: torch.device | str = 'cpu',
               dtype: torch.dtype = torch.float32, eps: float = 1e-6) -> torch.Tensor:
    """The uniform noise u of one sample of every gate, clamped to [eps, 1 - eps]. It is drawn in float64 on the
    generator's device (the CPU for a CPU generator), so a stream gives the same draws on every device and rank,
    then moved to ``device`` and ``dtype``."""
    draw_on = generator.device if generator is not None else device
    u = torch.rand(shape, generator=generator, dtype=torch.float64, device=draw_on)
    return u.to(device=device, dtype=dtype).clamp(eps, 1.0 - eps)


def gates_from_noise(log_alpha: torch.Tensor, u: torch.Tensor, beta: float = BETA, gamma: float = GAMMA,
                     zeta: float = ZETA) -> torch.Tensor:
    """The reparameterised gates for noise ``u`` (differentiable in log_alpha)."""
    s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / beta)
    return (s * (zeta - gamma) + gamma).clamp(0.0, 1.0)


def sample_gates(log_alpha: torch.Tensor, generator: torch.Generator | None = None, beta: float = BETA,
                 gamma: float = GAMMA, zeta: float = ZETA, eps: float = 1e-6) -> torch.Tensor:
    """One reparameterised sample of every gate (differentiable in log_alpha)."""
    u = gate_noise(log_alpha.shape, generator, log_alpha.device, log_alpha.dtype, eps)
    return gates_from_noise(log_alpha, u, beta, gamma, zeta)


def deterministic_gates(log_alpha: torch.Tensor, gamma: float = GAMMA, zeta: float = ZETA) -> torch.Tensor:
    """The test-time gate clamp(sigmoid(log_alpha) (zeta - gamma) + gamma, 0, 1): exactly 0 once log_alpha <=
    log(-gamma / zeta), exactly 1 once log_alpha >= log((1 - gamma) / (zeta - 1))."""
    return (torch.sigmoid(log_alpha) * (zeta - gamma) + gamma).clamp(0.0, 1.0)


def expected_l0(log_alpha: torch.Tensor, beta: float = BETA, gamma: float = GAMMA, zeta: float = ZETA) -> torch.Tensor:
    """P(z != 0) per gate: the expected L0 norm's closed form."""
    return torch.sigmoid(log_alpha - beta * math.log(-gamma / zeta))


def log_alpha_for_open_gates(beta: float = BETA, gamma: float = GAMMA, zeta: float = ZETA,
                             closed_probability: float = 1e-4) -> float:
    """A log_alpha at which a sampled gate is exactly 1 with probability 1 - ``closed_probability``, and the
    deterministic gate is 1: the start, where every original head is fully in use (z = 1)."""
    # z == 1 iff s >= (1 - gamma) / (zeta - gamma) = p, i.e. logistic noise L >= beta logit(p) - log_alpha.
    p = (1.0 - gamma) / (zeta - gamma)
    threshold = beta * math.log(p / (1.0 - p))
    return threshold - math.log(closed_probability / (1.0 - closed_probability))


def l0_target(step: int, total_steps: int, warmup_fraction: float = 0.3, start: float = 1.0) -> float:
    """Target density T: ``start`` falling linearly to 0 over the first ``warmup_fraction`` of the steps (seed 001
    section 3.5: T equals zero after the sparsity warm-up)."""
    warmup = warmup_fraction * total_steps
    if warmup <= 0:
        return 0.0
    return start * max(0.0, 1.0 - step / warmup)


def l0_loss(density: torch.Tensor, target: float) -> torch.Tensor:
    """Eq. 29: |s - T| + (s - T)^2 for the mean gate density s."""
    gap = density - target
    return gap.abs() + gap.square()

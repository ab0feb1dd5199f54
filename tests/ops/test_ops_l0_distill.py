"""Hard-concrete gates (Louizos et al.), the Eq. 29 L0 loss, and the KL / BiLD distillation losses."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dha_train.ops.distill import bild_loss, kl_loss
from dha_train.ops.hard_concrete import (
    deterministic_gates,
    expected_l0,
    l0_loss,
    l0_target,
    log_alpha_for_open_gates,
    sample_gates,
)


def test_hard_concrete_samples_lie_in_0_1_with_point_masses_at_both_ends():
    log_alpha = torch.full((200_000,), 0.3, dtype=torch.float64)
    z = sample_gates(log_alpha, generator=torch.Generator().manual_seed(0))
    assert float(z.min()) == 0.0 and float(z.max()) == 1.0
    at_zero, at_one = float((z == 0).double().mean()), float((z == 1).double().mean())
    assert 0.05 < at_zero < 0.5 and 0.05 < at_one < 0.5  # real point masses, not just values near the ends
    assert float(((z > 0) & (z < 1)).double().mean()) > 0.3  # and a continuous part between them


@pytest.mark.parametrize('value', [-3.0, -0.5, 0.0, 1.2, 4.0])
def test_expected_l0_closed_form_matches_monte_carlo(value):
    log_alpha = torch.full((400_000,), value, dtype=torch.float64)
    z = sample_gates(log_alpha, generator=torch.Generator().manual_seed(1))
    monte_carlo = float((z > 0).double().mean())
    closed = float(expected_l0(torch.tensor(value, dtype=torch.float64)))
    assert monte_carlo == pytest.approx(closed, abs=4 * math.sqrt(closed * (1 - closed) / 400_000) + 1e-4)


def test_open_gates_start_at_one_and_deterministic_gates_close_exactly():
    start = log_alpha_for_open_gates()
    z = sample_gates(torch.full((100_000,), start, dtype=torch.float64), generator=torch.Generator().manual_seed(2))
    assert float((z == 1).double().mean()) > 0.999
    assert float(deterministic_gates(torch.tensor(start))) == 1.0
    assert float(deterministic_gates(torch.tensor(math.log(0.1 / 1.1) - 1e-6))) == 0.0
    assert float(deterministic_gates(torch.tensor(math.log(0.1 / 1.1) + 0.05))) > 0.0


def test_l0_target_and_loss_closed_forms():
    assert [l0_target(step, 100) for step in (0, 15, 30, 60)] == [1.0, 0.5, 0.0, 0.0]
    assert float(l0_loss(torch.tensor(0.75), 0.5)) == pytest.approx(0.25 + 0.0625)
    assert float(l0_loss(torch.tensor(0.2), 0.5)) == pytest.approx(0.3 + 0.09)


def reference_bild(student, teacher, top_k, temperature):
    """Straightforward loops: per position, teacher-led and student-led pairwise differences, softmax, KL."""
    total, positions = 0.0, 0
    for s_row, t_row in zip(student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1])):
        for leader in (t_row, s_row):
            order = sorted(range(len(leader)), key=lambda v: -float(leader[v]))[:top_k]
            t_diff = [float(t_row[order[i]] - t_row[order[j]]) for i, j in itertools.combinations(range(top_k), 2)]
            s_diff = [float(s_row[order[i]] - s_row[order[j]]) for i, j in itertools.combinations(range(top_k), 2)]
            t_norm = math.log(sum(math.exp(d / temperature) for d in t_diff))
            s_norm = math.log(sum(math.exp(d / temperature) for d in s_diff))
            for t, s in zip(t_diff, s_diff):
                p = math.exp(t / temperature - t_norm)
                total += p * ((t / temperature - t_norm) - (s / temperature - s_norm))
        positions += 1
    return total / positions


@pytest.mark.parametrize('top_k, temperature', [(4, 1.0), (16, 2.0)])
def test_bild_equals_a_straightforward_implementation_and_vanishes_for_equal_logits(top_k, temperature):
    generator = torch.Generator().manual_seed(3)
    student = torch.randn(2, 3, 40, generator=generator, dtype=torch.float64) * 2
    teacher = torch.randn(2, 3, 40, generator=generator, dtype=torch.float64) * 2
    loss = float(bild_loss(student, teacher, top_k=top_k, temperature=temperature))
    assert loss == pytest.approx(reference_bild(student, teacher, top_k, temperature), rel=1e-5)
    assert loss > 0
    assert float(bild_loss(teacher, teacher, top_k=top_k, temperature=temperature)) == pytest.approx(0.0, abs=1e-7)


def test_kl_is_masked_and_zero_for_equal_logits():
    generator = torch.Generator().manual_seed(4)
    student, teacher = torch.randn(2, 5, 30, generator=generator), torch.randn(2, 5, 30, generator=generator)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 1] = True
    expected = torch.nn.functional.kl_div(torch.log_softmax(student[0, 1], -1), torch.log_softmax(teacher[0, 1], -1),
                                          log_target=True, reduction='sum')
    assert float(kl_loss(student, teacher, mask=mask)) == pytest.approx(float(expected), rel=1e-5)
    assert float(kl_loss(teacher, teacher)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match='top_k'):
        bild_loss(student, teacher, top_k=31)

"""Logit distillation losses (seed 001 Eq. 30): KL and BiLD (Li et al. 2024). Pure tensor maths.

Logits are (..., vocab); ``mask`` (...) selects the positions that count (e.g. labels != -100); every loss is the
mean over those positions.

BiLD: take the top-k logits of one model (the teacher for the teacher-led term, the student for the student-led
term), read both models' logits at those k vocabulary entries, form every pairwise difference l_i - l_j (i < j, in
the leader's ranking order), and compare the two models' softmaxes over those k (k - 1) / 2 differences (divided by
the temperature) with KL(teacher || student). BiLD is the sum of the two terms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _masked_mean(per_position: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return per_position.mean()
    mask = mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1.0)


def _kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(teacher) || softmax(student)) over the last dim, per position."""
    teacher_log = F.log_softmax(teacher_logits, dim=-1)
    return (teacher_log.exp() * (teacher_log - F.log_softmax(student_logits, dim=-1))).sum(dim=-1)


def kl_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """KL(p_teacher || p_student) at ``temperature``, scaled by T^2 so its gradient scale does not depend on T."""
    per_position = _kl(teacher.float() / temperature, student.float() / temperature)
    return _masked_mean(per_position, mask) * temperature ** 2


def logit_differences(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(..., k (k - 1) / 2): l[index_i] - l[index_j] for every i < j of the k gathered entries."""
    values = logits.gather(-1, index)
    first, second = torch.triu_indices(index.shape[-1], index.shape[-1], offset=1, device=logits.device)
    return values[..., first] - values[..., second]


def _led_term(student: torch.Tensor, teacher: torch.Tensor, leader: torch.Tensor, top_k: int,
              temperature: float) -> torch.Tensor:
    index = leader.topk(top_k, dim=-1).indices
    return _kl(logit_differences(teacher, index) / temperature, logit_differences(student, index) / temperature)


def bild_loss(student: torch.Tensor, teacher: torch.Tensor, top_k: int = 16, temperature: float = 1.0,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """Teacher-led plus student-led logit-difference KL (BiLD). Zero when the student's logits equal the teacher's;
    the teacher is never differentiated (detach it, or compute it under no_grad)."""
    if top_k < 2 or top_k > student.shape[-1]:
        raise ValueError(f'bild: top_k must be in [2, vocab={student.shape[-1]}], got {top_k}')
    student, teacher = student.float(), teacher.float()
    teacher_led = _led_term(student, teacher, teacher, top_k, temperature)
    student_led = _led_term(student, teacher, student.detach(), top_k, temperature)
    return _masked_mean(teacher_led + student_led, mask)

"""``Distillation``: logit distillation from a frozen teacher, for any method here (seed 001 Eq. 30-31).

The teacher is an HF causal LM folder (``teacher_path``, e.g. the original MHA model), loaded at ``Event.FIT_START``
onto the run's device, frozen and in eval mode; under FSDP it is sharded like the student (``fully_shard`` per
decoder layer and at the root, on the same device mesh), and when the student's weights came from rank 0 alone
(``model.load_on_rank0``) so do the teacher's: the other ranks build it on the meta device. At
``Event.AFTER_FORWARD`` it runs on the same micro-batch under no_grad; at ``Event.AFTER_LOSS`` the loss becomes

    lm_weight * L_lm + kl_weight * KL(teacher || student) + bild_weight * BiLD(student, teacher)

over the positions the attention mask keeps (``ops.distill``; BiLD with ``top_k`` and ``temperature``). Only the LM
term is reweighted: terms that other algorithms add to the loss keep their weight, in any order of the recipe's
``algorithms``. ``trainable: attention`` freezes everything but the attention modules at ``Event.INIT`` (healing's
KL stage on the attention parameters). Each term's value is kept for the ``distill/*`` metrics logged at batch end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from composer.utils import dist

import dha_train.models  # noqa: F401  (registers the DHA and MoH classes, should the teacher be one)
from dha_train import registry
from dha_train.config import ConfigError
from dha_train.distributed import causal_lm_on_meta, shard_like
from dha_train.errors import InputNotFoundError
from dha_train.model_folders import load_causal_lm, load_model_config
from dha_train.models.llama_layout import TRAINABLE, hf_model, train_only_attention
from dha_train.ops.distill import bild_loss, kl_loss


class Distillation(Algorithm):
    def __init__(self, teacher_path: str, kl_weight: float = 1.0, bild_weight: float = 1.0, lm_weight: float = 0.0,
                 top_k: int = 16, temperature: float = 1.0, trainable: str = 'all'):
        if min(kl_weight, bild_weight, lm_weight) < 0 or kl_weight + bild_weight + lm_weight == 0:
            raise ValueError('distillation: weights must be >= 0 and not all 0')
        if temperature <= 0 or top_k < 2:
            raise ValueError(f'distillation: temperature must be > 0 and top_k >= 2, got {temperature} and {top_k}')
        if not (Path(teacher_path) / 'config.json').is_file():
            raise InputNotFoundError(f'distillation: teacher_path {teacher_path} is not an HF model folder '
                                    '(no config.json)')
        if trainable not in TRAINABLE:
            raise ValueError(f"distillation: trainable must be one of {', '.join(TRAINABLE)}, got '{trainable}'")
        self.trainable = trainable
        self.teacher_path = teacher_path
        self.kl_weight, self.bild_weight, self.lm_weight = kl_weight, bild_weight, lm_weight
        self.top_k, self.temperature = top_k, temperature
        self.teacher: Optional[torch.nn.Module] = None
        self._teacher_logits: Optional[torch.Tensor] = None
        self._terms: dict[str, torch.Tensor] = {}  # detached; read as floats once per batch, not per micro-batch

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.FIT_START, Event.AFTER_FORWARD, Event.AFTER_LOSS, Event.BATCH_END)

    def _load_teacher(self, state: State) -> None:
        # The teacher loads the way the student did: when Composer broadcast the student from rank 0 (the ranks
        # other than 0 built it on the meta device, model.load_on_rank0), only rank 0 reads the teacher too.
        from_rank0 = state.fsdp_config is not None and state.fsdp_config.sync_module_states
        # Building the model draws random initial weights before loading; forking keeps those draws out of the
        # training RNG streams, so a resumed run (which loads the teacher again, mid-run) continues exactly.
        with torch.random.fork_rng():
            config = load_model_config(self.teacher_path, who='distillation teacher_path')
            if from_rank0 and dist.get_global_rank() != 0:
                teacher = causal_lm_on_meta(config)
            else:
                teacher = load_causal_lm(self.teacher_path, who='distillation teacher_path', config=config,
                                         torch_dtype=torch.float32)
        student_config = state.model.model.config if hasattr(state.model, 'model') else state.model.config
        if teacher.config.vocab_size != student_config.vocab_size:
            raise ConfigError(f'distillation: the teacher has vocab_size {teacher.config.vocab_size}, the student '
                             f'{student_config.vocab_size}')
        teacher.requires_grad_(False).eval()
        if from_rank0:
            self.teacher = shard_like(teacher, state.model, weights_from_rank0=True)  # sharding moves it to the device
        else:
            self.teacher = shard_like(state.device.module_to_device(teacher), state.model)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT and self.trainable == 'attention':
            # Healing's KL stage may train the converted attention alone; frozen before the FSDP wrap.
            train_only_attention(hf_model(state.model))
        elif event == Event.FIT_START:
            if self.teacher is None:
                self._load_teacher(state)
        elif event == Event.AFTER_FORWARD:
            batch = state.batch
            with torch.no_grad():
                self._teacher_logits = self.teacher(input_ids=batch['input_ids'],
                                                    attention_mask=batch.get('attention_mask')).logits.detach()
        elif event == Event.AFTER_LOSS:
            student = state.outputs.logits if hasattr(state.outputs, 'logits') else state.outputs['logits']
            mask = state.batch.get('attention_mask')
            kl = kl_loss(student, self._teacher_logits, self.temperature, mask)
            bild = bild_loss(student, self._teacher_logits, self.top_k, self.temperature, mask)
            # Reweight only the LM term (the model's own loss of this micro-batch), so terms other algorithms
            # added to state.loss (L0, fusion penalty, balance loss) keep their weight whatever the list order:
            # Composer runs AFTER_LOSS algorithms in reverse order.
            lm = state.outputs['loss']
            self._terms = {'lm': lm.detach(), 'kl': kl.detach(), 'bild': bild.detach()}
            state.loss = state.loss + (self.lm_weight - 1.0) * lm + self.kl_weight * kl + self.bild_weight * bild
            self._teacher_logits = None
        elif event == Event.BATCH_END and self._terms:
            logger.log_metrics({f'distill/{name}': float(value) for name, value in self._terms.items()})

    def state_dict(self) -> dict[str, Any]:
        return {}  # the teacher is a fixed input, not training state


registry.algorithms.register('distillation', Distillation)

"""``lm_eval_at_end``: lm-evaluation-harness on the trained model when a stage finishes, logged to every logger.

Every rank runs the same evaluation on its (possibly FSDP2-sharded) model, so the forward passes stay collective
and in step: each rank issues the same requests in the same order. Rank 0's scores are logged as
``lm_eval/<task>/<metric>``. The task list is checked when training starts, not after it.

    callbacks:
      lm_eval_at_end: {suite: local, include: [quickstart_run/eval_task], limit: 100}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from dha_train import registry
from dha_train.harness import EvalError, check_tasks, resolve_tasks, score_model


class LmEvalAtEnd(Callback):
    def __init__(self, suite: Optional[str] = None, tasks: Optional[Sequence[str]] = None,
                 num_fewshot: Optional[int] = None, limit: Optional[float] = None, include: Sequence[str] = (),
                 batch_size: int = 8):
        self.chosen = resolve_tasks(suite, list(tasks) if tasks else None, num_fewshot)
        if limit is not None and limit <= 0:
            raise EvalError(f'lm_eval_at_end: limit must be > 0, got {limit}')
        self.limit, self.include, self.batch_size = limit, list(include), batch_size
        self.scores: dict[str, dict[str, float]] = {}

    def fit_start(self, state: State, logger: Logger) -> None:
        check_tasks(self.chosen, self.include)

    def fit_end(self, state: State, logger: Logger) -> None:
        composer_model = state.model
        model = composer_model.model
        device = str(next(model.parameters()).device)
        if device.startswith('cuda') and ':' not in device:
            device = f'cuda:{torch.cuda.current_device()}'
        was_training = model.training
        model.eval()
        try:
            self.scores = score_model(model, composer_model.tokenizer, self.chosen, limit=self.limit,
                                      include=self.include, batch_size=self.batch_size, device=device)
        finally:
            model.train(was_training)
        if dist.get_global_rank() == 0:
            logger.log_metrics({f'lm_eval/{task}/{key}': value for task, metrics in self.scores.items()
                                for key, value in metrics.items() if key != 'num_fewshot'})


registry.callbacks.register('lm_eval_at_end', LmEvalAtEnd)

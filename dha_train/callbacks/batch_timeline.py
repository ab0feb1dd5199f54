"""Wall-clock marks of one training run, for ``dha-train bench healing-speed``: when the fit started and ended, and
per batch the seconds spent waiting for data and in forward, backward and the optimizer step, with the batch's
loss and token count. Rank 0 writes them as JSON at fit end; the bench adds the launch and the export around them."""

from __future__ import annotations

import json
import time

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from dha_train import registry
from dha_train.paths import write_file_atomically


class BatchTimeline(Callback):
    def __init__(self, out: str):
        self.out = out
        self.fit_start_time: float | None = None
        self.batches: list[dict] = []
        self._data_started = self._compute_started = 0.0
        self._data_seconds = 0.0

    def fit_start(self, state: State, logger: Logger) -> None:
        self.fit_start_time = time.time()  # epoch seconds: the bench compares it with the moment it spawned the run

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self._data_started = time.perf_counter()

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self._compute_started = time.perf_counter()
        self._data_seconds = self._compute_started - self._data_started

    def batch_end(self, state: State, logger: Logger) -> None:
        loss = state.total_loss_dict.get('loss/train/total')
        self.batches.append({'batch': int(state.timestamp.batch), 'tokens': int(state.timestamp.token),
                             'data_s': self._data_seconds, 'compute_s': time.perf_counter() - self._compute_started,
                             'loss': None if loss is None else float(loss)})

    def fit_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        write_file_atomically(self.out, json.dumps({'fit_start': self.fit_start_time, 'fit_end': time.time(),
                                                    'world_size': dist.get_world_size(), 'batches': self.batches}))


registry.callbacks.register('batch_timeline', BatchTimeline)

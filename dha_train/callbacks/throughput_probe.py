"""Measures training tokens/s over a window that skips warm-up batches, and writes it as JSON (rank 0)."""

from __future__ import annotations

import json
import time

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from dha_train import registry
from dha_train.paths import write_file_atomically


class ThroughputProbe(Callback):
    def __init__(self, out: str, warmup_batches: int = 3):
        self.out = out
        self.warmup_batches = warmup_batches
        self._start: tuple[float, int, int] | None = None
        self._end: tuple[float, int, int] | None = None

    def batch_end(self, state: State, logger: Logger) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # a GPU runs ahead of the host: time finished work, not queued work
        mark = (time.perf_counter(), int(state.timestamp.token), int(state.timestamp.batch))
        if int(state.timestamp.batch) == self.warmup_batches:
            self._start = mark
        self._end = mark

    def fit_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        if self._start is None or self._end is None or self._end[2] <= self._start[2]:
            raise RuntimeError(f'throughput_probe: the run needs more than {self.warmup_batches} batches to time')
        seconds = self._end[0] - self._start[0]
        tokens = self._end[1] - self._start[1]
        result = {'tokens_per_sec': tokens / seconds, 'timed_batches': self._end[2] - self._start[2],
                  'seconds': seconds, 'world_size': dist.get_world_size()}
        write_file_atomically(self.out, json.dumps(result))


registry.callbacks.register('throughput_probe', ThroughputProbe)

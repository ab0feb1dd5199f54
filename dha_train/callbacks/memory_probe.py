"""Records each rank's peak host memory (resident set size) through the start of a run, as JSON per rank.

The peak is the kernel's high-water mark of the process's resident pages (Linux's ``VmHWM``): the most pages the
process has held in RAM at once since it started, including file pages it mapped (safetensors weights are read
through mmap), never lowered by later frees. (``getrusage``'s ``ru_maxrss`` is no use here: a process keeps its
parent's high-water mark across fork and exec, so every rank would start at the ``composer`` launcher's size; it is
the fallback where there is no /proc.) It is read at four points, so each figure is the peak up to then:

- ``start``: when the callback is built, before the trainer builds data loaders and the model;
- ``model_built``: at ``Event.INIT``, after the model was built (the pretrained weights loaded, or not), before
  the algorithms' surgery (Composer runs callbacks first at INIT) and FSDP sharding;
- ``sharded``: at ``Event.FIT_START``, after FSDP sharding (and the broadcast from rank 0) and checkpoint loading;
- ``first_batch``: after the first training batch (optimizer state allocated).

Beside each peak it records the resident set size at that point (``VmRSS``, Linux only), whether this rank's
model had its parameters on the meta device at ``Event.INIT`` (no weights: ``model.load_on_rank0``) and whether Composer synchronised the module states from rank 0 while sharding.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from dha_train import registry
from dha_train.paths import write_file_atomically


def _proc_status_bytes(field: str) -> int | None:
    """A memory figure of this process from /proc/self/status (Linux), in bytes; None without /proc."""
    status = Path('/proc/self/status')
    if not status.is_file():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(f'{field}:'):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes."""
    peak = _proc_status_bytes('VmHWM')
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == 'darwin' else peak * 1024  # Linux reports kilobytes, macOS bytes


class MemoryProbe(Callback):
    def __init__(self, out: str):
        self.out = out
        self.peak_rss: dict[str, int] = {}
        self.current_rss: dict[str, int | None] = {}  # what the process holds at that point (Linux only)
        self._mark('start')
        self.built_on_meta: bool | None = None

    def _mark(self, phase: str) -> None:
        self.peak_rss[phase] = peak_rss_bytes()
        self.current_rss[phase] = _proc_status_bytes('VmRSS')

    def init(self, state: State, logger: Logger) -> None:
        self._mark('model_built')
        self.built_on_meta = any(parameter.is_meta for parameter in state.model.parameters())

    def fit_start(self, state: State, logger: Logger) -> None:
        self._mark('sharded')

    def batch_end(self, state: State, logger: Logger) -> None:
        if 'first_batch' not in self.peak_rss:
            self._mark('first_batch')
            self._write(state)

    def _write(self, state: State) -> None:
        rank = dist.get_global_rank()
        result = {'rank': rank, 'world_size': dist.get_world_size(), 'peak_rss_bytes': self.peak_rss,
                  'current_rss_bytes': self.current_rss,
                  'built_on_meta': self.built_on_meta,
                  'sync_module_states': bool(state.fsdp_config is not None and state.fsdp_config.sync_module_states)}
        folder = Path(self.out)
        folder.mkdir(parents=True, exist_ok=True)
        write_file_atomically(folder / f'rank{rank}.json', json.dumps(result, indent=2))


registry.callbacks.register('memory_probe', MemoryProbe)

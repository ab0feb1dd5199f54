"""`python -m dha_train.train` plus a callback that records which samples each rank trains on, for the resume tests.

Run under `composer -n N tests/scripts/train_recording_samples.py recipe.yaml callbacks.record_samples_for_tests.out=DIR
...`. Each rank appends one JSON line per batch to DIR/rank<r>.jsonl: the batch index and a hash of every sample (token
row) of its device batch, so a test can count the samples seen per domain across killed and resumed launches.
"""

import hashlib
import json
import sys
from pathlib import Path

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from dha_train import registry
from dha_train.train import main


def sample_hash(row) -> str:
    return hashlib.sha1(row.numpy().tobytes()).hexdigest()[:20]


class RecordSamples(Callback):
    def __init__(self, out: str):
        self.out = Path(out)

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        record = {'batch': int(state.timestamp.batch), 'epoch': int(state.timestamp.epoch),
                  'samples': [sample_hash(row) for row in state.batch['input_ids'].cpu()]}
        with (self.out / f'rank{dist.get_global_rank()}.jsonl').open('a') as handle:
            handle.write(json.dumps(record) + '\n')


registry.callbacks.register('record_samples_for_tests', RecordSamples)

if __name__ == '__main__':
    sys.exit(main())

"""`python -m dha_train.train` that writes, per rank, its resident memory before the model is built and its peak
(``ru_maxrss``) after the run: the measurement `dha-train plan` is compared with on CPU.

Run under `composer -n N tests/scripts/train_measuring_rss.py recipe.yaml ...` with ``RSS_OUT=DIR`` set; each rank
writes DIR/rank<r>.json: {"before_mib": ..., "peak_mib": ...}. Large tensors must be returned to the system when
freed for the peak to be theirs: the launch sets MALLOC_MMAP_THRESHOLD_ (glibc) so every allocation above 128 KiB is
its own mapping.
"""

import json
import os
import resource
import sys
from pathlib import Path

from dha_train.train import main


def resident_mib() -> float:
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024
    raise RuntimeError('no VmRSS in /proc/self/status')


if __name__ == '__main__':
    before = resident_mib()
    code = main()
    out = Path(os.environ['RSS_OUT'])
    out.mkdir(parents=True, exist_ok=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({'before_mib': before, 'peak_mib': peak}))
    sys.exit(code)

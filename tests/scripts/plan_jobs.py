"""Plan several recipes in one fresh process (no process group from earlier in-process runs, so no child process per
plan): reads ``{key: {"recipe": ..., "overrides": [...], "options": {...}}}`` as JSON from stdin and prints
``{key: plan}`` (or ``{key: {"error": ...}}``) as JSON on the last line of stdout."""

import json
import sys

from dha_train.plan import plan_recipe

if __name__ == '__main__':
    jobs = json.load(sys.stdin)
    plans = {}
    for key, job in jobs.items():
        try:
            plans[key] = plan_recipe(job['recipe'], job['overrides'], **job['options'])
        except Exception as exc:  # noqa: BLE001  (reported per job, as the test's failure message)
            plans[key] = {'error': f'{type(exc).__name__}: {exc}'}
    print(json.dumps(plans))

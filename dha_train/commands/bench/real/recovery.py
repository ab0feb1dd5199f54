"""The recovery curve of `bench real --heal-points`: each healing chain's mean accuracy against its hours of healing
on the machine that ran it (refit, attention transfer and KL, wall clock), every point with its 95% interval, beside
the teacher, 90% and 95% of it, and the published SmolLM-135M points as reference lines; and, per chain, the first
point that reaches each share of the teacher."""

from __future__ import annotations

import os
from pathlib import Path

from dha_train.commands.bench.real.report import BUDGET_PANELS

# MHA2MLA (Ji et al., 2025), SmolLM-135M after 2.25B tokens of fine-tuning: 96.8% of its average score with 31% of
# the cache, 92.1% with 12.5% (as issue 62 quotes them). Shares of their teacher's average, drawn at those shares of
# this teacher's mean accuracy: other tasks and another checkpoint, a bar to read against, not a paired comparison.
PUBLISHED = (('MHA2MLA SmolLM-135M: 31% of the cache, 2.25B tokens', 0.968),
             ('MHA2MLA SmolLM-135M: 12.5% of the cache, 2.25B tokens', 0.921))
SHARES = (0.90, 0.95)


def recovery_chains(results: dict) -> dict[str, list[dict]]:
    """{chain: its 0-token row then its recovery points by healing tokens}; a chain is a method at a budget whose rows
    carry ``healing_s`` (those of ``--heal-points``), rows reused from another chain (``same_as``) left out."""
    rows = [row for row in results['rows'] if not row.get('same_as')]
    chains: dict[str, list[dict]] = {}
    for row in rows:
        if 'healing_s' in row:
            chains.setdefault(f"{row['method']} {row['budget']}", []).append(row)
    for chain, points in chains.items():
        method, budget = points[0]['method'], points[0]['budget']
        start = [row for row in rows if (row['method'], row['budget'], row['tokens']) == (method, budget, 0)
                 and not row.get('stage')]
        chains[chain] = start[:1] + sorted(points, key=lambda row: row['tokens'])
    return chains


def recovery_summary(results: dict) -> list[dict]:
    """Per chain: each point's healing tokens, hours, mean accuracy (95% half-width) and share of the teacher's; and
    the hours of the first point at or above each of SHARES (None where no point reaches it)."""
    teacher = results['rows'][0]['mean_accuracy']
    summary = []
    for chain, rows in recovery_chains(results).items():
        points = [{'label': row['label'], 'healing_tokens': row['tokens'], 'hours': row.get('healing_s', 0.0) / 3600,
                   'mean_accuracy': row['mean_accuracy'], 'accuracy_ci95': row.get('accuracy_ci95'),
                   'share_of_teacher': row['mean_accuracy'] / teacher} for row in rows]
        reached = {f'{share:.0%}': next((p['hours'] for p in points if p['share_of_teacher'] >= share), None)
                   for share in SHARES}
        summary.append({'chain': chain, 'budget': rows[-1]['budget'], 'points': points, 'first_hours_at': reached})
    return summary


def plot_recovery(results: dict, work: Path) -> Path | None:
    """recovery.png: one panel per budget, mean accuracy against hours of healing, 95% error bars; None when the run
    has no recovery points."""
    from dha_train.plots import plot_panels

    summary = recovery_summary(results)
    if not summary:
        return None
    teacher = results['rows'][0]['mean_accuracy']
    panels: dict[str, dict] = {}
    for chain in summary:
        panels.setdefault(BUDGET_PANELS[chain['budget']], {})[chain['chain']] = {
            'points': [(p['hours'], p['mean_accuracy'], p['accuracy_ci95']) for p in chain['points']],
            'colour_key': chain['chain'].split()[0], 'dashed': False}
    references = [('teacher', teacher), *((f'{share:.0%} of the teacher', share * teacher) for share in SHARES),
                  *((name, share * teacher) for name, share in PUBLISHED)]
    return plot_panels(panels, work / 'recovery.png', title=f'{results["source"]["name"]}: recovery while healing '
                       '(mean accuracy, 6 tasks, 95% intervals)',
                       xlabel=f'hours of healing on {os.cpu_count()} cores (wall clock)', ylabel='mean accuracy',
                       references=references)

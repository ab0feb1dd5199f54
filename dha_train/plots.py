"""Plots written next to a run: PNG files, no display needed."""

from __future__ import annotations

from pathlib import Path


def plot_loss_curve(history: dict, out: str | Path, title: str = '') -> Path:
    """Train loss per batch and per-domain validation loss per evaluation, on one axis."""
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if history.get('train'):
        steps, losses = zip(*history['train'])
        ax.plot(steps, losses, color='0.6', linewidth=1, label='train')
    for domain, points in sorted(history.get('eval', {}).items()):
        steps, losses = zip(*points)
        ax.plot(steps, losses, marker='o', linewidth=1.5, label=f'val {domain}')
    ax.set_xlabel('batch')
    ax.set_ylabel('cross-entropy (nats/token)')
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out

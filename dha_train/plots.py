"""Plots written next to a run: PNG files, no display needed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def plot_loss_curve(history: dict, out: str | Path, title: str = '') -> Path:
    """Train loss per batch and per-domain validation loss per evaluation, on one axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if history.get('train'):
        steps, losses = zip(*history['train'])
        ax.plot(steps, losses, color='0.6', linewidth=1, label='train')
    for domain, points in sorted(history.get('eval', {}).items()):
        steps, losses = zip(*points)
        ax.plot(steps, losses, marker='o', linewidth=1.5, label=f'val {domain}')
    return _finish(fig, ax, out, 'batch', 'cross-entropy (nats/token)', title)


def _pyplot():
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, ax, out: str | Path, xlabel: str, ylabel: str, title: str, grid: bool = True,
            legend_outside: bool = False) -> Path:
    """Label one-axis figures alike, then save them; a long legend goes beside the axes instead of over the data."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if grid:
        ax.grid(alpha=0.3)
    if legend_outside:
        ax.legend(loc='upper left', bbox_to_anchor=(1.01, 1.0), fontsize='small')
    else:
        ax.legend()
    fig.tight_layout()
    return _save(fig, out)


def _save(fig, out: str | Path, keep_outside: bool = False) -> Path:
    """Write the PNG; ``keep_outside`` grows the image to hold a legend placed beside the axes."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches='tight' if keep_outside else None)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


def plot_head_similarity(similarities, out: str | Path, title: str = '', partitions=None, limits=None) -> Path:
    """One heatmap of head-by-head similarity per layer, in a grid (DHA Fig. 2). With ``partitions`` each layer's
    heads are reordered group by group and group borders are drawn, so the clusters read as blocks. ``limits``
    (low, high) fixes the colour scale (default: up to 1, for similarities; give it for distances)."""


    plt = _pyplot()
    num_layers = len(similarities)
    columns = min(8, num_layers)
    rows = math.ceil(num_layers / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(max(2.1 * columns + 1.2, 6.0), 2.1 * rows + 0.8), dpi=110,
                             squeeze=False)
    image = None
    for layer, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if layer >= num_layers:
            ax.axis('off')
            continue
        matrix = np.asarray(similarities[layer], dtype=float)
        if partitions is not None:
            order = [head for group in partitions[layer] for head in group]
            matrix = matrix[np.ix_(order, order)]
            edge = -0.5
            for group in partitions[layer][:-1]:
                edge += len(group)
                ax.axhline(edge, color='white', linewidth=0.6)
                ax.axvline(edge, color='white', linewidth=0.6)
        low, high = limits if limits is not None else (min(0.0, float(matrix.min())), 1.0)
        image = ax.imshow(matrix, vmin=low, vmax=high, cmap='viridis')
        ax.set_title(f'layer {layer}', fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, out)


def plot_layer_redundancy(redundancy: dict, out: str | Path, title: str = '') -> Path:
    """Mean pairwise head similarity per layer, one line per matrix or activation kind (DHA Fig. 3b)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for name, values in redundancy.items():
        ax.plot(range(len(values)), values, marker='o', linewidth=1.5, label=name)
    ax.xaxis.get_major_locator().set_params(integer=True)
    return _finish(fig, ax, out, 'layer', 'redundancy (mean CKA / similarity over head pairs)', title)


def plot_kv_allocation(head_map, out: str | Path, title: str = '') -> Path:
    """K and V heads per layer as paired bars (DHA Fig. 8)."""

    plt = _pyplot()
    counts = np.asarray(head_map.kv_heads())
    layers = np.arange(len(counts))
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    ax.bar(layers - 0.2, counts[:, 0], width=0.4, label='key heads')
    ax.bar(layers + 0.2, counts[:, 1], width=0.4, label='value heads')
    ax.xaxis.get_major_locator().set_params(integer=True)
    return _finish(fig, ax, out, 'layer', 'heads', f'{title} ({head_map.kv_budget_fraction():.0%} of the MHA KV heads)',
                   grid=False)


def plot_curves(curves: dict, out: str | Path, title: str = '', xlabel: str = 'batch', ylabel: str = '',
                references: dict | None = None, log_y: bool = False) -> Path:
    """Named curves {name: [(x, y), ...]} on one axis, plus horizontal reference lines {name: y}."""
    plt = _pyplot()
    many = len(curves) + len(references or {}) > 8  # the default cycle repeats after 10 colours
    fig, ax = plt.subplots(figsize=(10, 4.8) if many else (7, 4.2), dpi=120)
    if many:
        ax.set_prop_cycle(color=plt.get_cmap('tab20')(np.linspace(0, 1, 20))[:max(len(curves), 1)])
    for name, points in curves.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker='o' if len(points) < 30 else None, markersize=3, linewidth=1.5, label=name)
    for name, value in (references or {}).items():
        ax.axhline(value, linestyle='--', linewidth=1, color='0.4', label=name)
    if log_y:
        ax.set_yscale('log')
    return _finish(fig, ax, out, xlabel, ylabel, title, legend_outside=many)


def plot_panels(panels: dict, out: str | Path, title: str = '', xlabel: str = '', ylabel: str = '',
                reference: tuple[str, float] | None = None, references: Sequence[tuple[str, float]] = ()) -> Path:
    """Side-by-side axes sharing y, one per panel {panel: {curve: {'points': [(x, y, half_width), ...],
    'colour_key': str, 'dashed': bool}}}: each point with its 95% interval as an error bar, a curve's colour fixed by
    its ``colour_key`` across panels (so one method reads alike in every panel), and the same reference lines in each
    (``reference``, and ``references``, each in its own line style)."""
    plt = _pyplot()
    keys = sorted({curve['colour_key'] for curves in panels.values() for curve in curves.values()})
    palette = plt.get_cmap('tab10' if len(keys) <= 10 else 'tab20')
    colour = {key: palette(i % palette.N) for i, key in enumerate(keys)}
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.6 * max(len(panels), 1) + 2.4, 4.6), dpi=120,
                             sharey=True, squeeze=False)
    for ax, (panel, curves) in zip(axes[0], panels.items()):
        for name, curve in curves.items():
            points = sorted(curve['points'])
            if not points:
                continue
            xs, ys, half = zip(*points)
            ax.errorbar(xs, ys, yerr=[h or 0.0 for h in half], marker='o', markersize=3, capsize=2, linewidth=1.5,
                        linestyle='--' if curve['dashed'] else '-', color=colour[curve['colour_key']], label=name)
        lines = ([reference] if reference is not None else []) + list(references)
        for (name, value), style in zip(lines, [':', '--', '-.', (0, (1, 3)), (0, (5, 2, 1, 2)), (0, (3, 1))] * 2):
            ax.axhline(value, linestyle=style, linewidth=1, color='0.3', label=name)
        ax.set_title(panel)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    handles, labels = {}, []
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    fig.legend([handles[label] for label in labels], labels, loc='upper left', bbox_to_anchor=(0.995, 0.93),
               fontsize='small')
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, out, keep_outside=True)


def plot_head_load(load, out: str | Path, title: str = '') -> Path:
    """Share of tokens routed to each head, one heatmap row per layer (MoH Fig. 3); shared heads read 1."""

    plt = _pyplot()
    load = np.asarray(load, dtype=float)
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.35 * load.shape[0]), dpi=120)
    image = ax.imshow(load, aspect='auto', cmap='viridis', vmin=0.0, vmax=1.0, interpolation='nearest')
    fig.colorbar(image, ax=ax, label='share of tokens')
    ax.set_yticks(range(load.shape[0]))
    ax.set_xlabel('head')
    ax.set_ylabel('layer')
    ax.set_title(title)
    fig.tight_layout()
    return _save(fig, out)


def plot_comparison(rows: list[dict], tasks: list[str], out: str | Path) -> Path:
    """Runs side by side (`dha-train compare`): task scores as grouped bars, then KV-cache bytes, validation loss
    and training tokens per run, one panel each."""

    plt = _pyplot()
    names = [row['name'] for row in rows]
    fig, axes = plt.subplots(1, 4, figsize=(15, 4), dpi=110, gridspec_kw={'width_ratios': [3, 1, 1, 1]})
    width = 0.8 / max(len(rows), 1)
    positions = np.arange(len(tasks))
    for index, row in enumerate(rows):
        values = [row['scores'][t] if row['scores'][t] is not None else np.nan for t in tasks]
        axes[0].bar(positions + index * width, values, width=width, label=row['name'])
    axes[0].set_xticks(positions + width * (len(rows) - 1) / 2, tasks, rotation=30, ha='right')
    axes[0].set_ylabel('score')
    axes[0].set_title('tasks')
    axes[0].legend(fontsize=8)
    for ax, key, title in ((axes[1], 'kv_cache_bytes_per_4096_tokens', 'KV bytes / 4096 tokens'),
                           (axes[2], 'val_loss', 'validation loss'), (axes[3], 'train_tokens', 'training tokens')):
        values = [row[key] if row[key] is not None else np.nan for row in rows]
        ax.bar(range(len(rows)), values, color=[f'C{i}' for i in range(len(rows))])
        ax.set_xticks(range(len(rows)), names, rotation=30, ha='right', fontsize=8)
        ax.set_title(title)
    fig.tight_layout()
    return _save(fig, out)

"""How `dha-train plan` measures a deep model at two shallow probes: which layers each probe keeps
(``probe_layers``), the run cut to them (``cut_to``: the model, and every teacher, transfer source and head map its
algorithms name), and the whole model's reading extrapolated layer by layer from the two (``extrapolated``)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from dha_train.config import TrainConfig


@dataclass
class MemoryReading:
    """One rank's tracked peak, by category (bytes)."""
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    fsdp_buffers: int
    teacher: int
    other: int

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.fsdp_buffers
                + self.teacher + self.other)


def probe_layers(layer_sizes: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """The layers of the two probes: the first ``PROBE_DEPTHS[0]``, then those and the widest later layer (the
    lowest index among equals), so that what the second probe adds per layer bounds every later layer's activations
    from above (per-layer MLA ranks that grow, a searched head map)."""
    first = list(range(PROBE_DEPTHS[0]))
    later = range(PROBE_DEPTHS[0], len(layer_sizes))
    widest = max(later, key=lambda index: (layer_sizes[index][0], -index))
    return first, first + [widest]


# The tracked peak grows by the same amount for every layer of one width from the third on (LLaMA-2-7B at world size
# 8: +0.377 GiB a layer; tests/commands/test_plan_recipes.py holds 7-layer extrapolations to the 7-layer
# measurements), so a deep model is measured at its first 3 layers, then with its widest later layer as a 4th.
PROBE_DEPTHS = (3, 4)


def extrapolated(shallow: dict, deep: dict, deep_layers: list[int], layer_sizes: list[tuple[int, int]],
                  teacher_layers: int, all_parameters: int, teacher_parameters: int) -> dict:
    """The whole model's reading from the probes': what a layer adds to the parameters (and to the gradients, the
    optimizer state and the checkpoint) is proportional to its own (trainable) parameters, taken from the whole
    model after INIT, so layers that differ (a searched DHA head map, per-layer MLA ranks) count as they are; the
    activations (each checkpointed layer's input) grow by the probes' difference per layer, that of the widest later
    layer, so never less than they do; the FSDP buffers (one layer unsharded) follow the largest layer; a teacher's
    shards grow by the probes' difference per layer."""
    probe = len(deep_layers)
    a, b = shallow['reading'], deep['reading']
    last_parameters, last_trainable = layer_sizes[deep_layers[-1]]
    rest = [size for index, size in enumerate(layer_sizes) if index not in deep_layers]
    rest_parameters = sum(size for size, _ in rest)
    rest_trainable = sum(trainable for _, trainable in rest)
    extra_layers = len(rest)

    def per_weight(delta: int, weight: int, rest: int) -> int:
        return round(delta / weight * rest) if weight else 0

    largest = max(size for size, _ in layer_sizes)
    largest_probed = max(layer_sizes[index][0] for index in deep_layers)
    reading = MemoryReading(
        parameters=b.parameters + per_weight(b.parameters - a.parameters, last_parameters, rest_parameters),
        gradients=b.gradients + per_weight(b.gradients - a.gradients, last_trainable, rest_trainable),
        optimizer=b.optimizer + per_weight(b.optimizer - a.optimizer, last_trainable, rest_trainable),
        activations=b.activations + extra_layers * (b.activations - a.activations),
        fsdp_buffers=max(b.fsdp_buffers, round(b.fsdp_buffers * largest / largest_probed)),
        teacher=b.teacher + (teacher_layers - probe) * (b.teacher - a.teacher) if b.teacher else 0,
        other=b.other)
    checkpoint_weight = 4 * last_parameters + 8 * last_trainable  # fp32 weights; Adam's two fp32 moments
    checkpoint = deep['checkpoint_bytes'] + per_weight(deep['checkpoint_bytes'] - shallow['checkpoint_bytes'],
                                                       checkpoint_weight, 4 * rest_parameters + 8 * rest_trainable)
    return {**deep, 'reading': reading, 'checkpoint_bytes': checkpoint, 'all_parameters': all_parameters,
            'teacher_parameters': teacher_parameters, 'layer_sizes': layer_sizes, 'depth': len(layer_sizes),
            'extrapolated_from': list(PROBE_DEPTHS), 'probe_layers': deep_layers}


_PER_LAYER_CONFIG_KEYS = ('mla_ranks', 'mla_rope_pairs', 'moh_shared_heads', 'moh_top_k', 'layer_types')


def _picked(items: list, layers: list[int]) -> list:
    return [items[index] for index in layers]


def _cut_config(values: dict, layers: list[int]) -> dict:
    """An HF config's dict with the decoder ``layers`` named (and the per-layer settings cut alike)."""
    values = dict(values, num_hidden_layers=len(layers))
    for key in _PER_LAYER_CONFIG_KEYS:
        if isinstance(values.get(key), list):
            values[key] = _picked(values[key], layers)
    if isinstance(values.get('head_map'), dict):
        values['head_map'] = {**values['head_map'], 'layers': _picked(values['head_map']['layers'], layers)}
    return values


def _cut_folder(folder: Path, layers: list[int], out: Path) -> str:
    """``folder`` with its config cut to ``layers``; its other files (tokenizer, weights) linked (a plan builds on
    fake tensors and reads no weight)."""
    out.mkdir(parents=True)
    for item in folder.iterdir():
        if item.name != 'config.json':
            (out / item.name).symlink_to(item.resolve())
    (out / 'config.json').write_text(json.dumps(_cut_config(json.loads((folder / 'config.json').read_text()),
                                                            layers)))
    return str(out)


def cut_to(config: TrainConfig, layers: list[int], scratch: Path) -> TrainConfig:
    """The run with the decoder ``layers`` of its model and of every model folder or head map its algorithms name
    (a teacher, an attention-transfer source, a Fusion head map), in folders under ``scratch``."""
    cut = copy.deepcopy(config)
    if cut.model.pretrained_path is not None:
        cut.model.pretrained_path = _cut_folder(Path(cut.model.pretrained_path), layers, scratch / 'model')
    cut.model.config = _cut_config(cut.model.config, layers) if 'num_hidden_layers' in cut.model.config \
        else cut.model.config
    for name, settings in cut.algorithms.items():
        for key, value in (settings or {}).items():
            if not isinstance(value, str):
                continue
            path = Path(value)
            if (path / 'config.json').is_file():
                settings[key] = _cut_folder(path, layers, scratch / f'{name}.{key}')
            elif path.suffix == '.json' and path.is_file():
                head_map = json.loads(path.read_text())
                if isinstance(head_map, dict) and isinstance(head_map.get('layers'), list):
                    settings[key] = str(scratch / f'{name}.{key}.json')
                    Path(settings[key]).write_text(json.dumps({**head_map, 'layers': _picked(head_map['layers'],
                                                                                              layers)}))
    return cut

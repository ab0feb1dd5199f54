"""The head map: for every layer, which key head and which value head each query head reads.

- MHA is the identity map; GQA is contiguous equal groups with the same map for K and V;
- AsymGQA allows groups of different sizes (same map for K and V);
- DHA has separate K and V maps, with its own head counts in every layer.

A ``HeadMap`` is a small immutable value: searches produce one, conversions consume one, exported models carry one
(``head_map.json``). Compact head ``g`` of a layer's K (or V) projection serves the query heads mapped to ``g``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dha_train.errors import DhaTrainError
from dha_train.models.family_classes import FAMILY_CLASSES
from dha_train.models.llama_layout import head_dim as config_head_dim

Partition = Sequence[Sequence[int]]
HEAD_MAP_FILE = 'head_map.json'  # saved beside every converted or exported head-mapped model


class HeadMapError(DhaTrainError, ValueError):
    """An invalid head map, with the layer and the problem in the message."""


def source_head_map(config, who: str) -> HeadMap:
    """The map of a conversion source: a plain config of a source family (MHA, or standard GQA whose query heads
    share ``num_key_value_heads`` contiguous K/V heads). A model that already serves a DHA head map, or routes heads,
    is not a source: ``who`` names the command in the error."""
    if getattr(config, 'head_map', None) is not None or getattr(config, 'model_type', 'llama') not in FAMILY_CLASSES:
        raise HeadMapError(f'{who} starts from a plain source checkpoint (MHA or GQA: '
                           f"{', '.join(FAMILY_CLASSES)}), not a {getattr(config, 'model_type', '?')} model")
    return HeadMap.from_hf_config(config)


def _map_from_partition(partition: Partition, num_heads: int, where: str) -> tuple[int, ...]:
    """Groups -> query-head map; groups are numbered in the order of their smallest head."""
    seen: list[int] = []
    for group in partition:
        if not group:
            raise HeadMapError(f'{where}: empty group in {list(map(list, partition))}')
        seen.extend(int(h) for h in group)
    if sorted(seen) != list(range(num_heads)):
        raise HeadMapError(f'{where}: groups {list(map(list, partition))} must cover heads 0..{num_heads - 1} '
                           'exactly once')
    mapping = [0] * num_heads
    for index, group in enumerate(sorted(partition, key=min)):
        for head in group:
            mapping[int(head)] = index
    return tuple(mapping)


def _canonical(mapping: Sequence[int]) -> tuple[int, ...]:
    """Renumber compact heads in order of first use, so equal groupings compare equal."""
    order: dict[int, int] = {}
    return tuple(order.setdefault(int(g), len(order)) for g in mapping)


@dataclass(frozen=True)
class LayerHeadMap:
    key: tuple[int, ...]    # query head -> compact key head
    value: tuple[int, ...]  # query head -> compact value head

    @property
    def num_query_heads(self) -> int:
        return len(self.key)

    @property
    def num_key_heads(self) -> int:
        return max(self.key) + 1

    @property
    def num_value_heads(self) -> int:
        return max(self.value) + 1

    def key_groups(self) -> list[list[int]]:
        return _groups(self.key)

    def value_groups(self) -> list[list[int]]:
        return _groups(self.value)


def _groups(mapping: Sequence[int]) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for head, group in enumerate(mapping):
        groups.setdefault(group, []).append(head)
    return [groups[g] for g in sorted(groups)]


@dataclass(frozen=True)
class HeadMap:
    layers: tuple[LayerHeadMap, ...]
    head_dim: int

    def __post_init__(self):
        if not self.layers:
            raise HeadMapError('a head map needs at least one layer')
        if self.head_dim <= 0:
            raise HeadMapError(f'head_dim must be positive, got {self.head_dim}')
        num_heads = self.layers[0].num_query_heads
        for index, layer in enumerate(self.layers):
            for kind, mapping in (('key', layer.key), ('value', layer.value)):
                if len(mapping) != num_heads:
                    raise HeadMapError(f'layer {index} {kind}: maps {len(mapping)} query heads, expected {num_heads}')
                used = set(mapping)
                if used != set(range(len(used))):
                    raise HeadMapError(f'layer {index} {kind}: compact heads {sorted(used)} must be 0..n-1 with '
                                       'every head used by some query head')

    # --- constructors -------------------------------------------------------------------------------------------

    @classmethod
    def mha(cls, num_layers: int, num_heads: int, head_dim: int) -> HeadMap:
        identity = tuple(range(num_heads))
        return cls(tuple(LayerHeadMap(identity, identity) for _ in range(num_layers)), head_dim)

    @classmethod
    def gqa(cls, num_layers: int, num_heads: int, num_groups: int, head_dim: int) -> HeadMap:
        """Contiguous equal groups, the same for K and V (HF ``num_key_value_heads = num_groups``)."""
        if num_groups <= 0 or num_heads % num_groups:
            raise HeadMapError(f'GQA needs num_groups dividing num_heads={num_heads}, got {num_groups}')
        size = num_heads // num_groups
        mapping = tuple(h // size for h in range(num_heads))
        return cls(tuple(LayerHeadMap(mapping, mapping) for _ in range(num_layers)), head_dim)

    @classmethod
    def from_hf_config(cls, config) -> HeadMap:
        """The map an HF config serves: its ``head_map`` (DHA-style configs carry one), else standard GQA (MHA when
        ``num_key_value_heads`` equals the query heads)."""
        if getattr(config, 'head_map', None) is not None:
            return cls.from_dict(config.head_map)
        num_kv_heads = getattr(config, 'num_key_value_heads', None) or config.num_attention_heads
        return cls.gqa(config.num_hidden_layers, config.num_attention_heads, num_kv_heads, config_head_dim(config))

    @classmethod
    def from_partitions(cls, partitions: Sequence[Partition], num_heads: int, head_dim: int) -> HeadMap:
        """One partition of the query heads per layer, shared by K and V (group sizes may differ: AsymGQA)."""
        layers = []
        for index, partition in enumerate(partitions):
            mapping = _map_from_partition(partition, num_heads, f'layer {index}')
            layers.append(LayerHeadMap(mapping, mapping))
        return cls(tuple(layers), head_dim)

    @classmethod
    def dha(cls, key_partitions: Sequence[Partition], value_partitions: Sequence[Partition], num_heads: int,
            head_dim: int) -> HeadMap:
        """Separate K and V partitions per layer, each layer with its own head counts (DHA)."""
        if len(key_partitions) != len(value_partitions):
            raise HeadMapError(f'{len(key_partitions)} key partitions but {len(value_partitions)} value partitions')
        layers = tuple(
            LayerHeadMap(_map_from_partition(k, num_heads, f'layer {i} key'),
                         _map_from_partition(v, num_heads, f'layer {i} value'))
            for i, (k, v) in enumerate(zip(key_partitions, value_partitions)))
        return cls(layers, head_dim)

    @classmethod
    def from_source_partitions(cls, source: HeadMap, key_partitions: Sequence[Partition],
                               value_partitions: Sequence[Partition]) -> HeadMap:
        """A target described relative to a (GQA or MHA) source: per layer, partitions of the source's K heads and
        of its V heads; query head h then reads the target group holding its source head. For an MHA source the
        source heads are the query heads, so this is ``HeadMap.dha``."""
        if len(key_partitions) != source.num_layers or len(value_partitions) != source.num_layers:
            raise HeadMapError(f'{len(key_partitions)} key / {len(value_partitions)} value partitions for a source '
                               f'of {source.num_layers} layers')

        def query_partition(partition: Partition, source_map: Sequence[int], where: str) -> list[list[int]]:
            num_source = max(source_map) + 1
            covered = sorted(int(s) for group in partition for s in group)
            if covered != list(range(num_source)):
                raise HeadMapError(f'{where}: groups {[list(g) for g in partition]} must cover the source heads '
                                   f'0..{num_source - 1} exactly once')
            return [[h for h, s in enumerate(source_map) if s in set(group)] for group in partition]

        return cls.dha([query_partition(k, layer.key, f'layer {i} key')
                        for i, (k, layer) in enumerate(zip(key_partitions, source.layers))],
                       [query_partition(v, layer.value, f'layer {i} value')
                        for i, (v, layer) in enumerate(zip(value_partitions, source.layers))],
                       source.num_query_heads, source.head_dim)

    @classmethod
    def pooled(cls, source: HeadMap, num_kv_heads: int) -> HeadMap:
        """``num_kv_heads`` K and V heads per layer, each a contiguous run of the source's heads, the runs as equal
        as they can be (sizes differ by at most one): standard GQA when the count divides the source's K/V heads
        (and the query heads), else unequal groups (a DHA-served map), e.g. 3 source heads to 2 = {0, 1}, {2}."""
        counts = {n for layer in source.layers for n in (layer.num_key_heads, layer.num_value_heads)}
        if len(counts) != 1:
            raise HeadMapError(f'pooling to {num_kv_heads} heads needs a source with the same K/V head count in '
                               f'every layer, got {sorted(counts)}')
        num_source = counts.pop()
        if not 1 <= num_kv_heads <= num_source:
            raise HeadMapError(f'{num_kv_heads} K/V heads per layer: the source has {num_source}, so give '
                               f'1..{num_source}')
        bounds = [round(i * num_source / num_kv_heads) for i in range(num_kv_heads + 1)]
        partition = [list(range(bounds[i], bounds[i + 1])) for i in range(num_kv_heads)]
        return cls.from_source_partitions(source, [partition] * source.num_layers, [partition] * source.num_layers)

    # --- relative to a source ------------------------------------------------------------------------------------

    def source_partitions(self, source: HeadMap) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
        """Per layer, this map's K and V groups as partitions of ``source``'s K and V heads (the units every method
        works on: for an MHA source the query heads, for a GQA source its shared heads, so nothing is expanded to
        one head per query head). Raises when a group splits a source head between targets."""
        if source.num_layers != self.num_layers or source.num_query_heads != self.num_query_heads:
            raise HeadMapError(f'head map ({self.num_layers} layers, {self.num_query_heads} query heads) does not '
                               f'fit the source ({source.num_layers} layers, {source.num_query_heads} query heads)')
        partitions: tuple[list, list] = ([], [])
        for index, (target, origin) in enumerate(zip(self.layers, source.layers)):
            for kind, out in (('key', partitions[0]), ('value', partitions[1])):
                target_map, source_map = getattr(target, kind), getattr(origin, kind)
                group_of: dict[int, int] = {}
                for head, (group, unit) in enumerate(zip(target_map, source_map)):
                    if group_of.setdefault(unit, group) != group:
                        raise HeadMapError(
                            f'layer {index} {kind}: query heads of source {kind} head {unit} '
                            f'({[h for h, s in enumerate(source_map) if s == unit]}) land in different target '
                            'groups; a target over a GQA source must group whole source heads')
                out.append(_groups([group_of[unit] for unit in range(max(source_map) + 1)]))
        return partitions

    def kv_budget_fraction_of(self, source: HeadMap) -> float:
        """Compact KV heads as a fraction of ``source``'s (1/3 for one K and one V head from SmolLM2's 3)."""
        return sum(k + v for k, v in self.kv_heads()) / sum(k + v for k, v in source.kv_heads())

    def budget_text(self, source: HeadMap) -> str:
        """The KV budget against the source's cache and against MHA's, as the commands print it."""
        return (f'{self.kv_budget_fraction_of(source):.1%} of the source KV cache, '
                f'{self.kv_budget_fraction():.1%} of MHA\'s')

    # --- properties ---------------------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_query_heads(self) -> int:
        return self.layers[0].num_query_heads

    def kv_heads(self) -> list[tuple[int, int]]:
        """(key heads, value heads) per layer."""
        return [(layer.num_key_heads, layer.num_value_heads) for layer in self.layers]

    def kv_cache_bytes(self, batch_size: int, seq_len: int, bytes_per_element: int = 2) -> int:
        """Bytes of a KV cache that stores only the compact heads (bf16/fp16: 2 bytes per element)."""
        heads = sum(k + v for k, v in self.kv_heads())
        return heads * self.head_dim * batch_size * seq_len * bytes_per_element

    def kv_budget_fraction(self) -> float:
        """Compact KV heads as a fraction of MHA's (1.0 for MHA, 0.25 for a 25% budget)."""
        return sum(k + v for k, v in self.kv_heads()) / (2 * self.num_query_heads * self.num_layers)

    def uniform_gqa_groups(self) -> int | None:
        """The HF ``num_key_value_heads`` when this map is standard GQA (contiguous equal groups, K == V, every
        layer alike), else None."""
        groups = self.layers[0].num_key_heads
        if self.num_query_heads % groups:
            return None
        expected = HeadMap.gqa(1, self.num_query_heads, groups, self.head_dim).layers[0]
        return groups if all(layer == expected for layer in self.layers) else None

    def servable_problems(self) -> list[str]:
        """Why this map is not plain GQA up to a permutation of the query heads, which is all that serving engines
        take per layer (llama.cpp's ``deci`` GGUF with a per-layer ``head_count_kv``, vLLM): one line per
        layer where K and V are grouped apart ('layer 4: K and V are grouped apart') or the shared groups differ in
        size ('layer 7: groups of sizes [2, 1]'). Empty when every layer is servable; ``contiguous_permutation``
        then gives the order of the query heads that makes every layer contiguous GQA."""
        problems = []
        for index, layer in enumerate(self.layers):
            groups = layer.key_groups()
            if sorted(groups) != sorted(layer.value_groups()):
                problems.append(f'layer {index}: K and V are grouped apart')
            elif len({len(group) for group in groups}) > 1:
                problems.append(f'layer {index}: groups of sizes {[len(group) for group in groups]}')
        return problems

    def check_fits(self, config) -> None:
        """Raise ``HeadMapError`` naming every mismatch when this map cannot serve a model of ``config``."""
        problems = []
        if self.num_layers != config.num_hidden_layers:
            problems.append(f'{self.num_layers} layers vs num_hidden_layers={config.num_hidden_layers}')
        if self.num_query_heads != config.num_attention_heads:
            problems.append(f'{self.num_query_heads} query heads vs num_attention_heads={config.num_attention_heads}')
        if self.head_dim != config_head_dim(config):
            problems.append(f'head_dim {self.head_dim} vs the model head_dim {config_head_dim(config)}')
        if problems:
            raise HeadMapError('head map does not fit the model: ' + '; '.join(problems))

    # --- permutation --------------------------------------------------------------------------------------------

    def contiguous_permutation(self) -> list[list[int]]:
        """Per layer, an order of the query heads that makes groups contiguous wherever K and V agree.

        ``order[l][i]`` is the old index of the head that moves to position ``i``. Heads are sorted by key group,
        then value group, so when K and V share a partition every group becomes one contiguous block.
        """
        return [sorted(range(layer.num_query_heads), key=lambda h, layer=layer: (layer.key[h], layer.value[h], h))
                for layer in self.layers]

    def permuted(self, order: Sequence[Sequence[int]]) -> HeadMap:
        """The map after moving query head ``order[l][i]`` to position ``i`` in every layer."""
        if len(order) != self.num_layers:
            raise HeadMapError(f'permutation has {len(order)} layers, the map {self.num_layers}')
        layers = []
        for index, (layer, perm) in enumerate(zip(self.layers, order)):
            if sorted(perm) != list(range(layer.num_query_heads)):
                raise HeadMapError(f'layer {index}: {list(perm)} is not a permutation of the query heads')
            layers.append(LayerHeadMap(_canonical([layer.key[h] for h in perm]),
                                       _canonical([layer.value[h] for h in perm])))
        return HeadMap(tuple(layers), self.head_dim)

    # --- serialisation ------------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {'head_dim': self.head_dim, 'num_query_heads': self.num_query_heads,
                'layers': [{'key': list(layer.key), 'value': list(layer.value)} for layer in self.layers]}

    @classmethod
    def from_dict(cls, data: dict) -> HeadMap:
        try:
            layers = tuple(LayerHeadMap(tuple(int(h) for h in layer['key']), tuple(int(h) for h in layer['value']))
                           for layer in data['layers'])
            head_map = cls(layers, int(data['head_dim']))
        except (KeyError, TypeError) as exc:
            raise HeadMapError(f'not a head map: {exc!r}') from exc
        if 'num_query_heads' in data and data['num_query_heads'] != head_map.num_query_heads:
            raise HeadMapError(f"num_query_heads={data['num_query_heads']} disagrees with the layer maps")
        return head_map

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> HeadMap:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> HeadMap:
        path = Path(path)
        if not path.is_file():
            raise HeadMapError(f'head map file not found: {path}')
        try:
            return cls.from_json(path.read_text(encoding='utf-8'))
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError; a HeadMapError gets the file named too
            raise HeadMapError(f'head map {path}: {exc}' if isinstance(exc, HeadMapError) else
                               f'head map {path} is not a head map JSON file ({exc})') from exc

"""The sizes a checkpoint declares, checked against the bytes that back them before anything is allocated.

A checkpoint's tensors are data too: a sharded folder's ``.metadata`` says how large each tensor is, and export's
gather (``dcp_to_torch_save``) allocates, and writes to a temporary file, every tensor at its declared size before any
chunk is read; its ``planner_data`` says where each item goes in the nested state, and a list index there is
allocated up to (10^12 would grow memory without bound); a whole file's tensor may declare a shape its storage does
not hold (a stride of 0 makes a 100000 x 100000 weight of one value). Each reader of ``dha_train.checkpoints`` asks
these functions first; each returns what is wrong, or None:

- ``metadata_size_problem``: every tensor of ``.metadata`` is tiled by chunks inside its shape, and each chunk's stored
  bytes hold its values (a chunk is a ``torch.save`` of the chunk: at least its values' bytes); no storage is
  transformed (compressed) on the way in, since its bytes would not bound it; every ``planner_data`` path spells its
  own key and a list index in it is smaller than the number of entries beneath that list, so the nested state is no
  larger than ``.metadata`` itself;
- ``tensor_size_problem``: every tensor in a loaded whole file is a plain strided tensor whose values fit in its
  storage, with no stride of 0 across more than one value.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _sizes(value: Any) -> tuple[int, ...] | None:
    """A tuple of whole numbers from a ``torch.Size`` (or tuple/list), else None."""
    if isinstance(value, (torch.Size, tuple, list)) and all(_whole(n) for n in value):
        return tuple(value)
    return None


def _tensor_problem(fqn: str, entry: dcp_metadata.TensorStorageMetadata, storage: dict) -> str | None:
    size = _sizes(getattr(entry, 'size', None))
    dtype = getattr(getattr(entry, 'properties', None), 'dtype', None)
    chunks = getattr(entry, 'chunks', None)
    if size is None or not isinstance(dtype, torch.dtype) or not isinstance(chunks, list):
        return f'declares tensor {fqn} without a shape of whole numbers, a dtype and a list of chunks'
    values = math.prod(size)
    shown = f'{fqn} as {" x ".join(map(str, size)) or "a scalar"} {str(dtype).removeprefix("torch.")}'
    tiled = 0
    for chunk in chunks:
        offsets, sizes = _sizes(getattr(chunk, 'offsets', None)), _sizes(getattr(chunk, 'sizes', None))
        if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size) or any(
                start + extent > whole for start, extent, whole in zip(offsets, sizes, size)):
            return f'declares {shown} with a chunk outside that shape'
        info = storage.get(dcp_metadata.MetadataIndex(fqn, offsets))
        needed = math.prod(sizes) * dtype.itemsize
        if info is None or not _whole(getattr(info, 'length', None)) or info.length < needed:
            stored = 'no storage' if info is None else f'{getattr(info, "length", None)!r:.20} stored bytes'
            return f'declares {shown}, a chunk of {needed:,} bytes of which has {stored}'
        tiled += math.prod(sizes)
    if tiled != values:
        return f'declares {shown} ({values:,} values), which its chunks ({tiled:,} values) do not tile'
    return None


def _storage_problem(storage: Any) -> str | None:
    if not isinstance(storage, dict):
        return f'has storage data that is a {type(storage).__name__}, not a mapping'
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(getattr(index, 'fqn', None), str):
            return f'has a storage key {index!r:.80}, not an item index'
        if not (_whole(getattr(info, 'offset', None)) and _whole(getattr(info, 'length', None))):
            return f'places {index.fqn} at an offset and length that are not whole numbers'
        if getattr(info, 'transform_descriptors', None):
            return (f'stores {index.fqn} transformed ({info.transform_descriptors!r:.60}); dha-train reads only '
                    'items stored as they are, whose bytes bound their size')
    return None


def _planner_problem(planner_data: Any, keys: dict) -> str | None:
    """``planner_data``: each entry's path spells its own key, and every list index on a path is smaller than the
    number of entries beneath that list (so unflattening allocates no more list slots than there are path steps)."""
    if planner_data is None:
        return None
    if not isinstance(planner_data, dict):
        return f'has planner data that is a {type(planner_data).__name__}, not a mapping'
    beneath: Counter = Counter()
    largest: dict[tuple, int] = {}
    for fqn, path in planner_data.items():
        if fqn not in keys or not isinstance(path, (tuple, list)) or not path or not all(
                isinstance(key, str) or _whole(key) for key in path) or '.'.join(map(str, path)) != fqn:
            return f'has planner data for {fqn!r:.80} whose path {path!r:.80} is not the path of its own key'
        for depth, key in enumerate(path):
            if not isinstance(key, str):
                prefix = tuple(path[:depth])
                beneath[prefix] += 1
                largest[prefix] = max(largest.get(prefix, 0), key)
    for prefix, index in largest.items():
        if index >= beneath[prefix]:
            return (f'places an item at list index {index:,} of {".".join(map(str, prefix))}, a list of '
                    f'{beneath[prefix]} item(s)')
    return None


def metadata_size_problem(metadata: dcp_metadata.Metadata) -> str | None:
    """What is wrong with the sizes a sharded checkpoint's ``.metadata`` declares (see the module docstring), or
    None. Reads only the metadata: whether the shard files hold the stored bytes is the caller's to check."""
    storage, keys = metadata.storage_data, metadata.state_dict_metadata
    if not isinstance(keys, dict) or not all(isinstance(key, str) for key in keys):
        return 'has state metadata that is not a mapping of item names'
    problem = _storage_problem(storage)
    for fqn, entry in keys.items():
        if problem is not None:
            break
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            problem = _tensor_problem(fqn, entry, storage)
        elif not isinstance(entry, dcp_metadata.BytesStorageMetadata):
            problem = f'declares {fqn} as a {type(entry).__name__}, neither a tensor nor an item'
        elif dcp_metadata.MetadataIndex(fqn) not in storage:
            problem = f'declares item {fqn} with no storage'
    return problem or _planner_problem(metadata.planner_data, keys)


def tensor_size_problem(state: Any) -> str | None:
    """What is wrong with a tensor of a loaded whole-file checkpoint (any depth of dicts, lists and tuples): not a
    plain strided tensor, a stride of 0 across more than one value, or more values than its storage holds; or None."""
    stack = [((), state)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend(((*path, str(key)), item) for key, item in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend(((*path, str(index)), item) for index, item in enumerate(value))
        elif isinstance(value, torch.Tensor):
            name = '.'.join(path)
            if value.layout is not torch.strided or value.is_quantized:
                return f'its tensor {name} is a {value.layout} tensor; dha-train reads plain strided tensors only'
            if any(stride == 0 and extent > 1 for stride, extent in zip(value.stride(), value.shape)):
                return (f'its tensor {name} declares {tuple(value.shape)} with a stride of 0: one stored value '
                        'repeated; dha-train reads no tensor larger than its storage')
            needed = value.numel() * value.element_size()
            stored = value.untyped_storage().nbytes() - value.storage_offset() * value.element_size()
            if needed > stored:
                return (f'its tensor {name} declares {tuple(value.shape)} ({needed:,} bytes) over {stored:,} stored '
                        'bytes; dha-train reads no tensor larger than its storage')
    return None

"""What dha-train's checkpoint readers let a pickle build: the checkpoint errors, the numpy stand-ins for a
checkpoint's RNG state, the globals a whole file may name (``SAFE_GLOBALS``) and the unpickler of a sharded folder's
``.metadata`` (``MetadataUnpickler``). ``dha_train.checkpoints`` installs them in every read Composer and torch make."""

from __future__ import annotations

import datetime
import pickle
import types
from typing import Any

import numpy as np
import torch
from torch.torch_version import TorchVersion

from dha_train.errors import DhaTrainError

SHARDED_METADATA = '.metadata'


class CheckpointError(DhaTrainError, ValueError):
    """The checkpoint is missing, unreadable, or not a dha_train/Composer checkpoint."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint that names code to run, or forges an object: refused before anything of it runs."""


# numpy's RNG state (``rng[*].numpy``) is the one numpy object a Composer checkpoint holds: a plain uint32 array (the
# MT19937 key). Its pickle calls numpy.dtype('u4', False, True), BUILDs the dtype with its state, then numpy's
# _reconstruct(ndarray, (0,), b'b') and BUILDs the array with (version, shape, dtype, fortran, raw bytes). A dtype's
# state can add fields of object type with the flags cleared, and the array's raw bytes are then read as object
# pointers. So dha-train's reader builds neither numpy class from the pickle: 'numpy.dtype' builds a ``_PickledDtype``
# that takes only the exact state of a plain dtype of ``PLAIN_DTYPES``, and 'numpy.ndarray' a ``_CheckedArray`` whose
# state must carry such a dtype and exactly the bytes its shape needs; the array is made with a fresh
# ``np.dtype(spec)``, never with a dtype the pickle stated.
PLAIN_DTYPES = ('u4',)


class _PickledDtype:
    """A checkpoint's numpy dtype as dha-train reads it: the name of a plain dtype, checked; not a numpy dtype."""

    def __init__(self, spec: Any, align: Any = False, copy: Any = True):
        if not (isinstance(spec, str) and spec in PLAIN_DTYPES and align in (False, 0) and copy in (True, 1)):
            raise UnsafeCheckpointError(f'it holds a numpy dtype {spec!r}, not one of the plain dtypes of a '
                                        f"checkpoint's RNG state ({', '.join(PLAIN_DTYPES)})")
        self.spec = spec

    def __setstate__(self, state: Any) -> None:
        if state != np.dtype(self.spec).__reduce__()[2]:
            raise UnsafeCheckpointError(f'it re-states numpy dtype {self.spec} with fields, an object type or '
                                        'flags; only the plain dtype is allowed')


class _CheckedArray(np.ndarray):
    """A checkpoint's numpy array as dha-train reads it: a plain dtype of ``PLAIN_DTYPES`` and exactly the bytes its
    shape needs (an ndarray subclass, so numpy's RNG takes it as it is)."""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[2], _PickledDtype)):
            raise UnsafeCheckpointError('it holds a numpy array whose state is not the plain (version, shape, '
                                        'dtype, order, bytes) form of a plain dtype')
        version, shape, dtype, fortran, raw = state
        plain = np.dtype(dtype.spec)
        if not (version == 1 and isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)
                and fortran in (False, True) and type(raw) is bytes
                and len(raw) == plain.itemsize * int(np.prod(shape, dtype=np.int64))):
            raise UnsafeCheckpointError(f'it holds a numpy {dtype.spec} array whose shape, order and bytes do not '
                                        'fit together')
        super().__setstate__((version, shape, plain, fortran, raw))

    def __reduce__(self):  # saved again (export's gather of a sharded folder) as the plain ndarray it stands for
        return self.view(np.ndarray).__reduce__()


def _checked_reconstruct(subtype: Any, shape: Any, dtype: Any) -> _CheckedArray:
    """numpy's ``_reconstruct`` as dha-train's reader allows it: the empty array numpy's own pickles start from."""
    if subtype is not _CheckedArray or shape != (0,) or dtype != b'b':
        raise UnsafeCheckpointError('it rebuilds a numpy array otherwise than numpy pickles a plain ndarray')
    return _CheckedArray((0,), dtype='b')


# Every non-tensor type a Composer 0.32.1 checkpoint written by `dha-train train` holds, as
# torch.serialization.get_unsafe_globals_in_checkpoint lists them for full and sharded (gathered) checkpoints with
# algorithms, callbacks and evaluators. weights_only=True allows these and nothing else beyond tensors and plain data.
SAFE_GLOBALS: list[Any] = [
    datetime.timedelta,  # state.timestamp: the wall-clock times
    TorchVersion,  # state.metadata: the torch version that wrote the checkpoint
    # rng[*].numpy: numpy's RNG state, built by the checked stand-ins above under the names numpy pickles with (numpy
    # 2's _core and numpy 1's core: the numpy pin allows both, and a checkpoint may move between them).
    (_PickledDtype, 'numpy.dtype'),
    (_CheckedArray, 'numpy.ndarray'),
    (_checked_reconstruct, 'numpy._core.multiarray._reconstruct'),
    (_checked_reconstruct, 'numpy.core.multiarray._reconstruct'),
]


# What a torch.distributed.checkpoint ``.metadata`` (torch 2.7, as Composer 0.32.1 writes it) names: its dataclasses,
# the storage info of the filesystem writer, tensor sizes, dtypes and layouts, and the checkpoint's path.
METADATA_GLOBALS = frozenset({
    *(('torch.distributed.checkpoint.metadata', name) for name in (
        'Metadata', 'MetadataIndex', 'StorageMeta', 'TensorStorageMetadata', 'BytesStorageMetadata',
        'ChunkStorageMetadata', 'TensorProperties', '_MEM_FORMAT_ENCODING')),
    ('torch.distributed.checkpoint.filesystem', '_StorageInfo'),
    ('torch', 'Size'), ('torch.serialization', '_get_layout'),
    ('pathlib', 'PosixPath'), ('pathlib', 'WindowsPath'), ('pathlib', 'PurePosixPath'), ('pathlib', 'PureWindowsPath'),
})


class MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be checked, the C one's cannot
    """Unpickles a DCP ``.metadata`` building only ``METADATA_GLOBALS`` and torch dtypes, with BUILD only on
    instances of the allowed classes (never on a class, a function or a module: that would set attributes on them
    for the whole process)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (module == 'torch' and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f'its {SHARDED_METADATA} names {module}.{name}, which a torch.distributed.checkpoint '
                                    'metadata file does not hold; dha-train refuses to unpickle it')

    def load_build(self) -> None:
        target = self.stack[-2]  # BUILD's operands: the object, then its state on top
        allowed = type(target).__module__, type(target).__name__
        if isinstance(target, (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)) \
                or allowed not in METADATA_GLOBALS:
            raise UnsafeCheckpointError(f'its {SHARDED_METADATA} sets the state of {target!r:.80}, which is not an '
                                        'instance of a metadata class; dha-train refuses to unpickle it')
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

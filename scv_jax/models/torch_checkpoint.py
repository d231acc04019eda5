"""Reading a PyTorch ``torch.save`` state dict (``pytorch_model.bin``) as numpy arrays, without torch.

A zip-format torch checkpoint holds ``<archive>/data.pkl``, a pickle whose persistent ids name the raw
storages ``<archive>/data/<key>`` (little-endian), and tensors rebuilt from them by
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)``. The unpickler here accepts
only those globals (the storages of float32, float16, bfloat16, int64 and bool tensors, and
``collections.OrderedDict``), so a file cannot run code when read.
"""

from __future__ import annotations

import collections
import pathlib
import pickle
import zipfile
from typing import Any

import ml_dtypes
import numpy as np

STORAGE_DTYPES = {
    "FloatStorage": np.dtype(np.float32),
    "HalfStorage": np.dtype(np.float16),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype(np.int64),
    "BoolStorage": np.dtype(np.bool_),
}


class _StorageType:
    """What the unpickler returns for ``torch.<Name>Storage``: the numpy dtype of its elements."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype


class _Unpickler(pickle.Unpickler):
    def __init__(self, archive: zipfile.ZipFile, prefix: str, file: pathlib.Path):
        super().__init__(archive.open(f"{prefix}data.pkl"))
        self.archive, self.prefix, self.file = archive, prefix, file
        self.storages: dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise ValueError(f"{self.file}: pickled global {module}.{name} is not allowed (only tensors of "
                         f"{', '.join(STORAGE_DTYPES)} and OrderedDict)")

    def persistent_load(self, pid: Any) -> np.ndarray:
        """The storage ``('storage', type, key, location, numel)`` as a flat array."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise ValueError(f"{self.file}: unsupported persistent id {pid!r}")
        _, storage_type, key, _, numel = pid
        if key not in self.storages:
            raw = self.archive.read(f"{self.prefix}data/{key}")
            storage = np.frombuffer(raw, storage_type.dtype)
            if storage.size != numel:
                raise ValueError(f"{self.file}: storage {key} holds {storage.size} elements, its record says {numel}")
            self.storages[key] = storage
        return self.storages[key]

    def _rebuild_tensor(self, storage: np.ndarray, offset: int, size: tuple, stride: tuple, *_) -> np.ndarray:
        """A copy of the ``size``/``stride`` view at element ``offset`` of ``storage`` (bounds checked)."""
        if any(s < 0 for s in size) or any(s < 0 for s in stride) or offset < 0:
            raise ValueError(f"{self.file}: a tensor has negative size, stride or offset")
        last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset - 1
        if last >= storage.size:
            raise ValueError(f"{self.file}: a tensor of size {list(size)} reaches past its storage")
        item = storage.itemsize
        view = np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                               strides=tuple(s * item for s in stride), writeable=False)
        return np.array(view)


def read_torch_state_dict(file: str | pathlib.Path) -> dict[str, np.ndarray]:
    """{name: array} of a zip-format ``torch.save`` state dict (bfloat16 as ``ml_dtypes.bfloat16``).

    Raises ValueError naming ``file`` for a file that is not such a checkpoint, holds another object,
    a global other than the allowed ones, or a tensor of another dtype.
    """
    file = pathlib.Path(file)
    try:
        with zipfile.ZipFile(file) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
            if len(pickles) != 1:
                raise ValueError(f"{file}: expected one <archive>/data.pkl in the zip, found {len(pickles)}")
            prefix = pickles[0][:-len("data.pkl")]
            if f"{prefix}byteorder" in archive.namelist() and archive.read(f"{prefix}byteorder") != b"little":
                raise ValueError(f"{file}: only little-endian torch checkpoints are supported")
            state = _Unpickler(archive, prefix, file).load()
    except zipfile.BadZipFile:
        raise ValueError(f"{file} is not a zip-format torch checkpoint (torch.save since torch 1.6)") from None
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError) as e:
        raise ValueError(f"{file}: unreadable torch checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, np.ndarray)
                                              for k, v in state.items()):
        raise ValueError(f"{file}: expected a state dict of tensors, got {type(state).__name__}")
    return dict(state)

"""Writes, beside this file, ``pytorch_model.bin`` (a small state dict saved by real torch) with
``expected.npz`` (the same arrays), and ``eagle3_head.bin`` (the float16 EAGLE-3 head
``heads.BIN_HEAD`` saved by torch), for the torch-free reader's tests (tests/models/test_eagle3.py).

Run with an interpreter that has torch and numpy (CI has no torch, so both outputs are committed):
    python tests/models/eagle3_fixtures/make_bin_fixture.py

The state dict covers every dtype ``scv_jax.models.torch_checkpoint`` reads (float32, float16,
bfloat16, int64, bool), a transposed (non-contiguous) view and two tensors sharing one storage at
different offsets. ``expected.npz`` stores bfloat16 tensors as their uint16 bit patterns.
"""

import collections
import pathlib

import numpy as np
import torch

from heads import BIN_HEAD, head_tensors

HERE = pathlib.Path(__file__).parent


def state_dict() -> collections.OrderedDict:
    torch.manual_seed(0)
    shared = torch.randn(12)
    return collections.OrderedDict([
        ("float32", torch.randn(3, 5)),
        ("float16", torch.randn(4, 2).to(torch.float16)),
        ("bfloat16", torch.randn(2, 6).to(torch.bfloat16)),
        ("int64", torch.tensor([5, -3, 0, 2 ** 40], dtype=torch.int64)),
        ("bool", torch.tensor([True, False, False, True, True])),
        ("transposed", torch.randn(4, 3).t()),
        ("shared_head", shared[:4].view(2, 2)),
        ("shared_tail", shared[6:].view(3, 2)),
        ("scalar", torch.tensor(1.5)),
    ])


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
    return tensor.contiguous().numpy()


if __name__ == "__main__":
    tensors = state_dict()
    torch.save(tensors, HERE / "pytorch_model.bin")
    np.savez(HERE / "expected.npz", **{name: as_numpy(t) for name, t in tensors.items()})
    head = head_tensors(**BIN_HEAD, dtype=np.float16)
    torch.save({name: torch.from_numpy(array) for name, array in head.items()}, HERE / "eagle3_head.bin")

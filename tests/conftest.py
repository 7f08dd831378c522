"""Shared test setup.

* ``gpu`` tests skip without CUDA.
* In the TRITON_INTERPRET=1 process, the interpreter's ``tl.dot`` is replaced by a fixed-tree
  fp32 dot (see _tree_dot), and its fp32 -> bf16 cast by torch's. Triton 3.6's interpreter computes bf16 dots
  on raw bit patterns, truncates fp32 -> bf16 where GPUs round to nearest even, and does fp32
  dots with numpy/OpenBLAS, whose bits depend on the operand shapes (a 1-row product differs
  from the same row inside a 16-row one; measured on triton 3.6). None of that is what a
  GPU does. With the replacements the interpreter runs bik's real kernel programs — indexing,
  masking, strides, tile loop order, bias, casts — with a dot that, like the hardware's,
  treats every row of a tile alike.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_f32(handle) -> np.ndarray:
    import triton.language as tl

    data = handle.data
    if handle.dtype.scalar == tl.bfloat16:  # stored as uint16 bit patterns
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def _pairwise_sum(x: np.ndarray, axis: int) -> np.ndarray:
    """Sum over ``axis`` by a fixed pairwise tree (pairs (0,1), (2,3), ..., then recurse)."""
    x = np.moveaxis(x, axis, 0)
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = np.concatenate([x, np.zeros_like(x[:1])])
        x = x[0::2] + x[1::2]
    return x[0]


def _tree_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """acc + (a @ b) where each output's K_BLOCK products are summed by one fixed pairwise
    tree in fp32: every row of the tile is treated alike (as by a tensor-core instruction),
    and the K step is visible in the bits (as on the hardware), so a BLOCK_K that followed M
    would show up as a batch dependence."""
    from triton.runtime.interpreter import TensorHandle

    a32, b32 = _interpreter_f32(a), _interpreter_f32(b)
    products = a32[..., :, :, None] * b32[..., None, :, :]  # [.., M, K, N], each rounded
    acc = d.data.astype(np.float32) + _pairwise_sum(products, axis=-2)
    return TensorHandle(acc.astype(np.float32), d.dtype.scalar)


def _patch_bf16_cast(original):
    def cast_impl(self, src, dst_type):
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rne = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return TensorHandle(rne.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    return cast_impl


if INTERPRETER:
    from triton.runtime.interpreter import InterpreterBuilder

    InterpreterBuilder.create_dot = _tree_dot
    InterpreterBuilder.cast_impl = _patch_bf16_cast(InterpreterBuilder.cast_impl)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and bik's counters empty before, and no front end left on after (the
    front-end tests under tests/mode/)."""
    import bik

    torch._dynamo.reset()
    bik.reset_mode_stats()
    yield
    torch._dynamo.reset()
    assert not bik.is_enabled() and not bik.is_batch_invariant_mode_enabled()

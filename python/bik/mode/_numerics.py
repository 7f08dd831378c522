"""Process-wide numerics flags the mode sets: TF32 off and float32 matmul precision "highest"
while any thread is in the mode, the exact previous state restored when the last one leaves."""

from __future__ import annotations

import threading

import torch

__all__ = ["acquire_flags", "numerics_snapshot", "release_flags", "restore_numerics"]


def _has_attr_path(path) -> bool:
    obj = torch.backends
    for name in path:
        try:
            obj = getattr(obj, name)
        except AttributeError:
            return False
    return True


# torch >= 2.9 keeps the state as fp32_precision strings (parents before children: restoring a
# parent may reset its children); older torch only has the legacy flags.
_PRECISION_ATTRS = tuple(p for p in (
    ("fp32_precision",), ("cuda", "matmul", "fp32_precision"), ("cudnn", "fp32_precision"),
    ("cudnn", "conv", "fp32_precision"), ("cudnn", "rnn", "fp32_precision"),
    ("mkldnn", "fp32_precision"), ("mkldnn", "matmul", "fp32_precision"),
    ("mkldnn", "conv", "fp32_precision"), ("mkldnn", "rnn", "fp32_precision"),
) if _has_attr_path(p))
_flags_lock = threading.Lock()
_flags_users = 0
_saved_flags: tuple | None = None


def _attr_owner(path):
    obj = torch.backends
    for name in path[:-1]:
        obj = getattr(obj, name)
    return obj


def numerics_snapshot() -> tuple:
    """The state behind TF32 and float32 matmul precision: torch's legacy precision (None when
    torch refuses to read it after mixed legacy/new API use) and every fp32_precision string."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = None
    if not _PRECISION_ATTRS:
        return legacy, (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    return legacy, tuple(getattr(_attr_owner(p), p[-1]) for p in _PRECISION_ATTRS)


def restore_numerics(snapshot: tuple) -> None:
    legacy, state = snapshot
    if legacy is not None:
        torch.set_float32_matmul_precision(legacy)
    if not _PRECISION_ATTRS:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = state
        return
    for path, value in zip(_PRECISION_ATTRS, state):
        setattr(_attr_owner(path), path[-1], value)


def acquire_flags() -> None:
    global _flags_users, _saved_flags
    with _flags_lock:
        if _flags_users == 0:
            _saved_flags = numerics_snapshot()
            try:
                torch.set_float32_matmul_precision("highest")
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
            except BaseException:
                restore_numerics(_saved_flags)
                raise
        _flags_users += 1


def release_flags() -> None:
    global _flags_users, _saved_flags
    with _flags_lock:
        _flags_users -= 1
        if _flags_users == 0:
            snapshot, _saved_flags = _saved_flags, None
            restore_numerics(snapshot)

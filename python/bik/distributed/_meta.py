"""Agreement before compute: every rank shows the others what it is about to do.

A collective whose ranks disagree on shapes hangs or mixes garbage; a rank whose bik produces
other bits (another fingerprint) breaks the promise silently. So each bik.distributed call
first all-gathers a small description from every rank and checks it on every rank: a mismatch
raises the same ValueError everywhere instead of leaving the others waiting.
"""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.distributed as dist

from bik import configs

__all__ = ["describe", "gather_and_check", "group_size_rank"]


@functools.cache
def _fingerprint(device_type: str, split_mode: str) -> str:
    from bik.fingerprint import fingerprint

    del split_mode  # part of the key: the fingerprint follows it
    return fingerprint(device_type).digest


def describe(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), str(t.dtype)[6:], t.device.type)


def group_size_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("bik.distributed: torch.distributed is not initialized "
                           "(torch.distributed.init_process_group first)")
    return dist.get_world_size(group), dist.get_rank(group)


def _digest(fields: dict) -> int:
    text = repr(sorted(fields.items())).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def gather_and_check(op: str, group, device: torch.device, **mine) -> None:
    """Check that every rank's description (``mine`` plus the fingerprint) agrees on the fields
    listed in ``mine["same"]``. Raises ValueError on every rank, naming the op, the field and
    each rank's value, when they do not.

    The common case costs one all_gather of one int64 per rank (a digest of the fields, on the
    collective's device); only a mismatch, which every rank sees, pays an all_gather_object of
    the descriptions for the message."""
    size, _ = group_size_rank(group)
    same = mine.pop("same")
    mine["fingerprint"] = _fingerprint(device.type, configs.matmul_split_mode())
    checked = {key: mine[key] for key in ("fingerprint", *same)}
    where = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    digest = torch.tensor([_digest(checked)], dtype=torch.int64, device=where)
    digests = [torch.empty_like(digest) for _ in range(size)]
    dist.all_gather(digests, digest, group=group)
    if all(torch.equal(d, digests[0]) for d in digests):
        return
    everyone: list = [None] * size
    dist.all_gather_object(everyone, checked, group=group)
    for key in checked:
        values = [d[key] for d in everyone]
        if any(v != values[0] for v in values):
            raise ValueError(f"{op}: the ranks disagree on {key}: "
                             + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
    raise AssertionError(f"{op}: the ranks' digests differ but no field does")  # unreachable

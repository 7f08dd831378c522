"""bik::write_kv_cache: new K/V rows into a paged or contiguous cache, in place.

Pure data movement (no backend argument, no gradient): it cannot change any bits, only put
them where bik::attention reads them.
"""

from __future__ import annotations

import torch

from bik.ops._call import call
from bik.ops._checks import debug_checks
from bik.ops._define import define
from bik.ops._native import kernel_for
from bik.ops.attention.checks import check_kv_write


def _paged_view(cache: torch.Tensor) -> torch.Tensor:
    """A cache as [pages, tokens per page, Hkv, D] (a contiguous [B, max_len] one is already,
    a [slots, Hkv, D] one has pages of one token), strides kept."""
    return cache if cache.dim() == 4 else cache.unsqueeze(1)


def _shapes(op, args):
    check_kv_write(op, args.k_cache, args.v_cache, args.k, args.v, args.slot_mapping)
    return args


def _check(op, args):
    """The shapes, then (``validate`` or BIK_DEBUG_CHECKS=1) the slots: one host sync."""
    _shapes(op, args)
    k_cache, slot_mapping = args.k_cache, args.slot_mapping
    if k_cache.numel() and k_cache.data_ptr() == args.v_cache.data_ptr():  # (not in the fake)
        raise ValueError(f"{op}: k_cache and v_cache are the same memory (v would overwrite k)")
    if (args.validate or debug_checks()) and slot_mapping.numel():
        slots = slot_mapping.long()
        used = torch.sort(torch.where(slots >= 0, slots, -1)).values
        twice = (used[1:] == used[:-1]) & (used[1:] >= 0)
        top, n_twice = torch.stack([slots.max(), twice.sum()]).tolist()  # the one host sync
        if top >= _slots(k_cache):
            raise ValueError(f"{op}: slot {top} is outside the cache's {_slots(k_cache)} slots")
        if n_twice:  # which token's K/V would land there is up to the kernel: refuse
            raise ValueError(f"{op}: slot_mapping names a slot more than once ({n_twice} "
                             f"repeats)")
    return args


def _slots(cache: torch.Tensor) -> int:
    return cache.numel() // (cache.shape[-2] * cache.shape[-1])


def _run(launch, args):
    del launch  # no backend to choose; the slots are checked
    k_cache, v_cache, k, v = args.k_cache, args.v_cache, args.k, args.v
    if k_cache.device.type != "cpu":
        from bik.ops.attention.kv_cache_triton import write_rows_triton

        write_rows_triton(_paged_view(k_cache), _paged_view(v_cache), k, v, args.slot_mapping)
        return
    from bik.ops.attention.cpu import write_rows_cpu

    slots = args.slot_mapping.long()
    # Negative slots mark padding tokens and unchecked slots past the cache are skipped (as
    # the GPU kernel does): both by the C++ copy loop, or here by a mask.
    if all(write_rows_cpu(_paged_view(c), new, slots) for c, new in ((k_cache, k), (v_cache, v))):
        return
    keep = (slots >= 0) & (slots < _slots(k_cache))
    rows = slots[keep]
    for cache, new in ((k_cache, k), (v_cache, v)):
        pages = _paged_view(cache)  # a view: the write lands in the caller's cache
        block = pages.shape[1]
        pages[rows // block, rows % block] = new[keep]


def _fake(args):
    return None


define("write_kv_cache",
       "(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping, "
       "bool validate=True) -> ()",
       check=_check, fake_check=_shapes, run=_run, fake=_fake,
       native=kernel_for("write_kv_cache", kernel="kv_write"))


def write_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, slot_mapping: torch.Tensor, *,
                   validate: bool = True) -> None:
    """Write new K/V rows [tokens, Hkv, D] into the caches in place.

    Slot s is row ``s`` of the cache viewed as [-1, Hkv, D]: for a paged cache
    s = block * block_size + offset, for a contiguous one s = b * max_len + position.
    Negative slots (padding) are skipped. Pure data movement: it cannot change any bits.
    ``validate`` (default) checks every slot is inside the cache and named once, one host
    sync; with ``validate=False`` nothing is read back (CUDA-graph safe) and a slot past the
    cache is skipped — check the mapping where you build it (or set BIK_DEBUG_CHECKS=1).
    """
    call("write_kv_cache", k_cache, v_cache, k, v, slot_mapping, bool(validate))

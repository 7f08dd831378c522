"""What one forward pass runs on: a packed batch layout (:class:`Step`) and a paged KV cache.

A step packs the new tokens of several sequences into one [T] batch: sequence b owns rows
``cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1``, which sit at absolute positions
``cache_seqlens[b] - q_len_b .. cache_seqlens[b] - 1`` (bik.attention's convention). The same
layout describes a prefill, a prefill chunk, a decode token and a verify window, so the model
never needs to know which of them it is running.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["KVCache", "Step", "build_step"]


@dataclass(frozen=True)
class Step:
    """The layout of one forward pass over B sequences and T = sum(q_lens) new tokens.

    Device tensors (for the kernels) and host tuples (so that Python code needs no device sync)
    describe the same layout; :func:`build_step` fills both. The host side is also the ops'
    host metadata (max_seqlen_q / max_seqlen_k), so a forward pass reads nothing back.
    """

    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    cache_seqlens: torch.Tensor  # int32 [B], keys per sequence including this step's tokens
    block_table: torch.Tensor  # int32 [B, max_blocks]; entries past a sequence's pages are 0
    slot_mapping: torch.Tensor  # int64 [T]; slot = block * block_size + offset of each new token
    q_lens: tuple[int, ...]  # new tokens per sequence (host copy)
    kv_lens: tuple[int, ...]  # == cache_seqlens (host copy)
    max_block: int  # the largest block id the table uses (host; -1: none)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.kv_lens, default=0)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)


def build_step(q_lens: Sequence[int], kv_lens: Sequence[int],
               block_lists: Sequence[Sequence[int]], block_size: int,
               device: torch.device | str = "cpu") -> Step:
    """Build a :class:`Step` on the host and copy it to ``device`` once.

    Args:
        q_lens: new tokens of each sequence in this pass (>= 0).
        kv_lens: keys of each sequence after this pass, including its new tokens (>= q_len).
        block_lists: the cache blocks of each sequence in page order; page i holds absolute
            positions i*block_size .. (i+1)*block_size - 1. It must cover kv_len positions.
        block_size: tokens per cache block.

    The new tokens of sequence b are at positions kv_len - q_len .. kv_len - 1; their slots
    (where their K/V is written) follow from the block list.
    """
    q_lens, kv_lens = tuple(int(n) for n in q_lens), tuple(int(n) for n in kv_lens)
    if not len(q_lens) == len(kv_lens) == len(block_lists):
        raise ValueError(f"build_step: q_lens ({len(q_lens)}), kv_lens ({len(kv_lens)}) and "
                         f"block_lists ({len(block_lists)}) must have one entry per sequence")
    if block_size < 1:
        raise ValueError(f"build_step: block_size must be >= 1, got {block_size}")
    slots: list[int] = []
    for b, (q_len, kv_len, blocks) in enumerate(zip(q_lens, kv_lens, block_lists)):
        if q_len < 0 or kv_len < q_len:
            raise ValueError(f"build_step: sequence {b} needs 0 <= q_len <= kv_len, got "
                             f"q_len {q_len}, kv_len {kv_len}")
        if len(blocks) * block_size < kv_len:
            raise ValueError(f"build_step: sequence {b} has {kv_len} keys but its "
                             f"{len(blocks)} blocks of {block_size} hold "
                             f"{len(blocks) * block_size}")
        if any(int(block) < 0 for block in blocks):
            raise ValueError(f"build_step: sequence {b} has a negative block id: {list(blocks)}")
        for pos in range(kv_len - q_len, kv_len):
            slots.append(int(blocks[pos // block_size]) * block_size + pos % block_size)
    width = max((len(blocks) for blocks in block_lists), default=0) or 1
    table = [list(map(int, blocks)) + [0] * (width - len(blocks)) for blocks in block_lists]
    cu = [0]
    for q_len in q_lens:
        cu.append(cu[-1] + q_len)
    return Step(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        cache_seqlens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device).reshape(
            len(q_lens), width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        q_lens=q_lens,
        kv_lens=kv_lens,
        max_block=max((int(b) for blocks in block_lists for b in blocks), default=-1),
    )


@dataclass
class KVCache:
    """A paged KV cache: one [num_blocks, block_size, Hkv, D] tensor per layer for K and for V.

    Which blocks belong to which sequence is the caller's business (a block allocator); the
    model only writes the slots a :class:`Step` names and reads the pages of its block table.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(cls, config, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> KVCache:
        """Zero-filled caches for ``config`` (a LlamaConfig). Zeros, not garbage: bik.attention
        requires finite keys, and a never-written slot must not be NaN."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KVCache.allocate: num_blocks ({num_blocks}) and block_size "
                             f"({block_size}) must be >= 1")
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        layers = range(config.num_hidden_layers)
        return cls(k=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
                   v=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
                   block_size=block_size)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0] if self.k else 0

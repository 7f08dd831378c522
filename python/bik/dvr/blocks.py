"""A pool of KV-cache blocks with a deterministic free list.

The engine owns one pool per cache. Blocks are handed out lowest id first and returned in any
order; which physical block a token lands in never changes its bits (bik.attention's output
does not depend on the page layout), so the policy only has to be reproducible for debugging.
"""

from __future__ import annotations

import heapq

__all__ = ["BlockPool", "OutOfBlocksError", "blocks_for"]


class OutOfBlocksError(RuntimeError):
    """The pool cannot satisfy an allocation (the engine reserves each step's blocks first and
    preempts to make room, so it never lets this escape a step)."""


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` KV rows."""
    return -(-tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"BlockPool: num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap: lowest id first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(f"BlockPool: {count} blocks requested, {len(self._free)} of "
                                   f"{self.num_blocks} free")
        got = [heapq.heappop(self._free) for _ in range(count)]
        self._used.update(got)
        return got

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise RuntimeError(f"BlockPool: block {b} freed twice or never allocated")
            self._used.remove(b)
            heapq.heappush(self._free, b)

    def grow(self, blocks: list[int], tokens: int, block_size: int) -> None:
        """Extend a sequence's block list in place so that it holds ``tokens`` KV rows."""
        need = blocks_for(tokens, block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.allocate(need))

    def shrink(self, blocks: list[int], tokens: int, block_size: int) -> None:
        """Free the blocks of a sequence beyond those that hold its first ``tokens`` rows."""
        keep = blocks_for(tokens, block_size)
        if keep < len(blocks):
            self.free(blocks[keep:])
            del blocks[keep:]

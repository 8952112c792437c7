"""The KV block manager: which blocks of the paged cache each request holds."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """A free list over ``num_blocks`` blocks of ``block_size`` tokens.

    Blocks are handed out in FIFO order of release, so a freed block is reused as late as
    possible.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Extra blocks for a request holding ``num_held`` blocks to store ``num_tokens``."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def can_allocate(self, num_blocks: int) -> bool:
        """True when ``num_blocks`` more blocks are free."""
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks; raises if there are not enough."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the free list."""
        self._free.extend(block_ids)

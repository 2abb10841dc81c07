"""The device KV block pool: reference counts, an O(1) free list, and the prefix index.

Eviction order: the free list is a queue. A block whose reference count drops to zero goes to its
tail; allocation takes from its head. So the least recently freed block is reused first. A request
frees its blocks last-to-first, which puts a sequence's tail ahead of its prefix in the queue: a
shared prefix outlives the suffixes hanging off it. A free block keeps its hash (and stays a prefix
hit) until allocation takes it for new data.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from tierserve.engine.core.block_hash import BlockHash


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    """Tokens whose KV the block holds, kept to verify a hash hit."""


class EvictedBlock(NamedTuple):
    """A cached block that allocation took for new data (its KV is still intact)."""

    hash: BlockHash
    block_id: int
    token_ids: tuple[int, ...]
    """The tokens it held (allocation clears the block's own copy)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 keep_evicted: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._index: dict[BlockHash, int] = {}
        self.queries = 0
        """Blocks looked up in the prefix index (a metrics counter)."""
        self.hits = 0
        """Blocks found in the prefix index."""
        self._evicted: list[EvictedBlock] | None = [] if keep_evicted else None
        """With keep_evicted (a cpu tier wants demotions): the cached blocks allocation took for
        new data since the last take_evicted(). Their KV is intact until the next model step or
        block write."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / max(1, self.num_blocks)

    def free_order(self) -> list[int]:
        """Block ids in the order allocation will take them."""
        return list(self._free)

    def match_prefix(self, hashes: Sequence[BlockHash], token_ids: Sequence[int]) -> list[int]:
        """Ids of the leading blocks whose hash and tokens match; takes no reference."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            self.queries += 1
            bid = self._index.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            self.hits += 1
            found.append(bid)
        return found

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on blocks found by match_prefix."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_cnt == 0:
                del self._free[bid]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (reference count 1), or None if fewer than n are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            b = self.blocks[bid]
            if b.hash is not None:
                if self._index.get(b.hash) == bid:
                    del self._index[b.hash]
                    if self._evicted is not None:
                        self._evicted.append(EvictedBlock(b.hash, bid, b.token_ids))
                b.hash, b.token_ids = None, ()
            b.ref_cnt = 1
            out.append(bid)
        return out

    def take_evicted(self) -> list[EvictedBlock]:
        """The cached blocks allocation took since the last call (always [] without
        keep_evicted)."""
        if not self._evicted:
            return []
        out, self._evicted = self._evicted, []
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, last block first (see the eviction order)."""
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {bid} freed twice"
            if b.ref_cnt == 0:
                self._free[bid] = None

    def publish(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Make a block whose KV is written findable by its hash. An existing entry wins."""
        if not self.enable_prefix_caching:
            return
        b = self.blocks[block_id]
        if b.hash is not None or block_hash in self._index:
            return
        b.hash, b.token_ids = block_hash, tuple(token_ids)
        self._index[block_hash] = block_id

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def reset_prefix_cache(self) -> None:
        for b in self.blocks:
            b.hash, b.token_ids = None, ()
        self._index.clear()

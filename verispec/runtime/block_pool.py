"""The KV cache's block allocator (docs/design.md §13): which blocks of the pool are free, how
many holders each of the others has, and the prefix cache's index of published blocks.

- Block 0 is the *scratch block* (``SCRATCH_BLOCK``): the pool never hands it out, so the writes
  that no request owns can land in it (``runtime.kv_cache``: the padding tokens and rows of a
  captured step).
- ``BlockPool`` is host-side bookkeeping only: a free list in least-recently-freed order and a
  reference count per block (ready for blocks that several requests share), plus the published
  blocks' keys (``publish``, ``lookup``, ``reset_prefix_cache``). It holds no tensors and knows
  no slots: ``kv_cache.BlockTables`` gives each slot its blocks from the pool, and
  ``runtime.prefix_cache`` computes the keys it publishes and looks up.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

SCRATCH_BLOCK = 0


class BlockPool:
    """Block ids ``1 .. num_blocks - 1`` (0 is the scratch block), each with a reference count,
    and the prefix cache's index of published blocks (docs/design.md §13).

    A block nobody holds is *free*; free blocks wait in least-recently-freed order and are handed
    out from the oldest. A free block that is published (``publish``: its key names the tokens
    it holds and every token before them) keeps its contents and its key until it is handed out
    again: ``lookup`` finds it and ``touch`` takes it back from the free queue, so a later
    request reuses its KV instead of computing it. Handing a published block out evicts its key.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is scratch), got "
                             f"{num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[bytes, int] = {}  # key -> published block
        self._keys: dict[int, bytes] = {}  # published block -> key
        # Published blocks whose rows every cache on the tables holds (a proposer's too; the
        # others hold the target's rows only: a proposer that lagged behind its target).
        self.complete = np.zeros(num_blocks, dtype=bool)
        # ... and the token after each complete block in the request that completed it (a
        # proposer whose row at p depends on the token at p + 1: runtime.prefix_cache)
        self.next_token = np.full(num_blocks, -1, dtype=np.int64)
        # Blocks that computed an already published key again (two requests at once, or one
        # that could not use the published block: another next token); once complete they are
        # found under (key, next token) by such a proposer.
        self._duplicates: dict[int, bytes] = {}
        self._alternates: dict[tuple[bytes, int], int] = {}
        self._alternate_of: dict[int, tuple[bytes, int]] = {}

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks nobody holds (published ones among them: reused only when needed)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Published blocks, held or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - self.num_free / self.num_usable

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with reference count 1, the least recently freed first (a published one
        loses its key); ValueError if fewer are free (check first)."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} KV blocks: {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block = self._free.popitem(last=False)[0]
            key = self._keys.pop(block, None)
            if key is not None:
                del self._cached[key]
            alternate = self._alternate_of.pop(block, None)
            if alternate is not None:
                del self._alternates[alternate]
            self._duplicates.pop(block, None)
            self.complete[block] = False
            blocks.append(block)
        self.ref_counts[blocks] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """One more holder of each block (a request sharing another's blocks)."""
        if blocks and (self.ref_counts[blocks] < 1).any():
            raise ValueError(f"incref of a free block among {blocks[:8]}")
        np.add.at(self.ref_counts, blocks, 1)

    def touch(self, blocks: list[int]) -> None:
        """One more holder of each (published) block, taking a free one out of the free queue:
        a prefix-cache hit."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference of each block; a block nobody holds joins the free queue's end
        (give a request's blocks last first: its deepest published blocks are evicted first)."""
        for block in blocks:
            count = self.ref_counts[block]
            if count < 1:
                raise ValueError(f"double free of KV block {block}")
            self.ref_counts[block] = count - 1
            if count == 1:
                self._free[block] = None

    def publish(self, block: int, key: bytes) -> None:
        """Make ``block`` findable under ``key`` (a held block whose tokens are final). A key
        another block already has stays with that block; this one is kept as a duplicate,
        found only by ``lookup_shifted`` once complete (else freed as an ordinary block)."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"cannot publish the free KV block {block}")
        if block in self._keys or block in self._alternate_of:
            return
        if key not in self._cached:
            self._cached[key] = block
            self._keys[block] = key
        else:
            self._duplicates[block] = key

    def mark_complete(self, block: int, next_token: int = -1) -> None:
        """Every cache on the tables now holds the published ``block``'s rows, written before
        ``next_token`` (the first only: rows stay those of the first request to complete it)."""
        if block in self._keys and not self.complete[block]:
            self.complete[block] = True
            self.next_token[block] = next_token
        elif block in self._duplicates:
            alternate = (self._duplicates.pop(block), next_token)
            if alternate not in self._alternates:
                self._alternates[alternate] = block
                self._alternate_of[block] = alternate
                self.complete[block] = True
                self.next_token[block] = next_token

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The published blocks of the longest prefix of ``keys`` (a chain: key i names block i
        and everything before it)."""
        blocks = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def lookup_shifted(self, keys: list[bytes], next_tokens) -> list[int]:
        """``lookup`` for a proposer whose rows depend on the next token: block i must be
        complete and completed before ``next_tokens[i]`` (the published block or another with
        the same key)."""
        blocks = []
        for key, after in zip(keys, next_tokens):
            block = self._cached.get(key)
            if block is None:
                break
            if not (self.complete[block] and self.next_token[block] == after):
                block = self._alternates.get((key, int(after)))
                if block is None:
                    break
            blocks.append(block)
        return blocks

    def reset_prefix_cache(self) -> None:
        """Forget every published block (their contents stay with their holders)."""
        self._cached.clear()
        self._keys.clear()
        self._duplicates.clear()
        self._alternates.clear()
        self._alternate_of.clear()
        self.complete[:] = False

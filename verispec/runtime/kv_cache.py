"""The paged KV cache (docs/design.md §6, §13): K/V in a pool of fixed-size blocks, a block table
per request slot, and the committed length of each slot.

- A *block* holds ``block_size`` consecutive positions of one request, in every layer. Position
  ``t`` of the request in slot ``s`` lives at cache slot ``block_table[s, t // block_size] *
  block_size + t % block_size`` of the per-layer pool ``[num_blocks, block_size, kv_heads,
  head_dim]``. Models and kernels see only that layout (block tables, slot mapping, lengths).
- Block 0 is the *scratch block*: never handed out, it takes every write that no request owns
  (the padding tokens of a captured step past a request's blocks, the padding rows of a batch
  bucket, whose block-table row ``scratch_slot`` is all zeros). Nothing live is ever read from it.
- ``BlockPool`` (``runtime.block_pool``) is the host-side allocator (a free list and reference
  counts, ready for blocks that several requests share; the prefix cache's index of published
  blocks). ``BlockTables`` gives each slot its blocks and keeps the device copy the kernels read
  (a persistent tensor: CUDA graphs capture its address). A target's cache owns its tables; a
  proposer's cache (draft model, EAGLE head, early exit) *shares* them: block ``i`` of the
  draft's pool belongs to the same request as block ``i`` of the target's, so one reservation
  covers both and the memory plan counts both per block.
- The committed length of each slot is the cache's own (a draft's lags or leads the target's).
  Entries past it are dead: appending writes positions ``[length, length + n)``, rolling back
  rejected drafts only moves the length back; the blocks stay until the slot is freed.

The engine reserves, before a step, the blocks that every write of the step needs (``reserve``:
the k + 1 positions of a verify step); a runner used on its own reserves on append. A pool too
small for a reservation answers False (the scheduler then preempts or waits): it never raises
while serving.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from verispec.models.config import ModelConfig
from verispec.ops import to_device
from verispec.runtime.block_pool import SCRATCH_BLOCK, BlockPool

DEFAULT_BLOCK_SIZE = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockTables:
    """Each slot's blocks in order: host ``[num_slots + 1, max_blocks]`` int32 (row
    ``num_slots`` = the scratch slot, all zeros; unassigned entries are zero too, so a write
    past a slot's blocks lands in the scratch block) and the device copy the kernels read."""

    def __init__(self, pool: BlockPool, num_slots: int, max_blocks: int, block_size: int,
                 device: torch.device | str = "cpu") -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {block_size!r}")
        self.pool = pool
        self.num_slots = num_slots
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.scratch_slot = num_slots
        self.device = torch.device(device)
        self.table_np = np.zeros((num_slots + 1, max_blocks), dtype=np.int32)
        self.num_blocks_np = np.zeros(num_slots + 1, dtype=np.int64)  # blocks held per slot
        # the slot's leading blocks that are published (or were found published)
        self.num_published_np = np.zeros(num_slots + 1, dtype=np.int64)
        self.num_complete_np = np.zeros(num_slots + 1, dtype=np.int64)  # of which complete
        if self.device.type == "cpu":  # the kernels read the host table itself
            self.table = torch.from_numpy(self.table_np)
        else:
            self.table = torch.zeros((num_slots + 1, max_blocks), dtype=torch.int32,
                                     device=self.device)
        self._dirty: dict[int, tuple[int, int]] = {}  # slot -> changed entries [lo, hi)
        # every cache whose pools these tables index (weak: a cache refers to its tables)
        self._caches: list[weakref.ref[KVCache]] = []

    @property
    def caches(self) -> list[KVCache]:
        return [cache for cache in (ref() for ref in self._caches) if cache is not None]

    def add_cache(self, cache: KVCache) -> None:
        self._caches.append(weakref.ref(cache))

    def resize_pool(self, num_blocks: int) -> None:
        """A new pool of ``num_blocks`` blocks for every cache on these tables (start-up, while
        no slot holds a block: the memory plan, after a profile run on a small pool)."""
        if self.pool.num_free != self.pool.num_usable:
            raise ValueError("cannot resize a KV pool whose blocks are in use")
        self.pool = BlockPool(num_blocks)
        for cache in self.caches:
            cache.allocate()

    def blocks_needed(self, slot: int, num_tokens: int) -> int:
        """Blocks the slot lacks to hold positions ``[0, num_tokens)``."""
        return max(0, cdiv(num_tokens, self.block_size) - int(self.num_blocks_np[slot]))

    def reserve(self, slot: int, num_tokens: int) -> bool:
        """Give ``slot`` blocks for positions ``[0, num_tokens)``; False (and nothing taken)
        when the pool has too few free blocks."""
        need = self.blocks_needed(slot, num_tokens)
        if need == 0:
            return True
        have = int(self.num_blocks_np[slot])
        if have + need > self.max_blocks:
            raise ValueError(f"slot {slot}: {num_tokens} positions exceed the block table's "
                             f"{self.max_blocks} blocks of {self.block_size}")
        if need > self.pool.num_free:
            return False
        self.table_np[slot, have:have + need] = self.pool.allocate(need)
        self.num_blocks_np[slot] = have + need
        self._mark(slot, have, have + need)
        return True

    def assign(self, slot: int, blocks: list[int]) -> None:
        """Give an empty slot the published ``blocks`` as its first blocks (a prefix-cache hit:
        one more holder of each)."""
        if self.num_blocks_np[slot]:
            raise ValueError(f"slot {slot} already holds blocks")
        if len(blocks) > self.max_blocks:
            raise ValueError(f"slot {slot}: {len(blocks)} blocks exceed the block table's "
                             f"{self.max_blocks}")
        if not blocks:
            return
        self.pool.touch(blocks)
        self.table_np[slot, :len(blocks)] = blocks
        self.num_blocks_np[slot] = len(blocks)
        self.num_published_np[slot] = len(blocks)
        complete = self.pool.complete[blocks]
        self.num_complete_np[slot] = len(blocks) if complete.all() else int(complete.argmin())
        self._mark(slot, 0, len(blocks))

    def _mark(self, slot: int, lo: int, hi: int) -> None:
        old = self._dirty.get(slot)
        self._dirty[slot] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))

    def reserve_many(self, slots: np.ndarray, ends: np.ndarray) -> bool:
        """``reserve(slots[i], ends[i])`` for every i, all or nothing: False (nothing taken)
        when the pool lacks blocks for all of them. One numpy pass; only the slots that cross
        into a new block (one step in ``block_size``) take the per-slot path."""
        need = -(-ends // self.block_size) - self.num_blocks_np[slots]
        grow = np.flatnonzero(need > 0)
        if grow.size == 0:
            return True
        if int(need[grow].sum()) > self.pool.num_free:
            return False
        for i in grow.tolist():
            self.reserve(int(slots[i]), int(ends[i]))
        return True

    def release(self, slot: int) -> None:
        """Return every block of ``slot`` to the pool."""
        have = int(self.num_blocks_np[slot])
        self.num_published_np[slot] = self.num_complete_np[slot] = 0
        if have:
            self.pool.free(self.table_np[slot, have - 1::-1].tolist())
            self.table_np[slot, :have] = SCRATCH_BLOCK
            self.num_blocks_np[slot] = 0
            self._mark(slot, 0, have)

    def blocks(self, slot: int) -> list[int]:
        return self.table_np[slot, : int(self.num_blocks_np[slot])].tolist()

    def sync(self) -> None:
        """Copy the entries changed since the last sync to the device table, in one indexed
        write through pinned memory (it does not wait for the device; no-op on CPU)."""
        if not self._dirty:
            return
        if self.device.type != "cpu":
            rows = np.concatenate([np.full(hi - lo, s) for s, (lo, hi) in self._dirty.items()])
            cols = np.concatenate([np.arange(lo, hi) for lo, hi in self._dirty.values()])
            self.table[to_device(rows, self.device), to_device(cols, self.device)] = to_device(
                self.table_np[rows, cols], self.device)
        self._dirty.clear()

    def slot_mapping(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot of each (request slot, position) pair (host, int64)."""
        blocks = self.table_np[slots, positions // self.block_size].astype(np.int64)
        return blocks * self.block_size + positions % self.block_size


def full_pool_blocks(num_slots: int, max_blocks: int) -> int:
    """A pool where every slot can hold ``max_blocks`` blocks at once (+ the scratch block)."""
    return max(2, num_slots * max_blocks + 1)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled pool. On the CPU through numpy's ``zeros`` (calloc): the OS hands out a
    large allocation's pages zeroed as they are first written, so a pool costs time and resident
    memory as it fills rather than at start (``torch.zeros`` writes every byte: ~0.7 s and
    1 GiB resident for the default CPU pool before the first token)."""
    if device.type != "cpu" or 0 in shape:
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


class KVCache:
    """K and V pools ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` over
    ``block_tables``, and the committed length of each slot.

    ``block_tables`` None: the cache makes and owns tables over a pool of ``num_blocks`` blocks
    (default: every slot at full length, as a runner used on its own needs). Given: the cache
    shares another cache's tables and pool (``owns_blocks`` False: freeing a slot only resets
    its length here). ``extra_rows`` positions past ``max_model_len`` take the padding tokens
    of a fixed-shape (CUDA-graph) step; ``scratch_slot`` (= ``num_slots``) the padding rows.
    Zero-initialised, so never-written rows are finite.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_layers: int | None = None,
        extra_rows: int = 0,
        block_tables: BlockTables | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
    ) -> None:
        self.num_layers = config.num_hidden_layers if num_layers is None else num_layers
        self._init_pages(config, self.num_layers, num_slots, max_model_len, dtype, device,
                         extra_rows, block_tables, block_size, num_blocks)

    def _init_pages(self, config: ModelConfig, num_attention_layers: int, num_slots: int,
                    max_model_len: int, dtype: torch.dtype, device, extra_rows: int,
                    block_tables: BlockTables | None, block_size: int,
                    num_blocks: int | None) -> None:
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.extra_rows = extra_rows
        self.scratch_slot = num_slots if extra_rows else None
        if block_tables is None:
            max_blocks = cdiv(max_model_len + extra_rows, block_size)
            if num_blocks is None:
                num_blocks = full_pool_blocks(num_slots, max_blocks)
            block_tables = BlockTables(BlockPool(num_blocks), num_slots, max_blocks, block_size,
                                       device)
            self.owns_blocks = True
        else:
            if block_tables.num_slots != num_slots:
                raise ValueError(f"shared block tables have {block_tables.num_slots} slots, "
                                 f"this cache {num_slots}")
            self.owns_blocks = False
        self.block_tables = block_tables
        self.block_size = block_tables.block_size
        self._block_shape = (self.block_size, config.num_key_value_heads, config.head_dim)
        self.num_attention_layers = num_attention_layers
        self.dtype, self.device = dtype, torch.device(device)
        self.lengths_np = np.zeros(num_slots, dtype=np.int64)  # committed length per slot (host)
        block_tables.add_cache(self)
        self.allocate()

    def allocate(self) -> None:
        """(Re)allocate the pools for the tables' pool size, zero-filled."""
        self.k = self.v = None  # the old pools go before the new ones come
        shape = (self.num_attention_layers, self.block_tables.pool.num_blocks) + self._block_shape
        self.k = _zeros(shape, self.dtype, self.device)
        self.v = _zeros(shape, self.dtype, self.device)
        self._build_layers()

    def _build_layers(self) -> None:
        self.k_layers = list(self.k.unbind(0))  # per-layer views, indexed once here
        self.v_layers = list(self.v.unbind(0))

    @property
    def block_nbytes(self) -> int:
        """K and V bytes of one block in this cache."""
        return 2 * self.num_attention_layers * int(np.prod(self._block_shape)) * (
            torch.empty((), dtype=self.dtype).element_size())

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def pool(self) -> BlockPool:
        return self.block_tables.pool

    def length(self, slot: int) -> int:
        return int(self.lengths_np[slot])

    def set_lengths(self, slots, lengths) -> None:
        """Set the committed length of each slot (a proposer whose captured step wrote its
        rows; the positions must lie in the slots' reserved blocks)."""
        self.lengths_np[slots] = lengths

    def prepare_write(self, slots, ends) -> None:
        """Before a captured step writes positions below ``ends()[i]`` of ``slots[i]`` (a
        callable: computed only where needed): a cache that owns its blocks reserves them (a
        shared cache's are the engine's to reserve, up to ``max_model_len``; a write past them
        lands in the scratch block); then the device tables are brought up to date."""
        if self.owns_blocks:
            capacity = self.block_tables.max_blocks * self.block_size
            for slot, end in zip(np.asarray(slots).tolist(), np.asarray(ends()).tolist()):
                if not self.block_tables.reserve(slot, min(int(end), capacity)):
                    raise ValueError(f"slot {slot}: no free KV block for positions up to {end}")
        self.block_tables.sync()

    def check_append_many(self, slots, num_tokens: np.ndarray) -> None:
        """``check_append`` for every slot at once (the per-step path)."""
        slots = np.asarray(slots, dtype=np.int64)
        ends = self.lengths_np[slots] + num_tokens
        if (ends > self.max_model_len).any() or not self.block_tables.reserve_many(slots, ends):
            for slot, n in zip(slots.tolist(), np.asarray(num_tokens).tolist()):
                self.check_append(slot, int(n))  # the error naming the slot

    def check_append(self, slot: int, num_tokens: int) -> None:
        """Make sure ``num_tokens`` positions can be appended to ``slot``: within
        ``max_model_len`` and in blocks the slot holds (reserved here when the pool has them)."""
        end = self.lengths_np[slot] + num_tokens
        if end > self.max_model_len:
            raise ValueError(
                f"slot {slot} holds {self.lengths_np[slot]} tokens; appending {num_tokens} "
                f"exceeds max_model_len={self.max_model_len}"
            )
        if not self.block_tables.reserve(slot, int(end)):
            raise ValueError(
                f"slot {slot}: no free KV block for positions up to {int(end)} "
                f"({self.pool.num_free} of {self.pool.num_usable} blocks free); the engine "
                "reserves blocks before a step")

    def advance(self, slots: list[int], num_tokens: list[int]) -> None:
        """Mark ``num_tokens[i]`` rows appended to ``slots[i]`` (the forward wrote them)."""
        for slot, n in zip(slots, num_tokens):
            self.lengths_np[slot] += n

    @torch.inference_mode()
    def copy_positions(self, slots, src_positions, dst_positions) -> None:
        """Copy the K/V of position ``src_positions[i]`` to ``dst_positions[i]`` of slot
        ``slots[i]`` in every layer (host int arrays of one length; each destination in blocks
        the slot holds). Every source is read before any destination is written. A token tree's
        accepted path moves to consecutive positions this way (docs/design.md §16)."""
        slots = np.asarray(slots, dtype=np.int64)
        tables = self.block_tables
        src = to_device(tables.slot_mapping(slots, np.asarray(src_positions, np.int64)),
                        self.device)
        dst = to_device(tables.slot_mapping(slots, np.asarray(dst_positions, np.int64)),
                        self.device)
        for pool in (self.k, self.v):  # [layers, num_blocks, block_size, kv_heads, head_dim]
            rows = pool.flatten(1, 2)  # a view: [layers, num_blocks * block_size, ...]
            rows.index_copy_(1, dst, rows.index_select(1, src))

    def truncate(self, slot: int, length: int) -> None:
        """Roll slot back to ``length`` committed tokens (0 <= length <= current length)."""
        if not 0 <= length <= self.lengths_np[slot]:
            raise ValueError(
                f"cannot truncate slot {slot} to {length}: it holds {self.lengths_np[slot]} tokens"
            )
        self.lengths_np[slot] = length

    def free(self, slot: int) -> None:
        """The slot's request left: length 0, and its blocks back to the pool (owner only)."""
        self.lengths_np[slot] = 0
        if self.owns_blocks:
            self.block_tables.release(slot)

"""The paged KV cache's host side: the block pool (free list, reference counts), the block tables
and the memory plan's parsing and checks.

Strategy: direct checks of each rule (allocation order, exhaustion answered without taking
anything, double free, sharing by reference counts, the scratch block never handed out), then
thousands of random requests of random lengths growing, shrinking and leaving in random order
against a plain model of who holds what: no block is ever held twice, and at the end every block
is back in the free list.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from verispec.runtime import memory
from verispec.runtime.block_pool import SCRATCH_BLOCK, BlockPool
from verispec.runtime.kv_cache import BlockTables


def test_pool_allocates_frees_and_counts_references():
    pool = BlockPool(6)
    assert pool.num_usable == 5 and pool.num_free == 5 and pool.usage == 0.0
    a = pool.allocate(3)
    assert SCRATCH_BLOCK not in a and len(set(a)) == 3 and pool.num_free == 2
    assert pool.usage == pytest.approx(0.6)
    pool.incref(a[:1])  # a second holder of a[0]
    pool.free(a)
    assert pool.num_free == 4 and pool.ref_counts[a[0]] == 1
    pool.free(a[:1])
    assert pool.num_free == 5 and (pool.ref_counts == 0).all()
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[:1])
    with pytest.raises(ValueError, match="cannot allocate 6"):
        pool.allocate(6)
    with pytest.raises(ValueError, match="incref of a free block"):
        pool.incref([a[1]])
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_tables_reserve_release_and_exhaustion():
    tables = BlockTables(BlockPool(1 + 5), num_slots=2, max_blocks=4, block_size=4)
    assert tables.reserve(0, 9)  # positions 0..8: 3 blocks
    assert tables.blocks_needed(0, 12) == 0 and tables.blocks_needed(0, 13) == 1
    blocks = tables.blocks(0)
    assert len(blocks) == 3 and tables.table_np[0, 3] == SCRATCH_BLOCK
    # slot mapping: position t at block[t // 4] * 4 + t % 4
    mapped = tables.slot_mapping(np.array([0, 0, 0]), np.array([0, 5, 8]))
    assert mapped.tolist() == [blocks[0] * 4, blocks[1] * 4 + 1, blocks[2] * 4]
    assert not tables.reserve(1, 13)  # needs 4, 2 free: nothing taken
    assert tables.pool.num_free == 2 and tables.blocks(1) == []
    assert tables.reserve(1, 8)
    assert tables.pool.num_free == 0
    tables.release(0)
    assert tables.pool.num_free == 3 and (tables.table_np[0] == SCRATCH_BLOCK).all()
    with pytest.raises(ValueError, match="exceed the block table"):
        tables.reserve(1, 17)
    assert (tables.table_np[tables.scratch_slot] == SCRATCH_BLOCK).all()
    with pytest.raises(ValueError, match="power of two"):
        BlockTables(BlockPool(4), 1, 2, block_size=12)


def test_no_block_leaks_after_thousands_of_random_requests():
    """Random requests reserve, grow, roll back (their blocks stay) and leave; sometimes a
    reservation fails on a full pool. Blocks are never held by two slots, the pool's count of
    free blocks always matches, and at the end every block is free again."""
    rng = random.Random(0)
    num_slots, block_size = 8, 4
    tables = BlockTables(BlockPool(1 + 40), num_slots, max_blocks=16, block_size=block_size)
    lengths = [0] * num_slots
    failures = 0
    for _ in range(5000):
        slot = rng.randrange(num_slots)
        action = rng.random()
        if action < 0.15:
            tables.release(slot)
            lengths[slot] = 0
        else:
            want = min(64, lengths[slot] + rng.randint(1, 9))
            if tables.reserve(slot, want):
                lengths[slot] = want
            else:
                failures += 1
        held = [b for s in range(num_slots) for b in tables.blocks(s)]
        assert len(held) == len(set(held)) and SCRATCH_BLOCK not in held
        assert tables.pool.num_free == tables.pool.num_usable - len(held)
        for s in range(num_slots):
            assert len(tables.blocks(s)) == -(-lengths[s] // block_size)
    assert failures > 0  # the pool did run out
    for s in range(num_slots):
        tables.release(s)
    assert tables.pool.num_free == tables.pool.num_usable
    assert (tables.pool.ref_counts == 0).all() and (tables.table_np == 0).all()


def test_parse_bytes_and_utilization():
    assert memory.parse_bytes("4GiB") == 4 << 30
    assert memory.parse_bytes("512 MiB") == 512 << 20
    assert memory.parse_bytes("2e9") == 2 * 10**9
    assert memory.parse_bytes(1024) == 1024
    for bad in ("lots", "4 parsecs", -1, 0, True, "0"):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            memory.parse_bytes(bad)
    assert memory.check_utilization(0.5) == 0.5
    for bad in (0, 1.5, -0.1, "0.9", True):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            memory.check_utilization(bad)


def test_plan_refuses_a_pool_smaller_than_one_request():
    memory.check_plan(1 + 8, 16, 128, "test")  # exactly one request of 128
    with pytest.raises(ValueError, match=r"max_model_len=129 needs 9 KV blocks.*at most 128"):
        memory.check_plan(1 + 8, 16, 129, "kv_cache_memory=4096")

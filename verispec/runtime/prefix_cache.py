"""Prefix caching (docs/design.md §13): a request whose first tokens another request already
computed reuses that request's KV blocks instead of computing them again.

- **Keys.** Block ``i`` of a request (its tokens ``[i B, (i + 1) B)``, ``B`` = block size) is
  keyed by ``blake2b(key of block i - 1 + those tokens)``: a key names the block's tokens and
  every token before them, so equal keys mean equal KV in every layer of every cache on the
  tables (the target's, a draft model's, an EAGLE head's). Nothing else changes a block's KV
  today. A 128-bit digest, not Python's ``hash``: a collision would silently hand one request
  another's KV.
- **Publishing.** After a step, a request's full blocks below the target cache's committed
  length are published (``publish``): their tokens are final, and no row in them was written by
  a draft that verification later rejected (drafts write past the committed length; a block
  that holds one is not full of committed positions, so it waits). A published block is marked
  *complete* once every cache on the tables holds it (a draft model's or EAGLE head's cache may
  lag). A finished, aborted or preempted request publishes before it gives its blocks back.
- **Lookup.** An admitted request takes the longest chain of published blocks over its tokens,
  at most up to the token before the last it must compute (a prefill computes at least one
  token: the one whose logits give the next token). With ``shifted`` (an EAGLE head, whose KV
  at position p pairs the target's hidden state at p with the token at p + 1) a block's last
  row also depends on the token after the block, which its key does not name: a shared system
  prompt's last block is published by one conversation and found by others whose next token
  differs. Each complete block therefore records the token after it in the request that
  completed it, and a shifted hit takes, block by block, the published block or another
  complete copy of it (``BlockPool.lookup_shifted``: a request that computed the same key again
  before another next token) whose recorded token is the request's, and stops where there is
  none (vLLM instead drops the hit's last block, which misses blocks deeper in the chain that
  another request completed).

The target's cache starts the request at the hit's length and a proposer's after the complete
blocks of the hit (a draft model catches up on its own); the prefill computes the rest.
By the invariance rule (docs/architecture.md) the tokens are those of a cold run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from verispec.runtime.kv_cache import BlockTables


def extend_keys(keys: list[bytes], token_ids: np.ndarray, block_size: int,
                num_blocks: int) -> list[bytes]:
    """Extend ``keys`` (a request's block keys so far, kept on the request) to ``num_blocks``
    keys over ``token_ids``; returns ``keys``."""
    parent = keys[-1] if keys else b""
    for i in range(len(keys), num_blocks):
        block = np.ascontiguousarray(token_ids[i * block_size:(i + 1) * block_size],
                                     dtype=np.int64)
        parent = hashlib.blake2b(parent + block.tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Lookups and publishing over ``block_tables`` (the target's: a proposer's caches share
    them), with vLLM's hit counters: prompt tokens queried and found.

    A block is published once the target's cache holds it committed, and *complete* once every
    cache on the tables does (a draft model's or an EAGLE head's lags while the request does
    not draft: the per-request planner turned drafting off). A hit gives the target every
    matched block and a proposer's cache the complete ones: a draft model catches up from its
    tokens, writing its own rows of the blocks after (the same values any other holder of
    them computes: its rows depend on the block's tokens and those before only, and are batch
    invariant). With ``shifted`` (a proposer that needs the target's hidden states, which a hit
    does not compute) the hit itself stops at the complete blocks whose next token matches.
    """

    def __init__(self, block_tables: BlockTables, shifted: bool = False) -> None:
        self.block_tables = block_tables
        self.block_size = block_tables.block_size
        self.shifted = shifted
        self.num_queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries_total)
        self.num_hits = 0  # of which found (vllm:prefix_cache_hits_total)

    def lookup(self, request, num_tokens: int) -> list[int]:
        """The published blocks that hold the request's first tokens, for a prefill of its
        ``num_tokens`` first tokens (at least the last of them is left to compute)."""
        max_blocks = (num_tokens - 1) // self.block_size
        keys = extend_keys(request.block_keys, request.token_ids, self.block_size, max_blocks)
        pool = self.block_tables.pool
        if self.shifted:  # complete, and completed before the request's own next token
            after = request.token_ids[self.block_size:(max_blocks + 1) * self.block_size:
                                      self.block_size]
            return pool.lookup_shifted(keys[:max_blocks], after)
        return pool.lookup(keys[:max_blocks])

    def count(self, num_queried: int, num_found: int) -> None:
        self.num_queries += num_queried
        self.num_hits += num_found

    def publish(self, requests: Sequence) -> None:
        """Publish the full blocks of each request that the target's cache holds committed, and
        mark complete those every cache holds (one numpy pass; only requests that filled a
        block since go further)."""
        if not requests:
            return
        tables = self.block_tables
        slots = np.fromiter((r.slot for r in requests), dtype=np.int64, count=len(requests))
        ends = np.fromiter((r.num_tokens for r in requests), dtype=np.int64,
                           count=len(requests))
        complete = ends.copy()
        for cache in tables.caches:
            np.minimum(complete, cache.lengths_np[slots], out=complete)
            if cache.owns_blocks:
                np.minimum(ends, cache.lengths_np[slots], out=ends)
        held = tables.num_blocks_np[slots]
        full = np.minimum(ends // self.block_size, held)
        full_complete = np.minimum(complete // self.block_size, full)
        grow = (full > tables.num_published_np[slots]) | (
            full_complete > tables.num_complete_np[slots])
        for i in np.flatnonzero(grow).tolist():
            request, slot, n = requests[i], int(slots[i]), int(full[i])
            keys = extend_keys(request.block_keys, request.token_ids, self.block_size, n)
            row = tables.table_np[slot]
            for b in range(int(tables.num_published_np[slot]), n):
                tables.pool.publish(int(row[b]), keys[b])
            tables.num_published_np[slot] = max(n, int(tables.num_published_np[slot]))
            tokens = request.token_ids
            for b in range(int(tables.num_complete_np[slot]), int(full_complete[i])):
                after = (b + 1) * self.block_size  # committed: a cache holds a row paired with it
                tables.pool.mark_complete(int(row[b]),
                                          int(tokens[after]) if after < len(tokens) else -1)
            tables.num_complete_np[slot] = max(int(full_complete[i]),
                                               int(tables.num_complete_np[slot]))

    def start_lengths(self, slot: int, num_tokens: int) -> None:
        """Set every cache's length for a request that took a hit of ``num_tokens`` tokens: the
        target's to all of them, a proposer's to the complete blocks among them."""
        tables = self.block_tables
        complete = int(tables.num_complete_np[slot]) * self.block_size
        for cache in tables.caches:
            cache.set_lengths([slot], [num_tokens if cache.owns_blocks
                                       else min(num_tokens, complete)])

"""Continuous batching over the paged KV cache: requests wait for a slot and for KV blocks, run
together, give their blocks back under memory pressure, and leave when done (docs/design.md §13).

Each step is either a prefill of newly admitted requests or a decode / verify step of all running
ones (prefill first, so freed capacity is refilled at once).

- **Admission** takes waiting requests in order while a slot is free, the step's prefill tokens
  stay within ``max_num_batched_tokens`` (a single longer prompt still runs alone) and the pool
  has the blocks for the request's tokens plus the ``lookahead`` positions of its next step.
- **Reservation**: before a decode / verify step every running request holds blocks for its
  committed tokens plus ``lookahead`` (k + 1 with speculation): the verify rows, and a
  proposer's drafting rows, which share the target's block tables.
- **Preemption** (recompute, as vLLM's default): when a running request cannot get a block, the
  most recently admitted running request gives all its blocks back and returns to the front of
  the queue; it is prefilled again later over its prompt and the tokens it already has. Its
  tokens do not change: every draw is keyed by (seed, position), and prefill, decode and verify
  compute a position's logits the same way (batch invariance). Nothing is lost or failed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from verispec.engine.request import Request
from verispec.runtime.kv_cache import KVCache


class Scheduler:
    def __init__(self, max_num_seqs: int, kv_cache: KVCache | None = None,
                 max_num_batched_tokens: int | None = None, lookahead: int = 1,
                 on_preempt: Callable[[Request], None] | None = None) -> None:
        """``kv_cache``: the target's cache whose blocks are planned (None: slots only, every
        request's blocks are reserved as it appends); ``on_preempt(request)`` frees what the
        engine holds for a request being preempted (its caches, the proposer's state)."""
        self.max_num_seqs = max_num_seqs
        self.kv_cache = kv_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead
        self.on_preempt = on_preempt
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))  # a stack: lowest on top
        self.num_preemptions = 0
        self._admissions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_slots(self) -> int:
        """Request slots no request holds."""
        return len(self._free_slots)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool's blocks in use (0 without a planned cache)."""
        return 0.0 if self.kv_cache is None else self.kv_cache.pool.usage

    def _reserve(self, request: Request, num_tokens: int) -> bool:
        if self.kv_cache is None:
            return True
        end = min(num_tokens + self.lookahead, self.kv_cache.max_model_len)
        return self.kv_cache.block_tables.reserve(request.slot, end)

    def _reserve_all(self) -> bool:
        """Blocks for every running request's next step in one pass (the common case), or
        False with nothing taken when the pool lacks them."""
        if not self.running:
            return True
        cache = self.kv_cache
        slots = np.fromiter((r.slot for r in self.running), dtype=np.int64,
                            count=len(self.running))
        ends = np.fromiter((r.num_tokens for r in self.running), dtype=np.int64,
                           count=len(self.running))
        np.minimum(ends + self.lookahead, cache.max_model_len, out=ends)
        return cache.block_tables.reserve_many(slots, ends)

    def schedule(self) -> tuple[list[Request], bool]:
        """The requests of the next step and whether it is a prefill. A new list: the step
        releases finished requests from ``running`` while it walks the batch."""
        admitted: list[Request] = []
        budget = self.max_num_batched_tokens
        while self.waiting and self._free_slots:
            request = self.waiting[0]
            if admitted and budget is not None and request.num_tokens > budget:
                break
            request.slot = self._free_slots[-1]
            if not self._reserve(request, request.num_tokens):
                request.slot = -1
                break
            self._free_slots.pop()
            self.waiting.popleft()
            self._admissions += 1
            request.admission = self._admissions
            admitted.append(request)
            if budget is not None:
                budget -= request.num_tokens
        if admitted:
            self.running.extend(admitted)
            return admitted, True
        if self.kv_cache is not None and not self._reserve_all():
            # Oldest first: a request that cannot grow preempts the newest ones (maybe itself).
            index = 0
            while index < len(self.running):
                request = self.running[index]
                while not self._reserve(request, request.num_tokens):
                    self.preempt(self.running[-1])
                    if self.running[-1:] == [] or index >= len(self.running):
                        break
                index += 1
        if not self.running and self.waiting:  # everything preempted: prefill again
            return self.schedule()
        return list(self.running), False

    def preempt(self, request: Request) -> None:
        """Give the request's slot and blocks back; it waits at the front of the queue."""
        if self.on_preempt is not None:
            self.on_preempt(request)
        self.running.remove(request)
        self._release_slot(request)
        request.slot = -1
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release_slot(self, request: Request) -> None:
        if self.kv_cache is not None:
            self.kv_cache.free(request.slot)
        self._free_slots.append(request.slot)
        self._free_slots.sort(reverse=True)

    def finish(self, request: Request) -> None:
        """Release the request's slot and blocks (reused by the next step's prefill; the
        request keeps its slot number for the step's remaining bookkeeping)."""
        self.running.remove(request)
        self._release_slot(request)

    def abort(self, request: Request) -> None:
        """Drop an unfinished request, waiting or running (its slot is released)."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.finish(request)

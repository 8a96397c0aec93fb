"""Continuous batching: requests wait for a free KV cache slot, run together, and leave when done.

Each step is either a prefill of the newly admitted requests or a decode of all running ones
(prefill first, so a freed slot is refilled at once). Slots are handed out lowest first and the
running batch is kept in slot order, so a full batch reads the cache as one contiguous slice.
"""

from __future__ import annotations

import heapq
from collections import deque

from verispec.engine.request import Request


class Scheduler:
    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in slot order
        self._free_slots = list(range(max_num_seqs))  # a heap

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_slots(self) -> int:
        """KV cache slots no request holds."""
        return len(self._free_slots)

    def schedule(self) -> tuple[list[Request], bool]:
        """The requests of the next step and whether it is a prefill. A new list: the step
        releases finished requests from ``running`` while it walks the batch."""
        admitted = []
        while self.waiting and self._free_slots:
            request = self.waiting.popleft()
            request.slot = heapq.heappop(self._free_slots)
            admitted.append(request)
        if admitted:
            self.running = sorted(self.running + admitted, key=lambda r: r.slot)
            return admitted, True
        return list(self.running), False

    def finish(self, request: Request) -> None:
        """Release the request's slot (it may be reused by the next step's prefill)."""
        self.running.remove(request)
        heapq.heappush(self._free_slots, request.slot)

    def abort(self, request: Request) -> None:
        """Drop an unfinished request, waiting or running (its slot is released)."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.finish(request)

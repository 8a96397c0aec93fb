"""Pinned host memory that the host's small copies to a CUDA device pass through.

A copy to the GPU that does not wait must come from pinned (page-locked) memory: from pageable
memory the copy first waits for the stream to drain, which would serialise the host's
preparation of a step behind the GPU's work on the step before. ``tensor.pin_memory()`` gives
each copy a pinned block of its own, but that costs ~60 µs a call and the copy another ~70 µs
(a JSON-schema step at batch 64 made 41 of them: ~5 ms of a 34 ms step; H200 host,
docs/benchmarks.md). ``StagingRing`` instead copies the data into a slice of one pinned buffer,
taken in turn around the buffer, and records an event after each copy; a slice is handed out
again only after the copies that read it last time have run (their events), which by then they
almost always have: the ring holds many steps' inputs.

The other way, ``HostDrafts`` brings a step's draft ids to the host through pinned blocks it
keeps for the next copies.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import numpy as np
import torch

ALIGN = 64  # bytes: every slice starts at a multiple (any dtype's alignment)


class StagingRing:
    """A ring of ``capacity`` bytes of host memory for copies to one device.

    ``event`` makes a marker, recorded on the current stream, with ``synchronize()``; tests pass
    stand-ins (the ring's bookkeeping is the same on any device). Slices are handed out in ring
    order; the copies reading them, with their events, are kept oldest first, so those
    overlapping a new slice are at the front of the queue."""

    def __init__(self, buffer: torch.Tensor, event: Callable[[], object]) -> None:
        self.buffer = buffer  # [capacity] uint8, pinned on CUDA
        self.capacity = buffer.numel()
        self._event = event
        self._head = 0  # the next free byte
        self._in_flight: collections.deque[tuple[int, int, object]] = collections.deque()
        self._lock = threading.Lock()

    def fits(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` goes through the ring (large ones take a block of their
        own: a quarter of the ring at most, so one copy never waits for most of it)."""
        return 0 < nbytes <= self.capacity // 4

    def copy(self, tensor: torch.Tensor, send: Callable[[torch.Tensor], torch.Tensor]
             ) -> torch.Tensor:
        """``send(staged)`` of a staged copy of the host ``tensor`` (``fits`` its bytes); an
        event after it marks when its slice is free again."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            start = self._take(nbytes)
            staged = self.buffer[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
            _host_copy(staged, tensor)
            out = send(staged)
            self._in_flight.append((start, start + nbytes, self._event()))
        return out

    def _take(self, nbytes: int) -> int:
        start = -(-self._head // ALIGN) * ALIGN
        if start + nbytes > self.capacity:  # wrap: the tail is given up for this lap
            self._wait(start, self.capacity)
            start = 0
        self._wait(start, start + nbytes)
        self._head = start + nbytes
        return start

    def _wait(self, lo: int, hi: int) -> None:
        """Wait for the copies still reading bytes [lo, hi) (the oldest in flight)."""
        while self._in_flight:
            first, last, event = self._in_flight[0]
            if last <= lo or first >= hi:
                return
            event.synchronize()
            self._in_flight.popleft()


def _host_copy(staged: torch.Tensor, tensor: torch.Tensor) -> None:
    """``staged.copy_(tensor)`` on this thread: torch splits a copy of more than 32 768
    elements across its OpenMP workers, whose wake-ups (and, where torch was imported before
    verispec, spinning: ``verispec.cpu_threads``) then take the host's cores from the grammar
    masks' threads (docs/benchmarks.md); numpy copies on the calling thread."""
    try:
        np.copyto(staged.numpy(), tensor.numpy())
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16)
        staged.copy_(tensor)


CAPACITY = 16 << 20  # bytes of pinned memory per device
_rings: dict[int, StagingRing] = {}


def to_cuda(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host ``tensor`` on CUDA ``device``, copied without waiting for the stream (through the
    device's ring, or a pinned block of its own when large or while a graph is captured)."""
    nbytes = tensor.numel() * tensor.element_size()
    index = device.index if device.index is not None else torch.cuda.current_device()
    ring = _rings.get(index)
    if ring is None:
        ring = _rings[index] = StagingRing(
            torch.empty(CAPACITY, dtype=torch.uint8, pin_memory=True),
            lambda: _recorded_event(torch.device("cuda", index)))
    if not ring.fits(nbytes) or torch.cuda.is_current_stream_capturing():
        return tensor.pin_memory().to(device, non_blocking=True)
    return ring.copy(tensor, lambda staged: staged.to(device, non_blocking=True))


def _recorded_event(device: torch.device) -> torch.cuda.Event:
    """An event after the work queued so far on ``device``'s current stream (the copy's)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class HostDrafts:
    """A step's draft ids on their way to the host: on CUDA a copy into pinned memory that waits
    for the drafting work alone (an event after the copy), not for what the stream runs after
    it (the verify forward). The pinned blocks are kept for the next copies once read (a
    pinned allocation costs ~60 us: a JSON-schema step makes four of these copies)."""

    _free: list[torch.Tensor] = []  # pinned blocks read already
    KEPT = 8

    def __init__(self, draft_token_ids: torch.Tensor) -> None:
        self._device = draft_token_ids
        self._block: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._read: list[int] | None = None
        if draft_token_ids.device.type == "cuda":
            n = draft_token_ids.numel()
            fits = [i for i, b in enumerate(HostDrafts._free)
                    if b.numel() >= n and b.dtype == draft_token_ids.dtype]
            if fits:  # (by position: ``list.remove`` would compare tensors by value)
                self._block = HostDrafts._free.pop(fits[0])
            else:
                self._block = torch.empty(max(n, 256), dtype=draft_token_ids.dtype,
                                          pin_memory=True)
            host = self._block[:n].view(draft_token_ids.shape)
            host.copy_(draft_token_ids, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def tolist(self) -> list[int]:
        if self._read is None:
            if self._copied is None:
                self._read = self._device.tolist()
            else:
                self._copied.synchronize()
                n = self._device.numel()
                self._read = self._block[:n].view(self._device.shape).tolist()
                if len(HostDrafts._free) < HostDrafts.KEPT:
                    HostDrafts._free.append(self._block)
                self._block = None
        return self._read

"""CUDA graphs for fixed-shape steps (docs/design.md §7): capture once per batch-size bucket, replay
with the inputs copied into static buffers.

A *step* is a function of a few per-request input rows (token ids, slots, positions, ...) that
only launches device work (no host sync, no allocation that outlives it but its outputs). For
every bucket in ``batch_buckets(max_batch_size)`` (largest first, all into one memory pool that
later captures share) the runner gives the step static inputs ``[bucket, width]`` (the first
rows of one buffer per input, sized for the largest bucket), runs the step once to warm up
(Triton compiles, cuBLAS allocates its workspace), and captures it. A batch of B rows replays
the smallest bucket >= B: its rows are copied into the static inputs (one copy per input), the
rows past B hold the step's padding values (the scratch slot, token 0), and their outputs are
to be ignored. Whatever the step writes must exist at capture time and be read after the replay
(outputs returned by the step, or buffers it writes in place); a tensor allocated or swapped
after capture is never written by a replay.

Without CUDA (tests, CPU) the same runner runs the step eagerly on the same static buffers
(``capture=False``), so the bucket choice, the padding and the row selection are tested on the
CPU.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger("verispec")

# Steps of more requests than this run eagerly (vLLM captures up to 512 by default; our
# max_num_seqs is the bound in practice).
MAX_CAPTURE_BATCH_SIZE = 512


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every capture on ``device`` records on, and its warm-up runs on. What a step
    keeps between calls (the samplers' launch plans and scratch, keyed by stream) is then made by
    the warm-up, outside any capture: made during a capture it would come from the graphs'
    shared memory pool, where blocks another graph uses for its temporaries can overlap it."""
    return torch.cuda.Stream(device)


def batch_buckets(max_batch_size: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then multiples of 8, up to and including
    ``max_batch_size`` (capped at ``MAX_CAPTURE_BATCH_SIZE``); ascending."""
    top = min(max_batch_size, MAX_CAPTURE_BATCH_SIZE)
    buckets = [b for b in (1, 2, 4) if b < top] + list(range(8, top, 8))
    return buckets + [top]


def bucket_for(batch_size: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``batch_size`` rows (None: larger than every bucket)."""
    for bucket in buckets:
        if bucket >= batch_size:
            return bucket
    return None


@dataclass(frozen=True)
class StepInput:
    """One static input of a step: ``[bucket, width]`` of ``dtype``, padding rows = ``pad``."""

    width: int
    dtype: torch.dtype
    pad: float | int = 0


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (no CUDA)
    inputs: dict[str, torch.Tensor]  # name -> [bucket, width] static
    outputs: object  # what the step returned at capture (static tensors)
    # host copies of the inputs, pinned on CUDA (their copy to the device does not wait for the
    # stream to drain), and the event after the last copy out of them (shared by the buckets of
    # a step, as the buffers are)
    staging: dict[str, torch.Tensor] | None = None
    copied: torch.cuda.Event | None = None


class CUDAGraphRunner:
    """Captured steps by name, one graph per bucket; see the module docstring.

    Parameters
    ----------
    device : the step's device; graphs are captured on CUDA only
    max_batch_size : largest bucket (``max_num_seqs``)
    pool : a memory pool to share (``torch.cuda.graph_pool_handle()``); None makes one
    capture : False runs every step eagerly on the static buffers (the CPU, ``enforce_eager``)
    """

    def __init__(self, device: torch.device, max_batch_size: int, pool=None,
                 capture: bool = True) -> None:
        self.device = torch.device(device)
        self.buckets = batch_buckets(max_batch_size)
        self.capture_graphs = capture and self.device.type == "cuda"
        self.pool = pool
        if self.capture_graphs and pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self._steps: dict[str, dict[int, _Captured]] = {}
        self._specs: dict[str, dict[str, StepInput]] = {}
        self._step_fns: dict[str, Callable[[dict[str, torch.Tensor]], object]] = {}
        self._buckets: dict[str, list[int]] = {}  # each step's buckets
        self.capture_time_s = 0.0
        self.memory_bytes = 0  # device memory the captures took (pool and static buffers)

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def has(self, name: str) -> bool:
        return name in self._steps

    @torch.inference_mode()
    def add(self, name: str, inputs: Mapping[str, StepInput],
            step: Callable[[dict[str, torch.Tensor]], object],
            max_batch_size: int | None = None) -> None:
        """Allocate the static inputs of ``step`` for every bucket (up to the one that holds
        ``max_batch_size`` rows, when given), warm it up and capture it (largest bucket
        first); ``step(inputs)`` gets ``{name: [bucket, width] tensor}``."""
        if name in self._steps:
            raise ValueError(f"step {name!r} is already captured")
        start = time.perf_counter()
        before = self._memory()
        captured = {}
        buckets = self.buckets
        if max_batch_size is not None and max_batch_size < self.max_batch_size:
            top_bucket = bucket_for(max_batch_size, self.buckets)
            buckets = [b for b in self.buckets if b <= top_bucket]
        # One static buffer and one host staging buffer per input, of the largest bucket; a
        # bucket's graph reads their first ``bucket`` rows (replays are ordered on the stream).
        top = buckets[-1]
        static_all = {key: torch.full((top, spec.width), spec.pad, dtype=spec.dtype,
                                      device=self.device) for key, spec in inputs.items()}
        staging_all = {key: torch.empty(t.shape, dtype=t.dtype, pin_memory=self.capture_graphs)
                       for key, t in static_all.items()}
        copied = torch.cuda.Event() if self.capture_graphs else None
        for bucket in reversed(buckets):
            static = {key: t[:bucket] for key, t in static_all.items()}
            staging = {key: t[:bucket] for key, t in staging_all.items()}
            if not self.capture_graphs:
                captured[bucket] = _Captured(None, static, None, staging)
                continue
            stream = capture_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                step(static)  # warm-up: compiles kernels, makes launch plans and workspaces
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # No garbage collection inside a capture: freeing an unreachable object that holds
            # a CUDA graph (another engine dropped earlier) resets that graph, which a capture
            # in progress does not permit (the capture fails).
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    outputs = step(static)
            finally:
                if gc_was_enabled:
                    gc.enable()
            captured[bucket] = _Captured(graph, static, outputs, staging, copied)
        if self.capture_graphs:
            torch.cuda.synchronize(self.device)
        self._steps[name] = captured
        self._buckets[name] = buckets
        self._specs[name] = dict(inputs)
        self.capture_time_s += time.perf_counter() - start
        self.memory_bytes += self._memory() - before
        self._step_fns[name] = step

    def _memory(self) -> int:
        if not self.capture_graphs:
            return 0
        return torch.cuda.memory_reserved(self.device)

    def takes(self, name: str, key: str) -> bool:
        """Whether step ``name`` has the input ``key``."""
        return key in self._specs.get(name, ())

    def fits(self, name: str, batch_size: int) -> bool:
        return name in self._steps and 0 < batch_size <= self._buckets[name][-1]

    @torch.inference_mode()
    def run(self, name: str, rows: Mapping[str, np.ndarray | torch.Tensor]) -> tuple[object, int]:
        """Replay step ``name`` for ``B`` rows: ``rows[key]`` is ``[B, width]`` (host arrays,
        or device tensors copied on the device). Returns (the step's outputs, bucket): output
        rows past B belong to padding."""
        batch_size = len(next(iter(rows.values())))
        bucket = bucket_for(batch_size, self._buckets[name])
        captured = self._steps[name][bucket]
        specs = self._specs[name]
        if captured.copied is not None:
            captured.copied.synchronize()  # the last copy out of the staging buffers is done
        for key, static in captured.inputs.items():
            value = rows[key]
            if isinstance(value, np.ndarray):
                host = captured.staging[key]
                host_np = host.numpy()
                host_np[:batch_size] = value.reshape(batch_size, -1)
                host_np[batch_size:] = specs[key].pad
                static.copy_(host, non_blocking=True)
            else:
                static[:batch_size].copy_(value.view(batch_size, -1))
                if batch_size < bucket:
                    static[batch_size:].fill_(specs[key].pad)
        if captured.graph is None:
            return self._step_fns[name](captured.inputs), bucket
        captured.copied.record()
        captured.graph.replay()
        return captured.outputs, bucket

    def time_step(self, name: str, batch_size: int = 1, repeats: int = 20) -> float:
        """Median seconds of one replay of ``name`` at ``batch_size`` on its current inputs (the
        padding rows of a fresh capture): the device cost of the step, for the cost model."""
        captured = self._steps[name][bucket_for(batch_size, self._buckets[name])]
        if captured.graph is None:
            raise ValueError("time_step needs captured CUDA graphs")
        times = []
        for _ in range(repeats):
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            captured.graph.replay()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        return float(np.median(times))

    def log_summary(self, what: str) -> None:
        if self.capture_graphs and self._steps:
            logger.info("%s: CUDA graphs for %s, batch sizes %s, captured in %.1f s, %.0f MiB",
                        what, ", ".join(self._steps), self.buckets, self.capture_time_s,
                        self.memory_bytes / 2**20)

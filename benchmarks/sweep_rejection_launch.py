"""The statistics launch of the Triton rejection op over its shapes: chunks per program (GROUP),
warps and chunk size, against the rule ``triton_ops`` uses (V = 128 256, k = 4; times as
``bench_rejection.py``: single calls, L2 flushed, inputs rotated).

    python benchmarks/sweep_rejection_launch.py --batch-sizes 1 32 64 128 256
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_rejection import call, copy_bandwidth, make_inputs, print_json, time_gpu  # noqa: E402

from verispec.ops import triton_ops  # noqa: E402

SHAPES = list(itertools.product((1, 2), (2, 4, 8), (2048, 4096)))  # (group, warps, chunk)


class _Launch(triton_ops._Launch):
    """The plan's launch, with the statistics launch's warps replaced (``warps``)."""

    warps: int | None = None

    def __init__(self, kernel, grid, num_warps, constexprs, **static):
        if kernel is triton_ops._rows_kernel and self.warps is not None:
            num_warps = self.warps
        super().__init__(kernel, grid, num_warps, constexprs, **static)


def timed(B: int, with_probs: bool, sets, flush, shape) -> float:
    """Median µs of the op with the launch ``shape`` (None: the current rule)."""
    rule = triton_ops._Launch, triton_ops._GROUP_BATCH, triton_ops._MAX_CHUNK
    triton_ops._PLANS.clear()
    if shape is not None:
        group, _Launch.warps, triton_ops._MAX_CHUNK = shape
        triton_ops._Launch = _Launch
        triton_ops._GROUP_BATCH = 0 if group == 2 else 1 << 30  # GROUP 2 from this batch size
    try:
        return time_gpu(lambda s: call(triton_ops.rejection_sample, s, with_probs), sets,
                        flush, 0.15, max_reps=60)
    finally:
        triton_ops._Launch, triton_ops._GROUP_BATCH, triton_ops._MAX_CHUNK = rule
        triton_ops._PLANS.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 64, 128, 256])
    parser.add_argument("--vocab-size", type=int, default=128256)
    args = parser.parse_args()
    device = torch.device("cuda")
    flush = torch.ones(int(1e9) // 4, device=device)
    results = []
    print(f"{'B':>4} {'rule':8} {'current µs':>10} {'fastest µs':>10}  fastest (group, warps, "
          "chunk)")
    for B in args.batch_sizes:
        set_bytes = B * 5 * args.vocab_size * 4 * 2
        sets = [make_inputs(B, args.vocab_size, device, s)
                for s in range(max(4, min(16, 2 ** 28 // set_bytes)))]
        for with_probs in (False, True):
            current = timed(B, with_probs, sets, flush, None)
            times = {shape: timed(B, with_probs, sets, flush, shape) for shape in SHAPES}
            best = min(times, key=times.get)
            rule = "full" if with_probs else "one-hot"
            print(f"{B:>4} {rule:8} {current:>10.1f} {times[best]:>10.1f}  {best}")
            results.append(dict(batch_size=B, rule=rule, current_us=round(current, 1),
                                fastest_us=round(times[best], 1), fastest=best,
                                all={str(k): round(v, 1) for k, v in times.items()}))
    print_json("sweep_rejection_launch", torch.cuda.get_device_name(device),
               copy_bandwidth(device), results)


if __name__ == "__main__":
    main()

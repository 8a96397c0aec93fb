"""Per-kernel GPU times (torch.profiler) and host cost of the Triton rejection op, beside a plain
read of the same logits (what the statistics launch should approach) and the host cost of one
launch of a tiny Triton kernel through Triton's own launcher.

    python benchmarks/profile_rejection.py
"""
from __future__ import annotations

import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from bench_rejection import call, make_inputs  # noqa: E402

from verispec.ops import triton_ops  # noqa: E402


@triton.jit
def _tiny(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


@triton.jit
def _read(x_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    i = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * V + i, mask=i < V, other=0.0)
    tl.store(out_ptr + row * tl.num_programs(1) + c, tl.sum(x, 0))


def host_us(fn, n=500):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    dev = torch.device("cuda")
    x = torch.zeros(16, device=dev)
    print(f"host us per launch, tiny kernel: {host_us(lambda: _tiny[(1,)](x, 16, BLOCK=16)):.1f}")
    for B in (1, 8, 32, 256):
        s = make_inputs(B, 151936, dev, 0)
        for q in (True, False):
            print(f"B={B} draft_probs={q} host us per op call: "
                  f"{host_us(lambda s=s, q=q: call(triton_ops.rejection_sample, s, q)):.1f}")
        out = torch.empty(B * 5, 38, device=dev)

        def read(s=s, out=out, B=B):
            return _read[(B * 5, 38)](s["target_logits"], out, 151936, BLOCK=4096, num_warps=8)

        for _ in range(3):
            read()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            read()
        end.record()
        end.synchronize()
        print(f"B={B} plain read kernel of the logits: {start.elapsed_time(end) / 20 * 1e3:.1f} us")
        for q in (True, False):
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    call(triton_ops.rejection_sample, s, q)
                torch.cuda.synchronize()
            print(f"--- B={B} draft_probs={q}")
            total = 0.0
            for e in prof.key_averages():
                if e.device_time_total > 0:
                    total += e.device_time_total / 10
                    print(f"  {e.key[:40]:<40} {e.device_time_total / e.count:9.1f} us x "
                          f"{e.count}")
            print(f"  {'sum of kernel times per call':<40} {total:9.1f} us")


if __name__ == "__main__":
    main()

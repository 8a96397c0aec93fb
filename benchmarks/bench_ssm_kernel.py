"""The Mamba2 multi-token state update on the GPU (``verispec.ops.triton_ssm``): one layer's
decode step (1 token per request) against a verify step (k + 1 = 4), in the shape of
granite-4.0-h-350m (48 heads of 32 x state 128, float32 states in a per-slot ring).

For G requests and S tokens each the kernel must read each request's state once and write a
state per token (the verify step keeps the state after every position for the rollback), so
its memory floor is ``G * heads * head_dim * d_state * 4 * (1 + S)`` bytes over the copy
bandwidth measured in the same run. Times are medians of CUDA-graph replays of 20 calls
(``profile_gpu_step.graph_time``) over as many layers' rings as keep L2 from holding them.

Prints a table, then one JSON line.

    python benchmarks/bench_ssm_kernel.py
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_rejection import copy_bandwidth
from profile_gpu_step import graph_time

from verispec.ops.triton_ssm import ssm_state_update

HEADS, HEAD_DIM, D_STATE = 48, 32, 128
RING = 6  # k + 2 lengths per slot at k = 4


def step_inputs(G: int, S: int, layers: int, device) -> list[tuple]:
    """One call's arguments per layer: rings of G slots with a committed length of 40."""
    calls = []
    for _ in range(layers):
        ring = torch.randn(G, RING, HEADS, HEAD_DIM, D_STATE, device=device) * 0.1
        slots = torch.arange(G, device=device)
        starts = torch.full((G,), 40, dtype=torch.int64, device=device)
        counts = torch.full((G,), S, dtype=torch.int64, device=device)
        x = torch.randn(S, G, HEADS, HEAD_DIM, device=device)
        dtb = torch.randn(S, G, HEADS, D_STATE, device=device) * 0.1
        decay = torch.rand(S, G, HEADS, device=device)
        c = torch.randn(S, G, HEADS, D_STATE, device=device)
        calls.append((ring, slots, starts, counts, x, dtb, decay, c))
    return calls


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    state_bytes = HEADS * HEAD_DIM * D_STATE * 4
    rows = []
    for G in args.batch_sizes:
        times = {}
        for S in (1, 4):
            layers = max(2, -(-200 * 2**20 // (G * RING * state_bytes)))  # > L2 in all
            calls = step_inputs(G, S, layers, device)
            order = iter(range(1 << 62))  # each captured call takes the next layer's ring
            us = 1e6 * graph_time(lambda calls=calls, order=order, layers=layers:
                                  ssm_state_update(*calls[next(order) % layers]), 20)
            floor_us = G * state_bytes * (1 + S) / bandwidth * 1e6
            times[S] = us
            rows.append(dict(G=G, tokens=S, us=us, floor_us=floor_us, x_floor=us / floor_us,
                             x_decode=us / times[1]))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"state {HEADS} x {HEAD_DIM} x {D_STATE} float32 per layer and request")
    print(f"{'G':>4} {'tokens':>6} {'us':>8} {'floor us':>9} {'x floor':>8} {'x decode':>9}")
    for r in rows:
        print(f"{r['G']:>4} {r['tokens']:>6} {r['us']:>8.1f} {r['floor_us']:>9.1f} "
              f"{r['x_floor']:>8.2f} {r['x_decode']:>9.2f}")
    result = dict(benchmark="bench_ssm_kernel", device=torch.cuda.get_device_name(),
                  copy_bandwidth_tb_s=bandwidth / 1e12, rows=rows)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

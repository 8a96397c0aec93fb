"""The batch-invariant matmul's tiles at many rows (prefill and chunked steps) against cuBLAS:
the Llama-3.1-8B shapes (qkv, o, the fused gate|up + SwiGLU, down) at 512, 2 048 and 8 192 rows,
bfloat16, each call timed in a CUDA graph. ``same_bits``: row 0 equals the default tile's (every
tile sums an output in the same order). Decides ``LINEAR_MANY_ROWS`` and
``LINEAR_MANY_ROWS_GATED`` in ``verispec.ops.triton_rowwise``. Prints a table, then one JSON
line.

    python benchmarks/bench_linear_tiles.py [--rows 512,2048,8192]
"""

from __future__ import annotations

import argparse
import json

import torch
from profile_gpu_step import graph_time

from verispec.bench.report import print_table
from verispec.ops import triton_model
from verispec.ops.triton_model import LinearConfig

SHAPES = dict(qkv=(6144, 4096), o=(4096, 4096), gate_up=(14336, 4096), down=(4096, 14336))
# (block_m, block_n, warps, stages, block_k), bulk-copy loads
TILES = [(256, 128, 8, 4, 64), (256, 128, 8, 3, 64), (128, 256, 8, 4, 64), (128, 256, 8, 3, 64),
         (128, 128, 8, 5, 64), (128, 128, 8, 4, 64), (128, 128, 4, 4, 64), (64, 256, 4, 4, 64)]


def shape_rows(M: int, name: str, N: int, K: int) -> list[dict]:
    """Every tile, the default and cuBLAS on one weight shape at ``M`` rows."""
    gated = name == "gate_up"
    w = torch.randn(2 * N if gated else N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    fn = triton_model.linear_silu_mul if gated else triton_model.linear
    flops = 2 * M * w.shape[0] * K
    reference = fn(x, w)[:1]
    out = []
    for tile in [None] + TILES:
        cfg = None if tile is None else LinearConfig(*tile, tma=True)
        seconds = graph_time(lambda cfg=cfg: fn(x, w, config=cfg), 5)
        out.append(dict(rows=M, weight=name, tile="default" if tile is None else str(tile),
                        us=seconds * 1e6, tflops=flops / seconds / 1e12,
                        same_bits=torch.equal(fn(x, w, config=cfg)[:1], reference)))
    seconds = graph_time(lambda: x @ w.T, 5)  # gate|up: the product alone
    out.append(dict(rows=M, weight=name, tile="cublas", us=seconds * 1e6,
                    tflops=flops / seconds / 1e12, same_bits=None))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="512,2048,8192")
    args = parser.parse_args()
    rows = [row for M in args.rows.split(",") for name, (N, K) in SHAPES.items()
            for row in shape_rows(int(M), name, N, K)]
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    print_table(rows)
    print(json.dumps(dict(benchmark="linear_tiles", rows=rows)))


if __name__ == "__main__":
    main()

"""The bundled model's weight matmuls on the CPU: quantised kernel vs dequantised bfloat16 vs
torch's own 4-bit CPU kernel, in one run.

Per row count M (1 = decode, 4 and 16 = verify steps, 64 = a prefill chunk), the time of one
forward's weight products over all of the bundled GGUF's matrices (121: q|k|v, o, gate|up and
down of 30 layers, and the tied Q8_0 head), each system run alternately ``--repeats`` times, the
median kept:

- ``quant``: ``ops/quant_linear.c`` on the weights as loaded (Q4_1 nibbles, Q8_0 head);
- ``bf16``: ``cpu_kernels.bf16_linear`` on the same weights dequantised to bfloat16 (what
  ``--dtype bfloat16`` runs);
- ``torch_int4``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (bfloat16 activations and
  scales, groups of 32) for the Q4_1 matrices, the bfloat16 kernel for the Q8_0 head (it has no
  8-bit grouped kernel); its float32-activation path is ~40x slower and not timed.

Prints a table, then one JSON line.

    python benchmarks/bench_cpu_quant_matmul.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from verispec.bench.report import machine_description, print_table
from verispec.models.loader import load_model
from verispec.ops import cpu_kernels
from verispec.ops.quant import QuantizedWeight


def int4pack(w: QuantizedWeight):
    """(packed int4 weight, bfloat16 [K/32, N, 2] scales and zeros) of a 4-bit weight, in
    torch's convention ``(q - 8) * scale + zero``."""
    n, k = w.shape
    q, so = w._rows_q(slice(0, n))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scale, offset = so[:, ::32, 0], so[:, ::32, 1]  # [N, K/32]
    zeros = offset + 8 * scale
    return packed, torch.stack([scale.T, zeros.T], dim=-1).bfloat16().contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(None, None).model
    weights = list(dict.fromkeys(m for m in model.modules() if isinstance(m, QuantizedWeight)))
    dense = [w.dequantize().bfloat16().contiguous() for w in weights]
    packed = [int4pack(w) if w.bits == 4 else None for w in weights]
    inputs = {k: torch.randn(max(map(int, args.rows.split(","))), k) for k in (576, 1536)}

    def quant(m):
        for w in weights:
            w.linear(inputs[w.shape[1]][:m])

    def bf16(m):
        for w in dense:
            cpu_kernels.bf16_linear(inputs[w.shape[1]][:m].bfloat16(), w, None)

    def torch_int4(m):
        for w, d, p in zip(weights, dense, packed):
            x = inputs[w.shape[1]][:m].bfloat16()
            if p is None:
                cpu_kernels.bf16_linear(x, d, None)
            else:
                torch.ops.aten._weight_int4pack_mm_for_cpu(x, p[0], 32, p[1])

    systems = {"quant": quant, "bf16": bf16, "torch_int4": torch_int4}
    rows = []
    for m in map(int, args.rows.split(",")):
        times = {name: [] for name in systems}
        for _ in range(args.repeats):
            for name, run in systems.items():
                start = time.perf_counter()
                run(m)
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rows.append({"rows": m, **{f"{name}_ms": v for name, v in med.items()},
                     "bf16_vs_quant": med["bf16"] / med["quant"],
                     "torch_int4_vs_quant": med["torch_int4"] / med["quant"]})
    print(f"machine: {machine_description()}; {args.threads} threads; {len(weights)} matrices, "
          f"median of {args.repeats}")
    print_table(rows)
    print(json.dumps({"bench": "cpu_quant_matmul", "machine": machine_description(),
                      "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()

"""The CPU bfloat16 matmul kernels on the bundled model's weights, and what a verify step costs.

Part 1: the 121 weight matrices of SmolLM2-135M-Instruct (LM head included) through each
bfloat16 kernel this CPU runs (``cpu_kernels.bf16_isas()``: AVX2, AVX-512 BF16, AMX) and
through torch's own bfloat16 matmul (oneDNN; not batch invariant), for 1, 4, 8, 16 and 64 input
rows; medians of ``--repeats`` passes. Part 2: the engine's forward over n = 1 .. 8 new tokens
(after a 200-token context) over the forward of one, with the default kernel: the verify cost of
n - 1 drafts in decode steps. Prints tables, then one JSON line.

    python benchmarks/bench_cpu_matmul.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from verispec import LLM  # before torch: the OpenMP wait policy


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    import torch
    import torch.nn.functional as F

    from verispec.ops import cpu_kernels

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    llm = LLM(dtype="bfloat16", max_model_len=512, max_num_seqs=1)
    model = llm.loaded.model
    weights = [p for name, p in model.named_parameters()
               if p.dim() == 2 and "embed" not in name] + [model.lm_head_weight]
    weights = list({w.data_ptr(): w for w in weights}.values())  # tied LM head once
    kernels = {isa: (lambda x, w, isa=isa: cpu_kernels.bf16_linear(x, w, None, isa))
               for isa in cpu_kernels.bf16_isas()}
    kernels["torch (oneDNN)"] = lambda x, w: F.linear(x, w)
    matmul = []
    for rows in args.rows:
        inputs = [torch.randn(rows, w.shape[1]).bfloat16() for w in weights]
        row = {"rows": rows}
        for name, kernel in kernels.items():
            def run(kernel=kernel, inputs=inputs):
                for x, w in zip(inputs, weights):
                    kernel(x, w)
            row[name] = _median_ms(run, args.repeats)
        matmul.append(row)

    runner = llm.runner
    runner.forward([0], [list(range(100, 300))])
    context = runner.kv_cache.length(0)

    def forward(n: int):
        def run():
            runner.kv_cache.truncate(0, context)
            runner.forward([0], [list(range(5, 5 + n))])
        return run

    one = _median_ms(forward(1), args.repeats)
    verify = [{"tokens": n, "ms": _median_ms(forward(n), args.repeats)} for n in range(1, 9)]
    for v in verify:
        v["cost"] = v["ms"] / one

    policy = (os.environ.get("OMP_WAIT_POLICY")
              or f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    print(f"\nbundled model, bfloat16, {len(weights)} matrices "
          f"({sum(w.numel() for w in weights) / 1e6:.1f} M weights); {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, OpenMP {policy}\n")
    names = list(kernels)
    print("| rows | " + " | ".join(f"{n} ms" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for row in matmul:
        print(f"| {row['rows']} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " |")
    print("\nforward over n new tokens / over one (default kernel: "
          f"{cpu_kernels.bf16_isas()[-1]})\n")
    print("| n | ms | cost |")
    print("|---|---|---|")
    for v in verify:
        print(f"| {v['tokens']} | {v['ms']:.1f} | {v['cost']:.2f} |")
    print(json.dumps({"bench_cpu_matmul": {"matmul_ms": matmul, "verify": verify,
                                           "isas": list(cpu_kernels.bf16_isas()),
                                           "omp": policy}}))


if __name__ == "__main__":
    main()

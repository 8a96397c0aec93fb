"""What batch invariance costs on CPU: plain decode with ``LLM(batch_invariant=True)`` (the
default) against ``batch_invariant=False`` (torch's own matmul and attention choices), in one run.

The bundled SmolLM2-135M-Instruct, greedy, one chat prompt, ``--tokens`` new tokens (EOS
ignored) at batch 1, both engines alternating ``--repeats`` times, best time of each; tokens/s
over the whole ``generate`` call (prefill included), and the time to first token. Prints a
table, then one JSON line.

    python benchmarks/bench_cpu_invariance.py --dtypes bfloat16 float32 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import time

from verispec import LLM, SamplingParams  # before torch: the OpenMP wait policy

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    rows = []
    for dtype in args.dtypes:
        llms = {mode: LLM(dtype=dtype, max_model_len=512, max_num_seqs=1, batch_invariant=mode)
                for mode in (True, False)}
        best = {mode: (float("inf"), 0.0) for mode in llms}
        for llm in llms.values():
            llm.generate(PROMPT, SamplingParams(max_tokens=4))  # warm-up
        for _ in range(args.repeats):
            for mode, llm in llms.items():
                start = time.perf_counter()
                out = llm.generate(PROMPT, params)[0]
                elapsed = time.perf_counter() - start
                if elapsed < best[mode][0]:
                    best[mode] = (elapsed, out.metrics.time_to_first_token_s)
        row = {"dtype": dtype, "tokens": args.tokens}
        for mode, name in ((True, "invariant"), (False, "variant")):
            row[f"{name}_tok_s"] = args.tokens / best[mode][0]
            row[f"{name}_ttft_ms"] = 1e3 * best[mode][1]
        row["cost"] = 1 - row["invariant_tok_s"] / row["variant_tok_s"]
        rows.append(row)
        del llms
    machine = f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} " \
              "threads"
    print(f"\nbatch 1 plain decode, bundled model, {args.tokens} tokens, best of {args.repeats}; "
          f"{machine}\n")
    print("| dtype | invariant tok/s | opt-out tok/s | cost | TTFT invariant / opt-out |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['invariant_tok_s']:.1f} | {r['variant_tok_s']:.1f} | "
              f"{100 * r['cost']:+.1f} % | {r['invariant_ttft_ms']:.0f} / "
              f"{r['variant_ttft_ms']:.0f} ms |")
    print(json.dumps({"benchmark": "cpu_invariance", "machine": machine, "results": rows}))


if __name__ == "__main__":
    main()

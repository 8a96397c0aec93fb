"""Decode at long context and small batch: split-KV against one program per attention tile.

A decode step's attention reads every cached key of every request; at batch 1 the launch has
one program per kv head (8 for the 8B shape), far fewer than the GPU's multiprocessors, so a
32 k context reads its keys at a small fraction of the bandwidth. Split-KV
(``ops.triton_attention``) gives each partition of the keys a program of its own, the last of
them to finish folding them, with the same bits. For each ``--cases`` entry BxL (B requests of
L random prompt tokens) this times ``--tokens`` greedy decode steps (the prompt's prefill is
timed apart and subtracted), once with split-KV (the default) and once with it off
(``SPLIT_PROGRAMS_PER_SM = 0``), each engine in a process of its own, on a random-weight
Llama-3.1-8B-shaped target (``--tiny``: a tiny one, a smoke run on CPU, where neither applies).
Both must give the same tokens.

    python benchmarks/bench_long_context.py --workdir /tmp/bench_long

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        batch, _, length = item.partition("x")
        if not (batch.isdigit() and length.isdigit()) or int(batch) < 1 or int(length) < 1:
            raise SystemExit(f"--cases: {item!r} is not BxL (e.g. 1x32000)")
        cases.append((int(batch), int(length)))
    return cases


def run_engine(model: str, device: str, cases, tokens: int, split: bool) -> list[dict]:
    """Decode tokens/s and a digest of the tokens per case, on one engine."""
    from verispec import LLM, SamplingParams

    if not split:
        from verispec.ops import triton_attention
        triton_attention.SPLIT_PROGRAMS_PER_SM = 0
    max_len = max(length for _, length in cases) + tokens + 16
    llm = LLM(model, device=device, dtype="bfloat16", load_format="dummy",
              max_model_len=max_len, max_num_seqs=max(batch for batch, _ in cases))
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    rows = []
    for batch, length in cases:
        prompts = [rng.integers(0, vocab, size=length).tolist() for _ in range(batch)]

        def timed(n, prompts=prompts):
            start = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True,
                                                        temperature=0.0))
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            return time.perf_counter() - start, outs

        timed(1)  # prefill, then the prompt is a prefix-cache hit
        first, _ = timed(1)
        total, outs = timed(tokens + 1)
        seconds = max(total - first, 1e-9)
        digest = hashlib.sha256(str([o.outputs[0].token_ids for o in outs]).encode())
        rows.append(dict(batch=batch, context=length, tok_s=batch * tokens / seconds,
                         step_ms=seconds / tokens * 1e3, tokens=digest.hexdigest()[:16]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/verispec_bench_long_context")
    parser.add_argument("--model", default=None, help="a model directory (default: build one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and short contexts")
    parser.add_argument("--cases", default=None,
                        help="BxL,... (default 1x2000,1x8000,1x32000,8x8000,16x4000,32x2000)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--engine-only", choices=["split", "one"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = parse_cases(args.cases or ("1x64,2x200" if args.tiny else
                                       "1x2000,1x8000,1x32000,8x8000,16x4000,32x2000"))
    if args.engine_only:
        print(json.dumps(run_engine(args.model, args.device, cases, args.tokens,
                                    args.engine_only == "split")))
        return
    import bench_throughput

    from verispec.bench.report import machine_description, print_table

    model = args.model or bench_throughput.checkpoint(args.workdir, args.tiny, args.device)
    results = {}
    for mode in ("split", "one"):
        cmd = [sys.executable, os.path.abspath(__file__), "--engine-only", mode, "--model", model,
               "--device", args.device, "--cases", ",".join(f"{b}x{n}" for b, n in cases),
               "--tokens", str(args.tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"the {mode} engine did not run: {proc.stderr.strip()[-500:]}")
        results[mode] = json.loads(lines[-1])
    rows = []
    for split, one in zip(results["split"], results["one"]):
        rows.append(dict(batch=split["batch"], context=split["context"],
                         split_tok_s=split["tok_s"], one_program_tok_s=one["tok_s"],
                         speedup=split["tok_s"] / one["tok_s"], split_step_ms=split["step_ms"],
                         same_tokens=split["tokens"] == one["tokens"]))
    print(machine_description())
    print_table(rows, ["batch", "context", "split_tok_s", "one_program_tok_s", "speedup",
                       "split_step_ms", "same_tokens"])
    print(json.dumps({"benchmark": "long_context", "machine": machine_description(),
                      "tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()

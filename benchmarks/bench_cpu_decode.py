"""CPU decode throughput: verispec's engine vs HF transformers ``generate``, in one run.

Both load the bundled SmolLM2-135M-Instruct (the same converted weights, same dtype), run the
same chat prompts greedily for exactly ``--tokens`` new tokens (EOS ignored), at batch 1 and
batch 8. Each configuration is timed ``--repeats`` times, alternating ours and HF so that both
see the same machine load, and the best time of each is kept (the least disturbed run on a
shared machine). tokens/s counts generated tokens over the whole ``generate`` call (prefill
included). Prints a table, then one JSON line.

    python benchmarks/bench_cpu_decode.py                 # float32 + bfloat16, batch 1 + 8
    python benchmarks/bench_cpu_decode.py --dtypes bfloat16 --batch-sizes 1 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle.",
    "Give me three tips for writing clean code.",
    "Why is the sky blue?",
    "Summarise the plot of a heist movie you invent.",
    "How do vaccines train the immune system?",
]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def time_ours(llm, prompts, tokens: int) -> float:
    from verispec import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == tokens for o in outs)
    return elapsed


def time_hf(hf, tokenizer, prompts, tokens: int) -> float:
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
             for p in prompts]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens,
                          do_sample=False, pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - batch["input_ids"].shape[1] == tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice, one per core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from verispec import LLM

    hf_logging.set_verbosity_error()
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    machine = f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, " \
              f"{torch.get_num_threads()} threads"
    rows = []
    for dtype in args.dtypes:
        llm = LLM(dtype=dtype, max_model_len=1024, max_num_seqs=max(args.batch_sizes))
        hf = AutoModelForCausalLM.from_pretrained(
            llm.loaded.path, dtype=getattr(torch, dtype)
        ).eval()
        for batch_size in args.batch_sizes:
            prompts = (chats * batch_size)[:batch_size]
            time_ours(llm, prompts, 4)  # warm-up both
            time_hf(hf, llm.tokenizer, prompts, 4)
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(time_ours(llm, prompts, args.tokens))
                theirs.append(time_hf(hf, llm.tokenizer, prompts, args.tokens))
            n = batch_size * args.tokens
            row = {
                "dtype": dtype, "batch_size": batch_size, "tokens": args.tokens,
                "ours_tok_s": n / min(ours), "hf_tok_s": n / min(theirs),
            }
            row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
            rows.append(row)
            print(f"  {dtype} batch {batch_size}: ours {row['ours_tok_s']:.1f} tok/s, "
                  f"HF {row['hf_tok_s']:.1f} tok/s", flush=True)
        del llm, hf

    print(f"\nCPU decode, bundled SmolLM2-135M-Instruct, greedy, {args.tokens} new tokens per "
          f"request, best of {args.repeats}\nmachine: {machine}\n")
    print("| dtype | batch | verispec tok/s | HF generate tok/s | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch_size']} | {r['ours_tok_s']:.1f} | "
              f"{r['hf_tok_s']:.1f} | {r['ratio']:.2f}x |")
    print(json.dumps({"benchmark": "cpu_decode", "machine": machine, "results": rows}))


if __name__ == "__main__":
    main()

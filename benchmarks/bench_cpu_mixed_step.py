"""A CPU step that mixes decodes with a prefill chunk: one padded forward against one forward
per group of similar token counts (``runtime.padded_layout.padding_groups``).

One engine on the bundled model (quantised GGUF, the default) or ``--model``: ``--decodes``
requests with a ``--context``-token prompt each, then one step that feeds each of them one token
beside a ``--chunk``-token prompt of a new request. The step is timed with the grouping on and
switched off (``MAX_PADDING_RATIO`` raised), alternating, ``--repeats`` times each; the logits of
both are compared (batch invariance: the same bits).

    python benchmarks/bench_cpu_mixed_step.py --decodes 4 --chunk 256

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from verispec import LLM
from verispec.bench.report import machine_description, print_table
from verispec.runtime import padded_layout


def step(llm: LLM, decodes: int, context: int, chunk: int, grouped: bool, seed: int):
    """(seconds, logits) of one mixed step on empty slots (freed afterwards)."""
    runner = llm.runner
    padded_layout.MAX_PADDING_RATIO = 1.25 if grouped else 1e9
    rng = np.random.default_rng(seed)
    vocab = runner.config.vocab_size
    slots = list(range(decodes + 1))
    runner.forward(slots[:decodes], [rng.integers(1, vocab, context).tolist()
                                     for _ in range(decodes)], logits="none")
    tokens = [[int(t)] for t in rng.integers(1, vocab, decodes)]
    tokens.append(rng.integers(1, vocab, chunk).tolist())
    start = time.perf_counter()
    logits = runner.forward(slots, tokens)
    seconds = time.perf_counter() - start
    for slot in slots:
        runner.kv_cache.free(slot)
    return seconds, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--decodes", type=int, default=4)
    parser.add_argument("--context", type=int, default=40)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kwargs = {} if args.model is None else {"model": args.model}
    llm = LLM(max_model_len=args.context + args.chunk + 16, max_num_seqs=args.decodes + 1,
              enable_prefix_caching=False, **kwargs)
    times = {True: [], False: []}
    same = True
    step(llm, args.decodes, args.context, args.chunk, True, seed=99)  # warm-up
    for r in range(args.repeats):
        outputs = {}
        for grouped in (True, False):
            seconds, outputs[grouped] = step(llm, args.decodes, args.context, args.chunk,
                                             grouped, seed=r)
            times[grouped].append(seconds)
        same &= torch.equal(outputs[True], outputs[False])
    grouped, padded = float(np.median(times[True])), float(np.median(times[False]))
    row = {"decodes": args.decodes, "chunk": args.chunk, "grouped_s": grouped,
           "padded_s": padded, "speedup": padded / grouped, "same_logits": bool(same)}
    print(machine_description())
    print_table([row])
    print(json.dumps({"benchmark": "cpu_mixed_step", **row}))


if __name__ == "__main__":
    main()

"""What a target verify forward over a token tree costs against a decode step (issue goal: a
32-token tree at batch 1 on an 8B-shaped target at most 1.1x a decode step).

Random weights from ``--shape``'s config (``LLM(..., load_format="dummy")``), driven through a
``ModelRunner`` of their own on one slot holding ``--context`` tokens. Timed per call, wall
clock with the device synchronised (the host work of each forward included), median of
``--repeats``; the cache is truncated back after each call. Rows:

- ``decode (graph)``: one token, the captured step the engine replays;
- ``decode (eager)``: the same forward with the graphs set aside;
- ``chain k (graph)``: a chain verify of k + 1 tokens, captured (the engine's chain step);
- ``tree N``: the verify forward over a tree of N tokens (the root and N - 1 nodes:
  ``runtime.tree_verify.verify_tree``), logits for every row: replaying the captured tree step
  (``graph``, as the engine does up to batch 8) and eagerly.

``--profile`` (CUDA) also lists the GPU time of each kernel in one eager decode step and one
eager verify of each tree (torch profiler), and the host functions of the captured steps by
their own time (cProfile): where a tree's extra time goes.

    python benchmarks/bench_tree_verify.py                      # GPU, 8B shape
    python benchmarks/bench_tree_verify.py --device cpu --shape tiny --repeats 3

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_tensor_parallel  # noqa: E402

from verispec import LLM  # noqa: E402
from verispec.bench.report import (  # noqa: E402
    machine_description,
    print_host_profile,
    print_table,
)
from verispec.runtime.model_runner import ModelRunner  # noqa: E402
from verispec.runtime.tree_verify import verify_tree  # noqa: E402

K = 3
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, tie_word_embeddings=False)


def tree_parents(num_nodes: int) -> tuple[list[int], int]:
    """A breadth-first tree of ``num_nodes`` nodes shaped like an EAGLE-2 tree of top-k 4:
    each level keeps the first nodes of the level before as parents, 4 children each, until
    the budget is spent. Returns (local parent of every node, -1 = the root; depth)."""
    parents, level, depth = [], [-1], 0
    while len(parents) < num_nodes:
        depth += 1
        nxt = []
        for parent in level:
            for _ in range(4):
                if len(parents) == num_nodes:
                    break
                nxt.append(len(parents))
                parents.append(parent)
        level = nxt[:4]
    return parents, depth


def timed(device: torch.device, fn, repeats: int) -> float:
    """Median wall milliseconds of ``fn()`` with the device synchronised around each call."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def kernel_times(fn) -> dict[str, float]:
    """Kernel name -> GPU microseconds of one ``fn()`` (after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            totals[e.name[:50]] = totals.get(e.name[:50], 0.0) + e.device_time
    return totals


def host_profile(label: str, fn, calls: int = 20) -> None:
    """The host functions of ``calls`` calls of ``fn`` by their own time, after a warm-up."""
    fn()

    def repeated():
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    print_host_profile(f"{calls} x {label}", repeated, rows=14)


def print_kernel_times(columns: dict[str, dict[str, float]]) -> None:
    names = sorted({k for c in columns.values() for k in c},
                   key=lambda k: -max(c.get(k, 0.0) for c in columns.values()))
    rows = [dict(kernel=k, **{f"{c} us": columns[c].get(k, 0.0) for c in columns})
            for k in names]
    rows.append(dict(kernel="TOTAL", **{f"{c} us": sum(columns[c].values()) for c in columns}))
    print_table(rows, ["kernel"] + [f"{c} us" for c in columns])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="8b", choices=["8b", "1b", "70b", "tiny"])
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layers")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tree-tokens", default="8,16,32,64")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--workdir", default="/tmp/bench_tree_verify")
    parser.add_argument("--profile", action="store_true",
                        help="GPU time per kernel: an eager decode against each eager tree")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    if args.shape == "tiny":
        bench_tensor_parallel.SHAPES["tiny"] = TINY
    path = bench_tensor_parallel.write_config(args.workdir, args.shape, args.layers)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    llm = LLM(model=path, dtype=dtype, load_format="dummy", device=args.device, max_num_seqs=1,
              max_model_len=args.context + 128, enable_prefix_caching=False,
              kv_cache_memory="1GiB" if args.device.startswith("cuda") else None)
    sizes = [int(x) for x in args.tree_tokens.split(",")]
    # a runner of its own whose cache takes the largest tree (the engine's takes k + 1 tokens)
    runner = ModelRunner(llm.runner.model, 1, args.context + 128, args.device,
                         max_step_tokens=max(sizes + [K + 1]))
    runner.capture([1, K + 1])
    device = torch.device(args.device)
    vocab = llm.model_config.vocab_size
    rng = np.random.default_rng(0)
    slot = 0
    runner.forward([slot], [rng.integers(100, vocab, args.context).tolist()], logits="none")
    length = int(runner.kv_cache.lengths_np[slot])
    token = int(rng.integers(100, vocab))

    def run(token_ids, logits="last"):
        def call():
            runner.forward([slot], [token_ids], logits=logits)
            runner.kv_cache.truncate(slot, length)
        return call

    def tree_call(parents, depth, drafts):
        def call():
            verify_tree(runner, [slot], [token], drafts, np.asarray(parents),
                        np.asarray([len(parents)]), depth)
            runner.kv_cache.truncate(slot, length)
        return call

    rows = []
    has_graphs = runner.graphs is not None
    mode = " (graph)" if has_graphs else ""
    decode_ms = timed(device, run([token]), args.repeats)
    rows.append(dict(row="decode" + mode, tokens=1, ms=decode_ms))
    chain = rng.integers(100, vocab, K + 1).tolist()
    rows.append(dict(row=f"chain k={K}" + mode, tokens=K + 1,
                     ms=timed(device, run(chain, "all"), args.repeats)))
    trees = {n: tree_parents(n - 1) for n in sizes}
    drafts = {n: rng.integers(100, vocab, n - 1) for n in sizes}
    if has_graphs:
        for n, (parents, depth) in trees.items():
            runner.tree_graph = (n, depth)
            runner.capture_tree()
            call = tree_call(parents, depth, drafts[n])
            rows.append(dict(row=f"tree {n} (depth {depth}, graph)", tokens=n,
                             ms=timed(device, call, args.repeats)))
            if args.profile:
                host_profile(f"tree {n}, graph", call)
        if args.profile:
            host_profile("decode, graph", run([token]))
        runner.tree_graph = None
    graphs, runner.graphs = runner.graphs, None
    try:
        if has_graphs:
            rows.append(dict(row="decode (eager)", tokens=1,
                             ms=timed(device, run([token]), args.repeats)))
        for n, (parents, depth) in trees.items():
            rows.append(dict(row=f"tree {n} (depth {depth}, eager)", tokens=n,
                             ms=timed(device, tree_call(parents, depth, drafts[n]),
                                      args.repeats)))
        if args.profile and device.type == "cuda":
            calls = {"decode": run([token])}
            calls.update({f"tree {n}": tree_call(parents, depth, drafts[n])
                          for n, (parents, depth) in trees.items()})
            print_kernel_times({name: kernel_times(call) for name, call in calls.items()})
    finally:
        runner.graphs = graphs
    for r in rows:
        r["vs_decode"] = r["ms"] / decode_ms
    print(f"{machine_description()}; {args.shape} shape, batch 1, context {args.context}")
    print_table(rows, ["row", "tokens", "ms", "vs_decode"])
    result = dict(device=machine_description(), shape=args.shape, context=args.context,
                  rows=rows)
    print(json.dumps(result))
    llm.close()
    return result


if __name__ == "__main__":
    main()

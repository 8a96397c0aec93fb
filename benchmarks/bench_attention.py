"""The GPU attention kernel on long contexts: time and bit-equality of its query tile sizes.

A step of chunked prefill at a long context is dominated by its attention: a chunk of C queries
over L cached keys (Llama-3.1-8B shape: 32 query heads, 8 KV heads, head_dim 128, bfloat16,
blocks of 16). For each (C, L) and each tile of query rows (``block_q``) and warps this times
``ops.triton_model.rope_cache_attention`` (the launch that writes the chunk's K/V, then the one
that attends; CUDA events, median of ``--repeats``), prints TFLOP/s of the attention products,
and checks that the output is bit-identical to the default tile's (16 rows, 4 warps): a tile
that changed a row's bits would break batch invariance (a decode row and the same position in a
prefill chunk must agree). Also a mixed launch: decode rows of 32 requests beside the chunk,
their rows compared with a launch of the decode rows alone.

    python benchmarks/bench_attention.py [--contexts 4096,32768] [--chunks 512,2048]

``--decode`` times decode and verify launches instead (``--cases`` BxL[xQ]: B requests of Q
queries at L keys): each attention launch (split-KV folds inside it) captured 20 times in a CUDA
graph (a launch timed alone is host-bound at batch 1), split-KV against one program a tile
(their bits compared), under the default partitions and under 512-key partitions from key 0
(``SMALL_PARTITIONS = 0``, the layout before small partitions).

    python benchmarks/bench_attention.py --decode [--cases 1x1024,16x4000]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HQ, HKV, D, BLOCK_SIZE = 32, 8, 128, 16
TILES = [(16, 4), (32, 4), (64, 4), (64, 8), (128, 4), (128, 8)]


def make_case(chunk: int, context: int, num_decodes: int, decode_ctx: int, device):
    """Tensors of one launch: request 0 a chunk of ``chunk`` queries ending at ``context``,
    then ``num_decodes`` requests of one query at ``decode_ctx``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    lens = [context] + [decode_ctx] * num_decodes
    counts = [chunk] + [1] * num_decodes
    blocks_per = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks_per) + 1
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    max_blocks = max(blocks_per)
    table = torch.zeros((len(lens) + 1, max_blocks), dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks_per):
        table[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    dtype = torch.bfloat16
    k_cache = (torch.randn((num_blocks, BLOCK_SIZE, HKV, D), generator=gen) * 0.5).to(dtype)
    v_cache = torch.randn((num_blocks, BLOCK_SIZE, HKV, D), generator=gen).to(dtype)
    T = sum(counts)
    qkv = (torch.randn((T, (HQ + 2 * HKV) * D), generator=gen) * 0.5).to(dtype)
    angles = torch.arange(context + 1)[:, None] * (1e-4 ** (torch.arange(D // 2) / (D // 2)))
    cos = torch.cat([angles.cos(), angles.cos()], 1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], 1).to(dtype)
    query_start = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int64)
    positions = torch.cat([torch.arange(n - c, n) for n, c in zip(lens, counts)])
    slots = torch.arange(len(lens), dtype=torch.int64)
    slot_mapping = (table[slots.repeat_interleave(torch.tensor(counts)),
                          positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE)
    case = dict(qkv=qkv, positions=positions, cos=cos, sin=sin, k_cache=k_cache,
                v_cache=v_cache, slot_mapping=slot_mapping, block_tables=table,
                slot_ids=slots, context_lens=torch.tensor(lens, dtype=torch.int64),
                query_start=query_start)
    case = {k: v.to(device) for k, v in case.items()}
    case.update(max_queries=max(counts), num_heads=HQ, num_kv_heads=HKV, scale=D ** -0.5)
    return case


def run(case, block_q, num_warps, repeats):
    from verispec.ops import triton_model

    times = []
    out = None
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = triton_model.rope_cache_attention(**case, block_q=block_q, num_warps=num_warps)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return out, float(np.median(times[1:]))


DECODE_CASES = ("1x500,1x1024,1x2000,1x2100,1x4096,1x32000,8x8000,16x4000,2x2000,1x1024x4,"
                "64x1024")
GRAPH_CALLS = 20


def graph_us(case: dict, **kwargs) -> tuple[torch.Tensor, float]:
    """(output, median device microseconds of one launch pair) over ``GRAPH_CALLS`` calls
    replayed from a CUDA graph."""
    from verispec.ops import triton_model

    def call():
        return triton_model.rope_cache_attention(**case, **kwargs)

    out = call()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(GRAPH_CALLS):
                call()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1e3 * start.elapsed_time(end) / GRAPH_CALLS)
    return out, float(np.median(times[2:]))


def decode_rows(cases: str, device: torch.device) -> list[dict]:
    from verispec.ops import triton_attention

    layouts = {"default": triton_attention.SMALL_PARTITIONS, "512 from key 0": 0}
    rows = []
    for spec in cases.split(","):
        b, length, *q = (int(x) for x in spec.split("x"))
        queries = q[0] if q else 1
        case = make_case(queries, length, b - 1, length, device)
        kv_bytes = b * length * HKV * D * 2 * 2  # K and V, bfloat16
        for name, small in layouts.items():
            triton_attention.SMALL_PARTITIONS = small
            try:
                split, split_us = graph_us(case)
                one, one_us = graph_us(case, split_programs=1)
            finally:
                triton_attention.SMALL_PARTITIONS = layouts["default"]
            rows.append(dict(batch=b, keys=length, queries=queries, partitions=name,
                             split_us=split_us, gb_s=kv_bytes / split_us / 1e3,
                             one_program_us=one_us, same_bits=bool(torch.equal(split, one))))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--chunks", default="512,2048")
    parser.add_argument("--decodes", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode", action="store_true",
                        help="decode / verify launches (--cases) instead of prefill chunks")
    parser.add_argument("--cases", default=DECODE_CASES, help="with --decode: BxL[xQ],...")
    args = parser.parse_args()
    from verispec.bench.report import machine_description, print_table

    if not torch.cuda.is_available():
        parser.error("this benchmark times the GPU kernel: it needs CUDA")
    device = torch.device("cuda")
    if args.decode:
        rows = decode_rows(args.cases, device)
        print(machine_description())
        print_table(rows, ["batch", "keys", "queries", "partitions", "split_us", "gb_s",
                           "one_program_us", "same_bits"])
        print(json.dumps({"benchmark": "decode_attention", "machine": machine_description(),
                          "rows": rows}))
        return
    rows = []
    for context in [int(x) for x in args.contexts.split(",")]:
        for chunk in [int(x) for x in args.chunks.split(",")]:
            case = make_case(chunk, context, args.decodes, 600, device)
            # the decode rows alone, on the same cache: a decode step's launch (default tile)
            alone = dict(case, qkv=case["qkv"][chunk:], positions=case["positions"][chunk:],
                         slot_mapping=case["slot_mapping"][chunk:],
                         slot_ids=case["slot_ids"][1:], context_lens=case["context_lens"][1:],
                         query_start=case["query_start"][1:] - chunk, max_queries=1)
            decoded, _ = run(alone, 16, 4, 1)
            flops = 4 * HQ * D * sum(context - chunk + i + 1 for i in range(chunk))
            reference = None
            for block_q, num_warps in TILES:
                out, ms = run(case, block_q, num_warps, args.repeats)
                if reference is None:
                    reference = out.clone()
                rows.append(dict(context=context, chunk=chunk, block_q=block_q,
                                 num_warps=num_warps, ms=ms, tflops=flops / ms / 1e9,
                                 same_bits=bool(torch.equal(out, reference)),
                                 decode_rows_same=bool(torch.equal(out[chunk:], decoded))))
                print(json.dumps(rows[-1]), flush=True)
    print(machine_description())
    print_table(rows, ["context", "chunk", "block_q", "num_warps", "ms", "tflops", "same_bits",
                       "decode_rows_same"])
    print(json.dumps({"benchmark": "attention", "machine": machine_description(), "rows": rows}))


if __name__ == "__main__":
    main()

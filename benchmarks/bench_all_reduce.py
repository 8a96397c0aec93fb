"""A tensor-parallel layer's all-reduce plus the RMSNorm after it, three ways, inside CUDA graphs:
NCCL then the norm, the peer-to-peer all-reduce (``PeerAllReduce``) then the norm, and the fused
kernel (``PeerReduceNorm``, ``ops.triton_peer``). Times one call (a graph of ``--calls`` of
them, replayed) and checks that the three give the same bits on random partial sums.

    torchrun --nproc-per-node 2 benchmarks/bench_all_reduce.py

Prints a table (rank 0), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from verispec.models.parallel import PeerAllReduce, PeerReduceNorm
from verispec.ops import triton_model
from verispec.runtime.workers import SAFE_ENV


def paths(peer: PeerAllReduce, fused: PeerReduceNorm):
    """name -> f(partial, weight, residual) -> normed, each updating residual in place."""
    def nccl(x, w, res):
        y = x.clone()
        dist.all_reduce(y)
        return triton_model.rms_norm(y, w, 1e-5, res)

    def peer_then_norm(x, w, res):
        return triton_model.rms_norm(peer(x.clone()), w, 1e-5, res)

    def fused_kernel(x, w, res):
        return fused(x, w, 1e-5, res)

    return {"nccl": nccl, "peer": peer_then_norm, "fused": fused_kernel}


def time_in_graph(fn, x, w, res, calls: int, replays: int) -> float:
    """Microseconds per call: ``calls`` calls captured in one graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x, w, res)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x, w, res)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", default="4096,8192")
    parser.add_argument("--rows", default="1,8,64,128")
    parser.add_argument("--calls", type=int, default=64, help="calls per graph")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    dtype = torch.bfloat16
    peer = PeerAllReduce(dist.group.WORLD, device, dtype)
    fused = PeerReduceNorm(dist.group.WORLD, device)
    ways = paths(peer, fused)
    rows_out = []
    for hidden in [int(h) for h in args.hidden.split(",")]:
        for rows in [int(r) for r in args.rows.split(",")]:
            if rows * hidden * 2 > min(PeerReduceNorm.HALF_BYTES, PeerAllReduce.MAX_BYTES):
                continue
            g = torch.Generator(device=device).manual_seed(1000 * rank + rows)
            x = torch.randn(rows, hidden, generator=g, device=device, dtype=dtype)
            w = torch.randn(hidden, generator=g, device=device, dtype=dtype)
            base = torch.randn(rows, hidden, device=device, dtype=dtype,
                               generator=torch.Generator(device=device).manual_seed(rows))
            outs = {}
            for name, fn in ways.items():
                res = base.clone()
                outs[name] = (fn(x, w, res), res)
            same = all(torch.equal(outs[n][0], outs["nccl"][0])
                       and torch.equal(outs[n][1], outs["nccl"][1]) for n in outs)
            row = dict(hidden=hidden, rows=rows, same_bits=same)
            for name, fn in ways.items():
                row[f"{name}_us"] = time_in_graph(fn, x, w, base.clone(), args.calls,
                                                  args.replays)
            flags = torch.tensor([int(same)], device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            row["same_bits"] = bool(flags.item())
            rows_out.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    torch.cuda.synchronize()
    timed_out = int(fused.counters[-1].item())
    if rank == 0:
        print(f"{dist.get_world_size()} x {torch.cuda.get_device_name(device)}, bfloat16, "
              f"{args.calls} calls per graph")
        print("hidden | rows | nccl + norm us | peer + norm us | fused us | same bits")
        for r in rows_out:
            print(f"{r['hidden']} | {r['rows']} | {r['nccl_us']:.1f} | {r['peer_us']:.1f} | "
                  f"{r['fused_us']:.1f} | {r['same_bits']}")
        result = dict(world=dist.get_world_size(), device=torch.cuda.get_device_name(device),
                      rows=rows_out, timed_out=timed_out)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f)
        print(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Rejection sampling on the GPU: the Triton op and the torch op against the memory floor.

For each vocabulary V, batch size B and rule (full rule with draft probabilities, one-hot rule
without), k = 4 drafts per request, temperature 1, float32 target logits:

    floor = bytes that must be read once (target logits [B (k + 1), V], plus draft probabilities
            [B k, V] float32 for the full rule) / the device's measured copy bandwidth

and the median GPU time of each op (CUDA events around single calls, after warm-up, inputs
rotated over enough buffer sets that L2 cannot hold them and at least eight of them, since
single inputs differ by several percent at small batches, and L2 flushed before each call by
reading a buffer larger than it), as
microseconds and as a multiple of the floor. Beside them, ``read``: the same bytes read once by
a kernel that only takes each 4096-token chunk's maximum (``read_kernel``), the floor in
practice, and the Triton op as a multiple of it. ``host us``: the host time of one eager call of
the Triton op (Python and launch overhead, which a CUDA graph removes): the median of five
means of 40 calls, with the GPU kept behind. At B in {1, 8} the Triton op is also timed inside
a CUDA graph (one graph replaying one call per buffer set). Drafts are accepted about 80 % of
the time per position (the drafted token's target probability is set near 0.8), so both the
bonus path and the recovered-token path run; the mean acceptance length is printed. Each
configuration also checks that the two ops return the same tokens. Both ops are called with
``check_draft_ids=False`` (the engine's call): the default range check of the draft ids reads
them on the host, a sync that would land inside the timed call.

With ``--before DIR`` (DIR holds an earlier ``verispec/ops``, e.g. from ``git archive REV
verispec/ops | tar -x -C DIR``) that revision's Triton op is timed too, right after ours on the
same inputs, as ``before us`` and ``now / before``: a like-for-like comparison in one run.

Prints a human table, then one JSON line.

    python benchmarks/bench_rejection.py                  # the full table
    python benchmarks/bench_rejection.py --batch-sizes 1 8 --vocab-sizes 151936 --quick
    python benchmarks/bench_rejection.py --vocab-sizes 128256 --skip-torch --before /tmp/before
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from verispec.ops import rejection

K = 4


def copy_bandwidth(device, num_bytes=1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * num_bytes / statistics.median(times)


def make_inputs(batch_size, vocab_size, device, seed, accept_prob=0.8):
    """One buffer set: float32 logits with the drafted token at target probability ~accept_prob
    (so acceptance is ~accept_prob per position), q = a perturbed copy of the target."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_rows = batch_size * (K + 1)
    logits = torch.randn(num_rows, vocab_size, device=device, generator=gen)
    cu = torch.arange(0, batch_size + 1, device=device, dtype=torch.int64) * K
    drafts = torch.randint(0, vocab_size, (batch_size * K,), device=device, generator=gen)
    verify_rows = torch.arange(batch_size * K, device=device)
    verify_rows = verify_rows + verify_rows // K
    rest = torch.logsumexp(logits[verify_rows], -1)
    logits[verify_rows, drafts] = rest + math.log(accept_prob / (1 - accept_prob))
    q_logits = logits[verify_rows] + 0.3 * torch.randn(
        batch_size * K, vocab_size, device=device, generator=gen)
    q = torch.softmax(q_logits, -1)
    return dict(
        target_logits=logits,
        draft_token_ids=drafts,
        cu_num_draft_tokens=cu,
        draft_probs=q,
        temperature=torch.ones(batch_size, device=device),
        seeds=torch.randint(0, 2**62, (batch_size,), device=device, generator=gen),
        positions=torch.randint(0, 4096, (batch_size,), device=device, generator=gen),
    )


@functools.cache
def _has_draft_id_check(op) -> bool:
    return "check_draft_ids" in inspect.signature(op).parameters


def call(op, inputs, with_draft_probs, **kwargs):
    """One verify call of ``op`` on a buffer set, without the host-side draft id check (an op
    from before that check, ``--before``, has no such argument)."""
    if _has_draft_id_check(op):
        kwargs["check_draft_ids"] = False
    return op(
        inputs["target_logits"], inputs["draft_token_ids"], inputs["cu_num_draft_tokens"],
        inputs["draft_probs"] if with_draft_probs else None, inputs["temperature"], None, None,
        None, inputs["seeds"], inputs["positions"], K, **kwargs,
    )


def load_before(path: str):
    """The ``triton_ops`` module of the ``verispec/ops`` under ``path``, imported as the
    package ``ops_before`` (a copy whose ``verispec.ops`` imports point at itself)."""
    source = os.path.join(path, "verispec", "ops")
    if not os.path.isfile(os.path.join(source, "triton_ops.py")):
        raise SystemExit(f"--before {path}: no verispec/ops/triton_ops.py there")
    root = tempfile.mkdtemp()
    package = os.path.join(root, "ops_before")
    shutil.copytree(source, package)
    for name in os.listdir(package):
        if name.endswith(".py"):
            file = os.path.join(package, name)
            with open(file) as f:
                text = f.read().replace("verispec.ops", "ops_before")
            with open(file, "w") as f:
                f.write(text)
    sys.path.insert(0, root)
    return importlib.import_module("ops_before.triton_ops")


def time_gpu(fn, sets, flush, budget_s, max_reps=200) -> float:
    """Median GPU microseconds of single calls, rotating over the buffer sets. Before each call a
    read of ``flush`` (larger than L2) evicts the inputs, and the flush and a GPU sleep keep the
    GPU busy while the host enqueues the call, so host overhead stays out of the number (as
    triton.testing.do_bench).
    A read, not a write as do_bench's: a zeroing flush leaves L2 full of dirty lines whose
    write-back then lands inside the timed call (on an H100, +9.4 us on a plain read of 97 MB of
    logits, 44.7 instead of 35.3 us), a cost of the flush, not of the op."""
    out = torch.empty((), dtype=flush.dtype, device=flush.device)
    for s in sets[:3]:
        fn(s)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(sets[0])
    torch.cuda.synchronize()
    estimate = time.perf_counter() - t0
    reps = int(max(10, min(max_reps, budget_s / max(estimate, 1e-6))))
    # the sleep: three times the slowest host enqueue seen (at least 1e6 cycles, ~0.6 ms), so
    # that a slow host does not leave the GPU idle between the op's launches
    host = max(time_host(fn, s, reps=1) for s in sets[:5]) * 1e-6
    cycles = max(1_000_000, math.ceil(3 * host * sleep_cycles_per_s()))
    times = []
    for r in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s = sets[r % len(sets)]
        torch.sum(flush, dim=0, out=out)
        torch.cuda._sleep(cycles)  # the host enqueues the call meanwhile
        start.record()
        fn(s)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


@functools.cache
def sleep_cycles_per_s() -> float:
    """Cycles of ``torch.cuda._sleep`` per second of GPU time, measured once."""
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) * 1e-3)


def time_host(fn, s, reps=40, rounds=5) -> float:
    """Host microseconds per call (launch overhead), the GPU kept behind: the median over
    ``rounds`` rounds of the mean of ``reps`` calls (the host is shared; single rounds vary)."""
    for _ in range(3):
        fn(s)
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(s)
        times.append((time.perf_counter() - t0) / reps * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def time_graph(fn, sets, reps=50) -> float | None:
    """Median microseconds per call of a CUDA graph that makes one call per buffer set."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets[:2]:
            fn(s)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for s in sets:
                fn(s)
    except Exception as exc:  # a non-capturable op: report, do not fail the table
        print(f"  (graph capture failed: {type(exc).__name__}: {exc})")
        return None
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(sets))
    return statistics.median(times)


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def add_timing_args(parser: argparse.ArgumentParser) -> None:
    """The options every GPU benchmark here shares: buffer rotation, flush, budget, torch."""
    parser.add_argument("--rotate-bytes", type=float, default=256e6,
                        help="bytes of input buffer sets to rotate over (>> L2)")
    parser.add_argument("--min-sets", type=int, default=8,
                        help="fewest input buffer sets to rotate over, however large they are "
                             "(single inputs differ by several percent at small batches)")
    parser.add_argument("--flush-bytes", type=float, default=1e9,
                        help="bytes read before each timed call (evicts L2, hides host time)")
    parser.add_argument("--quick", action="store_true", help="shorter timing budgets")
    parser.add_argument("--skip-torch", action="store_true")


def num_buffer_sets(args, set_bytes: int) -> int:
    """Buffer sets to rotate over: enough bytes that L2 cannot hold them, and at least
    ``--min-sets`` inputs, so that the median is not one or two inputs' time."""
    return max(args.min_sets, min(64, math.ceil(args.rotate_bytes / set_bytes)))


def timing_setup(args, what: str) -> tuple:
    """(device, its name, copy bandwidth in bytes/s, timing budget in s, flush buffer); prints
    the line that names them, ``what`` appended."""
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    bandwidth = copy_bandwidth(device)
    print(f"device: {name}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); "
          f"torch {torch.__version__}; k = {K}; float32 logits; temperature 1{what}")
    flush = torch.ones(int(args.flush_bytes) // 4, dtype=torch.float32, device=device)
    return device, name, bandwidth, 0.3 if args.quick else 1.0, flush


def print_json(benchmark: str, device_name: str, bandwidth: float, results: list) -> None:
    """The one JSON line a GPU benchmark here ends with."""
    print(json.dumps(dict(benchmark=benchmark, device=device_name,
                          copy_bandwidth_tb_s=round(bandwidth / 1e12, 3), k=K,
                          torch=torch.__version__, results=results)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[151936, 128256])
    parser.add_argument("--graph-batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--before", metavar="DIR",
                        help="also time the Triton op of the verispec/ops under DIR")
    add_timing_args(parser)
    args = parser.parse_args()

    import read_kernel  # imports triton: only on a GPU machine

    from verispec.ops import triton_ops

    before_ops = load_before(args.before) if args.before else None
    device, name, bandwidth, budget, flush = timing_setup(args, "")
    results = []
    header = (f"{'V':>7} {'B':>4} {'rule':>8} {'floor us':>9} {'read us':>8} {'x floor':>8} "
              f"{'triton us':>10} {'x floor':>8} {'x read':>7} {'graph us':>9} {'host us':>8} "
              f"{'torch us':>9} {'x floor':>8} {'accept len':>10} {'same':>5}"
              + (f" {'before us':>10} {'now/before':>10}" if before_ops else ""))
    print(header)
    print("-" * len(header))
    for vocab_size in args.vocab_sizes:
        for batch_size in args.batch_sizes:
            set_bytes = batch_size * (2 * K + 1) * vocab_size * 4
            num_sets = num_buffer_sets(args, set_bytes)
            sets = [make_inputs(batch_size, vocab_size, device, seed) for seed in range(num_sets)]
            for with_q in (True, False):
                rule = "full" if with_q else "one-hot"
                floor_bytes = batch_size * (K + 1) * vocab_size * 4
                if with_q:
                    floor_bytes += batch_size * K * vocab_size * 4
                floor_us = floor_bytes / bandwidth * 1e6
                read_out = torch.empty(
                    batch_size * (2 * K + 1) * math.ceil(vocab_size / read_kernel.CHUNK),
                    device=device)
                read_us = time_gpu(
                    lambda s, q=with_q, out=read_out: read_kernel.chunk_max(
                        s["target_logits"], s["draft_probs"] if q else None, out),
                    sets, flush, budget / 2)
                expected = call(rejection.rejection_sample, sets[0], with_q)
                accept_len = float((expected != -1).sum(1).float().mean())
                torch_us = None
                if not args.skip_torch:
                    torch_us = time_gpu(
                        lambda s, q=with_q: call(rejection.rejection_sample, s, q), sets, flush,
                        budget / 2, max_reps=50)
                same = bool(torch.equal(expected, call(triton_ops.rejection_sample, sets[0],
                                                       with_q)))

                def op(s, q=with_q):
                    return call(triton_ops.rejection_sample, s, q)

                triton_us = time_gpu(op, sets, flush, budget)
                before_us = None
                if before_ops is not None:
                    before_us = time_gpu(
                        lambda s, q=with_q: call(before_ops.rejection_sample, s, q), sets,
                        flush, budget)
                host_us = time_host(op, sets[0])
                graph_us = None
                if batch_size in args.graph_batch_sizes:
                    graph_us = time_graph(op, sets[:16])
                row = dict(
                    vocab_size=vocab_size, batch_size=batch_size, rule=rule,
                    floor_us=round(floor_us, 2), read_us=round(read_us, 2),
                    read_x_floor=round(read_us / floor_us, 3), triton_us=round(triton_us, 2),
                    triton_x_floor=round(triton_us / floor_us, 3),
                    triton_x_read=round(triton_us / read_us, 3),
                    triton_graph_us=None if graph_us is None else round(graph_us, 2),
                    triton_host_us=round(host_us, 1),
                    torch_us=None if torch_us is None else round(torch_us, 2),
                    torch_x_floor=None if torch_us is None else round(torch_us / floor_us, 3),
                    mean_acceptance_length=round(accept_len, 3), same_tokens=same,
                )
                if before_us is not None:
                    row.update(before_us=round(before_us, 2),
                               now_x_before=round(triton_us / before_us, 3))
                results.append(row)
                print(f"{vocab_size:>7} {batch_size:>4} {rule:>8} {floor_us:>9.1f} "
                      f"{read_us:>8.1f} {row['read_x_floor']:>8.2f} {triton_us:>10.1f} "
                      f"{row['triton_x_floor']:>8.2f} {row['triton_x_read']:>7.2f} "
                      f"{fmt(graph_us, '9.1f'):>9} {host_us:>8.1f} {fmt(torch_us, '9.1f'):>9} "
                      f"{fmt(row['torch_x_floor'], '8.2f'):>8} {accept_len:>10.2f} "
                      f"{str(same):>5}" + ("" if before_us is None else
                                          f" {before_us:>10.1f} {triton_us / before_us:>10.3f}"),
                      flush=True)
            del sets
            torch.cuda.empty_cache()
    print_json("bench_rejection", name, bandwidth, results)


if __name__ == "__main__":
    main()

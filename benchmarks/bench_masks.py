"""Rejection sampling with sampling masks on the GPU: what top-k, top-p and min-p cost.

The inputs, timing and floor of ``bench_rejection.py`` (k = 4 drafts per request, temperature 1,
float32 logits, ~80 % acceptance per position, L2 flushed by a read before each call), with the
one-hot rule (no draft probabilities) and per-request masks: none, min-p 0.05, top-k 50, top-p
0.9, and all three at once. For each: the Triton op's median µs, as a multiple of the memory
floor (the target logits read once) and of the same op without masks in the same run; the same
op with the mask search forced to its narrow programs (``triton_ops._MASK_WARPS``, what batches
whose rows outnumber the SMs get) where the default plan runs wide ones; the torch op's µs; and
whether both ops return the same tokens.

Prints a human table, then one JSON line.

    python benchmarks/bench_masks.py
    python benchmarks/bench_masks.py --batch-sizes 8 --vocab-sizes 151936 --quick
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from bench_rejection import (
    K,
    add_timing_args,
    fmt,
    make_inputs,
    num_buffer_sets,
    print_json,
    time_gpu,
    timing_setup,
)

from verispec.ops import rejection

MASKS = {
    "none": {},
    "min-p 0.05": {"min_p": 0.05},
    "top-k 50": {"top_k": 50},
    "top-p 0.9": {"top_p": 0.9},
    "all three": {"top_k": 50, "top_p": 0.9, "min_p": 0.05},
}


def mask_tensors(spec: dict, batch_size: int, device) -> tuple:
    """(top_k, top_p, min_p) per request, None where the mask is off."""
    top_k = top_p = min_p = None
    if "top_k" in spec:
        top_k = torch.full((batch_size,), spec["top_k"], dtype=torch.int32, device=device)
    if "top_p" in spec:
        top_p = torch.full((batch_size,), spec["top_p"], dtype=torch.float32, device=device)
    if "min_p" in spec:
        min_p = torch.full((batch_size,), spec["min_p"], dtype=torch.float32, device=device)
    return top_k, top_p, min_p


def call(op, inputs, masks):
    return op(
        inputs["target_logits"], inputs["draft_token_ids"], inputs["cu_num_draft_tokens"], None,
        inputs["temperature"], *masks, inputs["seeds"], inputs["positions"], K,
        check_draft_ids=False,
    )


@contextlib.contextmanager
def narrow_mask_search(triton_ops):
    """The mask search in narrow programs whatever the batch size (for the comparison; plans
    made afresh, since a plan keeps the width it was made with)."""
    saved = triton_ops._MASK_WIDE_WARPS, triton_ops._PLANS
    triton_ops._MASK_WIDE_WARPS, triton_ops._PLANS = triton_ops._MASK_WARPS, {}
    try:
        yield
    finally:
        triton_ops._MASK_WIDE_WARPS, triton_ops._PLANS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[151936, 128256])
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    add_timing_args(parser)
    args = parser.parse_args()

    from verispec.ops import triton_ops

    device, name, bandwidth, budget, flush = timing_setup(args, "; one-hot rule")
    header = (f"{'V':>7} {'B':>4} {'masks':>11} {'floor us':>9} {'triton us':>10} "
              f"{'x floor':>8} {'x unmasked':>10} {'narrow us':>10} {'x triton':>8} "
              f"{'torch us':>9} {'same':>5}")
    print(header)
    print("-" * len(header))
    results = []
    for vocab_size in args.vocab_sizes:
        for batch_size in args.batch_sizes:
            set_bytes = batch_size * (2 * K + 1) * vocab_size * 4
            num_sets = num_buffer_sets(args, set_bytes)
            sets = [make_inputs(batch_size, vocab_size, device, seed) for seed in range(num_sets)]
            floor_us = batch_size * (K + 1) * vocab_size * 4 / bandwidth * 1e6
            unmasked_us = time_gpu(
                lambda s: call(triton_ops.rejection_sample, s, (None, None, None)), sets, flush,
                budget)
            for label in args.masks:
                masks = mask_tensors(MASKS[label], batch_size, device)
                expected = call(rejection.rejection_sample, sets[0], masks)
                same = bool(torch.equal(expected,
                                        call(triton_ops.rejection_sample, sets[0], masks)))
                triton_us = (unmasked_us if label == "none" else time_gpu(
                    lambda s, m=masks: call(triton_ops.rejection_sample, s, m), sets, flush,
                    budget))
                narrow_us = None
                wide = triton_ops._mask_warps(batch_size * (K + 1), device) != \
                    triton_ops._MASK_WARPS
                if label != "none" and wide:
                    with narrow_mask_search(triton_ops):
                        same &= bool(torch.equal(
                            expected, call(triton_ops.rejection_sample, sets[0], masks)))
                        narrow_us = time_gpu(
                            lambda s, m=masks: call(triton_ops.rejection_sample, s, m), sets,
                            flush, budget)
                torch_us = None
                if not args.skip_torch:
                    torch_us = time_gpu(lambda s, m=masks: call(rejection.rejection_sample, s, m),
                                        sets, flush, budget / 2, max_reps=30)
                row = dict(vocab_size=vocab_size, batch_size=batch_size, masks=label,
                           floor_us=round(floor_us, 2), triton_us=round(triton_us, 2),
                           triton_x_floor=round(triton_us / floor_us, 3),
                           triton_x_unmasked=round(triton_us / unmasked_us, 3),
                           narrow_us=None if narrow_us is None else round(narrow_us, 2),
                           torch_us=None if torch_us is None else round(torch_us, 2),
                           same_tokens=same)
                results.append(row)
                print(f"{vocab_size:>7} {batch_size:>4} {label:>11} {floor_us:>9.1f} "
                      f"{triton_us:>10.1f} {row['triton_x_floor']:>8.2f} "
                      f"{row['triton_x_unmasked']:>10.2f} {fmt(narrow_us, '10.1f'):>10} "
                      f"{fmt(None if narrow_us is None else narrow_us / triton_us, '8.2f'):>8} "
                      f"{fmt(torch_us, '9.1f'):>9} "
                      f"{str(same):>5}", flush=True)
            del sets
            torch.cuda.empty_cache()
    print_json("bench_masks", name, bandwidth, results)


if __name__ == "__main__":
    main()

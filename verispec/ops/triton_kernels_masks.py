"""Triton kernels for the row-wide parts of logits processing: the top-k / top-p / min-p
thresholds (by bisection, never a sort) and the processed distribution p itself.

The masks of ``sampling.py`` are thresholds on one row (top-k keeps z >= the k-th largest z;
top-p keeps p >= tau, tau the smallest p_v whose strictly-larger mass is < top_p; min-p keeps
p >= min_p * max p), so ``_mask_stats_kernel`` finds each by bisection over the order-preserving
integer keys of float32 values: 32 counting (or mass-summing) passes over the row at most, no
sort and no per-row memory beyond the row itself. It writes the statistics every consumer
needs to compute p_v for any v on its own:

    row_stats[row] = (m, S, kth, tau, s_p, floor, s3)
    p_v = exp(z_v - m) / S             over z_v >= kth             (top-k, softmax)
    p_v = p_v / s_p                    over p_v >= tau             (top-p, renormalised)
    p_v = p_v / s3                     over p_v >= floor           (min-p, renormalised)
"""

from __future__ import annotations

import triton
import triton.language as tl

from verispec.ops.triton_kernels import (
    _exp,
    _helper,
    _load_row_stats,
    _processed,
    _request_span,
    _scale,
)


@_helper
def _key(x):
    """int64 key with the order of float32 x (negative floats flipped below the positives)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@_helper
def _from_key(key):
    bits = key.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@_helper
def _load_z(logits_ptr, row_offset, start, vocab_size, t_eff, TILE: tl.constexpr):
    ids = start + tl.arange(0, TILE)
    valid = ids < vocab_size
    x = tl.load(logits_ptr + row_offset + ids, mask=valid, other=float("-inf"))
    return _scale(x.to(tl.float32), t_eff), valid


@triton.jit
def _mask_stats_kernel(
    logits_ptr, logits_stride,  # [num_rows, V]
    cu_ptr,  # [B + 1] int, leading 0 (unused with NO_DRAFTS)
    temperature_ptr,  # [B] float32 (0 = greedy, processed as T = 1)
    top_k_ptr, top_p_ptr, min_p_ptr,  # [B] int / float32 / float32 (each HAS_*)
    row_stats_ptr,  # [num_rows, 8] float32 out: m, S, kth, tau, s_p, floor, s3
    vocab_size,
    TILE: tl.constexpr, NO_DRAFTS: tl.constexpr,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
):
    """Grid (B, max_num_draft_tokens + 1): row i of request r, one program per row."""
    req = tl.program_id(0)
    draft_start, num_drafts = _request_span(cu_ptr, req, NO_DRAFTS)
    if tl.program_id(1) > num_drafts:
        return
    row = draft_start + req + tl.program_id(1)
    temperature = tl.load(temperature_ptr + req)
    t_eff = tl.where(temperature > 0.0, temperature, 1.0)
    row_offset = row.to(tl.int64) * logits_stride

    z_max = tl.full([], float("-inf"), tl.float32)
    z_min = tl.full([], float("inf"), tl.float32)
    for start in range(0, vocab_size, TILE):
        z, valid = _load_z(logits_ptr, row_offset, start, vocab_size, t_eff, TILE)
        z_max = tl.maximum(z_max, tl.max(z, axis=0))
        z_min = tl.minimum(z_min, tl.min(tl.where(valid, z, float("inf")), axis=0))

    # top-k: kth = the largest key K with count(z >= K) >= k (an element's value; ties kept).
    kth = tl.full([], float("-inf"), tl.float32)
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + req).to(tl.int64)
        if (k > 0) & (k < vocab_size):
            lo = _key(z_min)  # count(z >= lo) = V >= k
            hi = _key(z_max) + 1  # count(z >= hi) = 0 < k
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                threshold = _from_key(mid)
                count = tl.zeros([], tl.int64)
                for start in range(0, vocab_size, TILE):
                    z, valid = _load_z(logits_ptr, row_offset, start, vocab_size, t_eff, TILE)
                    count += tl.sum((valid & (z >= threshold)).to(tl.int64), axis=0)
                if count >= k:
                    lo = mid
                else:
                    hi = mid
            kth = _from_key(lo)

    # softmax normaliser over the kept tokens
    s = tl.zeros([], tl.float32)
    for start in range(0, vocab_size, TILE):
        z, valid = _load_z(logits_ptr, row_offset, start, vocab_size, t_eff, TILE)
        z = tl.where(z < kth, float("-inf"), z)
        s += tl.sum(_exp(z - z_max), axis=0)
    p_max = tl.math.div_rn(1.0, s)  # exp(z_max - z_max) / S

    # top-p: tau = the smallest key K with mass(p > K) < top_p (an element's value).
    tau = tl.zeros([], tl.float32)
    s_p = tl.full([], 1.0, tl.float32)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + req)
        if top_p < 1.0:
            lo = tl.full([], -1, tl.int64)  # below every p: mass = 1 >= top_p
            hi = _key(p_max)  # mass(p > max p) = 0 < top_p
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                threshold = _from_key(mid)
                mass = tl.zeros([], tl.float32)
                for start in range(0, vocab_size, TILE):
                    z, valid = _load_z(logits_ptr, row_offset, start, vocab_size, t_eff, TILE)
                    p = _processed(z, z_max, s, kth, 0.0, 1.0, 0.0, 1.0, HAS_TOP_K, False, False)
                    mass += tl.sum(tl.where(p > threshold, p, 0.0), axis=0)
                if mass < top_p:
                    hi = mid
                else:
                    lo = mid
            tau = _from_key(hi)
        s_p = tl.zeros([], tl.float32)
        for start in range(0, vocab_size, TILE):
            z, valid = _load_z(logits_ptr, row_offset, start, vocab_size, t_eff, TILE)
            p = _processed(z, z_max, s, kth, 0.0, 1.0, 0.0, 1.0, HAS_TOP_K, False, False)
            s_p += tl.sum(tl.where(p < tau, 0.0, p), axis=0)
        p_max = tl.math.div_rn(p_max, s_p)

    # min-p: keep p >= min_p * max p
    floor = tl.zeros([], tl.float32)
    s3 = tl.full([], 1.0, tl.float32)
    if HAS_MIN_P:
        floor = tl.load(min_p_ptr + req) * p_max
        s3 = tl.zeros([], tl.float32)
        for start in range(0, vocab_size, TILE):
            z, valid = _load_z(logits_ptr, row_offset, start, vocab_size, t_eff, TILE)
            p = _processed(z, z_max, s, kth, tau, s_p, 0.0, 1.0, HAS_TOP_K, HAS_TOP_P, False)
            s3 += tl.sum(tl.where(p < floor, 0.0, p), axis=0)

    i = tl.arange(0, 8)
    stats = tl.where(i == 0, z_max, tl.where(i == 1, s, tl.where(i == 2, kth, tl.where(
        i == 3, tau, tl.where(i == 4, s_p, tl.where(i == 5, floor, s3))))))
    tl.store(row_stats_ptr + row * 8 + i, stats, mask=i < 7)


@triton.jit
def _probs_kernel(
    logits_ptr, logits_stride,  # [R, V]
    temperature_ptr,  # [R] float32 (0 = processed as T = 1)
    row_stats_ptr,  # [R, 8] float32 (MASKED)
    part_f_ptr,  # [3, R, NUM_CHUNKS] float32 softmax partials m_c, S_c (not MASKED)
    probs_ptr, probs_stride,  # [R, V] float32 out
    num_rows, vocab_size,
    NUM_CHUNKS: tl.constexpr, NC_P2: tl.constexpr, CHUNK: tl.constexpr,
    MASKED: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
):
    """Writes the processed distribution p of each row, one chunk per program."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    t_eff = tl.where(temperature > 0.0, temperature, 1.0)
    if MASKED:
        m, s, kth, tau, s_p, floor, s3 = _load_row_stats(row_stats_ptr + row * 8)
    else:
        c = tl.arange(0, NC_P2)
        pm = tl.load(part_f_ptr + row * NUM_CHUNKS + c, mask=c < NUM_CHUNKS, other=float("-inf"))
        ps = tl.load(part_f_ptr + num_rows * NUM_CHUNKS + row * NUM_CHUNKS + c,
                     mask=c < NUM_CHUNKS, other=0.0)
        m = tl.max(pm, axis=0)
        s = tl.sum(ps * tl.exp(pm - tl.where(m == float("-inf"), 0.0, m)), axis=0)
        kth, tau, s_p, floor, s3 = 0.0, 0.0, 1.0, 0.0, 1.0
    z, valid = _load_z(logits_ptr, row.to(tl.int64) * logits_stride, chunk * CHUNK, vocab_size,
                       t_eff, CHUNK)
    p = _processed(z, m, s, kth, tau, s_p, floor, s3, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    tl.store(probs_ptr + row.to(tl.int64) * probs_stride + ids, p, mask=valid)

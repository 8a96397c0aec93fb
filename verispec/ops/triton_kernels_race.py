"""Triton kernel for the recovered token at the first rejection (REFERENCE §3): the
exponential race over the residual of the final row, split over programs by chunk. See
``triton_kernels`` for the whole design."""

from __future__ import annotations

import triton
import triton.language as tl

from verispec.ops.triton_kernels import (
    BIG_INDEX,
    RESIDUAL_STREAM,
    _argmax_tile,
    _helper,
    _noise_at,
    _noise_tile,
    _processed,
    _race_candidates,
    _scale,
    _tile_ids,
    _two_level_pick,
    _write_output,
)


@triton.jit
def _race_kernel(
    logits_ptr, logits_stride,  # [num_rows, V]
    draft_ids_ptr,  # [num_draft_tokens] int
    cu_ptr,  # [B + 1] int, leading 0
    draft_probs_ptr, draft_probs_stride,  # [num_draft_tokens, V] float32 (HAS_DRAFT_PROBS)
    temperature_ptr,  # [B] float32
    seeds_ptr, positions_ptr,  # [B] int64
    record_ptr,  # [B, 2] int32: (num_accepted, rejected draft), or -1: nothing to race
    record_f_ptr,  # [B, 8] float32: the final row's m, S, kth, tau, s_p, floor, s3
    race_f_ptr,  # [2, B, NUM_RACE_CHUNKS] float32: chunk winners' scores, chunk masses
    race_i_ptr,  # [B, NUM_RACE_CHUNKS] int32: chunk winners' ids
    counter_ptr,  # [B] int32, zeroed by _stats_kernel
    token_ids_ptr, token_ids_stride,  # [B, width] int32
    batch_size, vocab_size, width,
    RACE_CHUNK: tl.constexpr, NUM_RACE_CHUNKS: tl.constexpr, NRC_P2: tl.constexpr,
    WIDTH_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    NB_P2: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
):
    """Grid (B, NUM_RACE_CHUNKS): the recovered token of request r at its first rejection,
    raced over one chunk of the final row per program; the last program of the request picks
    it. Requests with nothing to race exit after one load."""
    req = tl.program_id(0)
    chunk = tl.program_id(1)
    record = tl.load(record_ptr + 2 * req)
    if record >= 0:
        num_accepted = record.to(tl.int64)
        draft_start = tl.load(cu_ptr + req).to(tl.int64)
        st = record_f_ptr + 8 * req
        temperature = tl.load(temperature_ptr + req)
        _residual_race(
            logits_ptr, logits_stride, draft_ids_ptr, draft_probs_ptr, draft_probs_stride,
            race_f_ptr, race_f_ptr + batch_size * NUM_RACE_CHUNKS, race_i_ptr, counter_ptr,
            token_ids_ptr, token_ids_stride,
            req, chunk, draft_start, num_accepted, draft_start + req + num_accepted,
            tl.where(temperature > 0.0, temperature, 1.0),
            tl.load(seeds_ptr + req), tl.load(positions_ptr + req),
            tl.load(record_ptr + 2 * req + 1), RESIDUAL_STREAM, record >= 0,
            tl.load(st), tl.load(st + 1), tl.load(st + 2), tl.load(st + 3), tl.load(st + 4),
            tl.load(st + 5), tl.load(st + 6), vocab_size, width,
            NUM_RACE_CHUNKS, NRC_P2, RACE_CHUNK, WIDTH_P2, BLOCK, NUM_BLOCKS, NB_P2,
            HAS_DRAFT_PROBS, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P,
        )


@_helper
def _residual_race(
    logits_ptr, logits_stride, draft_ids_ptr, draft_probs_ptr, draft_probs_stride,
    race_score_ptr, race_mass_ptr, race_idx_ptr, counter_ptr, token_ids_ptr,
    token_ids_stride, req, chunk, draft_start, num_accepted, final_row, t_eff, seed, position,
    rejected_id, stream, rejected, m, s, kth, tau, s_p, floor, s3, vocab_size, width,
    NUM_CHUNKS: tl.constexpr, NC_P2: tl.constexpr, CHUNK: tl.constexpr,
    WIDTH_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    NB_P2: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
):
    """The token sampled on the final row: race over one chunk of it, then the last program of
    the request picks from the chunk winners and masses (``_two_level_pick``) and writes the
    output row. At a rejection (``rejected``) the weights are the residual and ``stream`` is the
    residual stream; on the bonus row (``rejected_id`` = -1) they are p and ``stream`` the
    sample stream."""
    position = position + num_accepted
    best, best_id, mass = _chunk_winner(
        logits_ptr + final_row * logits_stride,
        draft_probs_ptr + (draft_start + num_accepted) * draft_probs_stride, chunk * CHUNK,
        vocab_size, t_eff, seed, position, stream, rejected_id, rejected,
        m, s, kth, tau, s_p, floor, s3, CHUNK, HAS_DRAFT_PROBS, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
    slot = req * NUM_CHUNKS + chunk
    tl.store(race_score_ptr + slot, best)
    tl.store(race_mass_ptr + slot, mass)
    tl.store(race_idx_ptr + slot, best_id)
    tl.debug_barrier()
    num_done = tl.atomic_add(counter_ptr + req, 1, sem="acq_rel")
    if num_done == NUM_CHUNKS - 1:
        c = tl.arange(0, NC_P2)
        c_ok = c < NUM_CHUNKS
        base = req * NUM_CHUNKS + c
        chunk_ids = tl.load(race_idx_ptr + base, mask=c_ok, other=0, volatile=True)
        scores = tl.load(race_score_ptr + base, mask=c_ok, other=-1.0, volatile=True)
        masses = tl.load(race_mass_ptr + base, mask=c_ok, other=0.0, volatile=True)
        if tl.max(masses, axis=0) == 0.0:
            # Empty residual (p = q up to rounding): sample from p, on the same stream.
            for cc in range(0, NUM_CHUNKS):
                b, b_id, mass_cc = _exact_tile_winner(
                    logits_ptr + final_row * logits_stride, cc * CHUNK, vocab_size, t_eff, seed,
                    position, stream, -1, m, s, kth, tau, s_p, floor, s3, CHUNK,
                    HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
                scores = tl.where(c == cc, b, scores)
                chunk_ids = tl.where(c == cc, b_id, chunk_ids)
                masses = tl.where(c == cc, mass_cc, masses)
        token = _two_level_pick(scores, chunk_ids, masses, c, c_ok, seed, position, stream,
                                CHUNK, BLOCK, NUM_BLOCKS, NB_P2)
        _write_output(token_ids_ptr, token_ids_stride, draft_ids_ptr, draft_start, req,
                      num_accepted, token, width, WIDTH_P2, False)


@_helper
def _chunk_winner(row_ptr, q_row_ptr, start, vocab_size, t_eff, seed, position, stream,
                  rejected_id, rejected, m, s, kth, tau, s_p, floor, s3, CHUNK: tl.constexpr,
                  HAS_DRAFT_PROBS: tl.constexpr, HAS_TOP_K: tl.constexpr,
                  HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """The race over tokens start .. start + CHUNK of a final row: (best score, its id, the
    chunk's total weight on the scale the ranking uses). Bounds on the noise that need no
    logarithm (``_race_candidates``) leave a few tokens that can win; those are scored exactly
    as the twin scores them, so the winner and its score are the twin's. Weights as
    ``_residual_race`` describes (``q_row_ptr``: the rejected draft's q row, full rule)."""
    ids = _tile_ids(start, CHUNK // 4)
    valid = ids < vocab_size
    x = tl.load(row_ptr + ids, mask=valid, other=float("-inf"))
    z = _scale(x.to(tl.float32), t_eff)
    if HAS_TOP_K or HAS_TOP_P or HAS_MIN_P:
        p = _processed(z, m, s, kth, tau, s_p, floor, s3, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
        w = _residual(p, ids, q_row_ptr, valid, rejected_id, rejected, HAS_DRAFT_PROBS)
    elif HAS_DRAFT_PROBS:
        # max(0, p - q) cancels: rank it with the twin's p; on the bonus row exp(z - m) will do
        if rejected:
            p = _processed(z, m, s, kth, tau, s_p, floor, s3, False, False, False)
            w = _residual(p, ids, q_row_ptr, valid, rejected_id, rejected, True)
        else:
            w = tl.exp(z - m)
    else:
        # one-hot rule without masks: the residual is proportional to exp(z - m) off the
        # rejected draft, which is all the ranking needs
        w = tl.where(ids == rejected_id, 0.0, tl.exp(z - m))
    w = tl.where(valid, w, 0.0)
    cand = _race_candidates(w, seed, position, stream, start, CHUNK // 4)
    best_id = start  # a valid index even if no token has weight
    best = tl.full((), -1.0, tl.float32)
    nxt = tl.min(tl.min(tl.where(cand, ids, BIG_INDEX), axis=1), axis=0)
    while nxt < BIG_INDEX:
        # residual / E as the twin computes it (ties: the smallest index, as argmax)
        p_c = _processed(_scale(tl.load(row_ptr + nxt).to(tl.float32), t_eff), m, s, kth, tau,
                         s_p, floor, s3, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
        w_c = _residual(p_c, nxt, q_row_ptr, nxt >= 0, rejected_id, rejected, HAS_DRAFT_PROBS)
        score = tl.math.div_rn(w_c, _noise_at(seed, position, stream, nxt))
        best_id = tl.where(score > best, nxt, best_id)
        best = tl.maximum(score, best)
        nxt = tl.min(tl.min(tl.where(cand & (ids > nxt), ids, BIG_INDEX), axis=1), axis=0)
    return best, best_id, tl.sum(tl.sum(w, axis=1), axis=0)


@_helper
def _exact_tile_winner(row_ptr, start, vocab_size, t_eff, seed, position, stream, rejected_id,
                       m, s, kth, tau, s_p, floor, s3, TILE: tl.constexpr,
                       HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
                       HAS_MIN_P: tl.constexpr):
    """The race over tokens start .. start + TILE of a row (one-hot rule or no rejection:
    weights p, token ``rejected_id`` excluded; -1 excludes none), every token scored exactly as
    the twin scores it: (best score, its id (ties: the smallest), the tile's mass of p without
    the excluded token). No candidate loop: a fixed chain of latency, for the critical path."""
    ids = _tile_ids(start, TILE // 4)
    valid = ids < vocab_size
    x = tl.load(row_ptr + ids, mask=valid, other=float("-inf"))
    p = _processed(_scale(x.to(tl.float32), t_eff), m, s, kth, tau, s_p, floor, s3,
                   HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
    w = tl.where(valid & (ids != rejected_id), p, 0.0)
    noise = _noise_tile(seed, position, stream, start, TILE // 4)
    best, best_id = _argmax_tile(tl.where(valid, tl.math.div_rn(w, noise), -1.0), ids)
    return best, best_id, tl.sum(tl.sum(w, axis=1), axis=0)


@_helper
def _residual(p, ids, q_row_ptr, valid, rejected_id, rejected, HAS_DRAFT_PROBS: tl.constexpr):
    """The residual weights at ``ids``: max(0, p - q) (full rule) or p with the rejected draft
    zeroed (one-hot rule); p itself on the bonus row (no rejection: q is not read, and
    ``rejected_id`` = -1 zeroes nothing)."""
    if HAS_DRAFT_PROBS:
        q = tl.load(q_row_ptr + ids, mask=valid & (ids * 0 + rejected.to(tl.int32) > 0),
                    other=0.0)
        w = tl.maximum(p - q, 0.0)
    else:
        w = tl.where(ids == rejected_id, 0.0, p)
    return w

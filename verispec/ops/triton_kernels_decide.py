"""Triton code that verifies one request's drafts from its rows' chunk statistics (REFERENCE §3):
``_decide_kernel`` (grid (B,), the second of the three launches) and the helper it shares with
the one-launch kernel of ``triton_kernels_fused``. See ``triton_kernels`` for the whole design."""

from __future__ import annotations

import triton
import triton.language as tl

from verispec.ops.triton_kernels import (
    ACCEPT_STREAM,
    BIG_INDEX,
    _helper,
    _noise_at,
    _partial_planes,
    _processed,
    _request_span,
    _scale,
    _two_level_pick,
    _uniform_at,
    _write_output,
)


@triton.jit
def _decide_kernel(
    logits_ptr, logits_stride,  # [num_rows, V]
    draft_ids_ptr,  # [num_draft_tokens] int
    cu_ptr,  # [B + 1] int, leading 0 (unused with NO_DRAFTS)
    draft_probs_ptr, draft_probs_stride,  # [num_draft_tokens, V] float32 (HAS_DRAFT_PROBS)
    temperature_ptr,  # [B] float32, 0 = greedy
    seeds_ptr, positions_ptr,  # [B] int64
    rates_ptr,  # [>= max_num_draft_tokens] float32 conditional rates (SYNTHETIC)
    row_stats_ptr,  # [num_rows, 8] float32 (MASKED): m, S, kth, tau, s_p, floor, s3
    part_f_ptr,  # [3, num_rows, NUM_CHUNKS] float32: chunk max m_c, sum exp(z - m_c), raw max
    part_i_ptr,  # [2, num_rows, NUM_CHUNKS] int32: raw argmax, chunk winner of the bonus race
    record_ptr,  # [B, 2] int32 out: (num_accepted, rejected draft) where a recovered token
    #              must be raced, else (-1, -1)
    record_f_ptr,  # [B, 8] float32 out: the final row's m, S, kth, tau, s_p, floor, s3
    token_ids_ptr, token_ids_stride,  # [B, width] int32 (or int64 for sampling)
    num_rows, width, bonus_stream,
    NUM_CHUNKS: tl.constexpr, NC_P2: tl.constexpr, ROWS_P2: tl.constexpr,
    WIDTH_P2: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr,
    NO_DRAFTS: tl.constexpr, ALL_GREEDY: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr,
    SYNTHETIC: tl.constexpr, MASKED: tl.constexpr, HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
):
    """Grid (B,): verify request r's drafts from the row statistics; write its output row,
    unless its recovered token must be raced over the final row (then ``record[r]``)."""
    _decide_request(
        tl.program_id(0), logits_ptr, logits_stride, draft_ids_ptr, cu_ptr, draft_probs_ptr,
        draft_probs_stride, temperature_ptr, seeds_ptr, positions_ptr, rates_ptr, row_stats_ptr,
        part_f_ptr, part_i_ptr, record_ptr, record_f_ptr, token_ids_ptr, token_ids_stride,
        num_rows, width, bonus_stream, NUM_CHUNKS, NC_P2, ROWS_P2, WIDTH_P2, CHUNK, BLOCK,
        NUM_BLOCKS, NB_P2, NO_DRAFTS, ALL_GREEDY, HAS_DRAFT_PROBS, SYNTHETIC, True, MASKED,
        HAS_TOP_K, HAS_TOP_P, HAS_MIN_P,
    )


@_helper
def _decide_request(
    req, logits_ptr, logits_stride, draft_ids_ptr, cu_ptr, draft_probs_ptr, draft_probs_stride,
    temperature_ptr, seeds_ptr, positions_ptr, rates_ptr, row_stats_ptr, part_f_ptr,
    part_i_ptr, record_ptr, record_f_ptr, token_ids_ptr, token_ids_stride,
    num_rows, width, bonus_stream,
    NUM_CHUNKS: tl.constexpr, NC_P2: tl.constexpr, ROWS_P2: tl.constexpr,
    WIDTH_P2: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr,
    NO_DRAFTS: tl.constexpr, ALL_GREEDY: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr,
    SYNTHETIC: tl.constexpr, BONUS_CANDIDATES: tl.constexpr, MASKED: tl.constexpr,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    RESIDUAL_MASSES: tl.constexpr = False,
):
    """Verify request ``req``. Writes its output row when the request is greedy, or when every
    draft passed and the bonus row's chunk candidates are known (BONUS_CANDIDATES); otherwise
    writes ``record[req]`` = (num_accepted, rejected draft or -1 for the bonus row) and the final
    row's statistics for the race. Returns (1 when a race is needed, else 0; num_accepted; the
    rejected draft or -1; the final row's m and S; its chunk masses of p; with RESIDUAL_MASSES
    (one-hot rule, unmasked) its chunk masses without the rejected draft, from the fourth
    plane of the partials, else zeros), so that a caller in the same program races at once."""
    part_m_ptr, part_s_ptr, part_amax_ptr, part_aidx_ptr, part_ridx_ptr = _partial_planes(
        part_f_ptr, part_i_ptr, num_rows, NUM_CHUNKS)
    draft_start, num_drafts = _request_span(cu_ptr, req, NO_DRAFTS)
    first_row = draft_start + req
    temperature = tl.load(temperature_ptr + req)
    greedy = (temperature == 0.0) | ALL_GREEDY
    t_eff = tl.where(greedy, 1.0, temperature)
    seed = tl.load(seeds_ptr + req)
    position = tl.load(positions_ptr + req)

    # --- per-row statistics of the request's rows (i = 0..n_r; row n_r is the bonus row) ---
    i = tl.arange(0, ROWS_P2)
    rows = first_row + i  # [ROWS_P2] int64
    row_ok = i <= num_drafts
    is_draft = i < num_drafts
    c = tl.arange(0, NC_P2)
    part = rows[:, None] * NUM_CHUNKS + c[None, :]  # [ROWS_P2, NC_P2]
    part_ok = row_ok[:, None] & (c < NUM_CHUNKS)[None, :]
    # The partials may come from other programs of the same launch (``triton_kernels_fused``):
    # read them from L2 (.cg), never from a stale L1 line.
    amax = tl.load(part_amax_ptr + part, mask=part_ok, other=float("-inf"), cache_modifier=".cg")
    aidx = tl.load(part_aidx_ptr + part, mask=part_ok, other=BIG_INDEX, cache_modifier=".cg")
    row_max = tl.max(amax, axis=1)
    row_argmax = tl.min(tl.where(amax == row_max[:, None], aidx, BIG_INDEX), axis=1)
    zeros = tl.zeros([ROWS_P2], dtype=tl.float32)
    m = zeros
    s = zeros + 1.0
    mass = tl.zeros([ROWS_P2, NC_P2], dtype=tl.float32)  # chunk masses (unmasked rows)
    residual_mass = mass  # the same without the row's draft (RESIDUAL_MASSES)
    kth = zeros
    tau = zeros
    s_p = zeros + 1.0
    floor = zeros
    s3 = zeros + 1.0
    if not ALL_GREEDY:
        if MASKED:
            st = row_stats_ptr + rows * 8
            m = tl.load(st, mask=row_ok, other=0.0)
            s = tl.load(st + 1, mask=row_ok, other=1.0)
            kth = tl.load(st + 2, mask=row_ok, other=0.0)
            tau = tl.load(st + 3, mask=row_ok, other=0.0)
            s_p = tl.load(st + 4, mask=row_ok, other=1.0)
            floor = tl.load(st + 5, mask=row_ok, other=0.0)
            s3 = tl.load(st + 6, mask=row_ok, other=1.0)
        else:
            # Combine the chunk partials: m = max m_c, S = sum_c S_c exp(m_c - m).
            pm = tl.load(part_m_ptr + part, mask=part_ok, other=float("-inf"),
                         cache_modifier=".cg")
            ps = tl.load(part_s_ptr + part, mask=part_ok, other=0.0, cache_modifier=".cg")
            if RESIDUAL_MASSES:
                plane = num_rows * NUM_CHUNKS
                pr = tl.load(part_f_ptr + 3 * plane + part, mask=part_ok, other=0.0,
                             cache_modifier=".cg")
            m = tl.max(pm, axis=1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            scale = tl.exp(pm - m_safe[:, None])
            mass = ps * scale
            s = tl.sum(mass, axis=1)
            if RESIDUAL_MASSES:
                residual_mass = pr * scale

    # --- the bonus token, in case every draft passes: from the bonus row's chunk winners, each
    # re-scored as the twin scores it, and the chunks' masses (issued before the verification
    # so that its loads overlap it) ---
    bonus_token = tl.sum(i * 0, axis=0)
    if BONUS_CANDIDATES and not ALL_GREEDY:
        bonus_row = first_row + num_drafts
        c_ok = c < NUM_CHUNKS * (temperature != 0.0).to(tl.int32)  # greedy: no race winners
        ridx = tl.load(part_ridx_ptr + bonus_row * NUM_CHUNKS + c, mask=c_ok, other=0)
        x_w = tl.load(logits_ptr + bonus_row * logits_stride + ridx, mask=c_ok, other=0.0)
        noise = _noise_at(seed, position + num_drafts, bonus_stream, ridx)
        at_bonus = i == num_drafts
        w = _processed(_scale(x_w.to(tl.float32), t_eff),
                       tl.sum(tl.where(at_bonus, m, 0.0), axis=0),
                       tl.sum(tl.where(at_bonus, s, 0.0), axis=0),
                       tl.sum(tl.where(at_bonus, kth, 0.0), axis=0),
                       tl.sum(tl.where(at_bonus, tau, 0.0), axis=0),
                       tl.sum(tl.where(at_bonus, s_p, 0.0), axis=0),
                       tl.sum(tl.where(at_bonus, floor, 0.0), axis=0),
                       tl.sum(tl.where(at_bonus, s3, 0.0), axis=0),
                       HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
        if MASKED:  # the stats kernel left the bonus row's chunk masses of p in that plane
            masses = tl.load(part_s_ptr + bonus_row * NUM_CHUNKS + c, mask=c_ok, other=0.0,
                             cache_modifier=".cg")
        else:
            masses = tl.sum(tl.where(at_bonus[:, None], mass, 0.0), axis=0)
        bonus_token = _two_level_pick(tl.math.div_rn(w, noise), ridx, masses, c, c_ok, seed,
                                      position + num_drafts, bonus_stream, CHUNK, BLOCK,
                                      NUM_BLOCKS, NB_P2)

    # --- verification: accept d_i ... the leading run of accepts counts ---
    num_accepted = num_drafts * 0
    d = i * 0
    if not NO_DRAFTS:
        d = tl.load(draft_ids_ptr + draft_start + i, mask=is_draft, other=0).to(tl.int32)
        u = _uniform_at(seed, position + i, ACCEPT_STREAM)  # [ROWS_P2] in (0, 1)
        if SYNTHETIC:
            # accept iff u_i < c_i, whatever p and q say (benchmarking only)
            accepted = u < tl.load(rates_ptr + i, mask=is_draft, other=0.0)
        else:
            accepted = d == row_argmax  # greedy target: accept iff d == argmax p
            if not ALL_GREEDY:
                x_d = tl.load(logits_ptr + rows * logits_stride + d, mask=is_draft, other=0.0)
                p_d = _processed(_scale(x_d.to(tl.float32), t_eff), m, s, kth, tau, s_p, floor,
                                 s3, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
                if HAS_DRAFT_PROBS:
                    # full rule: accept iff u q(d) < p(d); q(d) = 0 cannot be sampled: reject
                    q_d = tl.load(draft_probs_ptr + (draft_start + i) * draft_probs_stride + d,
                                  mask=is_draft, other=0.0)
                    accept_random = (u * q_d < p_d) & (q_d > 0.0)
                else:
                    # one-hot rule: accept iff u < p(d); p(d) = 0 never passes as u > 0
                    accept_random = u < p_d
                accepted = tl.where(greedy, accepted, accept_random)
        accepted = accepted & is_draft
        num_accepted = tl.min(tl.where(accepted, ROWS_P2, i), axis=0).to(tl.int64)

    # --- the final row: recovered at the first rejection, else the bonus row ---
    rejected = num_accepted < num_drafts
    at_final = i == num_accepted
    token = tl.sum(tl.where(at_final, row_argmax, 0), axis=0)
    finished = greedy
    if BONUS_CANDIDATES:
        finished = greedy | (rejected == 0)
    needs_race = 0
    rejected_id = tl.where(rejected, tl.sum(tl.where(at_final, d, 0), axis=0), -1)
    final_m = tl.sum(tl.where(at_final, m, 0.0), axis=0)
    final_s = tl.sum(tl.where(at_final, s, 0.0), axis=0)
    if finished:
        if not ALL_GREEDY:
            token = tl.where(greedy, token, bonus_token)
        _write_output(token_ids_ptr, token_ids_stride, draft_ids_ptr, draft_start, req,
                      num_accepted, token, width, WIDTH_P2, NO_DRAFTS)
        tl.store(record_ptr + 2 * req, -1)
    else:
        # everything the race needs about the final row, so that it starts with one load
        needs_race = 1
        tl.store(record_ptr + 2 * req, num_accepted.to(tl.int32))
        tl.store(record_ptr + 2 * req + 1, rejected_id)
        out = record_f_ptr + 8 * req
        tl.store(out, final_m)
        tl.store(out + 1, final_s)
        tl.store(out + 2, tl.sum(tl.where(at_final, kth, 0.0), axis=0))
        tl.store(out + 3, tl.sum(tl.where(at_final, tau, 0.0), axis=0))
        tl.store(out + 4, tl.sum(tl.where(at_final, s_p, 0.0), axis=0))
        tl.store(out + 5, tl.sum(tl.where(at_final, floor, 0.0), axis=0))
        tl.store(out + 6, tl.sum(tl.where(at_final, s3, 0.0), axis=0))
    return (needs_race, num_accepted, rejected_id, final_m, final_s,
            tl.sum(tl.where(at_final[:, None], mass, 0.0), axis=0),
            tl.sum(tl.where(at_final[:, None], residual_mass, 0.0), axis=0))

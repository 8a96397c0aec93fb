"""The second launch of rejection sampling (and plain sampling): ``_finish_kernel`` finds each
request's first candidate row from the first launch's records and races its token
(``verispec.ops.triton_kernels_rows`` describes both launches and ``_rows_kernel``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from verispec.ops.triton_kernels import (
    RESIDUAL_STREAM,
    _argmax_vec,
    _chosen_block,
    _exact_tile_winner,
    _load_row_stats,
    _request_span,
    _residual_chunk_winner,
    _write_output,
)
from verispec.ops.triton_kernels_rows import CANDIDATE, RESIDUAL, _synthetic_final_row


@triton.jit(do_not_specialize=["batch_size", "num_rows", "width"])
def _finish_kernel(
    logits_ptr, logits_stride, draft_ids_ptr, cu_ptr, draft_probs_ptr, draft_probs_stride,
    temperature_ptr, seeds_ptr, positions_ptr, rates_ptr, row_stats_ptr,  # as _rows_kernel's
    row_i_ptr, row_f_ptr,  # the rows' records, written by _rows_kernel
    race_f_ptr,  # [2, B, NUM_PROGRAMS] float32: the programs' best scores, residual masses
    race_i_ptr,  # [B, NUM_PROGRAMS] int32: their winners
    sync_ptr,  # [num_rows + 2 B] int32: row counters, early words, race counters
    token_ids_ptr, token_ids_stride,  # [B, width] int32 (sampling: [B] int64)
    batch_size, num_rows, vocab_size, width, bonus_stream,
    NUM_PROGRAMS: tl.constexpr, NP_P2: tl.constexpr, RACE_CHUNK: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_SPAN: tl.constexpr, ROWS_P2: tl.constexpr, WIDTH_P2: tl.constexpr,
    BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr,
    NO_DRAFTS: tl.constexpr, ALL_GREEDY: tl.constexpr, SYNTHETIC: tl.constexpr,
    MASKED: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (B, NUM_PROGRAMS): request r's final row, RACE_CHUNK tokens of its race per
    program; the last program to count writes the output row. See the module docstring."""
    req = tl.program_id(0)
    c = tl.program_id(1)
    draft_start, num_drafts = _request_span(cu_ptr, req, NO_DRAFTS)
    seed = tl.load(seeds_ptr + req)
    position = tl.load(positions_ptr + req)
    temperature = tl.load(temperature_ptr + req)
    i = tl.arange(0, ROWS_P2)
    drafts = tl.full([ROWS_P2], -1, tl.int32)  # the request's drafts (-1: none)
    if not NO_DRAFTS:
        drafts = tl.load(draft_ids_ptr + draft_start + i, mask=i < num_drafts, other=-1)
    if PDL:  # launched early (programmatic dependent launch): the inputs above were ready;
        # what _rows_kernel wrote, and its counters, only once it has finished
        gdc_wait()
    if c == 0:  # the row counters and the early word, zero for the next launch
        tl.store(sync_ptr + draft_start + req + i, 0, mask=i <= num_drafts)
        tl.store(sync_ptr + num_rows + req, 0)
    if SYNTHETIC:
        final = _synthetic_final_row(draft_ids_ptr + draft_start, num_drafts, seed, position,
                                     rates_ptr, ROWS_P2)
    else:
        state = tl.load(row_i_ptr + (draft_start + req + i) * 2, mask=i <= num_drafts,
                        other=CANDIDATE)
        final = tl.min(tl.where(state >= CANDIDATE, i, ROWS_P2), axis=0)
    row = draft_start + req + final
    first = tl.load(row_i_ptr + row * 2 + 1)  # a greedy row's token, else a block's start
    if (temperature == 0.0) | ALL_GREEDY:
        if c == 0:
            _write_output(token_ids_ptr, token_ids_stride, draft_ids_ptr, draft_start, req,
                          final, first, width, WIDTH_P2, NO_DRAFTS)
    else:
        d = tl.max(tl.where(i == final, drafts, -1), axis=0).to(tl.int32)  # -1: none
        stream = tl.where(d >= 0, RESIDUAL_STREAM, bonus_stream)
        excluded = tl.full((), -1, tl.int32)
        if tl.load(row_i_ptr + row * 2) == RESIDUAL:  # the final row's draft, rejected
            excluded = d
            if HAS_DRAFT_PROBS:  # races max(0, p - q) over the whole row, and falls back to
                # p's block (``first``) when that is empty
                excluded, first = first, -1
        m = tl.load(row_f_ptr + row * 2)
        s = tl.load(row_f_ptr + row * 2 + 1)
        kth, tau, s_p, floor, s3 = 0.0, 0.0, 1.0, 0.0, 1.0
        if MASKED:
            _, _, kth, tau, s_p, floor, s3 = _load_row_stats(row_stats_ptr + row * 8)
        row_ptr = logits_ptr + row * logits_stride
        position = position + final
        score, idx, mass = -1.0, 0, 0.0
        if first >= 0:  # the chosen block, RACE_CHUNK tokens per program
            if c * RACE_CHUNK < BLOCK_SPAN:
                score, idx = _exact_tile_winner(
                    row_ptr, first + c * RACE_CHUNK, vocab_size, temperature, seed, position,
                    stream, excluded, m, s, kth, tau, s_p, floor, s3, RACE_CHUNK, HAS_TOP_K,
                    HAS_TOP_P, HAS_MIN_P)
        else:  # full rule, rejected: chunk c of the whole row, weights max(0, p - q)
            score, idx, mass = _residual_chunk_winner(
                row_ptr, draft_probs_ptr + (draft_start + final) * draft_probs_stride,
                c * RACE_CHUNK, vocab_size, temperature, seed, position, stream, m, s, kth,
                tau, s_p, floor, s3, RACE_CHUNK, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
        slot = req * NUM_PROGRAMS + c
        tl.store(race_f_ptr + slot, score)
        tl.store(race_f_ptr + batch_size * NUM_PROGRAMS + slot, mass)
        tl.store(race_i_ptr + slot, idx)
        tl.debug_barrier()
        counter_ptr = sync_ptr + num_rows + batch_size + req
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == NUM_PROGRAMS - 1:
            tl.store(counter_ptr, 0)
            k = tl.arange(0, NP_P2)
            k_ok = k < NUM_PROGRAMS
            slots = req * NUM_PROGRAMS + k
            scores = tl.load(race_f_ptr + slots, mask=k_ok, other=-2.0, cache_modifier=".cg")
            ids = tl.load(race_i_ptr + slots, mask=k_ok, other=0, cache_modifier=".cg")
            if first < 0:
                masses = tl.load(race_f_ptr + batch_size * NUM_PROGRAMS + slots, mask=k_ok,
                                 other=0.0, cache_modifier=".cg")
                if tl.max(masses, axis=0) == 0.0:
                    # empty residual (p = q up to rounding): p's block, on the same stream
                    scores = tl.full([NP_P2], -2.0, tl.float32)
                    for t in range(0, BLOCK_SPAN // RACE_CHUNK):
                        b_score, b_idx = _exact_tile_winner(
                            row_ptr, excluded + t * RACE_CHUNK, vocab_size, temperature, seed,
                            position, stream, -1, m, s, kth, tau, s_p, floor, s3, RACE_CHUNK,
                            HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
                        scores = tl.where(k == t, b_score, scores)
                        ids = tl.where(k == t, b_idx, ids)
                else:
                    chosen = _chosen_block(masses, k, k_ok, seed, position, stream, RACE_CHUNK,
                                           BLOCK, NUM_BLOCKS, NB_P2)
                    scores = tl.where(k // (BLOCK // RACE_CHUNK) == chosen, scores, -2.0)
            _, token = _argmax_vec(scores, ids)
            _write_output(token_ids_ptr, token_ids_stride, draft_ids_ptr, draft_start, req,
                          final, token, width, WIDTH_P2, NO_DRAFTS)

"""Rejection sampling in one Triton launch (REFERENCE §3), so that the final row of a request,
which the race reads a second time, is still in L2 when it is read again.

The three launches of ``triton_kernels`` read every target row once for its statistics, then
the final row of each request whose draft a random target rejected again, from device memory:
by the time ``_race_kernel`` runs, the whole batch has streamed through L2. Here one grid holds
three kinds of work, ordered so that a request's race follows its statistics closely:

    program id = step * (ROWS * NUM_CHUNKS + NUM_RACE_CHUNKS) + item
    item <  ROWS * NUM_CHUNKS    statistics of (row item % ROWS, chunk item // ROWS) of request
                                 ``step``; the last of them to finish (a counter) verifies the
                                 request (``_decide_request``) and publishes the decision
    item >= ROWS * NUM_CHUNKS    one chunk of the race over the final row of request
                                 ``step - lag``: the recovered token at the first rejection, or
                                 the bonus token when every draft passed (noise is paid on the
                                 final row only, one row per random request); the last of them
                                 picks the winner and writes the output row

A race program waits (spins) until its request is decided. Programs start in the order of
their ids, and every program a race program waits for has a smaller id and waits for nothing
later than itself, so the wait always ends; with ``lag`` requests between a request's
statistics and its race, it rarely waits at all, and the final row is read back from L2
(``lag + 1`` requests' rows are in flight: 3 MB each at k = 4, V = 151 936). Counters and
decision flags live in ``sync`` ([3, B] int32, zeroed before the launch).

Everything each step computes is what the three launches compute (the same helpers), so the
tokens are the same.
"""

from __future__ import annotations

import triton
import triton.language as tl

from verispec.ops.triton_kernels import RESIDUAL_STREAM, _request_span, _row_chunk_stats
from verispec.ops.triton_kernels_decide import _decide_request
from verispec.ops.triton_kernels_race import _residual_race


@triton.jit
def _fused_kernel(
    logits_ptr, logits_stride,  # [num_rows, V]
    draft_ids_ptr,  # [num_draft_tokens] int
    cu_ptr,  # [B + 1] int, leading 0
    draft_probs_ptr, draft_probs_stride,  # [num_draft_tokens, V] float32 (HAS_DRAFT_PROBS)
    temperature_ptr,  # [B] float32, 0 = greedy
    seeds_ptr, positions_ptr,  # [B] int64
    rates_ptr,  # [>= max_num_draft_tokens] float32 conditional rates (SYNTHETIC)
    part_f_ptr,  # [3, num_rows, NUM_CHUNKS] float32: chunk max m_c, sum exp(z - m_c), raw max
    part_i_ptr,  # [2, num_rows, NUM_CHUNKS] int32: raw argmax (plane 1 unused)
    record_ptr,  # [B, 2] int32: (num_accepted, rejected draft or -1 on the bonus row)
    record_f_ptr,  # [B, 8] float32: the final row's m, S (then mask statistics, unused)
    race_f_ptr,  # [B, NUM_RACE_CHUNKS] float32: chunk winners' ranking scores
    race_i_ptr,  # [2, B, NUM_RACE_CHUNKS] int32: chunk winners' ids, chunk has a residual
    sync_ptr,  # [3, B] int32, zeroed: per request statistics programs done, decision, race
    #            programs done
    token_ids_ptr, token_ids_stride,  # [B, width] int32
    batch_size, num_rows, vocab_size, width, bonus_stream, lag,
    ROWS: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, NC_P2: tl.constexpr,
    ROWS_P2: tl.constexpr, WIDTH_P2: tl.constexpr, RACE_CHUNK: tl.constexpr,
    NUM_RACE_CHUNKS: tl.constexpr, NRC_P2: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr, SYNTHETIC: tl.constexpr,
):
    """Grid ((B + lag) * (ROWS * NUM_CHUNKS + NUM_RACE_CHUNKS),): see the module docstring.
    No masks (their thresholds need a pass of their own first)."""
    num_stats: tl.constexpr = ROWS * NUM_CHUNKS
    step = tl.program_id(0) // (num_stats + NUM_RACE_CHUNKS)
    item = tl.program_id(0) % (num_stats + NUM_RACE_CHUNKS)
    decision_ptr = sync_ptr + batch_size  # 0: pending, 1: race the final row, 2: written
    if item < num_stats:
        req = step
        if req < batch_size:
            index_in_request = item % ROWS  # == num_drafts on the bonus row
            chunk = item // ROWS
            draft_start, num_drafts = _request_span(cu_ptr, req, False)
            if index_in_request <= num_drafts:
                _row_chunk_stats(
                    logits_ptr, logits_stride, temperature_ptr, seeds_ptr, positions_ptr,
                    part_f_ptr, part_f_ptr, part_i_ptr, num_rows, vocab_size, bonus_stream,
                    req, draft_start + req + index_in_request, chunk,
                    index_in_request == num_drafts, num_drafts,
                    NUM_CHUNKS, CHUNK, False, False, False, False, False, False,
                )
            # the last statistics program of the request (every one counts, rows past n_r
            # too) sees all partials and verifies the drafts
            tl.debug_barrier()
            num_done = tl.atomic_add(sync_ptr + req, 1, sem="acq_rel")
            if num_done == num_stats - 1:
                needs_race = _decide_request(
                    req, logits_ptr, logits_stride, draft_ids_ptr, cu_ptr, draft_probs_ptr,
                    draft_probs_stride, temperature_ptr, seeds_ptr, positions_ptr, rates_ptr,
                    part_f_ptr, part_f_ptr, part_i_ptr, record_ptr, record_f_ptr,
                    token_ids_ptr, token_ids_stride, num_rows, width, bonus_stream,
                    NUM_CHUNKS, NC_P2, ROWS_P2, WIDTH_P2, False, False, HAS_DRAFT_PROBS,
                    SYNTHETIC, False, False, False, False, False,
                )
                tl.debug_barrier()
                tl.atomic_xchg(decision_ptr + req, 2 - needs_race, sem="release")
    else:
        req = step - lag
        if req >= 0:
            decision = tl.atomic_add(decision_ptr + req, 0, sem="acquire")
            while decision == 0:
                decision = tl.atomic_add(decision_ptr + req, 0, sem="acquire")
            if decision == 1:
                # written by another program of this launch: read from L2 (.cg)
                num_accepted = tl.load(record_ptr + 2 * req, cache_modifier=".cg").to(tl.int64)
                rejected_id = tl.load(record_ptr + 2 * req + 1, cache_modifier=".cg")
                rejected = rejected_id >= 0
                draft_start = tl.load(cu_ptr + req).to(tl.int64)
                temperature = tl.load(temperature_ptr + req)
                st = record_f_ptr + 8 * req
                _residual_race(
                    logits_ptr, logits_stride, draft_ids_ptr, draft_probs_ptr,
                    draft_probs_stride, race_f_ptr, race_i_ptr,
                    race_i_ptr + batch_size * NUM_RACE_CHUNKS, sync_ptr + 2 * batch_size,
                    token_ids_ptr, token_ids_stride,
                    req, item - num_stats, draft_start, num_accepted,
                    draft_start + req + num_accepted, temperature,
                    tl.load(seeds_ptr + req), tl.load(positions_ptr + req), rejected_id,
                    tl.where(rejected, RESIDUAL_STREAM, bonus_stream), rejected,
                    tl.load(st, cache_modifier=".cg"), tl.load(st + 1, cache_modifier=".cg"),
                    0.0, 0.0, 1.0, 0.0, 1.0, vocab_size, width,
                    NUM_RACE_CHUNKS, NRC_P2, RACE_CHUNK, WIDTH_P2, HAS_DRAFT_PROBS,
                    False, False, False,
                )

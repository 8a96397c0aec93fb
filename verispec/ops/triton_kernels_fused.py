"""Rejection sampling in one Triton launch (REFERENCE §3): statistics, verification and the
sampled token of each request in one grid.

The three launches of ``triton_kernels`` read every target row once for its statistics, verify,
then race the final row of each request whose draft a random target rejected in a third launch,
reading that row again from device memory. Here one grid does all of it:

    program id = step * (ROWS * NUM_CHUNKS + NUM_RACE_CHUNKS) + item
    item <  ROWS * NUM_CHUNKS    statistics of (row item % ROWS, chunk item // ROWS) of request
                                 ``step``; the last of them to finish (a counter) verifies the
                                 request (``_decide_request``), then
        one-hot rule             samples the final row's token itself (``_block_race``): the
                                 two-level race of ``sampling.race`` picks a block from the chunk
                                 masses that the statistics already hold (the residual's, summed
                                 without the draft), and only that block of the final row is
                                 read again (16 KB, from L2: its statistics were just read) and
                                 raced. For the last ``num_tail`` requests it only picks the
                                 block and publishes it (``_publish_block``) for:
        full rule                publishes the decision for:
    item >= ROWS * NUM_CHUNKS    (full rule only) one chunk of the race over the final row of
                                 request ``step - lag`` (its residual max(0, p - q) has no mass
                                 per chunk before m and S are known); the last of them picks the
                                 token and writes the output row.
    program id >= B * ROWS * NUM_CHUNKS
                                 (one-hot rule only) HELPERS programs per tail request, each
                                 racing 1/HELPERS of its chosen block (``_helper_race``): the
                                 race of a request near the end of the grid would otherwise run
                                 in one program after the last byte is read, with nothing left
                                 to overlap it.

A race program waits (spins) until its request is decided. Programs start in the order of their
ids, and every program a race program waits for has a smaller id and waits for nothing later
than itself, so the wait always ends; with ``lag`` requests between a request's statistics and
its race it rarely waits at all, and the final row is read back from L2. Counters and decision
flags live in ``sync``: under the one-hot rule [3, B] int32 (statistics counters, block flags,
helper counters), zero before the launch and reset by the deciding program and the last helper
of each request; under the full rule [3, B], zeroed before it.

Every step computes what the three launches compute (the same helpers, the same arithmetic for
every score), so the tokens are the same.
"""

from __future__ import annotations

import triton
import triton.language as tl

from verispec.ops.triton_kernels import (
    RESIDUAL_STREAM,
    _argmax_vec,
    _block_noise,
    _block_of_noise,
    _helper,
    _request_span,
    _row_chunk_stats,
    _write_output,
)
from verispec.ops.triton_kernels_decide import _decide_request
from verispec.ops.triton_kernels_race import _chunk_winner, _exact_tile_winner, _residual_race


@triton.jit
def _fused_kernel(
    logits_ptr, logits_stride,  # [num_rows, V]
    draft_ids_ptr,  # [num_draft_tokens] int
    cu_ptr,  # [B + 1] int, leading 0
    draft_probs_ptr, draft_probs_stride,  # [num_draft_tokens, V] float32 (HAS_DRAFT_PROBS)
    temperature_ptr,  # [B] float32, 0 = greedy
    seeds_ptr, positions_ptr,  # [B] int64
    rates_ptr,  # [>= max_num_draft_tokens] float32 conditional rates (SYNTHETIC)
    part_f_ptr,  # [4, num_rows, NUM_CHUNKS] float32: chunk max m_c, sum exp(z - m_c), raw
    #              max, the same sum without the row's draft (one-hot rule)
    part_i_ptr,  # [2, num_rows, NUM_CHUNKS] int32: raw argmax (plane 1 unused)
    record_ptr,  # [B, 2] int32: (num_accepted, rejected draft or -1 on the bonus row)
    record_f_ptr,  # [B, 8] float32: the final row's m, S (then mask statistics, unused)
    race_f_ptr,  # [2, B, NUM_RACE_CHUNKS] float32: chunk winners' scores, chunk masses
    race_i_ptr,  # [B, NUM_RACE_CHUNKS] int32: chunk winners' ids
    sync_ptr,  # [3, B] int32 (one-hot rule: [B]), zero: per request statistics programs done,
    #            decision, race programs done
    token_ids_ptr, token_ids_stride,  # [B, width] int32
    batch_size, num_rows, vocab_size, width, bonus_stream, lag, num_tail,
    ROWS: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, NC_P2: tl.constexpr,
    ROWS_P2: tl.constexpr, WIDTH_P2: tl.constexpr, RACE_CHUNK: tl.constexpr,
    NUM_RACE_CHUNKS: tl.constexpr, NRC_P2: tl.constexpr, BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr, BLOCK_SPAN: tl.constexpr,
    RACE_SUB: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, SYNTHETIC: tl.constexpr,
    HELPERS: tl.constexpr = 0, HELPER_TILE: tl.constexpr = 16, HELPERS_P2: tl.constexpr = 2,
):
    """Grid ((B + lag) * (ROWS * NUM_CHUNKS + NUM_RACE_CHUNKS),): see the module docstring;
    NUM_RACE_CHUNKS and lag are 0 under the one-hot rule. No masks (their thresholds need a
    pass of their own first)."""
    num_stats: tl.constexpr = ROWS * NUM_CHUNKS
    step = tl.program_id(0) // (num_stats + NUM_RACE_CHUNKS)
    item = tl.program_id(0) % (num_stats + NUM_RACE_CHUNKS)
    decision_ptr = sync_ptr + batch_size  # 0: pending, 1: race the final row, 2: written
    if HELPERS > 0 and tl.program_id(0) >= batch_size * num_stats:
        # one-hot rule: helper h of the last num_tail requests, HELPERS programs each
        extra = tl.program_id(0) - batch_size * num_stats
        req = batch_size - num_tail + extra // HELPERS
        _helper_race(
            req, extra % HELPERS, logits_ptr, logits_stride, cu_ptr, temperature_ptr,
            seeds_ptr, positions_ptr, race_f_ptr, race_i_ptr, decision_ptr + req,
            sync_ptr + 2 * batch_size + req, token_ids_ptr, token_ids_stride, vocab_size,
            BLOCK, HELPERS, HELPER_TILE, HELPERS_P2)
    elif item < num_stats:
        req = step
        if req < batch_size:
            index_in_request = item % ROWS  # == num_drafts on the bonus row
            chunk = item // ROWS
            draft_start, num_drafts = _request_span(cu_ptr, req, False)
            if index_in_request <= num_drafts:
                excluded_id = -1
                if not HAS_DRAFT_PROBS:
                    excluded_id = tl.load(draft_ids_ptr + draft_start + index_in_request,
                                          mask=index_in_request < num_drafts, other=-1)
                _row_chunk_stats(
                    logits_ptr, logits_stride, temperature_ptr, seeds_ptr, positions_ptr,
                    part_f_ptr, part_f_ptr, part_i_ptr, num_rows, vocab_size, bonus_stream,
                    req, draft_start + req + index_in_request, chunk,
                    index_in_request == num_drafts, num_drafts, excluded_id,
                    NUM_CHUNKS, CHUNK, False, False, False, False, False, False,
                    not HAS_DRAFT_PROBS,
                )
            # the last statistics program of the request (every one counts, rows past n_r
            # too) sees all partials and verifies the drafts
            tl.debug_barrier()
            num_done = tl.atomic_add(sync_ptr + req, 1, sem="acq_rel")
            if num_done == num_stats - 1:
                if not HAS_DRAFT_PROBS:
                    tl.store(sync_ptr + req, 0)  # every program has counted: ready for reuse
                needs_race, num_accepted, rejected_id, m, s, p_masses, residual_masses = (
                    _decide_request(
                        req, logits_ptr, logits_stride, draft_ids_ptr, cu_ptr, draft_probs_ptr,
                        draft_probs_stride, temperature_ptr, seeds_ptr, positions_ptr,
                        rates_ptr, part_f_ptr, part_f_ptr, part_i_ptr, record_ptr,
                        record_f_ptr, token_ids_ptr, token_ids_stride, num_rows, width,
                        bonus_stream, NUM_CHUNKS, NC_P2, ROWS_P2, WIDTH_P2, CHUNK, BLOCK,
                        NUM_BLOCKS, NB_P2, False, False, HAS_DRAFT_PROBS, SYNTHETIC, False,
                        False, False, False, False, not HAS_DRAFT_PROBS,
                    ))
                if HAS_DRAFT_PROBS:
                    tl.debug_barrier()
                    tl.atomic_xchg(decision_ptr + req, 2 - needs_race, sem="release")
                elif HELPERS > 0 and req >= batch_size - num_tail:
                    # a request near the end of the grid: its helpers split the block race
                    _publish_block(
                        req, draft_ids_ptr, draft_start, seeds_ptr, positions_ptr, race_f_ptr,
                        race_i_ptr, decision_ptr + req, token_ids_ptr, token_ids_stride,
                        needs_race, num_accepted, rejected_id, m, s, p_masses,
                        residual_masses, bonus_stream, width, NUM_CHUNKS, NC_P2, CHUNK,
                        WIDTH_P2, BLOCK, NUM_BLOCKS, NB_P2, HELPERS)
                elif needs_race == 1:
                    _block_race(
                        req, logits_ptr, logits_stride, draft_ids_ptr, draft_start,
                        temperature_ptr, seeds_ptr, positions_ptr, token_ids_ptr,
                        token_ids_stride, num_accepted, rejected_id, m, s, p_masses,
                        residual_masses, vocab_size, width, bonus_stream, NUM_CHUNKS, NC_P2,
                        CHUNK, WIDTH_P2, BLOCK, NUM_BLOCKS, NB_P2, BLOCK_SPAN, RACE_SUB,
                    )
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
                    draft_probs_stride, race_f_ptr, race_f_ptr + batch_size * NUM_RACE_CHUNKS,
                    race_i_ptr,
                    sync_ptr + 2 * batch_size, token_ids_ptr, token_ids_stride,
                    req, item - num_stats, draft_start, num_accepted,
                    draft_start + req + num_accepted, temperature,
                    tl.load(seeds_ptr + req), tl.load(positions_ptr + req), rejected_id,
                    tl.where(rejected, RESIDUAL_STREAM, bonus_stream), rejected,
                    tl.load(st, cache_modifier=".cg"), tl.load(st + 1, cache_modifier=".cg"),
                    0.0, 0.0, 1.0, 0.0, 1.0, vocab_size, width,
                    NUM_RACE_CHUNKS, NRC_P2, RACE_CHUNK, WIDTH_P2, BLOCK, NUM_BLOCKS, NB_P2,
                    HAS_DRAFT_PROBS, False, False, False,
                )


@_helper
def _block_race(
    req, logits_ptr, logits_stride, draft_ids_ptr, draft_start, temperature_ptr, seeds_ptr,
    positions_ptr, token_ids_ptr, token_ids_stride, num_accepted, rejected_id, m, s, p_masses,
    residual_masses, vocab_size, width, bonus_stream,
    NUM_CHUNKS: tl.constexpr, NC_P2: tl.constexpr, CHUNK: tl.constexpr,
    WIDTH_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    NB_P2: tl.constexpr, BLOCK_SPAN: tl.constexpr, RACE_SUB: tl.constexpr,
):
    """One-hot rule, random request, just verified (``_decide_request``'s results, in
    registers): the recovered token at the first rejection (p without the rejected draft,
    residual stream) or the bonus token (p, sample stream). The final row's chunk masses come
    from the statistics (the draft-free sums at a rejection); an empty residual (p(d) = 1 in
    float32) falls back to p, as the twin does. The chosen block (its BLOCK_SPAN tokens:
    BLOCK, or the whole row when it is one block) is raced RACE_SUB tokens at a time, the
    steps' winners compared in index order (ties: the smallest index). Small steps keep this
    program's registers, and so the statistics programs' occupancy, low. H100, V = 151 936,
    one-hot rule: B = 8 (one 4096-token step) 24.6 us with candidates, 28.7 with every token
    scored exactly; B = 32 (four 1024-token steps) 48.9 us exactly, 50.3 with candidates."""
    temperature = tl.load(temperature_ptr + req)
    seed = tl.load(seeds_ptr + req)
    position = tl.load(positions_ptr + req) + num_accepted
    first, stream, rejected_id = _race_block(
        seed, position, num_accepted, rejected_id, p_masses, residual_masses, bonus_stream,
        NUM_CHUNKS, NC_P2, CHUNK, BLOCK, NUM_BLOCKS, NB_P2)
    token = _block_token(
        logits_ptr + (draft_start + req + num_accepted) * logits_stride, first, vocab_size,
        tl.where(temperature > 0.0, temperature, 1.0), seed, position, stream, rejected_id, m,
        s, BLOCK_SPAN, RACE_SUB)
    _write_output(token_ids_ptr, token_ids_stride, draft_ids_ptr, draft_start, req,
                  num_accepted, token, width, WIDTH_P2, False)


@_helper
def _block_token(row_ptr, first, vocab_size, t_eff, seed, position, stream, rejected_id, m, s,
                 BLOCK_SPAN: tl.constexpr, RACE_SUB: tl.constexpr):
    """The race over the chosen block of a final row (its BLOCK_SPAN tokens from ``first``:
    BLOCK, or the whole row when it is one block), one-hot rule without masks, in one program:
    RACE_SUB tokens at a time, the steps' winners compared in index order (ties: the smallest
    index). One step: bounds on the noise leave a few candidates, scored exactly (cheapest for
    one tile); several steps: every token scored exactly, no candidate loop per step (whose
    dependent loads would lengthen the critical path); a step past the vocabulary reads
    nothing and scores -1. Small steps keep the program's registers, and so the occupancy of
    the statistics programs beside it, low."""
    best = tl.full((), -1.0, tl.float32)
    token = first
    if RACE_SUB == BLOCK_SPAN:
        _, token, _ = _chunk_winner(row_ptr, row_ptr, first, vocab_size, t_eff, seed, position,
                                    stream, rejected_id, rejected_id >= 0, m, s, 0.0, 0.0, 1.0,
                                    0.0, 1.0, RACE_SUB, False, False, False, False)
    else:
        # a loop, not unrolled: in the middle of the stream, where this program runs, an
        # instruction fetch that misses waits behind the stream's reads (H100, B = 32: a race
        # of 4 unrolled steps took ~25 us there, ~11 as a loop)
        for j in range(0, BLOCK_SPAN // RACE_SUB):
            score, idx, _ = _exact_tile_winner(
                row_ptr, first + j * RACE_SUB, vocab_size, t_eff, seed, position, stream,
                rejected_id, m, s, 0.0, 0.0, 1.0, 0.0, 1.0, RACE_SUB, False, False, False)
            token = tl.where(score > best, idx, token)
            best = tl.maximum(score, best)
    return token


@_helper
def _race_block(seed, position, num_accepted, rejected_id, p_masses, residual_masses,
                bonus_stream, NUM_CHUNKS: tl.constexpr, NC_P2: tl.constexpr,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                NB_P2: tl.constexpr):
    """The block level of the final row's race (one-hot rule): (first token of the chosen
    block, the stream, the token to exclude or -1). The residual stream at a rejection, the
    sample stream on the bonus row; an empty residual (p(d) = 1 in float32) falls back to p,
    on the residual stream, as the twin does."""
    stream = tl.where(rejected_id >= 0, RESIDUAL_STREAM, bonus_stream)
    noise = _block_noise(seed, position, stream, NC_P2, CHUNK, BLOCK, NUM_BLOCKS, NB_P2)
    first, rejected_id = _race_block_drawn(noise, rejected_id, p_masses, residual_masses,
                                           NUM_CHUNKS, NC_P2, CHUNK, BLOCK, NUM_BLOCKS, NB_P2)
    return first, stream, rejected_id


@_helper
def _race_block_drawn(noise, rejected_id, p_masses, residual_masses, NUM_CHUNKS: tl.constexpr,
                      NC_P2: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                      NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr):
    """``_race_block`` from the block draws of its stream (``_block_noise``): (first token of
    the chosen block, the token to exclude or -1)."""
    c = tl.arange(0, NC_P2)
    masses = tl.where(rejected_id >= 0, residual_masses, p_masses)
    if tl.max(masses, axis=0) == 0.0:  # empty residual: sample from p
        rejected_id = -1
        masses = p_masses
    first = _block_of_noise(masses, noise, c, c < NUM_CHUNKS, CHUNK, BLOCK, NUM_BLOCKS,
                            NB_P2).to(tl.int64) * BLOCK
    return first, rejected_id


@_helper
def _publish_block(req, draft_ids_ptr, draft_start, seeds_ptr, positions_ptr, race_f_ptr,
                   race_i_ptr, flag_ptr, token_ids_ptr, token_ids_stride, needs_race,
                   num_accepted, rejected_id, m, s, p_masses, residual_masses, bonus_stream,
                   width, NUM_CHUNKS: tl.constexpr, NC_P2: tl.constexpr, CHUNK: tl.constexpr,
                   WIDTH_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                   NB_P2: tl.constexpr, HELPERS: tl.constexpr):
    """One-hot rule, a request whose block race is split over HELPERS programs, just verified:
    write its output row but the final token, put the token to exclude, the stream, m and S
    in the request's slots of ``race_i`` / ``race_f`` (HELPERS + 4 each: the helpers'
    winners, then these), then raise the flag: 1 when there is nothing to race (a greedy
    request, its row already written), else 2 + num_accepted * 2^16 + the chosen block, so
    that a helper knows which tile to read as soon as it sees the flag."""
    flag = tl.full((), 1, tl.int32)
    if needs_race == 1:
        seed = tl.load(seeds_ptr + req)
        position = tl.load(positions_ptr + req) + num_accepted
        first, stream, rejected_id = _race_block(
            seed, position, num_accepted, rejected_id, p_masses, residual_masses,
            bonus_stream, NUM_CHUNKS, NC_P2, CHUNK, BLOCK, NUM_BLOCKS, NB_P2)
        slot = req * (HELPERS + 4) + HELPERS
        tl.store(race_i_ptr + slot, rejected_id)
        tl.store(race_i_ptr + slot + 1, stream.to(tl.int32))
        tl.store(race_f_ptr + slot, m)
        tl.store(race_f_ptr + slot + 1, s)
        col = tl.arange(0, WIDTH_P2)
        drafts = tl.load(draft_ids_ptr + draft_start + col, mask=col < num_accepted, other=-1)
        tl.store(token_ids_ptr + req.to(tl.int64) * token_ids_stride + col,
                 tl.where(col < num_accepted, drafts, -1),
                 mask=(col < width) & (col != num_accepted))
        flag = (2 + num_accepted * 65536 + first // BLOCK).to(tl.int32)
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, flag, sem="release")


@_helper
def _helper_race(req, h, logits_ptr, logits_stride, cu_ptr, temperature_ptr, seeds_ptr,
                 positions_ptr, race_f_ptr, race_i_ptr, flag_ptr, counter_ptr, token_ids_ptr,
                 token_ids_stride, vocab_size, BLOCK: tl.constexpr, HELPERS: tl.constexpr,
                 SUB: tl.constexpr, HELPERS_P2: tl.constexpr):
    """Helper h of request ``req`` (one-hot rule): wait for its verification
    (``_publish_block``), race tokens h * SUB .. (h + 1) * SUB of the chosen block (the
    HELPERS tiles cover it; every token scored exactly), and the last helper to finish picks
    the best (ties: the smallest index, as the one-program race) and writes the final token.
    That last helper also resets the flag and the counter to zero for the next launch. The
    wait ends: the deciding program has a smaller program id and waits for nothing."""
    # what does not depend on the verification is loaded while it runs
    draft_start = tl.load(cu_ptr + req).to(tl.int64)
    temperature = tl.load(temperature_ptr + req)
    seed = tl.load(seeds_ptr + req)
    position = tl.load(positions_ptr + req)
    # poll with plain loads (an atomic per poll would contend with the counters), then one
    # acquire so that the reads below see what the deciding program wrote
    flag = tl.load(flag_ptr, volatile=True)
    while flag == 0:
        flag = tl.load(flag_ptr, volatile=True)
    flag = tl.atomic_add(flag_ptr, 0, sem="acquire")
    slot = req * (HELPERS + 4)
    num_accepted = ((flag - 2) >> 16).to(tl.int64)
    if flag >= 2:
        first = ((flag - 2) & 65535).to(tl.int64) * BLOCK
        # written by another program of this launch: read from L2 (.cg)
        rejected_id = tl.load(race_i_ptr + slot + HELPERS, cache_modifier=".cg")
        stream = tl.load(race_i_ptr + slot + HELPERS + 1, cache_modifier=".cg")
        m = tl.load(race_f_ptr + slot + HELPERS, cache_modifier=".cg")
        s = tl.load(race_f_ptr + slot + HELPERS + 1, cache_modifier=".cg")
        score, idx, _ = _exact_tile_winner(
            logits_ptr + (draft_start + req + num_accepted) * logits_stride, first + h * SUB,
            vocab_size, tl.where(temperature > 0.0, temperature, 1.0), seed,
            position + num_accepted, stream, rejected_id, m, s, 0.0, 0.0, 1.0, 0.0, 1.0, SUB,
            False, False, False)
        tl.store(race_f_ptr + slot + h, score)
        tl.store(race_i_ptr + slot + h, idx)
    tl.debug_barrier()
    num_done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if num_done == HELPERS - 1:
        if flag >= 2:
            j = tl.arange(0, HELPERS_P2)
            scores = tl.load(race_f_ptr + slot + j, mask=j < HELPERS, other=-2.0,
                             volatile=True)
            ids = tl.load(race_i_ptr + slot + j, mask=j < HELPERS, other=0, volatile=True)
            _, token = _argmax_vec(scores, ids)
            tl.store(token_ids_ptr + req.to(tl.int64) * token_ids_stride + num_accepted, token)
        tl.store(counter_ptr, 0)
        tl.store(flag_ptr, 0)

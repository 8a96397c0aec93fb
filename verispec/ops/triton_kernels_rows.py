"""Rejection sampling under the one-hot rule in one Triton launch, rows in order (REFERENCE §3).

Under the one-hot rule everything about a verify row is decided by that row alone: whether its
draft passes (u_i < p_i(d_i), with u_i from the acceptance stream at position + i), and the
token the request would emit if this row were its final one (the race over p_i without d_i on
the residual stream at position + i, or over the bonus row's p on the sample stream). The
request's output is then the accepted drafts up to its first *candidate* row (a rejected draft,
or the bonus row) and that row's token. So this kernel reads rows, not requests, in order:

    program id = (j * B + r) * NUM_GROUPS + g     statistics of chunks g * GROUP ..
                                                  (g + 1) * GROUP - 1 of row j of request r
    program id >= B * ROWS * NUM_GROUPS           HELPERS programs per row of the tail, which
                                                  decide the row and race its block

All requests' first rows stream first, then all second rows, and so on. A statistics program
reads GROUP chunks (by default two from B = 64, one below): each program costs a check of the
early word and a count besides its reads, and at large batches two chunks per program halve
those. Outside the tail, the row's last statistics program (its last id) decides the row
(``_decide_row``) once the others have counted: they count with a reduction that returns
nothing (``_count``), so no program but the decider waits for a round trip after its reads,
and the decider polls the row's counter with acquiring loads. At a candidate row it first
marks the request's *early* word (bit 16 + j, one relaxed OR), then, for a random request,
picks the race's block from the chunk masses and races that block of the row (read back from
L2) at once, while later rows still stream, then publishes (``_publish_row``): the row's
token, and its bits in the request's state word (done, candidate), set with one atomic OR. The
OR that first makes the state *resolved* (some candidate row f, every row up to f done)
belongs to the program that writes the request's output row.

Rows after a request's first candidate are never needed. A statistics program of row j first
reads its request's early word (``_program_word``: one read for all its threads), and when a
candidate before row j is already known it reads no logits at all (it still counts, marked as
skipped, so that the row's decider publishes the row as done). The early word is set before
the candidate's race (several microseconds in one program), so the skip does not wait for it.
With rows in order, row j of a request is decided before its row j + 2 starts at any batch size,
and mostly before its row j + 1 from B = 32 on (H100, B = 32: the row-1 programs of requests
rejected at row 0 nearly all read nothing), so at 80 % acceptance per position up to a third of
the bytes are never read. Synthetic rates decide acceptance without the logits: there every
program knows the final row from the acceptance uniforms alone and only that row is read.

The rows at the end of the grid (``num_tail`` of them) are decided and raced by HELPERS
programs each (``_row_helper``), placed after every statistics program: after the last byte
is read nothing else would overlap a race in one program. Each helper polls the row's counter
(all the row's statistics programs count), decides the row from the partials itself and races
its share of the block, so no hand-over from a decider (a fence, a flag, a poll) lies between
the row's last byte and its race; the draws that need no logits (the acceptance uniform, the
block noise) are made while the helper waits.

Synchronisation words (int32, ``sync``): a counter per row ([num_rows]: statistics programs
done, + 2^16 per skipped one), a state per request ([B]: bit j row j done, bit 16 + j row j a
candidate with its token stored), a helper counter per tail row, an early word per request
([B]: bit 16 + j row j a candidate, token or not). All are zero before the launch and reset by
their last user: the row's decider (of a tail row: its last helper), the last publisher of a
request (state and early word: every early bit is set before its row is published), the tail
row's last helper. A decider or a helper waits for its row's statistics programs only: programs
with smaller ids, which started before it and wait for none but programs with still smaller
ids, so the launch always ends. Rows per request are at most 16 (the state word).
"""

from __future__ import annotations

import triton
import triton.language as tl

from verispec.ops.triton_kernels import (
    ACCEPT_STREAM,
    BIG_INDEX,
    INTERPRET,
    RESIDUAL_STREAM,
    _argmax_vec,
    _block_noise,
    _helper,
    _partial_planes,
    _processed,
    _request_span,
    _row_chunk_stats,
    _scale,
    _uniform_at,
    _write_output,
)
from verispec.ops.triton_kernels_fused import _block_token, _race_block, _race_block_drawn
from verispec.ops.triton_kernels_race import _exact_tile_winner

SKIPPED = tl.constexpr(65536)  # what a statistics program that read nothing adds to the counter


@triton.jit
def _rows_kernel(
    logits_ptr, logits_stride,  # [num_rows, V]
    draft_ids_ptr,  # [num_draft_tokens] int
    cu_ptr,  # [B + 1] int, leading 0
    temperature_ptr,  # [B] float32, 0 = greedy
    seeds_ptr, positions_ptr,  # [B] int64
    rates_ptr,  # [>= ROWS - 1] float32 conditional rates (SYNTHETIC)
    part_f_ptr,  # [4, num_rows, NUM_CHUNKS] float32: chunk max m_c, sum exp(z - m_c), raw
    #              max, the same sum without the row's draft
    part_i_ptr,  # [2, num_rows, NUM_CHUNKS] int32: raw argmax (plane 1 unused)
    race_f_ptr,  # [num_tail, HELPERS] float32: helpers' best scores
    race_i_ptr,  # [num_tail, HELPERS] int32: helpers' winners
    row_token_ptr,  # [B, ROWS] int32: the token of each candidate row
    draft_logit_ptr,  # [num_rows] float32: each draft row's raw logit of its draft
    sync_ptr,  # int32, zero: [num_rows] row counters, [B] request states, [num_tail] helper
    #            counters, [B] early words
    token_ids_ptr, token_ids_stride,  # [B, width] int32
    batch_size, num_rows, vocab_size, width, bonus_stream, num_tail,
    ROWS: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, NC_P2: tl.constexpr,
    ROWS_P2: tl.constexpr, WIDTH_P2: tl.constexpr, BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr, BLOCK_SPAN: tl.constexpr,
    RACE_SUB: tl.constexpr, SYNTHETIC: tl.constexpr, HELPERS: tl.constexpr,
    HELPER_TILE: tl.constexpr, HELPERS_P2: tl.constexpr, GROUP: tl.constexpr = 1,
):
    """Grid (B * ROWS * NUM_GROUPS + num_tail * HELPERS,), NUM_GROUPS = ceil(NUM_CHUNKS /
    GROUP): see the module docstring; a statistics program reads GROUP chunks of its row. No
    masks (their thresholds need a pass of their own first)."""
    NUM_GROUPS: tl.constexpr = (NUM_CHUNKS + GROUP - 1) // GROUP
    num_stats = batch_size * ROWS * NUM_GROUPS
    state_ptr = sync_ptr + num_rows
    early_ptr = state_ptr + batch_size + num_tail
    first_tail = batch_size * ROWS - num_tail  # row order (j * B + r) of the first tail row
    pid = tl.program_id(0)
    if pid >= num_stats:
        slot = (pid - num_stats) // HELPERS
        _row_helper(
            first_tail + slot, (pid - num_stats) % HELPERS, slot, logits_ptr, logits_stride,
            draft_ids_ptr, cu_ptr, temperature_ptr, seeds_ptr, positions_ptr, rates_ptr,
            part_f_ptr, part_i_ptr, race_f_ptr, race_i_ptr, row_token_ptr, draft_logit_ptr,
            sync_ptr, state_ptr, early_ptr, state_ptr + batch_size + slot,
            token_ids_ptr, token_ids_stride, num_rows, batch_size, vocab_size, width,
            bonus_stream, ROWS, NUM_CHUNKS, NC_P2, CHUNK, ROWS_P2, WIDTH_P2, BLOCK,
            NUM_BLOCKS, NB_P2, SYNTHETIC, HELPERS, HELPER_TILE, HELPERS_P2, NUM_GROUPS)
    else:
        order = pid // NUM_GROUPS
        group = pid % NUM_GROUPS
        j = order // batch_size
        req = order % batch_size
        # a tail row's helpers decide it: every one of its statistics programs counts
        decides = (group == NUM_GROUPS - 1) & (order < first_tail)
        # independent loads, issued together: a skipped program is one round trip long
        draft_start, num_drafts = _request_span(cu_ptr, req, False)
        seed = tl.load(seeds_ptr + req)
        position = tl.load(positions_ptr + req)
        early = tl.zeros((), dtype=tl.int32)
        if not SYNTHETIC:
            early = _program_word(early_ptr + req)
        if j <= num_drafts:
            row = draft_start + req + j
            if SYNTHETIC:
                skip = j != _synthetic_final_row(seed, position, num_drafts, rates_ptr, ROWS_P2)
            else:
                skip = _earlier_candidate(early, j)
            # the row's last program decides it once the others have counted
            if skip:
                # nothing written to publish: a relaxed count (a skipped row's decider reads
                # no partials)
                if decides == 0:
                    _count(sync_ptr + row, 1 + SKIPPED, False)
            else:
                excluded_id = tl.load(draft_ids_ptr + draft_start + j, mask=j < num_drafts,
                                      other=-1)
                for c in tl.static_range(GROUP):
                    # past the row's last chunk: that chunk again (the same partials)
                    _row_chunk_stats(
                        logits_ptr, logits_stride, temperature_ptr, seeds_ptr, positions_ptr,
                        part_f_ptr, part_f_ptr, part_i_ptr, num_rows, vocab_size,
                        bonus_stream, req, row, tl.minimum(group * GROUP + c, NUM_CHUNKS - 1),
                        j == num_drafts, num_drafts, excluded_id, NUM_CHUNKS, CHUNK, False,
                        False, False, False, False, False, True,
                    )
                first_id = group * GROUP * CHUNK
                if (excluded_id >= first_id) & (excluded_id < first_id + GROUP * CHUNK):
                    # the draft's logit, for the row's decision (there it would be a load
                    # that waits for the draft id, on the critical path)
                    x_d = tl.load(logits_ptr + row * logits_stride + excluded_id)
                    tl.store(draft_logit_ptr + row, x_d.to(tl.float32))
                # the partials of every thread, released to the decider by the count
                tl.debug_barrier()
                if decides == 0:
                    _count(sync_ptr + row, 1, True)
            if decides:
                num_done = tl.zeros((), dtype=tl.int32)
                if NUM_GROUPS > 1:
                    num_done = _wait_row(sync_ptr + row, NUM_GROUPS - 1)
                tl.store(sync_ptr + row, 0)  # every program has counted: ready for reuse
                incomplete = (num_done >= SKIPPED) | skip
                _finish_row(
                    req, j, row, incomplete == 0, early, draft_start, num_drafts, seed,
                    position, logits_ptr, logits_stride, draft_ids_ptr, temperature_ptr,
                    rates_ptr, part_f_ptr, part_i_ptr, row_token_ptr, draft_logit_ptr,
                    state_ptr, early_ptr, token_ids_ptr, token_ids_stride, num_rows,
                    vocab_size, width, bonus_stream, ROWS, NUM_CHUNKS, NC_P2, CHUNK, ROWS_P2,
                    WIDTH_P2, BLOCK, NUM_BLOCKS, NB_P2, BLOCK_SPAN, RACE_SUB, SYNTHETIC)


@_helper
def _wait_row(counter_ptr, num_counts):
    """Poll a row's counter until ``num_counts`` programs have counted (skipped ones add
    SKIPPED besides); its final value. Each poll is one acquiring load (Triton makes an
    atomic add of 0 one thread's load); the counting programs have smaller ids than the
    poller, so they have started."""
    num_done = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while (num_done & (SKIPPED - 1)) != num_counts:
        num_done = tl.atomic_add(counter_ptr, 0, sem="acquire")
    return num_done


if INTERPRET:
    @_helper
    def _count(ptr, value, RELEASE: tl.constexpr):
        """The interpreter runs programs one after another: a plain atomic add will do."""
        tl.atomic_add(ptr, value, sem="relaxed")
else:  # pragma: no cover - CUDA
    @triton.jit
    def _count(ptr, value, RELEASE: tl.constexpr):
        """Add ``value`` to the int32 at ``ptr`` in one thread, and go on without the old value
        (``red``; Triton's atomics wait for it, so a program that exits after its count would
        hold its slot for the round trip). RELEASE: the program's earlier writes (after a
        barrier) are visible to whoever acquires the count."""
        if RELEASE:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                "@p red.release.gpu.global.add.u32 [$1], $2; mov.u32 $0, 0; }", "=r,l,r",
                [ptr, value], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                "@p red.relaxed.gpu.global.add.u32 [$1], $2; mov.u32 $0, 0; }", "=r,l,r",
                [ptr, value], dtype=tl.int32, is_pure=False, pack=1)


@_helper
def _program_word(ptr):
    """A word that other programs change, read once for the whole program. A plain load is
    made by every thread, and threads that see different values (one before another program's
    write, one after) would take different branches, past barriers and single-thread atomics.
    Triton makes an atomic add of 0 one thread's relaxed load, its value shared through shared
    memory (cheaper than an atomic OR of 0, which the L2 executes: H100, B = 32, V = 128 256:
    33.7 vs 34.0 us)."""
    return tl.atomic_add(ptr, 0, sem="relaxed")


@_helper
def _synthetic_final_row(seed, position, num_drafts, rates_ptr, ROWS_P2: tl.constexpr):
    """Synthetic rates: the request's final row, the first draft with u_i >= c_i (or the bonus
    row), from the acceptance uniforms alone."""
    i = tl.arange(0, ROWS_P2)
    is_draft = i < num_drafts
    u = _uniform_at(seed, position + i, ACCEPT_STREAM)
    accepted = (u < tl.load(rates_ptr + i, mask=is_draft, other=0.0)) & is_draft
    return tl.min(tl.where(accepted, ROWS_P2, i), axis=0)


@_helper
def _earlier_candidate(state, j):
    """Whether a request's state word shows a candidate row before row j."""
    return ((state >> 16) & ((1 << j) - 1)) != 0


@_helper
def _resolution(state, ROWS_P2: tl.constexpr):
    """(first candidate row f, whether rows 0..f are all done) of a request's state word."""
    i = tl.arange(0, ROWS_P2)
    done = (state >> i) & 1
    candidate = (state >> (16 + i)) & 1
    first = tl.min(tl.where(candidate == 1, i, ROWS_P2), axis=0)
    resolved = (first < ROWS_P2) & (tl.min(tl.where(i <= first, done, 1), axis=0) == 1)
    return first, resolved


@_helper
def _decide_row(row, j, num_drafts, d, greedy, t_eff, u, rates_ptr, draft_logit_ptr,
                part_f_ptr, part_i_ptr, num_rows, NUM_CHUNKS: tl.constexpr,
                NC_P2: tl.constexpr, SYNTHETIC: tl.constexpr):
    """Row j of a request from its chunk partials and its acceptance uniform u (drawn at
    position + j on the acceptance stream): (1 if it is a candidate, i.e. its draft is
    rejected or it is the bonus row, else 0; its raw argmax; m; S; the chunk masses of p and of
    p without the draft, on the scale exp(z - m)). The arithmetic of ``_decide_request``."""
    part_m_ptr, part_s_ptr, part_amax_ptr, part_aidx_ptr, _ = _partial_planes(
        part_f_ptr, part_i_ptr, num_rows, NUM_CHUNKS)
    c = tl.arange(0, NC_P2)
    c_ok = c < NUM_CHUNKS
    part = row * NUM_CHUNKS + c
    # written by other programs of this launch: read from L2 (.cg)
    amax = tl.load(part_amax_ptr + part, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
    aidx = tl.load(part_aidx_ptr + part, mask=c_ok, other=BIG_INDEX, cache_modifier=".cg")
    pm = tl.load(part_m_ptr + part, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
    ps = tl.load(part_s_ptr + part, mask=c_ok, other=0.0, cache_modifier=".cg")
    pr = tl.load(part_f_ptr + 3 * num_rows * NUM_CHUNKS + part, mask=c_ok, other=0.0,
                 cache_modifier=".cg")
    row_max = tl.max(amax, axis=0)
    argmax = tl.min(tl.where(amax == row_max, aidx, BIG_INDEX), axis=0)
    m = tl.max(pm, axis=0)
    scale = tl.exp(pm - tl.where(m == float("-inf"), 0.0, m))
    masses = ps * scale
    s = tl.sum(masses, axis=0)
    is_draft = j < num_drafts
    if SYNTHETIC:
        accepted = u < tl.load(rates_ptr + j, mask=is_draft, other=0.0)
    else:
        x_d = tl.load(draft_logit_ptr + row, mask=is_draft, other=0.0, cache_modifier=".cg")
        p_d = _processed(_scale(x_d, t_eff), m, s, 0.0, 0.0, 1.0, 0.0, 1.0,
                         False, False, False)
        # greedy target: accept iff d == argmax p; one-hot rule: iff u < p(d)
        accepted = tl.where(greedy, d == argmax, u < p_d)
    candidate = 1 - (accepted & is_draft).to(tl.int32)
    return candidate, argmax, m, s, masses, pr * scale


@_helper
def _finish_row(
    req, j, row, complete, early, draft_start, num_drafts, seed, position, logits_ptr,
    logits_stride, draft_ids_ptr, temperature_ptr, rates_ptr, part_f_ptr, part_i_ptr,
    row_token_ptr, draft_logit_ptr, state_ptr, early_ptr, token_ids_ptr, token_ids_stride,
    num_rows, vocab_size, width, bonus_stream,
    ROWS: tl.constexpr, NUM_CHUNKS: tl.constexpr, NC_P2: tl.constexpr, CHUNK: tl.constexpr,
    ROWS_P2: tl.constexpr, WIDTH_P2: tl.constexpr, BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr, BLOCK_SPAN: tl.constexpr,
    RACE_SUB: tl.constexpr, SYNTHETIC: tl.constexpr,
):
    """The last statistics program of row j (not a tail row): decide it and, at a candidate
    row of a random request, race its block; then publish. A row that was skipped
    (``complete`` = 0) only comes after a known candidate: published as done. A candidate whose
    request already showed an earlier candidate (``early``, read when this program started) is
    not raced: its token is never used."""
    candidate = tl.zeros((), dtype=tl.int32)
    token = tl.zeros((), dtype=tl.int32)
    if complete:
        temperature = tl.load(temperature_ptr + req)
        greedy = temperature == 0.0
        t_eff = tl.where(greedy, 1.0, temperature)
        d = tl.load(draft_ids_ptr + draft_start + j, mask=j < num_drafts, other=-1)
        candidate, token, m, s, masses, residual_masses = _decide_row(
            row, j, num_drafts, d, greedy, t_eff, _uniform_at(seed, position + j, ACCEPT_STREAM),
            rates_ptr, draft_logit_ptr, part_f_ptr, part_i_ptr, num_rows, NUM_CHUNKS, NC_P2,
            SYNTHETIC)
        if not SYNTHETIC:
            if (candidate == 1) & (j < num_drafts):
                # known at once, before the race: later rows of the request that start from
                # now on read nothing (the state word shows a candidate with its token only)
                tl.atomic_or(early_ptr + req, 1 << (16 + j), sem="relaxed")
        if (candidate == 1) & (temperature != 0.0) & (_earlier_candidate(early, j) == 0):
            first, stream, excluded_id = _race_block(
                seed, position + j, j, tl.where(j < num_drafts, d, -1).to(tl.int32), masses,
                residual_masses, bonus_stream, NUM_CHUNKS, NC_P2, CHUNK, BLOCK, NUM_BLOCKS,
                NB_P2)
            token = _block_token(logits_ptr + row * logits_stride, first, vocab_size,
                                 t_eff, seed, position + j, stream, excluded_id, m, s,
                                 BLOCK_SPAN, RACE_SUB).to(tl.int32)
    _publish_row(req, j, candidate, token, row_token_ptr, state_ptr, early_ptr,
                 draft_ids_ptr, draft_start, num_drafts, token_ids_ptr, token_ids_stride,
                 width, ROWS, ROWS_P2, WIDTH_P2)


@_helper
def _publish_row(req, j, candidate, token, row_token_ptr, state_ptr, early_ptr, draft_ids_ptr,
                 draft_start, num_drafts, token_ids_ptr, token_ids_stride, width,
                 ROWS: tl.constexpr, ROWS_P2: tl.constexpr, WIDTH_P2: tl.constexpr):
    """Row j of request ``req`` is done (and a candidate with ``token``, or not): store the
    token, set the row's bits in the request's state with one atomic OR; the OR that resolves
    the request writes its output row, the last one (every row done) resets the state."""
    if candidate == 1:
        tl.store(row_token_ptr + req * ROWS + j, token)
    tl.debug_barrier()
    bits = ((1 << j) | (candidate << (16 + j))).to(tl.int32)
    old = tl.atomic_or(state_ptr + req, bits, sem="acq_rel")
    new = old | bits
    _, was_resolved = _resolution(old, ROWS_P2)
    final, resolved = _resolution(new, ROWS_P2)
    if resolved & (was_resolved == 0):
        if final != j:  # another row's token, stored before its OR: read from L2
            token = tl.load(row_token_ptr + req * ROWS + final, volatile=True)
        _write_output(token_ids_ptr, token_ids_stride, draft_ids_ptr, draft_start, req,
                      final, token, width, WIDTH_P2, False)
    if (new & 65535) == (2 << num_drafts) - 1:
        # every row published (every early candidate bit set before its row's OR): reuse
        tl.store(state_ptr + req, 0)
        tl.store(early_ptr + req, 0)


@_helper
def _row_helper(order, h, slot, logits_ptr, logits_stride, draft_ids_ptr, cu_ptr,
                temperature_ptr, seeds_ptr, positions_ptr, rates_ptr, part_f_ptr, part_i_ptr,
                race_f_ptr, race_i_ptr, row_token_ptr, draft_logit_ptr, row_counters_ptr,
                state_ptr, early_ptr, counter_ptr, token_ids_ptr, token_ids_stride, num_rows,
                batch_size, vocab_size, width, bonus_stream,
                ROWS: tl.constexpr, NUM_CHUNKS: tl.constexpr, NC_P2: tl.constexpr,
                CHUNK: tl.constexpr, ROWS_P2: tl.constexpr, WIDTH_P2: tl.constexpr,
                BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr,
                SYNTHETIC: tl.constexpr, HELPERS: tl.constexpr, SUB: tl.constexpr,
                HELPERS_P2: tl.constexpr, NUM_GROUPS: tl.constexpr):
    """Helper h of the tail row ``order`` (= j * B + r): every helper of the row waits for
    all its statistics programs to count, decides the row as a decider would (the same
    partials, so the same decision in every helper) and, at a candidate row of a random
    request, races tokens h * SUB .. (h + 1) * SUB of the chosen block (every token scored
    exactly); the last helper to finish picks the best (ties: the smallest index) and
    publishes the row, and resets the row's counter and its own. A row without a race
    (skipped, accepted, greedy) is published by helper 0. No decider between the row's last
    statistics and the race: the hand-over would cost a fence, a flag and a poll. Unlike a
    decider, the helpers race a candidate row after a known earlier candidate too (the early
    word, read by each helper at its own time, could differ between them). A row past the
    request's drafts has no programs: its helpers return at once."""
    j = order // batch_size
    req = order % batch_size
    draft_start, num_drafts = _request_span(cu_ptr, req, False)
    if j <= num_drafts:
        # what does not depend on the row's statistics is loaded while they stream
        row = draft_start + req + j
        temperature = tl.load(temperature_ptr + req)
        seed = tl.load(seeds_ptr + req)
        position = tl.load(positions_ptr + req)
        d = tl.load(draft_ids_ptr + draft_start + j, mask=j < num_drafts, other=-1)
        greedy = temperature == 0.0
        t_eff = tl.where(greedy, 1.0, temperature)
        # the draws, which need no logits, while the row streams
        u = _uniform_at(seed, position + j, ACCEPT_STREAM)
        stream = tl.where(j < num_drafts, RESIDUAL_STREAM, bonus_stream)
        noise = _block_noise(seed, position + j, stream, NC_P2, CHUNK, BLOCK, NUM_BLOCKS, NB_P2)
        num_done = _wait_row(row_counters_ptr + row, NUM_GROUPS)
        at = slot * HELPERS  # this row's slots of race_f / race_i
        candidate = tl.zeros((), dtype=tl.int32)
        token = tl.zeros((), dtype=tl.int32)
        race = 0
        if num_done < SKIPPED:
            candidate, token, m, s, masses, residual_masses = _decide_row(
                row, j, num_drafts, d, greedy, t_eff, u, rates_ptr, draft_logit_ptr,
                part_f_ptr, part_i_ptr, num_rows, NUM_CHUNKS, NC_P2, SYNTHETIC)
            if not SYNTHETIC:
                if (h == 0) & (candidate == 1) & (j < num_drafts):
                    # released to the publishing helper by helper 0's count (the early bit
                    # is set before the request's last publisher resets the early word)
                    tl.atomic_or(early_ptr + req, 1 << (16 + j), sem="relaxed")
            if (candidate == 1) & (greedy == 0):
                race = 1
                first, excluded_id = _race_block_drawn(
                    noise, tl.where(j < num_drafts, d, -1).to(tl.int32), masses,
                    residual_masses, NUM_CHUNKS, NC_P2, CHUNK, BLOCK, NUM_BLOCKS, NB_P2)
                score, idx, _ = _exact_tile_winner(
                    logits_ptr + row * logits_stride, first + h * SUB, vocab_size, t_eff, seed,
                    position + j, stream, excluded_id, m, s, 0.0, 0.0, 1.0, 0.0, 1.0, SUB,
                    False, False, False)
                tl.store(race_f_ptr + at + h, score)
                tl.store(race_i_ptr + at + h, idx)
        if (race == 0) & (h == 0):
            _publish_row(req, j, candidate, token, row_token_ptr, state_ptr, early_ptr,
                         draft_ids_ptr, draft_start, num_drafts, token_ids_ptr,
                         token_ids_stride, width, ROWS, ROWS_P2, WIDTH_P2)
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == HELPERS - 1:
            if race == 1:
                k = tl.arange(0, HELPERS_P2)
                scores = tl.load(race_f_ptr + at + k, mask=k < HELPERS, other=-2.0,
                                 volatile=True)
                ids = tl.load(race_i_ptr + at + k, mask=k < HELPERS, other=0, volatile=True)
                _, token = _argmax_vec(scores, ids)
                _publish_row(req, j, tl.full((), 1, tl.int32), token, row_token_ptr,
                             state_ptr, early_ptr, draft_ids_ptr, draft_start, num_drafts,
                             token_ids_ptr, token_ids_stride, width, ROWS, ROWS_P2, WIDTH_P2)
            # every helper has read the row's counter
            tl.store(counter_ptr, 0)
            tl.store(row_counters_ptr + row, 0)

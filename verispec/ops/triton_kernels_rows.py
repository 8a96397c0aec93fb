"""Rejection sampling (and plain sampling) in two Triton launches; no program waits for another.

Under every rule of docs/design.md §3 a verify row decides itself: its draft passes or not from this
row alone (u_i < p_i(d_i); u_i q_i(d_i) < p_i(d_i) under the full rule; d_i == argmax for a
greedy target; u_i < c_i for synthetic rates), and the token the request emits if this row is
its final one is sampled from this row alone. A request's output is its accepted drafts up to
its first *candidate* row (a rejected draft, a draft of -1 "no draft here", or the bonus row),
then that row's token. So:

``_rows_kernel``    grid (B * ROWS * NUM_GROUPS,), program (j * B + r) * NUM_GROUPS + g: GROUP
    chunks of CHUNK tokens of row j of request r, all requests' first rows first, then all
    second rows, and so on. Each program writes its chunks' partials (max, sum of exp, raw
    argmax) and counts on the row's counter with an atomic add that returns the old value; the
    program that sees it is the last decides the row from the partials (``_decide_row``) and
    records: accepted, or a candidate with its greedy token or the block its token would be
    raced in (of p; of the residual for a draft rejected under the one-hot rule, whose chunk the
    decider sums again without the draft). A candidate draft row first sets its bit in the
    request's *early* word; a program that starts after that reads no logits and does not count,
    so rows after a known first rejection are never read (at 80 % acceptance up to a third of
    them). Under the full rule, where a row is rarely skipped, a program loads its first chunk
    before that check rather than after its round trip. Synthetic rates need no logits to
    accept: every program knows the final row from the acceptance uniforms and only that row is
    read.
``_finish_kernel``  (``triton_kernels_finish``) grid (B, NUM_PROGRAMS): finds request r's first
    candidate row from the records (rows before it were all read and decided, so no record is
    stale); races RACE_CHUNK tokens of the block per program (or, full rule, of the whole row's
    max(0, p - q), ``_residual_chunk_winner``); the last program to count picks the token and
    writes the output row. It also zeroes the request's row counters and early word for the
    next launch.

Work that needs the results of several programs is done by the last of them to count (an
acq_rel atomic add that returns the old count), never by one that polls; what depends on
programs not known to have finished is in the second launch. On Hopper and later (``PDL``) the
second launch may start once every program of the first has started: it reads the call's
inputs, then waits in hardware for the first launch to finish (``gdc_wait``), which needs no
program to be scheduled before another.

Masks (top-k, top-p, min-p) need row-wide thresholds first (``triton_kernels_masks``); then the
partials hold each chunk's mass of p instead of its softmax sums.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from verispec.ops.triton_kernels import (
    ACCEPT_STREAM,
    BIG_INDEX,
    RESIDUAL_STREAM,
    _argmax_tile,
    _argmax_vec,
    _chosen_block,
    _helper,
    _load_row_stats,
    _processed,
    _request_span,
    _scale,
    _tile_ids,
    _uniform_at,
)

EARLY_ROWS = tl.constexpr(30)  # rows with a bit in the early word (later rows are never skipped)
ACCEPTED = tl.constexpr(1)  # row states in row_i[row, 0]
CANDIDATE = tl.constexpr(2)  # its token is raced over p (a bonus row, greedy, an empty residual)
RESIDUAL = tl.constexpr(3)  # a rejected draft: over the residual


# the batch's sizes vary step to step: not specialized on (so a new one compiles nothing)
@triton.jit(do_not_specialize=["batch_size", "num_rows"])
def _rows_kernel(
    logits_ptr, logits_stride,  # [num_rows, V]
    draft_ids_ptr,  # [num_draft_tokens] int (unused with NO_DRAFTS)
    cu_ptr,  # [B + 1] int, leading 0 (unused with NO_DRAFTS)
    draft_probs_ptr, draft_probs_stride,  # [num_draft_tokens, V] float32 (HAS_DRAFT_PROBS)
    temperature_ptr,  # [B] float32, 0 = greedy
    seeds_ptr, positions_ptr,  # [B] int64
    rates_ptr,  # [>= ROWS - 1] float32 conditional rates (SYNTHETIC)
    row_stats_ptr,  # [num_rows, 8] float32 (MASKED): m, S, kth, tau, s_p, floor, s3
    part_f_ptr,  # [3, num_rows, NUM_CHUNKS] float32: m_c, S_c, raw max (MASKED: -, mass
    #              of p, raw max)
    part_i_ptr,  # [num_rows, NUM_CHUNKS] int32: raw argmax
    row_i_ptr,  # [num_rows, 2] int32 out: state, greedy token or start of p's block
    row_f_ptr,  # [num_rows, 2] float32 out: m, S
    sync_ptr,  # [num_rows + B] int32, zero: row counters, early words
    batch_size, num_rows, vocab_size, bonus_stream,
    ROWS: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, NC_P2: tl.constexpr,
    GROUP: tl.constexpr, ROWS_P2: tl.constexpr, BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr, NO_DRAFTS: tl.constexpr,
    ALL_GREEDY: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, SYNTHETIC: tl.constexpr,
    MASKED: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (B * ROWS * ceil(NUM_CHUNKS / GROUP),): statistics of GROUP chunks of one row;
    the row's last program to count decides it. See the module docstring."""
    if PDL:  # the finish launch may start as soon as every program here has
        gdc_launch_dependents()
    NUM_GROUPS: tl.constexpr = (NUM_CHUNKS + GROUP - 1) // GROUP
    order = tl.program_id(0) // NUM_GROUPS
    group = tl.program_id(0) % NUM_GROUPS
    j = order // batch_size
    req = order % batch_size
    first_chunk = tl.minimum(group * GROUP, NUM_CHUNKS - 1)
    draft_start, num_drafts = _request_span(cu_ptr, req, NO_DRAFTS)
    if j <= num_drafts:
        row = draft_start + req + j
        row_ptr = logits_ptr + row * logits_stride
        if HAS_DRAFT_PROBS:
            # the full rule rarely skips a row (a draft sampled from q passes more often than
            # not): its first tile is loaded before the early check, not after its round trip
            x = _chunk_load(row_ptr, first_chunk, vocab_size, CHUNK)
        d = tl.full((), -1, tl.int32)  # the row's draft; -1 on the bonus row
        if not NO_DRAFTS:
            d = tl.load(draft_ids_ptr + draft_start + j, mask=j < num_drafts,
                        other=-1).to(tl.int32)
        temperature = tl.load(temperature_ptr + req)
        greedy = (temperature == 0.0) | ALL_GREEDY
        t_eff = tl.where(greedy, 1.0, temperature)  # greedy rows are processed with T = 1
        seed = tl.load(seeds_ptr + req)
        position = tl.load(positions_ptr + req)
        early_ptr = sync_ptr + num_rows + req
        skip = j < 0
        if SYNTHETIC:
            skip = j != _synthetic_final_row(draft_ids_ptr + draft_start, num_drafts, seed,
                                             position, rates_ptr, ROWS_P2)
        elif j > 0:  # (no row comes before a first row)
            # one thread's load, shared by the program (threads that read it apart could see
            # different values and branch apart)
            early = tl.atomic_add(early_ptr, 0, sem="relaxed")
            skip = (early & ((1 << tl.minimum(j, EARLY_ROWS)) - 1)) != 0
        # a skipped program reads nothing and does not count: its row is never decided (it
        # follows a candidate, so it is not needed) and exits after one round trip
        if skip == 0:
            if not HAS_DRAFT_PROBS:
                x = _chunk_load(row_ptr, first_chunk, vocab_size, CHUNK)
            for g in tl.static_range(GROUP):  # past the row's last chunk: that chunk again
                chunk = tl.minimum(group * GROUP + g, NUM_CHUNKS - 1)
                if g > 0:
                    x = _chunk_load(row_ptr, chunk, vocab_size, CHUNK)
                _chunk_stats(x, row_stats_ptr + row * 8, part_f_ptr, part_i_ptr,
                             row * NUM_CHUNKS, num_rows * NUM_CHUNKS, chunk, vocab_size, greedy,
                             t_eff, CHUNK, ALL_GREEDY, MASKED, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
            tl.debug_barrier()  # every thread's partials, released by the count
            if tl.atomic_add(sync_ptr + row, 1, sem="acq_rel") == NUM_GROUPS - 1:
                _decide_row(
                    row_ptr, draft_probs_ptr, draft_probs_stride, rates_ptr,
                    row_stats_ptr + row * 8, part_f_ptr, part_i_ptr, row_i_ptr + row * 2,
                    row_f_ptr + row * 2, early_ptr, row * NUM_CHUNKS, num_rows * NUM_CHUNKS, j,
                    num_drafts, draft_start + j, d, greedy, t_eff, seed, position + j,
                    bonus_stream, vocab_size, NUM_CHUNKS, NC_P2, CHUNK, BLOCK, NUM_BLOCKS, NB_P2,
                    ALL_GREEDY, HAS_DRAFT_PROBS, SYNTHETIC, MASKED, HAS_TOP_K, HAS_TOP_P,
                    HAS_MIN_P)


@_helper
def _synthetic_final_row(drafts_ptr, num_drafts, seed, position, rates_ptr,
                         ROWS_P2: tl.constexpr):
    """Synthetic rates: the request's final row, its first draft with u_i >= c_i or of -1 (or
    the bonus row), from the acceptance uniforms alone."""
    i = tl.arange(0, ROWS_P2)
    is_draft = i < num_drafts
    d = tl.load(drafts_ptr + i, mask=is_draft, other=-1)
    u = _uniform_at(seed, position + i, ACCEPT_STREAM)
    accepted = (u < tl.load(rates_ptr + i, mask=is_draft, other=0.0)) & is_draft & (d >= 0)
    return tl.min(tl.where(accepted, ROWS_P2, i), axis=0)


@_helper
def _chunk_load(row_ptr, chunk, vocab_size, CHUNK: tl.constexpr):
    """One chunk's logits as a [CHUNK / 4, 4] float32 tile (-inf past the vocabulary)."""
    ids = _tile_ids(chunk * CHUNK, CHUNK // 4)
    return tl.load(row_ptr + ids, mask=ids < vocab_size, other=float("-inf")).to(tl.float32)


@_helper
def _chunk_stats(x, stats_ptr, part_f_ptr, part_i_ptr, row_part, plane, chunk, vocab_size,
                 greedy, t_eff, CHUNK: tl.constexpr, ALL_GREEDY: tl.constexpr,
                 MASKED: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
                 HAS_MIN_P: tl.constexpr):
    """One chunk of one row from its logits ``x`` (``_chunk_load``): a greedy row's raw
    argmax (ties: the smallest index, as torch.argmax) and the softmax partials m_c and
    sum exp(z - m_c); MASKED: the chunk's mass of p instead. The tile is reduced once and
    dropped: anything more on it here (the same sum without the draft, which the one-hot
    residual needs and the decider computes for the one chunk) keeps it live, 80-120
    registers a thread instead of 56-64, and the launch, which streams the logits, is then
    slower (fewer programs an SM)."""
    ids = _tile_ids(chunk * CHUNK, CHUNK // 4)  # [CHUNK / 4, 4]
    valid = ids < vocab_size
    out = row_part + chunk
    amax, aidx = float("-inf"), BIG_INDEX
    if greedy:
        amax, aidx = _argmax_tile(x, ids)
    tl.store(part_f_ptr + 2 * plane + out, amax)
    tl.store(part_i_ptr + out, aidx)
    if not ALL_GREEDY:
        z = _scale(x, t_eff)
        if MASKED:
            m, s, kth, tau, s_p, floor, s3 = _load_row_stats(stats_ptr)
            w = tl.where(valid, _processed(z, m, s, kth, tau, s_p, floor, s3, HAS_TOP_K,
                                           HAS_TOP_P, HAS_MIN_P), 0.0)
        else:
            m_c = tl.max(tl.max(z, axis=1), axis=0)
            w = tl.exp(z - tl.where(m_c == float("-inf"), 0.0, m_c))
            tl.store(part_f_ptr + out, m_c)
        tl.store(part_f_ptr + plane + out, tl.sum(tl.sum(w, axis=1), axis=0))


@_helper
def _decide_row(row_ptr, draft_probs_ptr, draft_probs_stride, rates_ptr, stats_ptr, part_f_ptr,
                part_i_ptr, info_ptr, info_f_ptr, early_ptr, row_part, plane, j, num_drafts,
                draft_index, d, greedy, t_eff, seed, position, bonus_stream, vocab_size,
                NUM_CHUNKS: tl.constexpr, NC_P2: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr,
                ALL_GREEDY: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr,
                SYNTHETIC: tl.constexpr, MASKED: tl.constexpr, HAS_TOP_K: tl.constexpr,
                HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """Row j of a request (``position`` = the request's position + j) from its chunk
    partials, written by other programs of this launch (read from L2, .cg): accept its draft
    or mark it a candidate. Records its state, m and S, and a candidate's greedy token or the
    block its token is raced in, chosen from the chunk masses of p (full rule: of p, the
    finish launch races max(0, p - q) over the whole row first) or of the one-hot residual."""
    c = tl.arange(0, NC_P2)
    c_ok = c < NUM_CHUNKS
    part = row_part + c
    amax = tl.load(part_f_ptr + 2 * plane + part, mask=c_ok, other=float("-inf"),
                   cache_modifier=".cg")
    aidx = tl.load(part_i_ptr + part, mask=c_ok, other=BIG_INDEX, cache_modifier=".cg")
    _, argmax = _argmax_vec(amax, aidx)
    is_draft = (j < num_drafts) & (d >= 0)
    accepted = d == argmax  # greedy target: accept iff d == argmax p
    u = _uniform_at(seed, position, ACCEPT_STREAM)
    if SYNTHETIC:  # accept iff u_i < c_i, whatever p and q say (benchmarking only)
        accepted = u < tl.load(rates_ptr + j, mask=is_draft, other=0.0)
    m, s = 0.0, 1.0
    masses = tl.zeros([NC_P2], dtype=tl.float32)  # the chunks' masses of p
    if not ALL_GREEDY:
        kth, tau, s_p, floor, s3 = 0.0, 0.0, 1.0, 0.0, 1.0
        if MASKED:
            m, s, kth, tau, s_p, floor, s3 = _load_row_stats(stats_ptr)
        else:  # m = max m_c
            m = tl.max(tl.load(part_f_ptr + part, mask=c_ok, other=float("-inf"),
                               cache_modifier=".cg"), axis=0)
        masses = _masses(part_f_ptr, part, plane, c_ok, m, MASKED)
        if not MASKED:  # S = sum_c S_c exp(m_c - m)
            s = tl.sum(masses, axis=0)
        if not SYNTHETIC:
            x_d = tl.load(row_ptr + d, mask=is_draft, other=0.0).to(tl.float32)
            p_d = _processed(_scale(x_d, t_eff), m, s, kth, tau, s_p, floor, s3, HAS_TOP_K,
                             HAS_TOP_P, HAS_MIN_P)
            if HAS_DRAFT_PROBS:
                # full rule: accept iff u q(d) < p(d); q(d) = 0 cannot be sampled: reject
                q_d = tl.load(draft_probs_ptr + draft_index * draft_probs_stride + d,
                              mask=is_draft, other=0.0)
                accept_random = (u * q_d < p_d) & (q_d > 0.0)
            else:  # one-hot rule: accept iff u < p(d); p(d) = 0 never passes as u > 0
                accept_random = u < p_d
            accepted = tl.where(greedy, accepted, accept_random)
    candidate = (accepted & is_draft) == 0
    if candidate & (j < num_drafts) & (j < EARLY_ROWS):
        # known before the block is chosen: later rows that start from now on read nothing
        tl.atomic_or(early_ptr, 1 << j, sem="relaxed")
    state = tl.where(candidate, CANDIDATE, ACCEPTED)
    first = argmax  # a greedy row's token
    if not ALL_GREEDY:
        if candidate & (greedy == 0):
            stream = tl.where(is_draft, RESIDUAL_STREAM, bonus_stream)
            if is_draft:  # rejected: its token is raced over the residual
                state = RESIDUAL
                if not HAS_DRAFT_PROBS:
                    # one-hot rule: p's masses but for the draft's chunk, summed again without
                    # the draft (directly, not as a difference that could cancel); p's block
                    # when the residual is empty (p(d) = 1 in float32)
                    residual = tl.where(c == d // CHUNK, _chunk_mass(
                        row_ptr, d // CHUNK, d, vocab_size, t_eff, m, s, kth, tau, s_p, floor,
                        s3, CHUNK, MASKED, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P), masses)
                    if tl.max(residual, axis=0) > 0.0:
                        masses = residual
                    else:
                        state = CANDIDATE
            first = _chosen_block(masses, c, c_ok, seed, position, stream, CHUNK, BLOCK,
                                  NUM_BLOCKS, NB_P2) * BLOCK
    tl.store(info_ptr, state)
    tl.store(info_ptr + 1, first.to(tl.int32))
    tl.store(info_f_ptr, m)
    tl.store(info_f_ptr + 1, s)


@_helper
def _masses(part_f_ptr, part, plane, c_ok, m, MASKED: tl.constexpr):
    """A row's chunk masses of p from its partials: S_c exp(m_c - m), or (MASKED) as stored."""
    masses = tl.load(part_f_ptr + plane + part, mask=c_ok, other=0.0, cache_modifier=".cg")
    if not MASKED:
        pm = tl.load(part_f_ptr + part, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
        masses = masses * tl.exp(pm - tl.where(m == float("-inf"), 0.0, m))
    return masses


@_helper
def _chunk_mass(row_ptr, chunk, excluded_id, vocab_size, t_eff, m, s, kth, tau, s_p, floor, s3,
                CHUNK: tl.constexpr, MASKED: tl.constexpr, HAS_TOP_K: tl.constexpr,
                HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """A chunk's mass without token ``excluded_id``, in the unit of ``_masses``."""
    ids = _tile_ids(chunk * CHUNK, CHUNK // 4)
    valid = ids < vocab_size
    z = _scale(tl.load(row_ptr + ids, mask=valid & (ids != excluded_id),
                       other=float("-inf")).to(tl.float32), t_eff)
    if MASKED:
        w = tl.where(valid, _processed(z, m, s, kth, tau, s_p, floor, s3, HAS_TOP_K,
                                       HAS_TOP_P, HAS_MIN_P), 0.0)
    else:  # exp(z - m)
        w = tl.exp(z - tl.where(m == float("-inf"), 0.0, m))
    return tl.sum(tl.sum(w, axis=1), axis=0)

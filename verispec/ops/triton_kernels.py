"""Triton kernels for sampling and rejection sampling: the GPU twins of ``sampling.py`` and
``rejection.py`` (REFERENCE §2-§4). Launched by ``verispec.ops.triton_ops``, which checks inputs.

Every op runs on the flattened layout: request r owns target rows ``cu[r] + r ... cu[r+1] + r``
(its n_r verify rows, then its bonus row). A plain sampling call is the same layout with no drafts
(``NO_DRAFTS``: row r is request r's bonus row). Three launches do the work:

``_stats_kernel``   grid (B * (k + 1), NUM_CHUNKS). Reads each target row once, in chunks of
    CHUNK tokens, and writes per chunk: the softmax partials (chunk max m_c, sum_v exp(z_v - m_c)),
    the raw-logit argmax (greedy rows) and, on the bonus row of a random request, the chunk's
    candidate of the exponential race for the bonus token (noise is paid on bonus rows only).
``_decide_kernel``  grid (B,). Verifies the request's drafts from the partials, vectorised over the
    draft index: p_i(d_i) is one gathered logit and the row's (m, S), q_i(d_i) one gathered
    probability, so no row is read again. Writes the output row directly when the request is
    greedy (argmax from the partials) or every draft passed (the bonus token: the best chunk
    candidate, each re-scored exactly as the twin scores it); otherwise records the first
    rejection for:
``_race_kernel``    grid (B, NUM_RACE_CHUNKS), in ``triton_kernels_race``. Races the recovered
    token over the final row (read a second time, with the rejected draft's q row under the full
    rule); the last program of the request (an atomic counter) picks the winner and writes.

So each target row is read once, plus the final row of a request whose draft a random target
rejected; each draft-probability row is read at one entry, plus the row of that rejected draft.
Masks (top-k, top-p, min-p) need row-wide thresholds first: ``triton_kernels_masks``.

Float semantics follow the torch twin: z = logits / T with IEEE division (``div_rn``), p = exp(z -
m) / S, score = p / E with E = -log(u); on CUDA exp and log are libdevice's (those torch uses).
Within a chunk a race candidate may be ranked with faster arithmetic; every candidate that can
win is re-scored with the twin's arithmetic before the final argmax.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Named Philox streams and constants, as in verispec/ops/philox.py.
DRAFT_STREAM = tl.constexpr(0)
ACCEPT_STREAM = tl.constexpr(1)
RESIDUAL_STREAM = tl.constexpr(2)
SAMPLE_STREAM = tl.constexpr(3)
NUM_STREAMS = tl.constexpr(4)
MIN_UNIFORM = tl.constexpr(2.3283064e-10)
BIG_INDEX = tl.constexpr(2**31 - 1)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:
    # Triton's CPU interpreter re-patches the language for every nested @triton.jit call, which
    # dominates its run time; there the helpers are plain functions (the interpreter executes
    # kernels as Python anyway). It has no libdevice: exp and log are numpy's.
    def _helper(fn):
        return fn

    def _exp(x):
        return tl.exp(x)

    def _log(x):
        return tl.log(x)

else:  # pragma: no cover - CUDA: libdevice's expf / logf, the functions torch's kernels use
    from triton.language.extra import libdevice

    _helper = triton.jit

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)

    @triton.jit
    def _log(x):
        return libdevice.log(x)


@_helper
def _request_span(cu_ptr, req, NO_DRAFTS: tl.constexpr):
    """(cu[r], n_r): the request's first draft index and its number of drafts."""
    if NO_DRAFTS:
        start = req.to(tl.int64) * 0
        num = start
    else:
        start = tl.load(cu_ptr + req).to(tl.int64)
        num = tl.load(cu_ptr + req + 1).to(tl.int64) - start
    return start, num


@_helper
def _tile_ids(start, C4: tl.constexpr):
    """[C4, 4] vocabulary indices start + 4a + b: column b holds Philox word b of counter a."""
    return start + tl.arange(0, C4)[:, None] * 4 + tl.arange(0, 4)[None, :]


@_helper
def _noise_tile(seed, position, stream, start, C4: tl.constexpr):
    """[C4, 4] Exp(1) noise E = -log u for the draws (seed, position, stream, start + 4a + b);
    ``start`` is a multiple of 4, so one Philox evaluation serves one tile row."""
    counter = (start // 4 + tl.arange(0, C4)).to(tl.int64)
    offset = ((position * NUM_STREAMS + stream) << 32) | counter
    u0, u1, u2, u3 = tl.rand4x(seed, offset)
    b = tl.arange(0, 4)[None, :]
    u = tl.where(b == 0, u0[:, None],
                 tl.where(b == 1, u1[:, None], tl.where(b == 2, u2[:, None], u3[:, None])))
    return -_log(tl.maximum(u, MIN_UNIFORM))


@_helper
def _noise_at(seed, position, stream, index):
    """Exp(1) noise at arbitrary vocabulary indices (a vector of them)."""
    offset = ((position * NUM_STREAMS + stream) << 32) | (index >> 2).to(tl.int64)
    u0, u1, u2, u3 = tl.rand4x(seed, offset)
    word = index & 3
    u = tl.where(word == 0, u0, tl.where(word == 1, u1, tl.where(word == 2, u2, u3)))
    return -_log(tl.maximum(u, MIN_UNIFORM))


@_helper
def _uniform_at(seed, position, stream):
    """Acceptance uniforms in (0, 1): draw (seed, position, stream, index 0), a vector."""
    offset = (position * NUM_STREAMS + stream) << 32
    return tl.maximum(tl.rand(seed, offset), MIN_UNIFORM)


@_helper
def _scale(x, temperature):
    """z = logits / T (IEEE division, as torch); T = 1 leaves x unchanged, so skip it."""
    z = x
    if temperature != 1.0:
        z = tl.math.div_rn(x, temperature)
    return z


@_helper
def _processed(z, m, s, kth, tau, s_p, floor, s3,
               HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """The processed target probability p of scaled logits z, given the row's statistics:
    top-k keeps z >= kth; softmax p = exp(z - m) / S; top-p keeps p >= tau, renormalised by
    s_p; min-p keeps p >= floor, renormalised by s3 (the twin's order of operations)."""
    if HAS_TOP_K:
        z = tl.where(z < kth, float("-inf"), z)
    p = tl.math.div_rn(_exp(z - m), s)
    if HAS_TOP_P:
        p = tl.math.div_rn(tl.where(p < tau, 0.0, p), s_p)
    if HAS_MIN_P:
        p = tl.math.div_rn(tl.where(p < floor, 0.0, p), s3)
    return p


@_helper
def _argmax_tile(score, ids):
    """(max score, smallest index holding it) over a [C4, 4] tile."""
    best = tl.max(tl.max(score, axis=1), axis=0)
    idx = tl.min(tl.min(tl.where(score == best, ids, BIG_INDEX), axis=1), axis=0)
    return best, idx


@_helper
def _argmax_vec(score, ids):
    """(max score, smallest index holding it) over a vector."""
    best = tl.max(score, axis=0)
    idx = tl.min(tl.where(score == best, ids, BIG_INDEX), axis=0)
    return best, idx


@triton.jit
def _stats_kernel(
    logits_ptr, logits_stride,  # [num_rows, V]
    cu_ptr,  # [B + 1] int, leading 0 (unused with NO_DRAFTS)
    temperature_ptr,  # [B] float32
    seeds_ptr, positions_ptr,  # [B] int64
    row_stats_ptr,  # [num_rows, 8] float32 (MASKED): m, S, kth, tau, s_p, floor, s3
    part_f_ptr,  # [3, num_rows, NUM_CHUNKS] float32: chunk max m_c, sum exp(z - m_c), raw max
    part_i_ptr,  # [2, num_rows, NUM_CHUNKS] int32: raw argmax, chunk winner of the bonus race
    counter_ptr,  # [B] int32, zeroed here for _race_kernel
    num_rows, vocab_size, bonus_stream,
    ROWS: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
    NO_DRAFTS: tl.constexpr, ALL_GREEDY: tl.constexpr, BONUS_RACE: tl.constexpr,
    MASKED: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
):
    """Grid (B * ROWS, NUM_CHUNKS), ROWS = max_num_draft_tokens + 1: row i of request r, one
    chunk. The row index varies fastest, so the bonus rows (which also race) spread over every
    wave of programs."""
    index_in_request = tl.program_id(0) % ROWS  # == num_drafts on the bonus row
    req = tl.program_id(0) // ROWS
    chunk = tl.program_id(1)
    if (index_in_request == 0) & (chunk == 0):
        tl.store(counter_ptr + req, 0)
    draft_start, num_drafts = _request_span(cu_ptr, req, NO_DRAFTS)
    if index_in_request <= num_drafts:
        row = draft_start + req + index_in_request
        _row_chunk_stats(
            logits_ptr, logits_stride, temperature_ptr, seeds_ptr, positions_ptr,
            row_stats_ptr, part_f_ptr, part_i_ptr, num_rows, vocab_size, bonus_stream,
            req, row, chunk, index_in_request == num_drafts, num_drafts,
            NUM_CHUNKS, CHUNK, ALL_GREEDY, BONUS_RACE, MASKED, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P,
        )


@_helper
def _row_chunk_stats(
    logits_ptr, logits_stride, temperature_ptr, seeds_ptr, positions_ptr,
    row_stats_ptr, part_f_ptr, part_i_ptr, num_rows, vocab_size, bonus_stream,
    req, row, chunk, is_bonus, num_drafts,
    NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, ALL_GREEDY: tl.constexpr,
    BONUS_RACE: tl.constexpr, MASKED: tl.constexpr, HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
):
    temperature = tl.load(temperature_ptr + req)
    greedy = (temperature == 0.0) | ALL_GREEDY
    plane = num_rows * NUM_CHUNKS
    part_m_ptr = part_f_ptr
    part_s_ptr = part_f_ptr + plane
    part_amax_ptr = part_f_ptr + 2 * plane
    part_aidx_ptr = part_i_ptr
    part_ridx_ptr = part_i_ptr + plane

    ids = _tile_ids(chunk * CHUNK, CHUNK // 4)  # [C4, 4]
    valid = ids < vocab_size
    x = tl.load(logits_ptr + row * logits_stride + ids, mask=valid,
                other=float("-inf")).to(tl.float32)
    out = row * NUM_CHUNKS + chunk

    if greedy:
        # Greedy rows take the argmax of the raw logits (ties: smallest index), as torch.argmax.
        amax, aidx = _argmax_tile(x, ids)
        tl.store(part_amax_ptr + out, amax)
        tl.store(part_aidx_ptr + out, aidx)
    else:
        tl.store(part_amax_ptr + out, float("-inf"))
        tl.store(part_aidx_ptr + out, BIG_INDEX)

    if not ALL_GREEDY:
        # Greedy rows are processed with T = 1 (their p is what processed_probs returns).
        t_eff = tl.where(greedy, 1.0, temperature)
        z = _scale(x, t_eff)
        m_c = tl.max(tl.max(z, axis=1), axis=0)
        m_safe = tl.where(m_c == float("-inf"), 0.0, m_c)
        if not MASKED:
            tl.store(part_m_ptr + out, m_c)
            tl.store(part_s_ptr + out, tl.sum(tl.sum(tl.exp(z - m_safe), axis=1), axis=0))
        if BONUS_RACE:
            if (temperature != 0.0) & is_bonus:
                # Bonus token race, argmax_v p_v / E_v, restricted to this chunk. Without masks
                # p_v is proportional to exp(z_v - m_c). This only picks the chunk's candidate
                # (fast exp and division); _decide_kernel re-scores each candidate exactly.
                seed = tl.load(seeds_ptr + req)
                position = tl.load(positions_ptr + req) + num_drafts
                noise = _noise_tile(seed, position, bonus_stream, chunk * CHUNK, CHUNK // 4)
                if MASKED:
                    st = row_stats_ptr + row * 8
                    w = _processed(z, tl.load(st), tl.load(st + 1), tl.load(st + 2),
                                   tl.load(st + 3), tl.load(st + 4), tl.load(st + 5),
                                   tl.load(st + 6), HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
                else:
                    w = tl.exp(z - m_safe)
                score = tl.where(valid, tl.math.fdiv(w, noise), -1.0)
                _, ridx = _argmax_tile(score, ids)
                tl.store(part_ridx_ptr + out, ridx)


@_helper
def _write_output(token_ids_ptr, token_ids_stride, draft_ids_ptr, draft_start, req,
                  num_accepted, token, width, WIDTH_P2: tl.constexpr, NO_DRAFTS: tl.constexpr):
    """Row ``req`` of token_ids: accepted drafts, the final token, then -1 padding."""
    col = tl.arange(0, WIDTH_P2)
    if NO_DRAFTS:
        out = tl.where(col == 0, token, -1)
    else:
        drafts = tl.load(draft_ids_ptr + draft_start + col, mask=col < num_accepted, other=-1)
        out = tl.where(col < num_accepted, drafts, tl.where(col == num_accepted, token, -1))
    tl.store(token_ids_ptr + req.to(tl.int64) * token_ids_stride + col, out, mask=col < width)

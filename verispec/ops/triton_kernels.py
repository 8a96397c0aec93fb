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
Masks (top-k, top-p, min-p) need row-wide thresholds first: ``triton_kernels_masks``. The
one-hot rule without masks takes one launch instead (``triton_kernels_fused``: the deciding
program races one block of the final row).

Every race is the two-level race of ``sampling.race``: chunks (at most one block each) report
their winner with its exact score and their mass; the block is chosen from the masses
(``_chosen_block``), then the best winner of its chunks (``_two_level_pick``).

Float semantics follow the torch twin: z = logits / T with IEEE division (``div_rn``), p = exp(z -
m) / S, score = p / E with E = -log(u); on CUDA exp and log are libdevice's (those torch uses).
Within a chunk the race needs no logarithm per token: with u the token's uniform, E lies in
[1 - u, (1 - u) / u], so bounds on each score (fast arithmetic, generous slack) leave the one or
two tokens that can win the chunk (``_race_candidates``), and only those are scored with the
twin's arithmetic; the chunk winners are compared with the twin's arithmetic too.
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
# First index of the block-level draws of the two-level race, as sampling.BLOCK_NOISE_INDEX.
BLOCK_NOISE_INDEX = tl.constexpr(2**33)
# Philox4x32-10 (as tl.randint4x) and tl.rand's scale from a folded word to [0, 1).
PHILOX_KEY_A = tl.constexpr(0x9E3779B9)
PHILOX_KEY_B = tl.constexpr(0xBB67AE85)
PHILOX_ROUND_A = tl.constexpr(0xD2511F53)
PHILOX_ROUND_B = tl.constexpr(0xCD9E8D57)
UNIFORM_SCALE = tl.constexpr(4.6566127342e-10)
# Relative slack of the race's candidate test, far above the error of its fast arithmetic
# (fast exp <= 6e-6, fast division and roundings < 1e-6).
RACE_SLACK = tl.constexpr(2.0**-14)

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

    def _fast_div(x, y):
        return x / y

else:  # pragma: no cover - CUDA: libdevice's expf / logf, the functions torch's kernels use
    from triton.language.extra import libdevice

    _helper = triton.jit

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)

    @triton.jit
    def _log(x):
        return libdevice.log(x)

    @triton.jit
    def _fast_div(x, y):  # rcp.approx and a multiply, 2 ulp for 2^-126 <= |y| <= 2^126
        return libdevice.fast_dividef(x, y)


@_helper
def _partial_planes(part_f_ptr, part_i_ptr, num_rows, NUM_CHUNKS: tl.constexpr):
    """The planes of the chunk partials, each [num_rows, NUM_CHUNKS]: float chunk max m_c,
    sum exp(z - m_c), raw-logit max; int32 raw argmax, race candidate id."""
    plane = num_rows * NUM_CHUNKS
    return (part_f_ptr, part_f_ptr + plane, part_f_ptr + 2 * plane,
            part_i_ptr, part_i_ptr + plane)


@_helper
def _load_row_stats(st):
    """A masked row's statistics (``row_stats[row]``, 8 float32): m, S, kth, tau, s_p, floor, s3."""
    return (tl.load(st), tl.load(st + 1), tl.load(st + 2), tl.load(st + 3), tl.load(st + 4),
            tl.load(st + 5), tl.load(st + 6))


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
def _philox(seed, c0, c1):
    """tl.randint4x's four uint32 words for counter (c0, c1, 0, 0) and key (seed_lo, seed_hi);
    each round's high and low products come from one 32 x 32 -> 64-bit multiply."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    c0 = c0.to(tl.uint32)
    c1 = c1.to(tl.uint32)
    c2 = c0 * 0
    c3 = c0 * 0
    for _ in tl.static_range(10):
        prod_a = c0.to(tl.uint64) * PHILOX_ROUND_A
        prod_b = c2.to(tl.uint64) * PHILOX_ROUND_B
        c0 = (prod_b >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (prod_a >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = prod_b.to(tl.uint32)
        c3 = prod_a.to(tl.uint32)
        k0 = k0 + PHILOX_KEY_A
        k1 = k1 + PHILOX_KEY_B
    return c0, c1, c2, c3


@_helper
def _race_candidates(w, seed, position, stream, start, C4: tl.constexpr):
    """[C4, 4] mask of the tokens that can win the race argmax_v w_v / E_v over a tile of
    vocabulary indices start + 4a + b (``start`` a multiple of 4; w >= 0, 0 where excluded),
    without a logarithm: E = -log u (u clamped below at MIN_UNIFORM) lies in
    [1 - u, (1 - u) / u], so w / E lies in [w u / (1 - u), w / (1 - u)]; a token whose upper
    bound is below the best lower bound cannot win. Usually one or two tokens remain; the
    caller scores them exactly."""
    counter = start // 4 + tl.arange(0, C4)
    word0, word1, word2, word3 = _philox(seed, counter, position * NUM_STREAMS + stream)
    b = tl.arange(0, 4)[None, :]
    word = tl.where(b == 0, word0[:, None], tl.where(b == 1, word1[:, None],
                    tl.where(b == 2, word2[:, None], word3[:, None])))
    # tl.rand's float: the word as int32, negative words folded to ~word, times the scale
    word = word.to(tl.int32, bitcast=True)
    u = tl.where(word < 0, -word - 1, word).to(tl.float32) * UNIFORM_SCALE
    upper = _fast_div(w, 1.0 - u)
    best_lower = tl.max(tl.max(upper * u, axis=1), axis=0)
    return (upper >= best_lower * (1.0 - RACE_SLACK)) & (upper > 0.0)


@_helper
def _chosen_block(masses, c, c_ok, seed, position, stream, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr):
    """The block level of the race (``sampling.race``): from the masses of a row's chunks
    (CHUNK <= BLOCK tokens each, any common scale), block b wins with argmax_b M_b / E'_b,
    E'_b the draw at BLOCK_NOISE_INDEX + b (ties: the smallest b). Block masses are sums, equal
    to the twin's up to summation order. 0 when the row is one block."""
    noise = _block_noise(seed, position, stream, c.shape[0], CHUNK, BLOCK, NUM_BLOCKS, NB_P2)
    return _block_of_noise(masses, noise, c, c_ok, CHUNK, BLOCK, NUM_BLOCKS, NB_P2)


@_helper
def _block_noise(seed, position, stream, NC_P2: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr):
    """The draws E'_b of ``_chosen_block``, by chunk where a chunk is a block (NC_P2 of
    them), else by block (a scalar when the row is one block). They need no logits, so a
    program can draw them before its row's statistics are in."""
    noise = tl.zeros((), dtype=tl.float32)
    if NUM_BLOCKS > 1:
        if CHUNK == BLOCK:
            b = tl.arange(0, NC_P2)
        else:
            b = tl.arange(0, NB_P2)
        noise = _noise_at(seed, position, stream, b.to(tl.int64) + BLOCK_NOISE_INDEX)
    return noise


@_helper
def _block_of_noise(masses, noise, c, c_ok, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                    NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr):
    """``_chosen_block`` from its draws (``_block_noise``)."""
    chosen = tl.sum(c * 0, axis=0)
    if NUM_BLOCKS > 1:
        if CHUNK == BLOCK:  # a chunk is a block
            _, chosen = _argmax_vec(tl.where(c_ok, tl.math.div_rn(masses, noise), -1.0), c)
        else:
            blk_of = c // (BLOCK // CHUNK)
            b = tl.arange(0, NB_P2)
            in_b = (blk_of[None, :] == b[:, None]) & c_ok[None, :]
            block_mass = tl.sum(tl.where(in_b, masses[None, :], 0.0), axis=1)  # [NB_P2]
            _, chosen = _argmax_vec(tl.where(b < NUM_BLOCKS,
                                             tl.math.div_rn(block_mass, noise), -1.0), b)
    return chosen


@_helper
def _two_level_pick(scores, ids, masses, c, c_ok, seed, position, stream,
                    CHUNK: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                    NB_P2: tl.constexpr):
    """The token of the race from per-chunk results over a row: chunk c's winner ``ids[c]``
    with its exact score (the twin's arithmetic) and the chunk's mass ``masses[c]``. The chunks
    of the chosen block (``_chosen_block``) compete: the best score, ties to the smallest id."""
    if NUM_BLOCKS > 1:
        chosen = _chosen_block(masses, c, c_ok, seed, position, stream, CHUNK, BLOCK,
                               NUM_BLOCKS, NB_P2)
        c_ok = c_ok & (c // (BLOCK // CHUNK) == chosen)
    _, token = _argmax_vec(tl.where(c_ok, scores, -1.0), ids)
    return token


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
            req, row, chunk, index_in_request == num_drafts, num_drafts, -1,
            NUM_CHUNKS, CHUNK, ALL_GREEDY, BONUS_RACE, MASKED, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P,
        )


@_helper
def _row_chunk_stats(
    logits_ptr, logits_stride, temperature_ptr, seeds_ptr, positions_ptr,
    row_stats_ptr, part_f_ptr, part_i_ptr, num_rows, vocab_size, bonus_stream,
    req, row, chunk, is_bonus, num_drafts, excluded_id,
    NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, ALL_GREEDY: tl.constexpr,
    BONUS_RACE: tl.constexpr, MASKED: tl.constexpr, HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, RESIDUAL_SUMS: tl.constexpr = False,
):
    """One chunk of one row: its softmax partials (m_c, S_c), raw argmax (greedy rows) and, with
    BONUS_RACE, the bonus row's race candidate. With RESIDUAL_SUMS (not MASKED) also the
    chunk's sum of exp(z - m_c) without token ``excluded_id`` (the row's draft: the one-hot
    residual's mass, summed directly rather than as a difference that could cancel) in the
    fourth float plane."""
    temperature = tl.load(temperature_ptr + req)
    greedy = (temperature == 0.0) | ALL_GREEDY
    part_m_ptr, part_s_ptr, part_amax_ptr, part_aidx_ptr, part_ridx_ptr = _partial_planes(
        part_f_ptr, part_i_ptr, num_rows, NUM_CHUNKS)

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
            e = tl.exp(z - m_safe)
            s_c = tl.sum(tl.sum(e, axis=1), axis=0)
            tl.store(part_m_ptr + out, m_c)
            tl.store(part_s_ptr + out, s_c)
            if RESIDUAL_SUMS:
                # only the chunk holding the draft sums again (elsewhere the sums are equal)
                first = chunk * CHUNK
                if (excluded_id >= first) & (excluded_id < first + CHUNK):
                    s_c = tl.sum(tl.sum(tl.where(ids == excluded_id, 0.0, e), axis=1), axis=0)
                tl.store(part_f_ptr + 3 * num_rows * NUM_CHUNKS + out, s_c)
        if BONUS_RACE:
            if (temperature != 0.0) & is_bonus:
                # Bonus token race, argmax_v p_v / E_v, restricted to this chunk. Without masks
                # p_v is proportional to exp(z_v - m_c). This only picks the chunk's candidate
                # (fast exp and division); _decide_kernel re-scores each candidate exactly.
                seed = tl.load(seeds_ptr + req)
                position = tl.load(positions_ptr + req) + num_drafts
                if MASKED:
                    m_r, s_r, kth, tau, s_p, floor, s3 = _load_row_stats(row_stats_ptr + row * 8)
                    w = _processed(z, m_r, s_r, kth, tau, s_p, floor, s3,
                                   HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
                else:
                    w = tl.exp(z - m_safe)
                w = tl.where(valid, w, 0.0)
                if MASKED:  # the chunk's mass for the block level (unmasked: from m_c, S_c)
                    tl.store(part_s_ptr + out, tl.sum(tl.sum(w, axis=1), axis=0))
                cand = _race_candidates(w, seed, position, bonus_stream, chunk * CHUNK,
                                        CHUNK // 4)
                # the candidates in index order, scored as the twin would (libdevice exp and
                # log, IEEE division; exp(z - m_c) stands for p, which _decide_kernel uses)
                ridx = chunk * CHUNK  # a valid index even if no token has weight
                best = tl.full((), -1.0, tl.float32)
                nxt = tl.min(tl.min(tl.where(cand, ids, BIG_INDEX), axis=1), axis=0)
                while nxt < BIG_INDEX:
                    z_c = _scale(tl.load(logits_ptr + row * logits_stride + nxt).to(tl.float32),
                                 t_eff)
                    if MASKED:
                        w_c = _processed(z_c, m_r, s_r, kth, tau, s_p, floor, s3,
                                         HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
                    else:
                        w_c = _exp(z_c - m_safe)
                    score = tl.math.div_rn(w_c, _noise_at(seed, position, bonus_stream, nxt))
                    ridx = tl.where(score > best, nxt, ridx)
                    best = tl.maximum(score, best)
                    nxt = tl.min(tl.min(tl.where(cand & (ids > nxt), ids, BIG_INDEX), axis=1),
                                 axis=0)
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

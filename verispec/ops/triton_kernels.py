"""Triton helpers shared by the sampling and rejection kernels (``triton_kernels_rows``,
``triton_kernels_masks``): Philox noise, the exponential race, the processed probability p.

Float semantics follow the torch twins (``sampling.py``, ``rejection.py``): z = logits / T with
IEEE division (``div_rn``), p = exp(z - m) / S, a race score = w / E with E = -log u; on CUDA
exp and log are libdevice's (those torch uses). Every race is the two-level race of
``sampling.race``: a row longer than ``SAMPLING_BLOCK`` tokens picks a block from the blocks'
masses first (``_chosen_block``), then the token inside it; ties go to the smallest index at both
levels.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Named Philox streams and constants, as in verispec/ops/philox.py (the draft and sample
# streams reach the kernels as arguments).
ACCEPT_STREAM = tl.constexpr(1)
RESIDUAL_STREAM = tl.constexpr(2)
NUM_STREAMS = tl.constexpr(4)
MIN_UNIFORM = tl.constexpr(2.3283064e-10)
BIG_INDEX = tl.constexpr(2**31 - 1)
# First index of the block-level draws of the two-level race, as sampling.BLOCK_NOISE_INDEX.
BLOCK_NOISE_INDEX = tl.constexpr(2**33)
# Relative slack of the race's candidate test, far above the error of its fast arithmetic
# (fast division and roundings < 1e-6).
RACE_SLACK = tl.constexpr(2.0**-14)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:
    # Triton's CPU interpreter re-patches the language for every nested @triton.jit call, which
    # dominates its run time; there the helpers are plain functions (the interpreter executes
    # kernels as Python anyway). It has no libdevice: exp and log are numpy's.
    def _helper(fn):
        return fn

    _math = tl

    def _fast_div(x, y):
        return x / y

else:  # pragma: no cover - CUDA: libdevice's expf / logf, the functions torch's kernels use
    from triton.language.extra import libdevice as _math

    _helper = triton.jit

    @triton.jit
    def _fast_div(x, y):  # rcp.approx and a multiply, 2 ulp for 2^-126 <= |y| <= 2^126
        return _math.fast_dividef(x, y)


@_helper
def _exp(x):
    return _math.exp(x)


@_helper
def _log(x):
    return _math.log(x)


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
def _tile_uniforms(seed, position, stream, start, C4: tl.constexpr):
    """[C4, 4] uniforms in [0, 1) of draws (seed, position, stream, start + 4a + b); ``start``
    is a multiple of 4, so one Philox evaluation serves one tile row."""
    offset = ((position * NUM_STREAMS + stream) << 32) | (start // 4 + tl.arange(0, C4))
    u0, u1, u2, u3 = tl.rand4x(seed, offset.to(tl.int64))
    b = tl.arange(0, 4)[None, :]
    return tl.where(b == 0, u0[:, None],
                    tl.where(b == 1, u1[:, None], tl.where(b == 2, u2[:, None], u3[:, None])))


@_helper
def _noise_at(seed, position, stream, index):
    """Exp(1) noise E = -log u at vocabulary indices ``index`` (a scalar or a vector)."""
    offset = ((position * NUM_STREAMS + stream) << 32) | (index >> 2).to(tl.int64)
    u0, u1, u2, u3 = tl.rand4x(seed, offset)
    word = index & 3
    u = tl.where(word == 0, u0, tl.where(word == 1, u1, tl.where(word == 2, u2, u3)))
    return -_log(tl.maximum(u, MIN_UNIFORM))


@_helper
def _uniform_at(seed, position, stream):
    """Acceptance uniforms in (0, 1): draw (seed, position, stream, index 0)."""
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
def _load_row_stats(st):
    """A masked row's statistics (``row_stats[row]``, 8 float32): m, S, kth, tau, s_p, floor, s3."""
    return (tl.load(st), tl.load(st + 1), tl.load(st + 2), tl.load(st + 3), tl.load(st + 4),
            tl.load(st + 5), tl.load(st + 6))


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


@_helper
def _chosen_block(masses, c, c_ok, seed, position, stream, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, NB_P2: tl.constexpr):
    """The block level of the race: from the masses of a row's chunks (CHUNK <= BLOCK tokens
    each, any common scale), block b wins with argmax_b M_b / E'_b, E'_b the draw at
    BLOCK_NOISE_INDEX + b (ties: the smallest b). Block masses are sums, equal to the twin's up
    to summation order. 0 when the row is one block."""
    chosen = tl.sum(c * 0, axis=0)
    if NUM_BLOCKS > 1:
        b = tl.arange(0, NB_P2)
        noise = _noise_at(seed, position, stream, b.to(tl.int64) + BLOCK_NOISE_INDEX)
        in_b = ((c // (BLOCK // CHUNK))[None, :] == b[:, None]) & c_ok[None, :]
        block_mass = tl.sum(tl.where(in_b, masses[None, :], 0.0), axis=1)  # [NB_P2]
        _, chosen = _argmax_vec(
            tl.where(b < NUM_BLOCKS, tl.math.div_rn(block_mass, noise), -1.0), b)
    return chosen


@_helper
def _exact_tile_winner(row_ptr, start, vocab_size, t_eff, seed, position, stream, excluded_id,
                       m, s, kth, tau, s_p, floor, s3, TILE: tl.constexpr,
                       HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
                       HAS_MIN_P: tl.constexpr):
    """The race over tokens start .. start + TILE of a row with weights p (token
    ``excluded_id`` zeroed; -1 excludes none), every token scored exactly as the twin scores
    it: (best score, its id, ties to the smallest). A fixed chain of latency, no loop."""
    ids = _tile_ids(start, TILE // 4)
    valid = ids < vocab_size
    x = tl.load(row_ptr + ids, mask=valid, other=float("-inf"))
    p = _processed(_scale(x.to(tl.float32), t_eff), m, s, kth, tau, s_p, floor, s3,
                   HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
    w = tl.where(valid & (ids != excluded_id), p, 0.0)
    noise = -_log(tl.maximum(_tile_uniforms(seed, position, stream, start, TILE // 4),
                             MIN_UNIFORM))
    return _argmax_tile(tl.where(valid, tl.math.div_rn(w, noise), -1.0), ids)


@_helper
def _residual_chunk_winner(row_ptr, q_row_ptr, start, vocab_size, t_eff, seed, position,
                           stream, m, s, kth, tau, s_p, floor, s3, CHUNK: tl.constexpr,
                           HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
                           HAS_MIN_P: tl.constexpr):
    """The full rule's race over tokens start .. start + CHUNK of a rejected row, weights
    max(0, p - q): (best score, its id, the chunk's residual mass). Without a logarithm per
    token: E = -log u lies in [1 - u, (1 - u) / u], so w / E lies in [w u / (1 - u),
    w / (1 - u)], and a token whose upper bound is below the best lower bound cannot win.
    Usually one or two tokens remain; those are scored as the twin scores them."""
    ids = _tile_ids(start, CHUNK // 4)
    valid = ids < vocab_size
    x = tl.load(row_ptr + ids, mask=valid, other=float("-inf"))
    p = _processed(_scale(x.to(tl.float32), t_eff), m, s, kth, tau, s_p, floor, s3,
                   HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
    w = tl.where(valid, tl.maximum(p - tl.load(q_row_ptr + ids, mask=valid, other=0.0), 0.0),
                 0.0)
    u = _tile_uniforms(seed, position, stream, start, CHUNK // 4)
    upper = _fast_div(w, 1.0 - u)
    best_lower = tl.max(tl.max(upper * u, axis=1), axis=0)
    cand = (upper >= best_lower * (1.0 - RACE_SLACK)) & (upper > 0.0)
    best_id = start  # a valid index even if no token has weight
    best = tl.full((), -1.0, tl.float32)
    nxt = tl.min(tl.min(tl.where(cand, ids, BIG_INDEX), axis=1), axis=0)
    while nxt < BIG_INDEX:
        p_c = _processed(_scale(tl.load(row_ptr + nxt).to(tl.float32), t_eff), m, s, kth, tau,
                         s_p, floor, s3, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
        w_c = tl.maximum(p_c - tl.load(q_row_ptr + nxt), 0.0)
        score = tl.math.div_rn(w_c, _noise_at(seed, position, stream, nxt))
        best_id = tl.where(score > best, nxt, best_id)
        best = tl.maximum(score, best)
        nxt = tl.min(tl.min(tl.where(cand & (ids > nxt), ids, BIG_INDEX), axis=1), axis=0)
    return best, best_id, tl.sum(tl.sum(w, axis=1), axis=0)


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

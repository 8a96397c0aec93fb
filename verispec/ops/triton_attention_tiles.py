"""The building blocks of the GPU attention kernel (``verispec.ops.triton_attention_kernels``):
RoPE on a tile's rows, one key block of the online softmax (shared by a tile's queries, or a
token tree's block read per query), the partitions of the reduction order and their folds, and
one partition of a split-KV launch. ``verispec.ops.triton_attention`` describes the design.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rope_rows(src, d, partner, pos, ok, cos_ptr, sin_ptr, stride_cos, norm_ptr, eps,
               D: tl.constexpr, HAS_NORM: tl.constexpr):
    """Rows ``[R, D]`` of heads at ``src`` (a pointer per row) at positions ``pos`` -> rotated,
    float32: ``x * cos + x[partner] * signed_sin`` (rotate-half; the sin table holds ``[-sin,
    sin]``), after Qwen3's per-head RMSNorm (rounded to the model dtype) where the model has
    one."""
    x = tl.load(src + d[None, :], mask=ok[:, None], other=0.0)
    dt = x.dtype
    x = x.to(tl.float32)
    xp = tl.load(src + partner[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
        w = tl.load(norm_ptr + d).to(tl.float32)[None, :]
        wp = tl.load(norm_ptr + partner).to(tl.float32)[None, :]
        x = ((x * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        xp = ((xp * rstd).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
    c = tl.load(cos_ptr + pos[:, None] * stride_cos + d[None, :], mask=ok[:, None], other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * stride_cos + d[None, :], mask=ok[:, None], other=0.0)
    return x * c.to(tl.float32) + xp * s.to(tl.float32)


@triton.jit
def _softmax_step(scores, key_pos, pos, window, m, s_sum, WINDOWED: tl.constexpr):
    """One key block of the online softmax: the rows' scores masked to the keys they see (up
    to their position, inside the window), the new running max, the rescale of the old sums,
    the numerators and the new sum."""
    visible = key_pos[None, :] <= pos[:, None]
    if WINDOWED:
        visible &= pos[:, None] - key_pos[None, :] < window
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    return m_new, alpha, p, s_sum * alpha + tl.sum(p, axis=1)


@triton.jit
def _partition_size(pos, SMALL_KEYS: tl.constexpr, SMALL_PARTS: tl.constexpr,
                    PART_KEYS: tl.constexpr, MAX_PARTS: tl.constexpr):
    """Keys per partition of the reduction of queries at ``pos``: SMALL_KEYS below position
    SMALL_KEYS x SMALL_PARTS, else PART_KEYS times as many as keep keys 0 .. pos within
    MAX_PARTS partitions."""
    units = (pos + PART_KEYS) // PART_KEYS
    large = PART_KEYS * ((units + MAX_PARTS - 1) // MAX_PARTS)
    return tl.where(pos < SMALL_KEYS * SMALL_PARTS, SMALL_KEYS, large)


@triton.jit
def _folded(m, s_sum, acc, big_m, big_l, big_a):
    """A partition's (max, sum, unnormalised output) folded into the running (big_m, big_l,
    big_a). Explicit fused multiply-adds pin the roundings, so the one-launch kernel and the
    split-KV combine give the same bits. Folding an empty partition (m = -1e30, 0, 0) changes
    nothing; the first fold gives the partition's own values."""
    m_new = tl.maximum(big_m, m)
    a = tl.exp(big_m - m_new)
    b = tl.exp(m - m_new)
    return m_new, tl.fma(big_l, a, s_sum * b), tl.fma(big_a, a[:, None], acc * b[:, None])


@triton.jit
def _fold(fold, m, s_sum, acc, big_m, big_l, big_a):
    """Rows ``fold`` fold their partition into the running values and start a new one."""
    m_new, l_new, a_new = _folded(m, s_sum, acc, big_m, big_l, big_a)
    return (tl.where(fold, -1.0e30, m), tl.where(fold, 0.0, s_sum),
            tl.where(fold[:, None], 0.0, acc), tl.where(fold, m_new, big_m),
            tl.where(fold, l_new, big_l), tl.where(fold[:, None], a_new, big_a))


@triton.jit
def _fold_at_end(key_end, part, uniform, part_all, m, s_sum, acc, big_m, big_l, big_a):
    """After the key block ending before ``key_end``: fold the rows whose partition ends
    there (all alike when the tile's rows share one partition size, ``uniform``)."""
    if uniform:
        if key_end % part_all == 0:
            big_m, big_l, big_a = _folded(m, s_sum, acc, big_m, big_l, big_a)
            m = tl.full(m.shape, -1.0e30, tl.float32)
            s_sum = tl.zeros(s_sum.shape, tl.float32)
            acc = tl.zeros(acc.shape, tl.float32)
    else:
        ends = key_end % part == 0
        if tl.max(ends.to(tl.int32), axis=0) > 0:
            m, s_sum, acc, big_m, big_l, big_a = _fold(ends, m, s_sum, acc, big_m, big_l,
                                                       big_a)
    return m, s_sum, acc, big_m, big_l, big_a


@triton.jit
def _key_block(bt_row, k_base, v_base, start, last_pos, d, stride_kc_block, stride_kc_pos,
               stride_vc_block, stride_vc_pos, BLOCK_SIZE: tl.constexpr,
               BLOCK_KV: tl.constexpr):
    """Positions ``start`` .. ``start + BLOCK_KV`` of a request and their keys and values, read
    through its block table (zeros past ``last_pos``)."""
    key_pos = start + tl.arange(0, BLOCK_KV)
    key_ok = key_pos <= last_pos
    block = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    row = (key_pos % BLOCK_SIZE).to(tl.int64)
    k = tl.load(k_base + (block * stride_kc_block + row * stride_kc_pos)[:, None] + d[None, :],
                mask=key_ok[:, None], other=0.0)
    v = tl.load(v_base + (block * stride_vc_block + row * stride_vc_pos)[:, None] + d[None, :],
                mask=key_ok[:, None], other=0.0)
    return key_pos, k, v


@triton.jit
def _tree_key_rows(path_ptr, pos_ptr, bt_row, query_token, stride_path, key_pos, in_tree, root,
                   stride_block, stride_pos, BLOCK_SIZE: tl.constexpr):
    """Cache offsets of the keys at ``key_pos`` as tree query ``query_token`` reads them (its
    path's slot at depth i for position root + i, the context before the root), and which of
    them it sees (positions up to its own)."""
    query_token = query_token.to(tl.int64)
    key_ok = key_pos <= tl.load(pos_ptr + query_token)
    slot_at = tl.load(path_ptr + query_token * stride_path + (key_pos - root),
                      mask=key_ok & in_tree, other=0)
    key_row = tl.where(in_tree, root + slot_at, key_pos)
    block = tl.load(bt_row + key_row // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    return block * stride_block + (key_row % BLOCK_SIZE).to(tl.int64) * stride_pos, key_ok


@triton.jit
def _limited(scores, key_pos, lo, part, LIMIT: tl.constexpr):
    """With ``LIMIT`` (split-KV), each row's scores outside its partition [lo, lo + part)."""
    if LIMIT:
        inside = (key_pos[None, :] >= lo[:, None]) & (key_pos[None, :] < (lo + part)[:, None])
        scores = tl.where(inside, scores, float("-inf"))
    return scores


@triton.jit
def _shared_tile(q, m, s_sum, acc, start, pos, window, lo, part, bt_row, k_base, v_base,
                 last_pos, d, stride_kc_block, stride_kc_pos, stride_vc_block, stride_vc_pos,
                 scale, BLOCK_SIZE: tl.constexpr, BLOCK_KV: tl.constexpr,
                 PRECISION: tl.constexpr, WINDOWED: tl.constexpr, LIMIT: tl.constexpr):
    """One key block every row of the tile reads alike: the online softmax's step."""
    key_pos, k, v = _key_block(bt_row, k_base, v_base, start, last_pos, d, stride_kc_block,
                               stride_kc_pos, stride_vc_block, stride_vc_pos, BLOCK_SIZE,
                               BLOCK_KV)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BQ, BKV] f32
    scores = _limited(scores, key_pos, lo, part, LIMIT)
    m, alpha, p, s_sum = _softmax_step(scores, key_pos, pos, window, m, s_sum, WINDOWED)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m, s_sum, acc


@triton.jit
def _tree_tile(q, m, s_sum, acc, start, pos, window, lo, part, query, first_query, last_query,
               q_lo, root, path_ptr, pos_ptr, bt_row, k_base, v_base, d, stride_path,
               stride_kc_block, stride_kc_pos, stride_vc_block, stride_vc_pos, scale,
               BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
               PRECISION: tl.constexpr, WINDOWED: tl.constexpr, LIMIT: tl.constexpr):
    """One key block holding tree rows: position root + i is the row of the path's slot at
    depth i, which differs between queries. Each query's keys and values are read for it and
    its rows keep their own products: every row computes exactly what it computes in its
    chain, whatever queries share its tile."""
    key_pos = start + tl.arange(0, BLOCK_KV)
    in_tree = key_pos >= root
    scores = tl.zeros((BLOCK_Q, BLOCK_KV), tl.float32)
    for j in range(first_query, last_query + 1):
        k_at, key_ok = _tree_key_rows(path_ptr, pos_ptr, bt_row, q_lo + j, stride_path, key_pos,
                                      in_tree, root, stride_kc_block, stride_kc_pos, BLOCK_SIZE)
        k = tl.load(k_base + k_at[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
        s_j = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where((query == j)[:, None], s_j, scores)
    scores = _limited(scores, key_pos, lo, part, LIMIT)
    m, alpha, p, s_sum = _softmax_step(scores, key_pos, pos, window, m, s_sum, WINDOWED)
    scaled = acc * alpha[:, None]
    acc = scaled
    for j in range(first_query, last_query + 1):
        v_at, key_ok = _tree_key_rows(path_ptr, pos_ptr, bt_row, q_lo + j, stride_path, key_pos,
                                      in_tree, root, stride_vc_block, stride_vc_pos, BLOCK_SIZE)
        v = tl.load(v_base + v_at[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
        acc = tl.where((query == j)[:, None],
                       tl.dot(p.to(v.dtype), v, scaled, input_precision=PRECISION), acc)
    return m, s_sum, acc


@triton.jit
def _partition(q, z, part, part_min, part_max, kv_lo, last_pos, tree_start, pos, window, query,
               first_query, last_query, q_lo, root, path_ptr, pos_ptr, bt_row, k_base, v_base,
               d, stride_path, stride_kc_block, stride_kc_pos, stride_vc_block, stride_vc_pos,
               scale, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
               D: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr,
               TREE: tl.constexpr):
    """Split-KV: partition ``z`` of the tile's rows from a fresh state, each row's keys limited
    to its partition -> (max, sum, unnormalised output)."""
    lo = z * part  # [BLOCK_Q]
    m = tl.full((BLOCK_Q,), -1.0e30, tl.float32)
    s_sum = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, D), tl.float32)
    for start in range(tl.maximum(z * part_min, kv_lo),
                       tl.minimum((z + 1) * part_max, last_pos + 1), BLOCK_KV):
        if TREE:
            if start >= tree_start:
                m, s_sum, acc = _tree_tile(
                    q, m, s_sum, acc, start, pos, window, lo, part, query, first_query,
                    last_query, q_lo, root, path_ptr, pos_ptr, bt_row, k_base, v_base, d,
                    stride_path, stride_kc_block, stride_kc_pos, stride_vc_block, stride_vc_pos,
                    scale, BLOCK_SIZE, BLOCK_Q, BLOCK_KV, PRECISION, WINDOWED, True)
            else:
                m, s_sum, acc = _shared_tile(
                    q, m, s_sum, acc, start, pos, window, lo, part, bt_row, k_base, v_base,
                    last_pos, d, stride_kc_block, stride_kc_pos, stride_vc_block, stride_vc_pos,
                    scale, BLOCK_SIZE, BLOCK_KV, PRECISION, WINDOWED, True)
        else:
            m, s_sum, acc = _shared_tile(
                q, m, s_sum, acc, start, pos, window, lo, part, bt_row, k_base, v_base,
                last_pos, d, stride_kc_block, stride_kc_pos, stride_vc_block, stride_vc_pos,
                scale, BLOCK_SIZE, BLOCK_KV, PRECISION, WINDOWED, True)
    return m, s_sum, acc

"""The Triton program of the GPU attention (``verispec.ops.triton_attention`` launches it and
describes the design): the attention over the paged cache with its cache write, and split-KV's
fold by a tile's last program; its building blocks are in ``triton_attention_tiles``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from verispec.ops.triton_attention_tiles import (
    _fold,
    _fold_at_end,
    _folded,
    _partition,
    _partition_size,
    _rope_rows,
    _shared_tile,
    _tree_tile,
)


@triton.jit
def _rope_attention_kernel(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, k_cache_ptr, v_cache_ptr,
                           out_ptr, bt_ptr, slot_ptr, ctx_ptr, qs_ptr, ts_ptr, pos_ptr, path_ptr,
                           part_ptr, ml_ptr, ticket_ptr, num_split, scratch_parts,
                           B, search_steps,
                           stride_qkv,
                           stride_cos,
                           stride_bt, stride_kc_block, stride_kc_pos, stride_kc_head,
                           stride_vc_block, stride_vc_pos, stride_vc_head, stride_ot, stride_oh,
                           stride_path, path_len,
                           scale, window, eps, BLOCK_SIZE: tl.constexpr,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                           BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                           HAS_QK_NORM: tl.constexpr, WINDOWED: tl.constexpr,
                           WRITE: tl.constexpr, ATTEND: tl.constexpr, PRECISION: tl.constexpr,
                           FLAT_GRID: tl.constexpr, TREE: tl.constexpr, PATH: tl.constexpr,
                           SPLIT: tl.constexpr, SMALL_KEYS: tl.constexpr,
                           SMALL_PARTS: tl.constexpr, PART_KEYS: tl.constexpr,
                           MAX_PARTS: tl.constexpr):
    G: tl.constexpr = HQ // HKV
    if FLAT_GRID:  # grid (tiles of every request, kv heads): find this tile's request
        t = tl.program_id(0)
        kv_head = tl.program_id(1)
        if t >= tl.load(ts_ptr + B):
            return
        lo = t * 0
        hi = lo + B
        for _ in range(search_steps):  # the last b with ts[b] <= t (ts ascending, ts[0] = 0)
            mid = (lo + hi) // 2
            go = tl.load(ts_ptr + mid) <= t
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        b = lo
        tile = t - tl.load(ts_ptr + b)
    else:  # grid (requests, kv heads, tiles up to the longest request's x split programs)
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2) // num_split
    split_program = tl.program_id(2) % num_split  # SPLIT: this program's first partition
    q_lo = tl.load(qs_ptr + b)
    num_q = tl.load(qs_ptr + b + 1) - q_lo
    done = tile * BLOCK_Q >= num_q * G
    if done:
        return
    slot = tl.load(slot_ptr + b).to(tl.int64)
    ctx = tl.load(ctx_ptr + b)
    d = tl.arange(0, D)
    partner = (d + D // 2) % D
    # Position t of the request lives in block bt[slot, t // BLOCK_SIZE], row t % BLOCK_SIZE.
    bt_row = bt_ptr + slot * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kc_head
    v_base = v_cache_ptr + kv_head * stride_vc_head
    first_query = (tile * BLOCK_Q) // G
    last_query = tl.minimum(num_q - 1, (tile * BLOCK_Q + BLOCK_Q - 1) // G)
    if ATTEND:
        rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)  # row = query * G + head in group
        query = rows // G
        row_ok = query < num_q
        token = (q_lo + query).to(tl.int64)
        head = kv_head * G + rows % G
        if TREE:
            pos = tl.load(pos_ptr + token, mask=row_ok, other=0)  # root row + depth
        else:
            pos = ctx - num_q + query  # absolute position of the row's query
        # [BLOCK_Q] keys per partition
        part = _partition_size(pos, SMALL_KEYS, SMALL_PARTS, PART_KEYS, MAX_PARTS)
        if SPLIT:
            num_parts = (pos + part) // part  # [BLOCK_Q] each row's partitions
            last_part = tl.max(tl.where(row_ok, num_parts, 0), axis=0)
            if split_program >= last_part:  # no partition for this program: no work at all
                return
    if WRITE:
        # K (rotated) and V of the new tokens, in blocks of BLOCK_Q tokens: with ATTEND every
        # block up to this tile's last query (tiles of one head write the same values), else
        # the tile-th block only (a separate launch before the attention).
        first_block = 0 if ATTEND else tile * BLOCK_Q
        end = last_query + 1 if ATTEND else tl.minimum(num_q, first_block + BLOCK_Q)
        for j0 in range(first_block, end, BLOCK_Q):
            j = j0 + tl.arange(0, BLOCK_Q)
            ok = j < end
            tok = (q_lo + j).to(tl.int64)
            p = ctx - num_q + j  # the token's cache row
            if TREE:  # at position root row + depth
                rope_pos = tl.load(pos_ptr + tok, mask=ok, other=0)
            else:
                rope_pos = p
            k = _rope_rows(qkv_ptr + tok[:, None] * stride_qkv + (HQ + kv_head) * D, d, partner,
                           rope_pos, ok, cos_ptr, sin_ptr, stride_cos, kn_ptr, eps, D,
                           HAS_QK_NORM)
            block = tl.load(bt_row + p // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
            row = (p % BLOCK_SIZE).to(tl.int64)
            k_at = (block * stride_kc_block + row * stride_kc_pos)[:, None]
            v_at = (block * stride_vc_block + row * stride_vc_pos)[:, None]
            tl.store(k_base + k_at + d[None, :], k.to(k_cache_ptr.dtype.element_ty),
                     mask=ok[:, None])
            v = tl.load(qkv_ptr + tok[:, None] * stride_qkv + (HQ + HKV + kv_head) * D
                        + d[None, :], mask=ok[:, None], other=0.0)
            tl.store(v_base + v_at + d[None, :], v.to(v_cache_ptr.dtype.element_ty),
                     mask=ok[:, None])
        tl.debug_barrier()  # this program's cache writes are visible to its reads below
    if ATTEND:
        if TREE:
            # the root's cache row, from the first query's path (slots at depths 0 .. depth)
            first_token = (q_lo + first_query).to(tl.int64)
            steps = tl.arange(0, PATH)
            on_path = tl.load(path_ptr + first_token * stride_path + steps,
                              mask=steps < path_len, other=-1) >= 0
            root = tl.load(pos_ptr + first_token) - (tl.sum(on_path.to(tl.int32), axis=0) - 1)
            last_pos = tl.max(tl.where(row_ok, pos, 0), axis=0)
            first_pos = tl.min(tl.where(row_ok, pos, last_pos), axis=0)
            tree_start = root // BLOCK_KV * BLOCK_KV  # the first key block holding a tree row
        else:
            last_pos = ctx - num_q + last_query
            first_pos = ctx - num_q + first_query
            tree_start = last_pos + 1
            root = tree_start  # (read by trees only)
        q = _rope_rows(qkv_ptr + token[:, None] * stride_qkv + head[:, None] * D, d, partner,
                       pos, row_ok, cos_ptr, sin_ptr, stride_cos, qn_ptr, eps, D, HAS_QK_NORM)
        q = q.to(qkv_ptr.dtype.element_ty)  # q rounded to the model dtype, as the twin's
        part_min = tl.min(tl.where(row_ok, part, 1 << 30), axis=0)
        part_max = tl.max(tl.where(row_ok, part, 0), axis=0)
        uniform = part_min == part_max
        m = tl.full((BLOCK_Q,), -1.0e30, tl.float32)  # finite: a fully masked block stays exact
        s_sum = tl.zeros((BLOCK_Q,), tl.float32)
        acc = tl.zeros((BLOCK_Q, D), tl.float32)
        big_m = tl.full((BLOCK_Q,), -1.0e30, tl.float32)  # the partitions folded so far
        big_l = tl.zeros((BLOCK_Q,), tl.float32)
        big_a = tl.zeros((BLOCK_Q, D), tl.float32)
        kv_lo = 0
        if WINDOWED:  # blocks wholly before every row's window are skipped (aligned to BLOCK_KV)
            kv_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_KV * BLOCK_KV
        if SPLIT:
            # A tile whose rows all have one partition (positions below SMALL_KEYS) is program
            # 0's alone: it folds as it goes below (the same bits), no scratch and no count.
            if last_part > 1:
                # Partitions split_program, + num_split, ...: each from a fresh state, its
                # rows' keys limited to their partition, written to the scratch; the tile's
                # last program to finish folds them in order.
                for z in range(split_program, last_part, num_split):
                    m, s_sum, acc = _partition(
                        q, z, part, part_min, part_max, kv_lo, last_pos, tree_start, pos,
                        window, query, first_query, last_query, q_lo, root, path_ptr, pos_ptr,
                        bt_row, k_base, v_base, d, stride_path, stride_kc_block, stride_kc_pos,
                        stride_vc_block, stride_vc_pos, scale, BLOCK_SIZE, BLOCK_Q, BLOCK_KV,
                        D, PRECISION, WINDOWED, TREE)
                    at = (token * HQ + head) * scratch_parts + z  # [BLOCK_Q]
                    keep = row_ok & (z < num_parts)
                    tl.store(ml_ptr + at * 2, m, mask=keep)
                    tl.store(ml_ptr + at * 2 + 1, s_sum, mask=keep)
                    tl.store(part_ptr + at[:, None] * D + d[None, :], acc, mask=keep[:, None])
                # Count this program in (its stores ordered before the count: the barrier, then
                # a release). The tile's programs with partitions are min(num_split,
                # last_part); the last to arrive puts the ticket back to 0 and folds.
                tl.debug_barrier()
                tiles = tl.num_programs(2) // num_split
                ticket = ticket_ptr + (b * HKV + kv_head) * tiles + tile
                arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
                if arrived == tl.minimum(num_split, last_part) - 1:
                    tl.store(ticket, 0)
                    _combine_rows(part_ptr, ml_ptr, out_ptr, token, head, row_ok, num_parts,
                                  last_part, scratch_parts, stride_ot, stride_oh, d, HQ,
                                  BLOCK_Q, D)
                return
        # key blocks every row of the tile reads alike (a tree's context before its root)
        for start in range(kv_lo, tl.minimum(tree_start, last_pos + 1), BLOCK_KV):
            m, s_sum, acc = _shared_tile(q, m, s_sum, acc, start, pos, window, pos, part, bt_row,
                                         k_base, v_base, last_pos, d, stride_kc_block,
                                         stride_kc_pos, stride_vc_block, stride_vc_pos, scale,
                                         BLOCK_SIZE, BLOCK_KV, PRECISION, WINDOWED, False)
            m, s_sum, acc, big_m, big_l, big_a = _fold_at_end(
                start + BLOCK_KV, part, uniform, part_min, m, s_sum, acc, big_m, big_l, big_a)
        if TREE:  # blocks holding tree rows (``_tree_tile``)
            for start in range(tl.maximum(tree_start, kv_lo), last_pos + 1, BLOCK_KV):
                m, s_sum, acc = _tree_tile(q, m, s_sum, acc, start, pos, window, pos, part,
                                           query, first_query, last_query, q_lo, root,
                                           path_ptr, pos_ptr, bt_row, k_base, v_base, d,
                                           stride_path, stride_kc_block, stride_kc_pos,
                                           stride_vc_block, stride_vc_pos, scale, BLOCK_SIZE,
                                           BLOCK_Q, BLOCK_KV, PRECISION, WINDOWED, False)
                m, s_sum, acc, big_m, big_l, big_a = _fold_at_end(
                    start + BLOCK_KV, part, uniform, part_min, m, s_sum, acc, big_m, big_l,
                    big_a)
        _, big_l, big_a = _folded(m, s_sum, acc, big_m, big_l, big_a)
        out = big_a / big_l[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_rows(part_ptr, ml_ptr, out_ptr, token, head, row_ok, num_parts, last_part,
                  scratch_parts, stride_ot, stride_oh, d, HQ: tl.constexpr, ROWS: tl.constexpr,
                  D: tl.constexpr):
    """Split-KV's fold, by the last program of a tile to finish: each (token, head) row folds
    its ``num_parts`` partitions in order with ``_fold``, as the one-launch kernel does, and
    writes partitions-folded / sum. The scratch is read from L2: other multiprocessors wrote
    it."""
    big_m = tl.full((ROWS,), -1.0e30, tl.float32)
    big_l = tl.zeros((ROWS,), tl.float32)
    big_a = tl.zeros((ROWS, D), tl.float32)
    for z in range(0, last_part):
        has = row_ok & (z < num_parts)
        at = (token * HQ + head) * scratch_parts + z
        m = tl.load(ml_ptr + at * 2, mask=has, other=-1.0e30, cache_modifier=".cg")
        s_sum = tl.load(ml_ptr + at * 2 + 1, mask=has, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_ptr + at[:, None] * D + d[None, :], mask=has[:, None], other=0.0,
                      cache_modifier=".cg")
        m, s_sum, acc, big_m, big_l, big_a = _fold(has, m, s_sum, acc, big_m, big_l, big_a)
    out = big_a / tl.where(row_ok, big_l, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

"""Triton kernels of the model's small ops and its matmul on the flat token layout
(``verispec.ops.model_ops`` has the contract and the torch twins).

Every kernel computes a row with the same instructions whatever the number of rows, so a token's
result does not depend on its batch (docs/design.md §12):

- ``_rms_norm_kernel``: one program per row, residual add and norm in one pass;
- ``_silu_mul_kernel``: elementwise (where the gate|up projection is not fused with it);
- ``_rope_attention_kernel``: one program per (request, kv head, tile of 16 query rows), the
  rows of a tile being the (query, head) pairs of one kv head's group. It rotates the tile's q
  (RoPE after Qwen3's per-head norm) in registers, and for a step of at most 16 new tokens per
  request (decode, verify) it first writes the rotated K and V of the request's new tokens into
  the cache itself (every tile of a head writes the same values; a barrier, then it reads them),
  so a layer's attention is one kernel; a longer step (prefill) writes them in a launch of its
  own first, with the same code on the same blocks of 16 tokens, so a token's K is the same
  bits whichever way it was written. Then an online softmax over key blocks of 64 from key 0,
  so a query's result is the same whether it is decoded alone or is one of the k + 1 queries
  of a verify step (blocks past its position are fully masked and leave its running sums
  unchanged: rescale by exp(0) = 1, add 0). Compiled with ``TREE`` (token trees), a tile holds
  one query, whose keys are read in the order of the chain holding its path;
- ``_argmax_chunk_kernel``, ``_argmax_rows_kernel``: the first maximum of a row (the greedy
  draft's token) from the partials of programs of 8192 columns;
- ``_linear_kernel``: ``x @ W.T``, each output summed over the input features 128 at a time in
  order (no split of the features, whose partial sums would have to be added in some order);
  the tile of rows x outputs follows the product's shape (``linear_config``: enough programs to
  stream the weight at one row, weight tiles reused across rows at many), which leaves each
  output's sum unchanged; with ``GATED`` it computes the gate and up tiles of the fused gate|up
  projection together and stores ``silu(gate) * up`` (no [T, 2I] intermediate, one kernel
  fewer per layer).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from verispec.ops.triton_kernels import INTERPRET

ATTENTION_BLOCK_Q = 16  # query rows per program (tl.dot needs >= 16)
# ... in a bfloat16 / float16 prefill or mixed step: twice the rows per key tile read, the same
# bits (both tiles take the same tensor-core instructions; 64 rows and more do not, nor do
# float32 products at 32 rows: benchmarks/bench_attention.py, tests/ops/test_model_ops.py).
# 64 rows in every launch would keep the bits too and make a 32 k chunk's attention 1.6x
# faster, but cost decode 5 % at batch 1 and 10 % at batch 64 (docs/benchmarks.md).
PREFILL_BLOCK_Q = 32
ATTENTION_BLOCK_KV = 64  # keys per step of the online softmax (part of the reduction order)


@triton.jit
def rms_norm_row(x, res_row_ptr, w_ptr, out_row_ptr, cols, mask, H, eps,
                 HAS_RESIDUAL: tl.constexpr):
    """One row: with a residual, residual += x (one rounding) and the norm of the new
    residual; the norm rounded to x's dtype, then scaled (as HF). Shared with the
    tensor-parallel kernel that fuses the all-reduce before it (``triton_peer``), so both give
    the same bits."""
    if HAS_RESIDUAL:
        r = tl.load(res_row_ptr + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_row_ptr + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_row_ptr + cols, y.to(out_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, H, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    rms_norm_row(x, res_ptr + row * stride_res, w_ptr, out_ptr + row * stride_out, cols, mask,
                 H, eps, HAS_RESIDUAL)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """See ``model_ops.rms_norm``."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res = x2 if residual is None else residual.view(-1, H)
    block = triton.next_power_of_2(H)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res, weight, out, x2.stride(0), res.stride(0), out.stride(0), H, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape)


def _check_index(**tensors: torch.Tensor) -> None:
    """The kernels read index tensors as contiguous 1-D arrays: a strided view (an expanded
    tensor has stride 0) would be read past its end."""
    for name, t in tensors.items():
        if t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape "
                             f"{tuple(t.shape)} and stride {t.stride()}")


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # rounded as torch's F.silu
    y = silu.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See ``model_ops.silu_mul``."""
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if T:
        _silu_mul_kernel[(T, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out


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
def _rope_attention_kernel(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, k_cache_ptr, v_cache_ptr,
                           out_ptr, bt_ptr, slot_ptr, ctx_ptr, qs_ptr, ts_ptr, pos_ptr, path_ptr,
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
                           FLAT_GRID: tl.constexpr, TREE: tl.constexpr, PATH: tl.constexpr):
    G: tl.constexpr = HQ // HKV
    # TREE: one query per tile (its G heads, in tiles of BLOCK_Q rows), whose keys are read in
    # the order of the chain holding its path (``rope_cache_attention``'s docstring)
    TILES_PER_QUERY: tl.constexpr = (G + BLOCK_Q - 1) // BLOCK_Q
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
    else:  # grid (requests, kv heads, tiles up to the longest request's)
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)
    q_lo = tl.load(qs_ptr + b)
    num_q = tl.load(qs_ptr + b + 1) - q_lo
    done = tile * BLOCK_Q >= num_q * G
    if TREE:
        if ATTEND:
            done = tile >= num_q * TILES_PER_QUERY
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
    if TREE:
        last_query = tl.minimum(num_q - 1, tile // TILES_PER_QUERY)
    else:
        last_query = tl.minimum(num_q - 1, (tile * BLOCK_Q + BLOCK_Q - 1) // G)
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
            in_group = (tile % TILES_PER_QUERY) * BLOCK_Q + tl.arange(0, BLOCK_Q)
            row_ok = in_group < G
            query_token = (q_lo + last_query).to(tl.int64)
            token = query_token + in_group * 0
            head = kv_head * G + in_group
            query_pos = tl.load(pos_ptr + query_token)  # root row + depth
            pos = query_pos + in_group * 0
            # its path: the slots at depths 0 .. depth (-1 past it); the root's cache row
            path_row = path_ptr + query_token * stride_path
            steps = tl.arange(0, PATH)
            on_path = tl.load(path_row + steps, mask=steps < path_len, other=-1) >= 0
            root = query_pos - (tl.sum(on_path.to(tl.int32), axis=0) - 1)
        else:
            rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)  # row = query * G + head in group
            query = rows // G
            row_ok = query < num_q
            pos = ctx - num_q + query  # absolute position of the row's query
            token = (q_lo + query).to(tl.int64)
            head = kv_head * G + rows % G
        q = _rope_rows(qkv_ptr + token[:, None] * stride_qkv + head[:, None] * D, d, partner,
                       pos, row_ok, cos_ptr, sin_ptr, stride_cos, qn_ptr, eps, D, HAS_QK_NORM)
        q = q.to(qkv_ptr.dtype.element_ty)  # q rounded to the model dtype, as the twin's
        m = tl.full((BLOCK_Q,), -1.0e30, tl.float32)  # finite: a fully masked block stays exact
        s_sum = tl.zeros((BLOCK_Q,), tl.float32)
        acc = tl.zeros((BLOCK_Q, D), tl.float32)
        if TREE:
            last_pos = query_pos
            first_pos = query_pos
        else:
            last_pos = ctx - num_q + last_query
            first_pos = ctx - num_q + (tile * BLOCK_Q) // G
        kv_lo = 0
        if WINDOWED:  # blocks wholly before every row's window are skipped (aligned to BLOCK_KV)
            kv_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_KV * BLOCK_KV
        for start in range(kv_lo, last_pos + 1, BLOCK_KV):
            key_pos = start + tl.arange(0, BLOCK_KV)
            key_ok = key_pos <= last_pos
            if TREE:  # position root + i: the path's slot at depth i, at row root + slot
                in_tree = key_pos >= root
                slot_at = tl.load(path_row + (key_pos - root), mask=key_ok & in_tree, other=0)
                key_row = tl.where(in_tree, root + slot_at, key_pos)
            else:
                key_row = key_pos
            block = tl.load(bt_row + key_row // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            row = (key_row % BLOCK_SIZE).to(tl.int64)
            k = tl.load(k_base + (block * stride_kc_block + row * stride_kc_pos)[:, None]
                        + d[None, :], mask=key_ok[:, None], other=0.0)
            v = tl.load(v_base + (block * stride_vc_block + row * stride_vc_pos)[:, None]
                        + d[None, :], mask=key_ok[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BQ, BKV] f32
            visible = key_pos[None, :] <= pos[:, None]
            if WINDOWED:
                visible &= pos[:, None] - key_pos[None, :] < window
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            s_sum = s_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / s_sum[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _precision(dtype: torch.dtype) -> str:
    """float32 products in full precision (a float32 model promises float32 arithmetic; Triton's
    default for them is tf32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


ARGMAX_CHUNK = 8192  # columns per program of the argmax: a 128k row is read by 16 programs


@triton.jit
def _argmax_chunk_kernel(x_ptr, val_ptr, idx_ptr, stride_x, N, NUM_CHUNKS,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (rows, chunks): the first maximum of CHUNK columns of a row (NaN counts as the
    largest value, as in torch), into the row's partials."""
    row = tl.program_id(0).to(tl.int64)
    first_col = tl.program_id(1) * CHUNK
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_col = first_col + lanes  # an all -inf chunk: its first column
    for start in range(first_col, first_col + CHUNK, BLOCK):  # lane j: columns j, j + BLOCK..
        cols = start + lanes
        v = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=float("-inf"))
        v = v.to(tl.float32)
        v = tl.where(v != v, float("inf"), v)
        take = v > best
        best = tl.where(take, v, best)
        best_col = tl.where(take, cols, best_col)
    top = tl.max(best, axis=0)
    out = row * NUM_CHUNKS + tl.program_id(1)
    tl.store(val_ptr + out, top)
    tl.store(idx_ptr + out, tl.min(tl.where(best == top, best_col, N), axis=0))


@triton.jit
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, NUM_CHUNKS, NC_P2: tl.constexpr):
    """Grid (rows,): the first maximum of a row from its chunks' partials."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, NC_P2)
    ok = c < NUM_CHUNKS
    val = tl.load(val_ptr + row * NUM_CHUNKS + c, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * NUM_CHUNKS + c, mask=ok, other=2**31 - 1)
    top = tl.max(val, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(val == top, idx, 2**31 - 1), axis=0).to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """See ``model_ops.argmax``: programs of ``ARGMAX_CHUNK`` columns, then one per row over
    their partials (torch's reduction gives a single row one block of threads, and one program
    per row leaves a long row to one program; docs/benchmarks.md)."""
    R, N = logits.shape
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R and N:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        num_chunks = triton.cdiv(N, ARGMAX_CHUNK)
        val = torch.empty((R, num_chunks), dtype=torch.float32, device=logits.device)
        idx = torch.empty((R, num_chunks), dtype=torch.int32, device=logits.device)
        chunk = min(ARGMAX_CHUNK, triton.next_power_of_2(N))
        _argmax_chunk_kernel[(R, num_chunks)](logits, val, idx, logits.stride(0), N, num_chunks,
                                              CHUNK=chunk, BLOCK=min(chunk, 2048), num_warps=4)
        _argmax_rows_kernel[(R,)](val, idx, out, num_chunks,
                                  NC_P2=max(2, triton.next_power_of_2(num_chunks)), num_warps=1)
    return out


# Steps of up to this many new tokens per request (decode, verify) write their K/V inside the
# attention launch; longer ones (prefill) write it in a launch of their own first.
FUSED_WRITE_MAX_QUERIES = 16


def rope_cache_attention(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                         slot_ids, context_lens, query_start, max_queries, num_heads, num_kv_heads,
                         scale, window=None, q_norm=None, k_norm=None, eps=1e-6,
                         tree_paths=None, block_q: int | None = None,
                         num_warps: int = 4) -> torch.Tensor:
    """See ``model_ops.rope_cache_attention``. The kernel derives each token's cache slot, and
    its position unless ``tree_paths`` is given, from ``context_lens``, ``query_start``,
    ``slot_ids`` and ``block_tables`` (``slot_mapping`` is the twin's). Keys are read in tiles of
    ``ATTENTION_BLOCK_KV`` positions from 0, whatever the blocks: the reduction order is that of
    a contiguous cache, so paging changes no bit. ``block_q`` / ``num_warps``: the tile of query
    rows and its warps (a tuning knob for ``benchmarks/bench_attention.py``).

    With ``tree_paths`` (token trees) the kernel is compiled with ``TREE``: a tile holds one
    query's heads (a chain's tile holds 16 / G queries), whose position is
    ``positions[token]``, and the key at position ``root + i`` is read from the row of its
    path's slot at depth i. Its tile, key blocks and order are those of the same query in a
    chain, so both give the same bits. Rows of a tile past the G heads are idle: G / 16 of the
    tile works, a cost that chains, compiled without ``TREE``, do not pay."""
    _check_index(slot_ids=slot_ids, context_lens=context_lens, query_start=query_start)
    tree = tree_paths is not None
    if tree:
        _check_index(positions=positions)
        if tree_paths.dim() != 2 or tree_paths.stride(-1) != 1 or tree_paths.shape[0] != \
                qkv.shape[0]:
            raise ValueError(f"tree_paths must be [T, P] with a contiguous last dimension, got "
                             f"shape {tuple(tree_paths.shape)} and stride {tree_paths.stride()}")
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables must be contiguous int32, got {block_tables.dtype} with "
                         f"strides {block_tables.stride()}")
    T = qkv.shape[0]
    D = cos.shape[-1]
    B = slot_ids.shape[0]
    out = torch.empty((T, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    if T == 0 or B == 0:
        return out
    for name, t in (("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache), ("cos", cos),
                    ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    G = num_heads // num_kv_heads
    has_norm = q_norm is not None
    fused = max_queries <= FUSED_WRITE_MAX_QUERIES
    if block_q is None:  # float32 products (no tensor cores) take another order at 32 rows
        block_q = (PREFILL_BLOCK_Q if not fused and qkv.dtype != torch.float32 and not tree
                   else ATTENTION_BLOCK_Q)
    if tree:  # every request's queries up to the longest's, one a tile (or G / block_q tiles)
        grid = (B, num_kv_heads, max_queries * triton.cdiv(G, block_q))
        tile_starts, search_steps = query_start, 0
    elif fused:  # decode / verify (captured): every request's tiles up to the longest's
        grid = (B, num_kv_heads, triton.cdiv(max_queries * G, block_q))
        tile_starts, search_steps = query_start, 0
    else:
        # A prefill or a mixed step (chunks beside one-token decodes): only real tiles, found
        # by each program from the requests' first tiles (no host sync: the grid is an upper
        # bound, T * G / block_q plus one partial tile per request; the rest return at once).
        tiles = (torch.diff(query_start) * G + block_q - 1) // block_q
        tile_starts = torch.zeros(B + 1, dtype=torch.int64, device=qkv.device)
        torch.cumsum(tiles, 0, out=tile_starts[1:])
        grid = (triton.cdiv(T * G, block_q) + B, num_kv_heads)
        search_steps = max(1, int(B).bit_length())
    paths = tree_paths if tree else query_start  # (unread without TREE)
    path_len = tree_paths.shape[1] if tree else 1
    args = (qkv, cos, sin, q_norm if has_norm else cos, k_norm if has_norm else cos, k_cache,
            v_cache, out, block_tables, slot_ids, context_lens, query_start, tile_starts,
            positions if tree else query_start, paths, B,
            search_steps, qkv.stride(0),
            cos.stride(0), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(1), paths.stride(0), path_len, scale,
            0 if window is None else window, eps)
    meta = dict(BLOCK_SIZE=k_cache.shape[1], HQ=num_heads, HKV=num_kv_heads, D=D,
                BLOCK_Q=block_q,
                BLOCK_KV=ATTENTION_BLOCK_KV, HAS_QK_NORM=has_norm, WINDOWED=window is not None,
                PRECISION=_precision(qkv.dtype), FLAT_GRID=not fused and not tree, TREE=tree,
                PATH=triton.next_power_of_2(path_len), num_warps=num_warps)
    if not fused:
        _rope_attention_kernel[grid](*args, WRITE=True, ATTEND=False, **meta)
    _rope_attention_kernel[grid](*args, WRITE=fused, ATTEND=True, **meta)
    return out


@dataclass(frozen=True)
class LinearConfig:
    """Tiles of ``_linear_kernel``. A row's reduction order is fixed by the features summed per
    step: each output is summed over ``block_k`` features per step, in order. On the tensor
    cores (bfloat16, float16) a step adds its 16-feature slices into the accumulator one after
    the other, so ``block_k`` 64 and 128 give the same sum too (bit-identical on the GPU:
    tests/ops/test_model_ops.py, ``same_bits`` in benchmarks/profile_gpu_step.py); float32 keeps
    one ``block_k``. The tile of rows and outputs changes which products run together, never the
    sum of one output. So the tile may follow the shape of the product, and a row's result is
    the same whatever the number of rows."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_k: int = 128
    # x and W tiles loaded by the Hopper tensor-memory accelerator (bulk copies into shared
    # memory, out-of-range elements zero) instead of per-thread loads; the same sums. Where the
    # device or the strides do not allow it, the same tile runs with per-thread loads.
    tma: bool = False


# Candidate tiles, largest first, per element size (float32 takes half the features per step
# to fit shared memory). ``linear_config`` takes the first that gives the product at least
# LINEAR_MIN_PROGRAMS programs, so that enough of them stream the weight; a row tile of 128 or
# 256 only for more than half its rows. Measured on an H100 over the Llama-3.1-8B shapes at 1,
# 16, 64 and 256 rows (``--parts sweep`` of benchmarks/profile_gpu_step.py), this rule (with
# the two tables below) picks a tile close to the fastest in every case.
LINEAR_TILES = {
    2: (LinearConfig(256, 128, 8, 4, 64), LinearConfig(128, 128, 8, 3),
        LinearConfig(64, 128, 4, 4), LinearConfig(64, 64, 4, 4), LinearConfig(64, 32, 4, 6)),
    4: (LinearConfig(128, 128, 8, 2, 64), LinearConfig(64, 128, 4, 3, 64),
        LinearConfig(64, 64, 4, 3, 64), LinearConfig(64, 32, 4, 4, 64)),
}
LINEAR_MIN_PROGRAMS = 96
# At up to 16 rows (decode and draft steps of small batches), products of up to 8192 outputs
# stream their weight faster in row tiles of 16 and output tiles of 32 (more programs share the
# weight stream); wider products keep the tiles above.
LINEAR_FEW_ROWS = {2: (16, 8192, LinearConfig(16, 32, 4, 6))}  # itemsize: rows, outputs, tile
# Loads by the tensor-memory accelerator from this many rows on (bfloat16 / float16 on Hopper).
# Bulk copies pay for many rows, are even at 64 and cost more at 16 and fewer (the sweep of
# benchmarks/profile_gpu_step.py).
LINEAR_TMA_MIN_ROWS = {2: 17}
# Above 128 rows (verify steps of large batches, near compute-bound) deeper pipelines of 64
# features per step pay: the 256 x 128 tile with 4 stages instead of 3, the 128 x 128 tile with
# 5 stages of 64 features instead of 3 of 128 (the same sweep); at 128 rows and fewer they
# do not.
LINEAR_MANY_ROWS = {(2, LinearConfig(128, 128, 8, 3)): LinearConfig(128, 128, 8, 5, 64)}


def linear_config(num_rows: int, num_outputs: int, dtype: torch.dtype) -> LinearConfig:
    """The tile of a [num_rows, K] x [num_outputs, K].T product (see ``LINEAR_TILES``,
    ``LINEAR_FEW_ROWS``, ``LINEAR_MANY_ROWS`` and ``LINEAR_TMA_MIN_ROWS``)."""
    few = LINEAR_FEW_ROWS.get(dtype.itemsize)
    if few is not None and num_rows <= few[0] and num_outputs <= few[1]:
        return few[2]
    tiles = LINEAR_TILES[dtype.itemsize]
    chosen = tiles[-1]
    for config in tiles:
        if config.block_m > 64 and num_rows <= config.block_m // 2:
            continue
        programs = triton.cdiv(num_rows, config.block_m) * triton.cdiv(num_outputs,
                                                                        config.block_n)
        if programs >= LINEAR_MIN_PROGRAMS:
            chosen = config
            break
    if num_rows > 128:
        chosen = LINEAR_MANY_ROWS.get((dtype.itemsize, chosen), chosen)
    if num_rows >= LINEAR_TMA_MIN_ROWS.get(dtype.itemsize, num_rows + 1):
        return _with_tma(chosen)
    return chosen


@functools.cache
def _with_tma(config: LinearConfig) -> LinearConfig:
    return dataclasses.replace(config, tma=True)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                   TMA: tl.constexpr, ROUND: tl.constexpr):
    """Grid (row tiles, output tiles). With ``TMA``, ``x_ptr`` and ``w_ptr`` are tensor
    descriptors of x [M, K] and W [N (GATED: 2N), K] with blocks [BLOCK_M, BLOCK_K] and
    [BLOCK_N, BLOCK_K]. Outputs are rounded to ``ROUND`` (x's dtype), then stored in the
    output's (float32 logits: the rounded values widened, no second pass over them)."""
    pid_m = tl.program_id(0)  # row tiles vary fastest: programs that run together share a
    pid_n = tl.program_id(1)  # weight tile, so the weight is read from memory about once
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if not TMA:
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        up_rows = w_rows + N * stride_wn  # GATED: weight rows N + n: output n's up projection
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):  # a fixed order of BLOCK_K steps: the row's sum
        kk = k0 + rk
        w_mask = (rn[:, None] < N) & (kk[None, :] < K)
        if TMA:
            x = x_ptr.load([pid_m * BLOCK_M, k0])
            w = w_ptr.load([pid_n * BLOCK_N, k0])  # rows past N: outputs not stored
        else:
            x = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if GATED:
            if TMA:
                u = w_ptr.load([N + pid_n * BLOCK_N, k0])
            else:
                u = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, tl.trans(u), acc_up, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptr + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if GATED:  # silu(gate) * up, each rounded as the unfused projection and silu_mul round it
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        acc = silu.to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             acc.to(ROUND).to(dtype),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None,
           config: LinearConfig | None = None) -> torch.Tensor:
    """See ``model_ops.linear``: every output is one sum over the input features in steps of
    ``block_k``, whatever the tile (``linear_config``, or ``config`` in benchmarks), so each row's
    result is independent of the number of rows."""
    return _linear(x, weight, bias, config, gated=False, out_dtype=out_dtype)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    *, config: LinearConfig | None = None) -> torch.Tensor:
    """See ``model_ops.linear_silu_mul``: the gate|up projection and ``silu_mul`` in one kernel,
    bit-identical to ``silu_mul(linear(x, weight, bias))``. A program computes a tile of the gate
    and the same tile of the up projection, half as wide as ``linear``'s tile of the [T, 2I]
    product, so it streams as many weight bytes as that tile would."""
    return _linear(x, weight, bias, config, gated=True)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            config: LinearConfig | None, gated: bool,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    K = x.shape[-1]
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("linear: the weight must have a contiguous last dimension")
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return out.view(*x.shape[:-1], N)
    cfg = config or linear_config(M, weight.shape[0], x.dtype)
    block_n = max(16, cfg.block_n // 2) if gated else cfg.block_n
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, block_n))
    x_arg, w_arg = x2, weight
    tma = cfg.tma and _tma_ok(x2) and _tma_ok(weight)
    if tma:
        x_arg = TensorDescriptor(x2, [M, K], [x2.stride(0), 1], [cfg.block_m, cfg.block_k])
        w_arg = TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1],
                                 [block_n, cfg.block_k])
    _linear_kernel[grid](
        x_arg, w_arg, weight if bias is None else bias, out, M, N, K, x2.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, GATED=gated,
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
        PRECISION=_precision(x.dtype), TMA=tma, ROUND=_TL_DTYPES[x.dtype],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.view(*x.shape[:-1], N)


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether the tensor-memory accelerator can load tiles of the 2-D ``t``: a Hopper or later
    GPU (or Triton's interpreter), 16-byte aligned base and row stride."""
    if t.device.type == "cuda":
        if not _has_tma(t.device.index if t.device.index is not None
                        else torch.cuda.current_device()):
            return False
    elif not INTERPRET:
        return False
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


@functools.cache
def _has_tma(index: int) -> bool:
    """Whether GPU ``index`` has the tensor-memory accelerator (compute capability >= 9)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


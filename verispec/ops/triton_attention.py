"""The attention of the GPU step over the paged KV cache, on the flat token layout (contract and
torch twin: ``verispec.ops.model_ops.rope_cache_attention``; read through
``verispec.ops.triton_model``).

Every program computes a row with the same instructions whatever the number of rows, so a token's
result does not depend on its batch (docs/design.md §12).

``_rope_attention_kernel`` has one program per (request, kv head, tile of 16 query rows), the
rows of a tile being the (query, head) pairs of one kv head's group. It rotates the tile's q
(RoPE after Qwen3's per-head norm) in registers, and for a step of at most 16 new tokens per
request (decode, verify) it first writes the rotated K and V of the request's new tokens into
the cache itself (every tile of a head writes the same values; a barrier, then it reads them),
so a layer's attention is one kernel; a longer step (prefill) writes them in a launch of its
own first, with the same code on the same blocks of 16 tokens, so a token's K is the same
bits whichever way it was written. Then an online softmax over key blocks of 64 from key 0,
so a query's result is the same whether it is decoded alone or is one of the k + 1 queries
of a verify step (blocks past its position are fully masked and leave its running sums
unchanged: rescale by exp(0) = 1, add 0). The blocks form partitions that depend on the
query's position alone (``PARTITION_KEYS``), each an online softmax from scratch, folded in
order (``_fold``); a decode or verify launch with fewer tiles than multiprocessors computes
the partitions in programs of their own (split-KV), and the last of a tile's programs to
finish folds them (``_combine_rows``), the same bits. Compiled with ``TREE`` (token trees),
each row of a tile reads its keys in the order of the chain holding its path: the key blocks
before the tree's root are shared by the tile's queries, a block holding tree rows is read
once per query and each row keeps its own query's scores and values.
"""

from __future__ import annotations

import functools

import torch
import triton

from verispec.ops.triton_attention_kernels import _rope_attention_kernel
from verispec.ops.triton_rowwise import _precision

ATTENTION_BLOCK_Q = 16  # query rows per program (tl.dot needs >= 16)
# ... in a bfloat16 / float16 prefill or mixed step: twice the rows per key tile read, the same
# bits (both tiles take the same tensor-core instructions; 64 rows and more do not, nor do
# float32 products at 32 rows: benchmarks/bench_attention.py, tests/ops/test_model_ops.py).
# 64 rows in every launch would keep the bits too and make a 32 k chunk's attention 1.6x
# faster, but cost decode 5 % at batch 1 and 10 % at batch 64 (docs/benchmarks.md).
PREFILL_BLOCK_Q = 32
ATTENTION_BLOCK_KV = 64  # keys per step of the online softmax (part of the reduction order)
# The reduction order's partitions (docs/design.md §12): a query at position p < SMALL_PARTITIONS
# x SMALL_PARTITION_KEYS reads its keys in partitions of SMALL_PARTITION_KEYS, one further on in
# partitions of PARTITION_KEYS x ceil(ceil((p + 1) / PARTITION_KEYS) / MAX_PARTITIONS) keys, at
# most MAX_PARTITIONS of them; each partition's online softmax starts afresh and the partitions
# are folded in order. One kernel folds them as it goes; a small batch's decode or verify
# (split-KV) computes them in programs of their own, the last to finish folding them. The small
# partitions give a short context's keys to more programs (batch 1, 1 k keys: 13 us a layer,
# not 22); past 2 k keys, 512 and more keep a program's loop long (partitions of 128 everywhere
# made 16 x 4 000 keys 18 % slower; docs/benchmarks.md). All are multiples of
# ATTENTION_BLOCK_KV: no key block straddles two partitions.
SMALL_PARTITION_KEYS = 128
SMALL_PARTITIONS = 16
PARTITION_KEYS = 512
MAX_PARTITIONS = 64
# A split-KV launch has about this many programs per multiprocessor (0: no split-KV); a token
# tree's, whose tiles are heavier (H200, 8B shape, a 32-token tree over 1 024 keys in a
# captured verify: 6.55 ms at 1 a multiprocessor, 6.58 at 2, 6.91 at 4; a decode step is the
# same 4.8 ms under all three).
SPLIT_PROGRAMS_PER_SM = 4
TREE_SPLIT_PROGRAMS_PER_SM = 1
# A token tree's launch does not pipeline its key loop (one stage: 35.6 against 39.9 us a layer
# for a 32-token tree over 1 024 keys, H200; the same bits). The kernel runs at the 255-register
# ceiling in every mode, two programs a multiprocessor, which is why more split-KV programs make
# a tree's launch slower, not faster (docs/benchmarks.md).
TREE_STAGES = 1


def _check_index(**tensors: torch.Tensor) -> None:
    """The kernels read index tensors as contiguous 1-D arrays: a strided view (an expanded
    tensor has stride 0) would be read past its end."""
    for name, t in tensors.items():
        if t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape "
                             f"{tuple(t.shape)} and stride {t.stride()}")


def _step_value(derived: dict | None, key: tuple, make) -> torch.Tensor:
    """``make()``, kept in ``derived`` under ``key`` (the step's layout-derived values, shared
    by its layers: made once a step, not once a layer); made afresh without ``derived``."""
    if derived is None:
        return make()
    if key not in derived:
        derived[key] = make()
    return derived[key]


def _tile_starts(query_start: torch.Tensor, G: int, block_q: int,
                 derived: dict | None) -> torch.Tensor:
    """[B + 1]: each request's first tile of ``block_q`` (query, head) rows in a flat-grid
    launch, once a step (``_step_value``), not seven small launches per layer."""

    def make() -> torch.Tensor:
        tiles = (torch.diff(query_start) * G + block_q - 1) // block_q
        starts = torch.zeros(query_start.shape[0], dtype=torch.int64, device=query_start.device)
        torch.cumsum(tiles, 0, out=starts[1:])
        return starts

    return _step_value(derived, ("tile_starts", G, block_q), make)


# Steps of up to this many new tokens per request (decode, verify) write their K/V inside the
# attention launch; longer ones (prefill) write it in a launch of their own first. Token trees
# up to FUSED_WRITE_MAX_TREE_QUERIES (a 32-token tree's verify, 8B shape, H200: 6.37 against
# 6.57 ms with the write apart, docs/benchmarks.md).
FUSED_WRITE_MAX_QUERIES = 16
FUSED_WRITE_MAX_TREE_QUERIES = 64


def rope_cache_attention(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                         slot_ids, context_lens, query_start, max_queries, num_heads, num_kv_heads,
                         scale, window=None, q_norm=None, k_norm=None, eps=1e-6,
                         tree_paths=None, derived=None, block_q: int | None = None,
                         num_warps: int = 4, split_programs: int | None = None) -> torch.Tensor:
    """See ``model_ops.rope_cache_attention``. The kernel derives each token's cache slot, and
    its position unless ``tree_paths`` is given, from ``context_lens``, ``query_start``,
    ``slot_ids`` and ``block_tables`` (``slot_mapping`` is the twin's). Keys are read in tiles of
    ``ATTENTION_BLOCK_KV`` positions from 0, whatever the blocks: the reduction order is that of
    a contiguous cache, so paging changes no bit. ``block_q`` / ``num_warps``: the tile of query
    rows and its warps (a tuning knob for ``benchmarks/bench_attention.py``; the warps change
    the order of the softmax's sums, hence the bits: every launch of the engine takes 4).

    A decode or verify launch with few programs (a small batch) runs split-KV: each (request, kv
    head, tile) gets ``split_programs`` programs (default: enough for ``SPLIT_PROGRAMS_PER_SM``
    a multiprocessor), each computing every ``split_programs``-th partition of the rows' keys;
    the tile's last program to finish folds the partitions in order (a count per tile in
    ``_tickets``: no second launch). Same bits as one program per tile.

    With ``tree_paths`` (token trees) the kernel is compiled with ``TREE``: tiles hold the
    (query, head) rows as a chain's do, a query's position is ``positions[token]``, and the key
    at position ``root + i`` is read from the row of its path's slot at depth i. The key blocks
    before the root are read once for the tile's queries; a block holding tree rows is read once
    per query, each row keeping the scores and products of its own query's keys. A row's key
    blocks, order and products are those of the same query in a chain, so both give the same
    bits."""
    _check_index(slot_ids=slot_ids, context_lens=context_lens, query_start=query_start)
    if PARTITION_KEYS % ATTENTION_BLOCK_KV or SMALL_PARTITION_KEYS % ATTENTION_BLOCK_KV:
        raise ValueError(f"PARTITION_KEYS ({PARTITION_KEYS}) and SMALL_PARTITION_KEYS "
                         f"({SMALL_PARTITION_KEYS}) must be multiples of ATTENTION_BLOCK_KV "
                         f"({ATTENTION_BLOCK_KV})")
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
    fused = max_queries <= (FUSED_WRITE_MAX_TREE_QUERIES if tree else FUSED_WRITE_MAX_QUERIES)
    if block_q is None:  # float32 products (no tensor cores) take another order at 32 rows
        block_q = (PREFILL_BLOCK_Q if not fused and qkv.dtype != torch.float32 and not tree
                   else ATTENTION_BLOCK_Q)
    if tree or fused:  # trees, decode / verify (captured): tiles up to the longest request's
        grid = (B, num_kv_heads, triton.cdiv(max_queries * G, block_q))
        tile_starts, search_steps = query_start, 0
    else:
        # A prefill or a mixed step (chunks beside one-token decodes): only real tiles, found
        # by each program from the requests' first tiles (no host sync: the grid is an upper
        # bound, T * G / block_q plus one partial tile per request; the rest return at once).
        tile_starts = _tile_starts(query_start, G, block_q, derived)
        grid = (triton.cdiv(T * G, block_q) + B, num_kv_heads)
        search_steps = max(1, int(B).bit_length())
    split = 1
    # the most partitions a request of this cache can have
    cache_keys = block_tables.shape[1] * k_cache.shape[1]
    scratch_parts = max(min(MAX_PARTITIONS, -(-cache_keys // PARTITION_KEYS)),
                        min(SMALL_PARTITIONS, -(-cache_keys // SMALL_PARTITION_KEYS)))
    if fused or tree:  # decode, verify, token trees
        per_sm = TREE_SPLIT_PROGRAMS_PER_SM if tree else SPLIT_PROGRAMS_PER_SM
        split = split_programs or _split_programs(grid[0] * grid[1] * grid[2], qkv.device,
                                                  per_sm)
        split = max(1, min(split, scratch_parts))
    if split > 1:
        grid = (grid[0], grid[1], grid[2] * split)
        parts = torch.empty((T, num_heads, scratch_parts, D), dtype=torch.float32,
                            device=qkv.device)
        maxes_sums = torch.empty((T, num_heads, scratch_parts, 2), dtype=torch.float32,
                                 device=qkv.device)
        tickets = _tickets(grid[0] * grid[1] * (grid[2] // split), qkv.device, derived)
    else:
        parts, maxes_sums, tickets = out, out, query_start  # (unread without SPLIT)
    paths = tree_paths if tree else query_start  # (unread without TREE)
    path_len = tree_paths.shape[1] if tree else 1
    args = (qkv, cos, sin, q_norm if has_norm else cos, k_norm if has_norm else cos, k_cache,
            v_cache, out, block_tables, slot_ids, context_lens, query_start, tile_starts,
            positions if tree else query_start, paths, parts, maxes_sums, tickets, split,
            scratch_parts if split > 1 else 1, B,
            search_steps, qkv.stride(0),
            cos.stride(0), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(1), paths.stride(0), path_len, scale,
            0 if window is None else window, eps)
    meta = dict(BLOCK_SIZE=k_cache.shape[1], HQ=num_heads, HKV=num_kv_heads, D=D,
                BLOCK_Q=block_q,
                BLOCK_KV=ATTENTION_BLOCK_KV, HAS_QK_NORM=has_norm, WINDOWED=window is not None,
                PRECISION=_precision(qkv.dtype), FLAT_GRID=not fused and not tree, TREE=tree,
                PATH=triton.next_power_of_2(path_len), SMALL_KEYS=SMALL_PARTITION_KEYS,
                SMALL_PARTS=SMALL_PARTITIONS, PART_KEYS=PARTITION_KEYS,
                MAX_PARTS=MAX_PARTITIONS, num_warps=num_warps)
    if tree:
        meta["num_stages"] = TREE_STAGES
    if not fused:
        _rope_attention_kernel[grid](*args, WRITE=True, ATTEND=False, SPLIT=False, **meta)
    _rope_attention_kernel[grid](*args, WRITE=fused, ATTEND=True, SPLIT=split > 1, **meta)
    return out


def _tickets(count: int, device: torch.device, derived: dict | None) -> torch.Tensor:
    """[count] int32 zeros: a split-KV launch's arrival count per tile. The last program of a
    tile puts its count back to 0, so the step's layers share one (``_step_value``): one zero
    fill a step, not one a layer."""
    return _step_value(derived, ("tickets", count),
                       lambda: torch.zeros((count,), dtype=torch.int32, device=device))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_programs(programs: int, device: torch.device, per_sm: int) -> int:
    """Programs per (request, kv head, tile) of a decode, verify or tree launch of
    ``programs`` tiles: 1 (no split) when there are more tiles than multiprocessors (a batch of
    32 x 2 000 keys ran 8 % slower split on an H200), else enough for ``per_sm`` programs a
    multiprocessor (``SPLIT_PROGRAMS_PER_SM``, ``TREE_SPLIT_PROGRAMS_PER_SM``)."""
    sms = _multiprocessors(device)
    if SPLIT_PROGRAMS_PER_SM == 0 or programs > sms:
        return 1
    return -(-per_sm * sms // programs)

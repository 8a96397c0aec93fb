"""Triton kernels of the model's ops that compute each token's row on its own (RMSNorm,
SiLU-and-multiply, argmax, the matmul) on the flat token layout (``verispec.ops.model_ops`` has
the contract and the torch twins; the attention over the KV cache is in
``verispec.ops.triton_model``, which re-exports these).

Every kernel computes a row with the same instructions whatever the number of rows, so a token's
result does not depend on its batch (docs/design.md §12):

- ``_rms_norm_kernel``: one program per row, residual add and norm in one pass;
- ``_silu_mul_kernel``: elementwise (where the gate|up projection is not fused with it);
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
# The fused gate|up projection at up to 16 rows, whatever its width: gate and up tiles of 64
# outputs (H200, one and four rows: 3-7 % faster than the tile above or the general rule on the
# 8B shape whole and split in two, the 70B shape split in two and the 1B shape).
LINEAR_FEW_ROWS_GATED = {2: (16, LinearConfig(16, 128, 4, 4))}  # itemsize: rows, tile
# Loads by the tensor-memory accelerator (bfloat16 / float16 on Hopper) from LINEAR_TMA_MIN_ROWS
# rows on, below LINEAR_TMA_ALL_ROWS only where the last tile of rows is at least 7/8 full. On an
# H200 (a step's matmuls of the 8B shape, default tiles with and without): bulk copies cost
# 4-56 % more from 17 to 48 rows (tree verify steps, decodes of 17-48 requests) and 9 % more at
# 96 (tiles of 64 or 128 rows, the last half or 3/4 full); 1-3 % less at 56 and 64, 7-14 % less
# at 128, 192 and 256.
LINEAR_TMA_MIN_ROWS = {2: 56}
LINEAR_TMA_ALL_ROWS = 128
# Above 128 rows (verify steps of large batches, near compute-bound) deeper pipelines of 64
# features per step pay: the 256 x 128 tile with 4 stages instead of 3, the 128 x 128 tile with
# 5 stages of 64 features instead of 3 of 128 (the same sweep); at 128 rows and fewer they
# do not.
LINEAR_MANY_ROWS = {(2, LinearConfig(128, 128, 8, 3)): LinearConfig(128, 128, 8, 5, 64)}
# ... and the fused gate|up projection above 128 rows (prefill and chunked steps): gate and up
# tiles of 128 x 128, 4 stages of 64 features (H200, 8B shape at 512 / 2 048 / 8 192 rows: 182
# / 720 / 3 095 us against 205 / 807 / 3 556 in the 256 x 128 tile the rule above picks;
# benchmarks/bench_linear_tiles.py).
LINEAR_MANY_ROWS_GATED = {2: LinearConfig(128, 256, 8, 4, 64)}


@functools.lru_cache(maxsize=4096)  # a step's layers ask for the same few shapes
def linear_config(num_rows: int, num_outputs: int, dtype: torch.dtype,
                  gated: bool = False) -> LinearConfig:
    """The tile of a [num_rows, K] x [num_outputs, K].T product, ``gated``: the fused gate|up
    one (see ``LINEAR_TILES``, ``LINEAR_FEW_ROWS``, ``LINEAR_FEW_ROWS_GATED``,
    ``LINEAR_MANY_ROWS``, ``LINEAR_MANY_ROWS_GATED``, ``LINEAR_TMA_MIN_ROWS`` and
    ``LINEAR_TMA_ALL_ROWS``)."""
    few_gated = LINEAR_FEW_ROWS_GATED.get(dtype.itemsize)
    if gated and few_gated is not None and num_rows <= few_gated[0]:
        return few_gated[1]
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
        if gated:
            chosen = LINEAR_MANY_ROWS_GATED.get(dtype.itemsize, chosen)
    if num_rows >= LINEAR_TMA_MIN_ROWS.get(dtype.itemsize, num_rows + 1) and (
            num_rows >= LINEAR_TMA_ALL_ROWS
            or 8 * (num_rows % chosen.block_m or chosen.block_m) >= 7 * chosen.block_m):
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
    cfg = config or linear_config(M, weight.shape[0], x.dtype, gated)
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


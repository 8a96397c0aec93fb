"""A tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it, over
NVLink peer-to-peer loads (docs/design.md §14).

A row-parallel projection (attention output, MLP down) leaves each rank a partial sum; the
layer then needs ``rms_norm(sum of partials, weight, eps, residual)``. Done apart that is a copy
into a shared buffer, an all-reduce kernel with two cross-GPU barriers and a norm kernel. Here
it is one kernel with one barrier:

1. each program copies its rows of the rank's partial into the rank's half of a symmetric
   buffer (every rank maps every rank's buffer), alternating between two halves call by call;
2. it raises its flag in every peer's flag array and waits for every peer's flag (the barrier);
3. it adds the rows of every rank in rank order in float32 (the same bits on every rank),
   rounds once to the model dtype, and finishes exactly as ``triton_rowwise.rms_norm`` with a
   residual does (the same code, ``triton_rowwise.rms_norm_row``).

Program ``p`` always handles rows ``p, p + PROGRAMS, ...`` and each program has its own flag
counter, so program ``p`` of one rank only ever waits for program ``p`` of the others. That is
what makes one barrier enough: a rank that writes a half again (two calls later) has passed
the barrier of the call in between with every peer's program ``p``, which those peers start
only after their previous kernel, the last reader of that half, has finished.

The counters live on the device and the kernel advances them itself, so the kernel replays
inside CUDA graphs. A wait gives up after ``max_polls`` reads of its flag (a rank that died) and
records it in ``counters[PROGRAMS]``, instead of hanging the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verispec.ops.triton_rowwise import rms_norm_row

PROGRAMS = 64  # fixed: the row -> program map must not depend on the number of rows
MAX_POLLS = 1 << 27


@triton.jit
def _peer_reduce_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, bases_ptr, counters_ptr,
                             M, H, stride_x, stride_res, stride_out, eps, half_bytes,
                             flags_offset, max_polls,
                             RANK: tl.constexpr, WORLD: tl.constexpr, PROGRAMS: tl.constexpr,
                             ITEMSIZE: tl.constexpr, BLOCK: tl.constexpr,
                             ALIGN: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = x_ptr.dtype.element_ty
    count = tl.load(counters_ptr + pid) + 1
    tl.store(counters_ptr + pid, count)
    half = (count % 2) * half_bytes  # offsets within a buffer of a few MiB: int32 suffices
    row_bytes = H * ITEMSIZE
    my_base = tl.load(bases_ptr + RANK)
    # 1. this rank's rows into its half of the shared buffer
    for row in range(pid, M, PROGRAMS):
        part = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dst = (my_base + half + row * row_bytes).to(tl.pointer_type(dtype))
        tl.store(tl.multiple_of(dst + cols, ALIGN), part, mask=mask)
    tl.debug_barrier()  # every thread's rows written before the flag goes up
    # 2. the barrier with program pid of every peer
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer_flags = (tl.load(bases_ptr + r) + flags_offset).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + RANK * PROGRAMS + pid, count, sem="release",
                           scope="sys")
    my_flags = (my_base + flags_offset).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != RANK:
            flag = my_flags + r * PROGRAMS + pid
            polls = 0
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            while ((seen - count) < 0) & (polls < max_polls):  # wraps safely (int32)
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                polls += 1
            if polls >= max_polls:
                tl.store(counters_ptr + PROGRAMS, 1)
    tl.debug_barrier()
    # 3. the sum in rank order, then the residual add and the norm
    for row in range(pid, M, PROGRAMS):
        acc = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                part = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
            else:
                src = (tl.load(bases_ptr + r) + half + row * row_bytes).to(
                    tl.pointer_type(dtype))
                # 16-byte aligned (buffer base, rows of H % 8 == 0 elements): vector loads
                part = tl.load(tl.multiple_of(src + cols, ALIGN), mask=mask, other=0.0,
                               volatile=True)
            acc += part.to(tl.float32)
        rms_norm_row(acc.to(dtype), res_ptr + row * stride_res, w_ptr,
                     out_ptr + row * stride_out, cols, mask, H, eps, True)


def peer_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float, bases: torch.Tensor, counters: torch.Tensor, rank: int,
                         world: int, half_bytes: int, flags_offset: int,
                         max_polls: int = MAX_POLLS) -> torch.Tensor:
    """``rms_norm(sum over ranks of x, weight, eps, residual)`` (residual updated in place), x
    [T, H] this rank's partial. ``bases`` [world] int64: each rank's shared buffer as this
    process maps it (two halves of ``half_bytes`` then ``world * PROGRAMS`` int32 flags at
    ``flags_offset``); ``counters`` [PROGRAMS + 1] int32 on the device, zero at first, shared
    by every call of this rank."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    res = residual.view(-1, H)
    if x2.shape[0] * H * x.element_size() > half_bytes:
        raise ValueError(f"peer_reduce_rms_norm: {x2.shape[0]} rows of {H} do not fit "
                         f"{half_bytes} bytes")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(H)
    _peer_reduce_norm_kernel[(PROGRAMS,)](
        x2, res, weight, out, bases, counters, x2.shape[0], H, x2.stride(0), res.stride(0),
        out.stride(0), eps, half_bytes, flags_offset, max_polls,
        RANK=rank, WORLD=world, PROGRAMS=PROGRAMS, ITEMSIZE=x.element_size(), BLOCK=block,
        ALIGN=16 // x.element_size() if (H * x.element_size()) % 16 == 0 else 1,
        num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape)

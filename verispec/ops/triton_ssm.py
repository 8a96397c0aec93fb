"""Triton kernel of the Mamba2 multi-token state update (a decode or verify step of a hybrid
model); the torch twin, with the same signature and the contract, is
``verispec.ops.model_ops.ssm_state_update``.

``_ssm_state_update_kernel``: one program per (request, head, block of ``BLOCK_P`` head-dim
rows). It loads the request's state rows ``[BLOCK_P, d_state]`` from the ring entry of its
committed length (zeros for an empty slot), then for each of the request's tokens keeps them in
registers while it applies ``h = h * decay + x (outer) dt B``, stores them to the ring entry of
the length after that token and writes ``y = C . h`` for its rows. A request's count is read on
the device (no host value shapes the launch but G, heads and the padded width), so the launch
is capturable in a CUDA graph. Each row's sum over d_state is one ``tl.sum`` whatever G: a
request's bits do not depend on its batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ssm_state_update_kernel(
    ring_ptr, slots_ptr, starts_ptr, counts_ptr, x_ptr, dtb_ptr, decay_ptr, c_ptr, y_ptr,
    stride_ring_slot, stride_ring_pos, RING_SIZE, G, H, P, N,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < P
    n_ok = n < N
    ok = p_ok[:, None] & n_ok[None, :]
    slot = tl.load(slots_ptr + g)
    start = tl.load(starts_ptr + g)
    count = tl.load(counts_ptr + g)
    rows = h * P * N + p[:, None] * N + n[None, :]  # within one ring entry [H, P, N]
    entry = ring_ptr + slot * stride_ring_slot
    state = tl.load(entry + (start % RING_SIZE) * stride_ring_pos + rows, mask=ok, other=0.0)
    state = tl.where(start > 0, state, 0.0)  # an empty slot starts from zeros
    for s in range(0, count):
        token = (s * G + g) * H + h  # [S, G, H] token-major index
        decay = tl.load(decay_ptr + token)
        x = tl.load(x_ptr + token * P + p, mask=p_ok, other=0.0)
        dtb = tl.load(dtb_ptr + token * N + n, mask=n_ok, other=0.0)
        c = tl.load(c_ptr + token * N + n, mask=n_ok, other=0.0)
        state = state * decay + x[:, None] * dtb[None, :]
        tl.store(entry + ((start + s + 1) % RING_SIZE) * stride_ring_pos + rows, state, mask=ok)
        y = tl.sum(state * c[None, :], axis=1)
        tl.store(y_ptr + token * P + p, y, mask=p_ok)


def ssm_state_update(
    ssm_ring: torch.Tensor,  # [num_slots, ring_size, heads, head_dim, d_state] float32, updated
    slots: torch.Tensor,  # [G] int64
    starts: torch.Tensor,  # [G] int64
    counts: torch.Tensor,  # [G] int64 >= 1
    x: torch.Tensor,  # [S, G, heads, head_dim] float32
    dtB: torch.Tensor,  # [S, G, heads, d_state] float32
    decay: torch.Tensor,  # [S, G, heads] float32
    C: torch.Tensor,  # [S, G, heads, d_state] float32
) -> torch.Tensor:
    """See ``verispec.ops.model_ops.ssm_state_update``. Returns y [S, G, heads, head_dim]
    float32, zeros for the padding tokens."""
    S, G, H, P = x.shape
    N = dtB.shape[-1]
    if ssm_ring.dtype != torch.float32 or ssm_ring.shape[2:] != (H, P, N):
        raise ValueError(f"ssm_ring must be float32 [num_slots, ring_size, {H}, {P}, {N}], got "
                         f"{ssm_ring.dtype} {tuple(ssm_ring.shape)}")
    if ssm_ring.stride()[2:] != (P * N, N, 1):
        raise ValueError("each ring entry of ssm_ring must be contiguous")
    for name, t, shape in (("x", x, (S, G, H, P)), ("dtB", dtB, (S, G, H, N)),
                           ("decay", decay, (S, G, H)), ("C", C, (S, G, H, N))):
        if t.shape != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    for name, t in (("slots", slots), ("starts", starts), ("counts", counts)):
        if t.shape != (G,) or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 tensor of shape ({G},), got "
                             f"{t.dtype} {tuple(t.shape)}")
    y = torch.zeros((S, G, H, P), dtype=torch.float32, device=x.device)
    if G == 0 or S == 0:
        return y
    block_n = triton.next_power_of_2(N)
    block_p = min(triton.next_power_of_2(P), max(1, 4096 // block_n))
    grid = (G, H, triton.cdiv(P, block_p))
    _ssm_state_update_kernel[grid](
        ssm_ring, slots, starts, counts, x, dtB, decay, C, y,
        ssm_ring.stride(0), ssm_ring.stride(1), ssm_ring.shape[1], G, H, P, N,
        BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
    return y

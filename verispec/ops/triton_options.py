"""Triton twins of ``ops.options.apply_penalties`` (the repetition, frequency and presence
penalties of a captured step's rows, in place) and of ``ops.options.apply_token_bitmask`` (a
grammar's token masks, in place, in one launch: the torch twin's unpacking takes ~8; docs/
design.md §15).

One program per (row, block of the vocabulary). A program whose request has no penalty
(slot -1) returns at once, so a captured step with no penalised request pays one launch of
programs that exit. Otherwise it reads the block of its slot's counts and prompt mask, adds the
drafts before its row (at most S - 1 compares per token), and applies the penalties with the
twin's float operations: IEEE division (``div_rn``), and no fused multiply-add (the launch
turns Triton's fusion off), so the bits equal the torch twin's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _penalties_kernel(logits_ptr, ids_ptr, slots_ptr, params_ptr, counts_ptr, prompt_ptr,
                      V, S: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    b = row // S
    i = row % S
    slot = tl.load(slots_ptr + b)
    if slot < 0:
        return
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = v < V
    base = slot.to(tl.int64) * V
    counts = tl.load(counts_ptr + base + v, mask=inside, other=0)
    for j in tl.static_range(1, S):  # the drafts before row i: ids[b, 1..i]
        if j <= i:
            token = tl.load(ids_ptr + b * S + j)
            counts += (v == token).to(tl.int32)
    present = counts > 0
    seen = present | (tl.load(prompt_ptr + base + v, mask=inside, other=0) != 0)
    rep = tl.load(params_ptr + b * 3)
    freq = tl.load(params_ptr + b * 3 + 1)
    pres = tl.load(params_ptr + b * 3 + 2)
    at = logits_ptr + row.to(tl.int64) * V + v
    z = tl.load(at, mask=inside, other=0.0)
    z = tl.where(seen, tl.where(z > 0, tl.math.div_rn(z, rep), z * rep), z)
    z = z - freq * counts.to(tl.float32)
    z = z - pres * present.to(tl.float32)
    tl.store(at, z, mask=inside)


def apply_penalties(logits: torch.Tensor, token_ids: torch.Tensor, slots: torch.Tensor,
                    params: torch.Tensor, output_counts: torch.Tensor,
                    prompt_mask: torch.Tensor) -> None:
    """See ``verispec.ops.options.apply_penalties`` (same signature, same bits)."""
    B, S = token_ids.shape
    V = logits.shape[1]
    if B == 0:
        return
    assert logits.dtype == torch.float32 and logits.is_contiguous() and logits.shape[0] == B * S
    _penalties_kernel[(B * S, triton.cdiv(V, _BLOCK))](
        logits, token_ids.contiguous(), slots.contiguous(), params.contiguous(),
        output_counts, prompt_mask.view(torch.uint8), V, S=S, BLOCK=_BLOCK,
        enable_fp_fusion=False)


@triton.jit
def _token_bitmask_kernel(logits_ptr, logits_stride, rows_ptr, rows_stride, bitmask_ptr,
                          bitmask_stride, token_ids_ptr, V, HAS_MAP: tl.constexpr,
                          BLOCK: tl.constexpr):
    g = tl.program_id(0)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = v < V
    token = tl.load(token_ids_ptr + v, mask=inside, other=0) if HAS_MAP else v
    word = tl.load(bitmask_ptr + g.to(tl.int64) * bitmask_stride + (token >> 5), mask=inside,
                   other=0)
    refused = ((word >> (token & 31)) & 1) == 0
    row = tl.load(rows_ptr + g * rows_stride).to(tl.int64)
    tl.store(logits_ptr + row * logits_stride + v, float("-inf"), mask=inside & refused)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                        token_ids: torch.Tensor | None = None) -> None:
    """See ``verispec.ops.options.apply_token_bitmask`` (same signature, same bits); ``rows``
    and the bitmask's rows may be strided (columns of one wider host upload)."""
    num_rows, V = bitmask.shape[0], logits.shape[1]
    if num_rows == 0:
        return
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and bitmask.dtype == torch.int32
    _token_bitmask_kernel[(num_rows, triton.cdiv(V, _BLOCK))](
        logits, logits.stride(0), rows, rows.stride(0), bitmask, bitmask.stride(0),
        logits if token_ids is None else token_ids, V, HAS_MAP=token_ids is not None,
        BLOCK=_BLOCK)

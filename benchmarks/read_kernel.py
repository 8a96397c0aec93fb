"""The read-only reference of ``bench_rejection``: a Triton kernel that reads the same bytes as
the rejection sampler once, in the same shape of grid (one program per 4096-token chunk of a
row, 4 warps), and keeps only each chunk's maximum. Its time is what streaming those bytes
costs on the device with no verification at all: the practical floor, beside the nominal one
(bytes / copy bandwidth)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096


@triton.jit
def _chunk_max_kernel(a_ptr, a_stride, a_rows, b_ptr, b_stride, vocab_size, out_ptr,
                      NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    """Program p: chunk p % NUM_CHUNKS of row p // NUM_CHUNKS of a, then of b."""
    row = tl.program_id(0) // NUM_CHUNKS
    chunk = tl.program_id(0) % NUM_CHUNKS
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < vocab_size
    if row < a_rows:
        x = tl.load(a_ptr + row.to(tl.int64) * a_stride + cols, mask=ok, other=float("-inf"))
    else:
        x = tl.load(b_ptr + (row - a_rows).to(tl.int64) * b_stride + cols, mask=ok,
                    other=float("-inf"))
    tl.store(out_ptr + tl.program_id(0), tl.max(x, axis=0))


def chunk_max(a: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Chunk maxima of the rows of a and then of b (None: a only), one launch. ``out`` holds at
    least (rows of a + rows of b) * ceil(V / CHUNK) floats."""
    vocab_size = a.shape[1]
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    b_rows = 0 if b is None else b.shape[0]
    b = a if b is None else b
    _chunk_max_kernel[((a.shape[0] + b_rows) * num_chunks,)](
        a, a.stride(0), a.shape[0], b, b.stride(0), vocab_size, out, NUM_CHUNKS=num_chunks,
        CHUNK=CHUNK, num_warps=4)
    return out

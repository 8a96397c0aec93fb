"""The weight matmul of the padded CPU forward (``models.llama`` and the models built on it):
``F.linear`` through the compiled CPU kernels or torch's ops, chosen by the kernels the runner
gave the model (``Backend.cpu``, docs/design.md §17) and by the product's dtype and rows."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from verispec.ops import quant

# float32 products of at most this many rows use ``kernels.f32_linear`` on CPU (see linear).
CPU_KERNEL_MAX_ROWS = 8


def linear(
    x: torch.Tensor,  # [..., in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None,  # [out_features] or None
    splits: int = 1,
    upcast_rows: int = 0,
    batch_invariant: bool = False,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """``F.linear``, or with ``splits > 1`` the same product computed as ``splits`` blocks of the
    weight's rows in one ``bmm`` (each output element is still one dot product over the input).

    With ``batch_invariant`` (the model runner's default on CPU) every row is computed the same
    way whatever the number of rows: ``invariant_linear``, and none of the choices below (MKL and
    oneDNN pick their kernels, and so the summation order of a row, by the number of rows).

    Why: on CPU, torch's float32 ``F.linear`` goes to MKL's sgemm, which for a few rows (decode, a
    verify step) runs on one thread; ``bmm`` over row blocks gives each thread its own block.
    Faster at every row count we measured (docs/benchmarks.md). float32 only:
    bfloat16's CPU matmul (oneDNN) already uses every thread.

    With ``upcast_rows > 0`` and at least that many rows, a bfloat16 product runs in float32: the
    weight and input widened exactly, float32 accumulation, the output rounded to bfloat16 once —
    what a bfloat16 matmul computes, up to summation order. Why: on a CPU without bfloat16
    instructions the bfloat16 matmul of many rows is compute-bound and several times slower
    than the widened product (docs/benchmarks.md). For a few rows widening
    every weight costs more than it saves, hence the threshold.

    Below it, given the compiled CPU kernels (``kernels``: ``Backend.cpu``), a bfloat16 product
    on a CPU without a fast bfloat16 matmul in torch goes to ``kernels.bf16_linear`` (float32
    accumulation, one rounding, memory-bound where torch's fallback is compute-bound), and a
    float32 product of at most ``CPU_KERNEL_MAX_ROWS`` rows to ``kernels.f32_linear`` (each
    weight row read once for up to four input rows, faster than the row blocks up to where MKL
    takes over; docs/benchmarks.md).
    """
    if isinstance(weight, quant.QuantizedWeight):  # GGUF weights kept quantised: ops.quant
        return weight.linear(x, bias)
    out_features, in_features = weight.shape
    if batch_invariant and weight.device.type == "cpu":
        return invariant_linear(x, weight, bias, kernels)
    if upcast_rows and x.numel() >= upcast_rows * in_features and x.dtype != torch.float32:
        return linear(x.float(), weight.float(), None if bias is None else bias.float(),
                      splits, kernels=kernels).to(x.dtype)
    if kernels is not None and weight.device.type == "cpu" and x.dtype == weight.dtype:
        if weight.dtype == torch.bfloat16 and not kernels.torch_has_fast_bf16():
            return kernels.bf16_linear(x, weight, bias)
        if weight.dtype == torch.float32 and x.numel() <= CPU_KERNEL_MAX_ROWS * in_features:
            return kernels.f32_linear(x, weight, bias)
    if splits <= 1 or out_features % splits or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, in_features)
    blocks = weight.view(splits, out_features // splits, in_features)
    y = torch.bmm(rows.expand(splits, -1, -1), blocks.transpose(1, 2))  # [splits, M, out/splits]
    if rows.shape[0] == 1:  # [splits, 1, out/splits] is already the row's memory layout
        y = y.view(*x.shape[:-1], out_features)
    else:
        y = y.transpose(0, 1).reshape(*x.shape[:-1], out_features)
    return y if bias is None else y.add_(bias)


def invariant_linear(
    x: torch.Tensor,  # [..., in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None,  # [out_features] or None
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """``F.linear`` on CPU with every output row computed by one algorithm, in one summation
    order, whatever the number of rows (docs/design.md §12): a token's row has the same bits decoded
    alone, in a batch, as one of a verify step's k + 1 rows or in a prefill.

    The compiled kernels (``kernels.bf16_linear`` / ``f32_linear``, float32 accumulation in an
    order fixed by the input size alone) where given; else one row per ``F.linear``
    call (always the one-row kernel; each row copied to its own aligned buffer, so no alignment
    peeling differs between rows). Returns [..., out_features] in x's dtype.
    """
    if (kernels is not None and x.dtype == weight.dtype
            and weight.dtype in (torch.bfloat16, torch.float32)):
        kernel = kernels.bf16_linear if weight.dtype == torch.bfloat16 else kernels.f32_linear
        return kernel(x, weight, bias)
    rows = x.reshape(-1, weight.shape[1])
    y = x.new_empty((rows.shape[0], weight.shape[0]))
    for i in range(rows.shape[0]):
        y[i] = F.linear(rows[i].clone(), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])

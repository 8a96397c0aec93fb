"""GGUF-quantised weights kept quantised on the CPU: the block formats, one packed layout for the
kernel, and the linear layer and embedding lookup over it.

Each supported GGUF type stores an integer q per weight and, per group of G inputs, numbers from
which the gguf package dequantises ``w = scale * q + offset`` in float32 (the product exact, one
rounding), with

============  ====  =====  ===========================  =======================
type          bits  G      scale                        offset
============  ====  =====  ===========================  =======================
Q4_0          4     32     d                            -8 d
Q4_1          4     32     d                            m
Q8_0          8     32     d                            0
Q4_K          4     32     d * sc (6-bit sc)            -(dmin * m) (6-bit m)
Q5_K          8     32     d * sc                       -(dmin * m)
Q6_K          8     16     d * sc (int8 sc)             0 (q - 32 stored)
============  ====  =====  ===========================  =======================

``pack_gguf`` converts a tensor's blocks once, at load, into the layout of
``ops/quant_linear.c`` (16 output features interleaved; a scale and offset per group, float16
where they all are float16 values, else float32; 4-bit types as nibbles, the others as int8).
``QuantizedWeight`` holds it:

- ``linear(x, bias)``: ``x @ w.T (+ bias)`` in float32 through the compiled kernel (one chain of
  fused multiply-adds over the inputs per output, in an order fixed by the layout, whatever the
  number of rows: batch invariant, docs/design.md §12), or where it does not run (no AVX-512;
  ``Backend.quant_kernels``, asked when the weight is made), the torch twin: the weights
  dequantised and multiplied one row at a time (the same per-row algorithm for any number of
  rows, another summation order; slow, so there the loader dequantises the model instead:
  ``models.loader.quantized_gguf``);
- ``dequantize()``: the float32 weights, the gguf package's ``gguf.quants.dequantize`` of the
  same blocks exactly (as numbers: +0 where it may give -0), the reference the tests multiply
  by;
- ``embedding(ids)``: the dequantised rows of ``ids`` (a tied embedding's lookup).

Activations are float32 (a quantised model's dtype): the weights' exact values times float32
inputs, nothing rounded to bfloat16.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from verispec.ops.backend import get_backend

QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
NR = 16  # output features interleaved in the layout (one AVX-512 vector)
TILE = 64  # the kernel's output tile: out_features are padded to a multiple of it


def _f16(a: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [..., 1] float32 (exact)."""
    return np.ascontiguousarray(a).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16 c] uint8 -> [n, 32 c]: per 16 bytes, the 16 low nibbles then the 16 high ones."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(n, -1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of a K-quant super-block: [n, 12] -> ([n, 8], [n, 8])."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _decode(qtype: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """[n, block_bytes] uint8 blocks -> (q [n, block_size] int, scale [n, groups] float32,
    offset [n, groups] float32, G), so that the gguf package's values are
    ``scale * q + offset`` group by group."""
    if qtype == "Q4_0":
        d = _f16(blocks[:, :2])
        return _nibbles(blocks[:, 2:]), d, -8 * d, 32
    if qtype == "Q4_1":
        return _nibbles(blocks[:, 4:]), _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), 32
    if qtype == "Q8_0":
        d = _f16(blocks[:, :2])
        return blocks[:, 2:].view(np.int8), d, np.zeros_like(d), 32
    if qtype in ("Q4_K", "Q5_K"):
        n = blocks.shape[0]
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        scale, offset = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
        if qtype == "Q4_K":  # 4 x 32 bytes: low nibbles = sub-block 2i, high = 2i + 1
            qs = blocks[:, 16:144].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(
                1, 1, 2, 1)
            return (qs & 0x0F).reshape(n, 256), scale, offset, 32
        qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        ql = blocks[:, 48:176].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(
            1, 1, 2, 1)
        q = (ql & 0x0F).reshape(n, 8, 32) | ((qh & 0x01) << 4)
        return q.reshape(n, 256), scale, offset, 32
    if qtype == "Q6_K":
        n = blocks.shape[0]
        ql = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(
            1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(n, 2, 4, 32)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1)
        q = (ql | ((qh & 0x03) << 4)).astype(np.int8) - np.int8(32)
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        scale = _f16(blocks[:, 208:210]) * sc
        return q.reshape(n, 256), scale, np.zeros_like(scale), 16
    raise ValueError(f"GGUF type {qtype} is not kept quantised; supported: {QUANT_TYPES}")


BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q5_K": 8, "Q6_K": 8}


class QuantizedWeight(nn.Module):
    """A [out_features, in_features] weight in the packed layout (module docstring); its
    ``shape`` and ``dtype`` (float32, the activations it takes) stand in for a tensor's."""

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int],
                 bits: int, group: int, qtype: str) -> None:
        super().__init__()
        # 4 bits: [Np/16, K/32, 16, 16] uint8; 8 bits: [Np/16, K, 16] int8 (Np: N padded)
        self.register_buffer("qs", qs)
        # [Np/16, K/G, 2, 16] scales then offsets: float32, or float16 where all are float16
        # values (Q4_0, Q4_1, Q8_0: half the bytes, the same numbers)
        self.register_buffer("scales", scales)
        self.shape = torch.Size(shape)
        self.bits, self.group, self.qtype = bits, group, qtype
        self.dtype = torch.float32
        self.quant_kernels = get_backend("cpu").quant_kernels()  # None: the twin

    @property
    def out_padded(self) -> int:
        return self._buffers["qs"].shape[0] * NR

    def extra_repr(self) -> str:
        return f"{self.qtype}, shape={tuple(self.shape)}"

    def _rows_q(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [R, K] float32, per-input (scale, offset) [R, K, 2]) of output rows ``rows``
        (indices into [0, out_padded))."""
        n, k = self.out_padded, self.shape[1]
        # the ids themselves, not torch.arange(n)[ids]: an arange of the vocabulary is a
        # parallel region each decode step, which wakes (and with OpenMP's default wait
        # policy, keeps spinning) a worker beside the kernels' own threads
        idx = (rows.to(torch.int64) if isinstance(rows, torch.Tensor)
               else torch.arange(*rows.indices(n)))
        g, r = idx // NR, idx % NR
        if self.bits == 4:
            b = self.qs[g, :, :, r]  # [R, K/32, 16]
            q = torch.cat((b & 15, b >> 4), dim=-1).reshape(len(idx), k)
        else:
            q = self.qs[g, :, r]  # [R, K]
        so = self.scales[g, :, :, r].float()  # [R, K/G, 2]
        return q.float(), so.repeat_interleave(self.group, dim=1)

    def dequantize(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """[R, in_features] float32 of output rows ``rows`` (default all ``out_features``): the
        gguf package's values (``scale * q`` is exact, then one rounding)."""
        if isinstance(rows, slice) and rows == slice(None):
            rows = slice(0, self.shape[0])
        q, so = self._rows_q(rows)
        return q * so[..., 0] + so[..., 1]

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """[...] int64 -> [..., in_features] float32: the dequantised rows of ``ids``."""
        return self.dequantize(ids.reshape(-1)).view(*ids.shape, self.shape[1])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[..., in_features] -> [..., out_features] in x's dtype (float32 inside)."""
        out_features, in_features = self.shape
        padded = self.out_padded
        rows = x.reshape(-1, in_features)
        if rows.dtype != torch.float32:
            rows = rows.float()
        if not rows.is_contiguous():
            rows = rows.contiguous()
        if bias is not None:
            bias = bias.float()
            if padded != out_features:
                bias = F.pad(bias, (0, padded - out_features))
        if self.quant_kernels is not None:
            buffers = self._buffers  # not through nn.Module.__getattr__: ~130 calls a step
            y = self.quant_kernels.quant_linear(rows, buffers["qs"], buffers["scales"],
                                                None if bias is None else bias.contiguous(),
                                                padded, self.bits, self.group)
            if padded != out_features:
                y = y[:, :out_features]
        else:  # the twin: one row per F.linear call, the same way for any number of rows
            w = self.dequantize()
            y = rows.new_empty((rows.shape[0], out_features))
            for i in range(rows.shape[0]):
                y[i] = F.linear(rows[i].clone(), w,
                                None if bias is None else bias[:out_features])
        y = y.reshape(*x.shape[:-1], out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)


# bytes before a block's 16 bytes of nibbles, for the types whose byte j holds inputs j (low
# nibble) and j + 16 (high) of the block: the 4-bit layout's own pairing
_PAIRED_NIBBLES = {"Q4_0": 2, "Q4_1": 4}


# bytes before a block's 16 bytes of nibbles, for the types whose byte j holds inputs j (low
# nibble) and j + 16 (high) of the block: the 4-bit layout's own pairing
_PAIRED_NIBBLES = {"Q4_0": 2, "Q4_1": 4}


def pack_gguf(parts: list[tuple[str, np.ndarray]], in_features: int) -> QuantizedWeight:
    """GGUF tensors' blocks stacked along out_features (a fused q|k|v or gate|up): each part is
    (type name, uint8 [rows, bytes per row] as ``gguf.GGUFReader`` gives them, rows in any order
    the caller chose). Parts of different types meet in the widest layout (8 bits, the smaller
    group), which holds each exactly. Q4_0 and Q4_1 blocks already pair their nibbles as the
    4-bit layout does: their bytes are moved, not unpacked (a third of the bundled model's
    start)."""
    qtype = "+".join(dict.fromkeys(qtype for qtype, _ in parts))
    if all(part_type in _PAIRED_NIBBLES for part_type, _ in parts):
        q, scale, offset = [], [], []
        for part_type, blocks in parts:
            head = _PAIRED_NIBBLES[part_type]
            b = blocks.reshape(blocks.shape[0], in_features // 32, head + 16)
            # the fp16 fields as they are (2-byte rows of a uint8 array: copied, then viewed)
            d = b[:, :, :2].copy().view(np.float16)[..., 0]
            q.append(b[:, :, head:])
            scale.append(d)
            if part_type == "Q4_1":
                offset.append(b[:, :, 2:4].copy().view(np.float16)[..., 0])
            else:  # -8 d is exact in float16 (an exponent step) unless it overflows
                with np.errstate(over="ignore", invalid="ignore"):
                    off = d * np.float16(-8)
                offset.append(off if np.isfinite(off).all() else -8 * d.astype(np.float32))
        return _pack(q, scale, offset, 4, 32, qtype)
    bits = max(BITS[part_type] for part_type, _ in parts)
    decoded = []
    for part_type, blocks in parts:
        rows = blocks.shape[0]
        block_size = 32 if part_type in ("Q4_0", "Q4_1", "Q8_0") else 256
        q, scale, offset, group = _decode(
            part_type, blocks.reshape(rows * (in_features // block_size), -1))
        decoded.append((q.reshape(rows, in_features), scale.reshape(rows, -1),
                        offset.reshape(rows, -1), group))
    group = min(d[3] for d in decoded)
    return _pack([_paired(d[0]) if bits == 4 else d[0] for d in decoded],
                 *([np.repeat(d[i], d[3] // group, axis=1) if d[3] != group else d[i]
                    for d in decoded] for i in (1, 2)), bits, group, qtype)


def _paired(q: np.ndarray) -> np.ndarray:
    """[N, K] 4-bit values -> [N, K/32, 16] uint8: byte j of a block of 32 holds input j in the
    low nibble, j + 16 in the high one."""
    q = q.astype(np.uint8).reshape(q.shape[0], -1, 2, 16)
    return q[:, :, 0] | (q[:, :, 1] << 4)


def pack_values(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int, group: int,
                qtype: str) -> QuantizedWeight:
    """q [N, K] integers (0..15 for 4 bits, int8 otherwise), scale and offset [N, K / group]
    float32 -> ``QuantizedWeight`` (N padded with zero rows to a multiple of 64)."""
    return _pack([_paired(q) if bits == 4 else q], [scale], [offset], bits, group, qtype)


def _pack(q: list[np.ndarray], scale: list[np.ndarray], offset: list[np.ndarray], bits: int,
          group: int, qtype: str) -> QuantizedWeight:
    """Parts stacked along out_features into the layout, each array written once: q [rows,
    K/32, 16] paired nibbles (4 bits) or [rows, K] int8 values (8 bits), scale and offset
    [rows, K / group] float32; the rows padded with zeros to a multiple of 64."""
    n = sum(part.shape[0] for part in q)
    k = scale[0].shape[1] * group
    padded = n + (-n % TILE)
    groups = padded // NR
    qs = np.zeros((padded, k // 32, 16) if bits == 4 else (padded, k),
                  np.uint8 if bits == 4 else np.int8)
    # float16 parts (the fp16 fields of Q4_0 / Q4_1) stay float16 where every value is finite
    # (-8 d of Q4_0 may overflow it); anything else is float32 and tried as float16 below
    finite16 = all(a.dtype == np.float16 and np.isfinite(a).all() for a in (*scale, *offset))
    so = np.zeros((padded, k // group, 2), np.float16 if finite16 else np.float32)
    row = 0
    for part, part_scale, part_offset in zip(q, scale, offset):
        rows = part.shape[0]
        qs[row:row + rows] = part
        so[row:row + rows, :, 0], so[row:row + rows, :, 1] = part_scale, part_offset
        row += rows
    if bits == 4:
        qs = qs.reshape(groups, NR, k // 32, 16).transpose(0, 2, 3, 1)  # [g, b, j, r]
    else:
        qs = qs.reshape(groups, NR, k).transpose(0, 2, 1)  # [g, k, r]
    so = so.reshape(groups, NR, k // group, 2).transpose(0, 2, 3, 1)  # [g, K/G, 2, r]
    if so.dtype == np.float32:
        half = so.astype(np.float16)
        if np.array_equal(half.astype(np.float32), so):  # every scale and offset a float16 value
            so = half
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(qs)),
                           torch.from_numpy(np.ascontiguousarray(so)), (n, k), bits, group,
                           qtype)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for a dense or quantised weight."""
    if isinstance(weight, QuantizedWeight):
        return weight.linear(x, bias)
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """``F.embedding`` for a dense or quantised table."""
    if isinstance(weight, QuantizedWeight):
        return weight.embedding(ids)
    return F.embedding(ids, weight)

"""GGUF weights kept quantised (``verispec.ops.quant``, ``ops/quant_linear.c``).

Strategy: small random tensors of every kept type are written into a GGUF file with the ``gguf``
package (Q4_0, Q4_1 and Q8_0 quantised by its ``gguf.quants.quantize``; the K-quants, which it
cannot quantise, as random blocks with small fp16 scales), read back by our own reader, packed,
and checked against the gguf package's ``dequantize`` of the same blocks:

- the dequantised weights are the gguf package's values exactly (the scales of the types with
  fp16 fields packed as float16, the others mostly as float32: both layouts run);
- the linear layer is the float32 product of those weights within the error bound of a
  sequential float32 sum (K * 2^-24 * sum_k |x_k w_k|), the kernel's order (one fused
  multiply-add chain over the inputs per output);
- batch invariance: a row's outputs have the same bits alone and in batches of every size,
  through both the few-row path (in registers) and the many-row one (a dequantised panel);
- fused parts of different types (q|k|v of Q4_K and Q6_K, say) meet in one layout exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.models.gguf_file import read_tensors
from verispec.ops import cpu_kernels, quant

gguf = pytest.importorskip("gguf")

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
needs_kernel = pytest.mark.skipif(not cpu_kernels.quant_available(),
                                  reason="the quantised kernel needs AVX-512")
SHAPES = [(64, 256), (40, 512), (130, 768)]  # (out, in): 40 and 130 pad to the 64-wide tile


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row] of valid blocks of ``qtype``."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), kind)
    num_blocks = rows * cols // 256
    blocks = rng.integers(0, 256, (num_blocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scales = (rng.random((num_blocks, 2)) * 0.02 - 0.005).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":  # d is the last field
        blocks[:, 208:210] = scales[:, :2]
    else:  # d, dmin first
        blocks[:, 0:4] = scales
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """Every (type, shape) as a tensor ``{type}.{rows}x{cols}`` of one GGUF file."""
    path = str(tmp_path_factory.mktemp("quant") / "tensors.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for i, qtype in enumerate(BLOCK_BYTES):
        for j, (rows, cols) in enumerate(SHAPES):
            blocks = random_blocks(qtype, rows, cols, seed=10 * i + j)
            writer.add_tensor(f"{qtype}.{rows}x{cols}", blocks,
                              raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensors(path: str) -> dict[str, tuple[str, np.ndarray]]:
    _, found = read_tensors(path)
    return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in found}


def reference(qtype: str, blocks: np.ndarray, cols: int) -> torch.Tensor:
    """The gguf package's float32 weights [rows, cols]."""
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(-1, cols)


def check_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    """y within a sequential float32 sum's error bound of the exact x @ w.T (+ bias)."""
    exact = x.double() @ w.double().T
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T) * 1.01 + 1e-30
    if bias is not None:
        exact = exact + bias.double()
        bound = bound + 2.0**-24 * exact.abs()
    assert ((y.double() - exact).abs() <= bound).all()


def test_reader_matches_the_gguf_package(gguf_file):
    reader = gguf.GGUFReader(gguf_file)
    ours = tensors(gguf_file)
    assert set(ours) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        qtype, data = ours[t.name]
        assert qtype == t.tensor_type.name
        assert np.array_equal(data, np.asarray(t.data).reshape(data.shape))


@pytest.mark.parametrize("qtype", list(BLOCK_BYTES))
def test_dequantize_is_the_gguf_packages_values(gguf_file, qtype):
    """Equal as values (the packed form gives +0 where gguf may give -0 for q = 0 weights)."""
    found = tensors(gguf_file)
    for rows, cols in SHAPES:
        _, blocks = found[f"{qtype}.{rows}x{cols}"]
        w = quant.pack_gguf([(qtype, blocks)], cols)
        assert w.shape == (rows, cols) and w.out_padded % quant.TILE == 0
        if qtype in ("Q4_0", "Q4_1", "Q8_0"):  # fp16 fields: scales kept in float16
            assert w.scales.dtype == torch.float16
        assert torch.equal(w.dequantize(), reference(qtype, blocks, cols))
        ids = torch.tensor([[0, rows - 1], [rows // 2, 3]])
        assert torch.equal(w.embedding(ids), reference(qtype, blocks, cols)[ids])


@needs_kernel
@pytest.mark.parametrize("qtype", list(BLOCK_BYTES))
def test_linear_is_the_float32_product_and_batch_invariant(gguf_file, qtype):
    """Batches of 1..8 rows take the few-row paths (1..4 rows over a whole tile, 5..8 over
    each half), 9 and 133 the panel one (133: two row blocks of the kernel); every row's bits
    are those of the row alone."""
    found = tensors(gguf_file)
    gen = torch.Generator().manual_seed(0)
    for rows, cols in SHAPES:
        _, blocks = found[f"{qtype}.{rows}x{cols}"]
        w = quant.pack_gguf([(qtype, blocks)], cols)
        ref = reference(qtype, blocks, cols)
        x = torch.randn(133, cols, generator=gen)
        bias = torch.randn(rows, generator=gen)
        alone = torch.cat([w.linear(x[i:i + 1], bias) for i in range(x.shape[0])])
        check_product(alone, x, ref, bias)
        for size in (2, 3, 4, 5, 6, 7, 8, 9, 133):
            assert torch.equal(w.linear(x[:size], bias), alone[:size]), size
        assert torch.equal(w.linear(x[:6].view(2, 3, cols)), w.linear(x[:6]).view(2, 3, rows))


@needs_kernel
def test_fused_parts_of_different_types(gguf_file):
    """q|k|v of Q4_K, Q6_K and Q4_1 (4-bit, 16-wide groups, 8-bit) in one 8-bit layout."""
    found = tensors(gguf_file)
    parts = [found["Q4_K.64x256"], found["Q6_K.64x256"], found["Q4_1.64x256"]]
    fused = quant.pack_gguf(parts, 256)
    assert fused.bits == 8
    ref = torch.cat([reference(qtype, blocks, 256) for qtype, blocks in parts])
    assert torch.equal(fused.dequantize(), ref)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    check_product(fused.linear(x), x, ref)


def test_torch_twin_where_the_kernel_does_not_run(gguf_file, monkeypatch):
    """Without AVX-512: the weights dequantised, one row per F.linear call (invariant too)."""
    monkeypatch.setattr(cpu_kernels, "quant_available", lambda: False)
    _, blocks = tensors(gguf_file)["Q4_1.40x512"]
    w = quant.pack_gguf([("Q4_1", blocks)], 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    y = w.linear(x)
    check_product(y, x, reference("Q4_1", blocks, 512))
    assert torch.equal(y[2:3], w.linear(x[2:3]))

"""The model ops of the GPU step: each Triton kernel against its torch twin on the same inputs
(Triton's interpreter on CPU, the GPU with ``VERISPEC_TEST_DEVICE=cuda``), and the property the
GPU engine relies on: a row's result does not depend on the other rows of the call (batch
invariance, REFERENCE §12), checked bit for bit.

Strategy: small random shapes that exercise every branch (residual or not, qk-norm, sliding
window, several queries per request with different context lengths, split and unsplit matmuls);
tolerances are those of one bfloat16 rounding where the kernel and the twin sum in different
orders.
"""

from __future__ import annotations

import pytest
import torch

from verispec.ops import model_ops

triton_model = pytest.importorskip("verispec.ops.triton_model")


def _dot_dtype(device, dtype: torch.dtype) -> None:
    """Triton's interpreter computes a bfloat16 ``tl.dot`` wrongly: such cases run on a GPU."""
    if dtype == torch.bfloat16 and torch.device(device).type != "cuda":
        pytest.skip("bfloat16 tl.dot runs on a GPU only (the interpreter does not emulate it)")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-2) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_twin(device, with_residual, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(device, dtype)
    res = torch.randn(5, 96, generator=g).to(device, dtype) if with_residual else None
    res_twin = None if res is None else res.clone()
    out = triton_model.rms_norm(x, w, 1e-5, res)
    ref = model_ops.rms_norm(x, w, 1e-5, res_twin)
    _close(out, ref)
    if with_residual:
        # x + r rounded once (the interpreter's float32 -> bfloat16 cast may truncate)
        torch.testing.assert_close(res, res_twin, rtol=8e-3, atol=0)


def test_silu_mul_matches_twin(device):
    gu = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(device)
    _close(triton_model.silu_mul(gu), model_ops.silu_mul(gu), 1e-5)


def _rope_inputs(device, dtype, T=6, hq=4, hkv=2, d=16, slots=3, max_len=20):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(device, dtype)
    positions = torch.tensor([0, 1, 2, 7, 8, 19][:T], device=device)
    slot_mapping = torch.tensor([0, 0, 0, 2, 2, 1][:T], device=device)
    angles = torch.arange(max_len)[:, None] * (0.3 ** torch.arange(d // 2))[None]
    emb = torch.cat((angles, angles), -1)
    sin = emb.sin()
    sin[:, : d // 2].neg_()
    cos, sin = emb.cos().to(device, dtype), sin.to(device, dtype)
    cache = torch.zeros(2, slots, max_len, hkv, d, device=device, dtype=dtype)
    return qkv, positions, cos, sin, cache, slot_mapping, hq, hkv


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_cache_write_matches_twin(device, qk_norm):
    dtype = torch.float32
    qkv, positions, cos, sin, cache, slot_mapping, hq, hkv = _rope_inputs(device, dtype)
    d = cos.shape[-1]
    norms = ((1 + 0.1 * torch.randn(d)).to(device), (1 - 0.1 * torch.randn(d)).to(device)) \
        if qk_norm else (None, None)
    twin_cache = cache.clone()
    q = triton_model.rope_cache_write(qkv, positions, cos, sin, cache[0], cache[1], slot_mapping,
                                      hq, hkv, *norms, 1e-6)
    q_ref = model_ops.rope_cache_write(qkv, positions, cos, sin, twin_cache[0], twin_cache[1],
                                       slot_mapping, hq, hkv, *norms, 1e-6)
    _close(q, q_ref, 1e-5)
    _close(cache, twin_cache, 1e-5)


def _attention_inputs(device, dtype, counts, contexts, hq=4, hkv=2, d=16, max_len=40, seed=3):
    g = torch.Generator().manual_seed(seed)
    B = len(counts)
    k_cache = torch.randn(B + 1, max_len, hkv, d, generator=g).to(device, dtype)
    v_cache = torch.randn(B + 1, max_len, hkv, d, generator=g).to(device, dtype)
    T = sum(counts)
    q = torch.randn(T, hq, d, generator=g).to(device, dtype)
    slot_ids = torch.arange(B, 0, -1, device=device)  # not the identity
    qs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), device=device)
    return q, k_cache, v_cache, slot_ids, torch.tensor(contexts, device=device), qs


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_attention_matches_twin(device, dtype, window):
    _dot_dtype(device, dtype)
    counts, contexts = [1, 4, 3, 9], [1, 11, 37, 20]
    args = _attention_inputs(device, dtype, counts, contexts)
    out = triton_model.cache_attention(*args, max(counts), 0.25, window)
    ref = model_ops.cache_attention(*args, max(counts), 0.25, window)
    _close(out, ref, 1e-2 if dtype == torch.bfloat16 else 1e-3)


def test_cache_attention_query_alone_equals_query_in_verify(device):
    """A query decoded alone (one new token) and the same query as one of four (a verify step)
    give bit-identical outputs: later keys are masked, and blocks past it leave it unchanged."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    q, k_cache, v_cache, slot_ids, _, _ = _attention_inputs(device, dtype, [4], [70], max_len=80)
    many = triton_model.cache_attention(q, k_cache, v_cache, slot_ids, torch.tensor(
        [70], device=device), torch.tensor([0, 4], device=device), 4, 0.25)
    for i in range(4):
        alone = triton_model.cache_attention(
            q[i:i + 1], k_cache, v_cache, slot_ids, torch.tensor([67 + i], device=device),
            torch.tensor([0, 1], device=device), 1, 0.25)
        assert torch.equal(alone[0], many[i])


@pytest.mark.parametrize("shape", [(40, 64), (48, 1024)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_twin(device, shape, bias, dtype):
    _dot_dtype(device, dtype)
    N, K = shape
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    _close(triton_model.linear(x, w, b), model_ops.linear(x, w, b),
           1e-3 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_silu_mul_matches_twin_and_the_unfused_kernels(device, bias, dtype):
    """The fused gate|up projection + SwiGLU equals the twin, and on a GPU it is bit-identical
    to the unfused kernels (linear, then silu_mul): the same sums, rounded the same way."""
    _dot_dtype(device, dtype)
    g = torch.Generator().manual_seed(6)
    inter, K = 80, 256  # 80 outputs: a partial last tile
    x = torch.randn(5, K, generator=g).to(device, dtype)
    w = (torch.randn(2 * inter, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn(2 * inter, generator=g).to(device, dtype) if bias else None
    fused = triton_model.linear_silu_mul(x, w, b)
    assert fused.shape == (5, inter)
    _close(fused, model_ops.linear_silu_mul(x, w, b), 1e-3 if dtype == torch.float32 else 1e-2)
    unfused = triton_model.silu_mul(triton_model.linear(x, w, b))
    if torch.device(device).type == "cuda":
        assert torch.equal(fused, unfused)
    else:  # the interpreter's dot of another tile shape may round differently
        _close(fused, unfused, 1e-5)
    for row in (0, 4):  # batch invariant like linear
        assert torch.equal(triton_model.linear_silu_mul(x[row:row + 1], w, b)[0], fused[row])


def test_linear_rows_do_not_depend_on_the_batch(device):
    """Row 0 of a one-row product equals row 0 of a 70-row product (another tile), bit for bit."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, 1024, generator=g).to(device, dtype)
    w = (torch.randn(48, 1024, generator=g) / 32).to(device, dtype)
    tiles = triton_model.LINEAR_TILES[x.element_size()]
    few_rows = triton_model.LINEAR_FEW_ROWS.get(x.element_size())
    full = triton_model.linear(x, w, config=tiles[0])  # the largest tile
    for row in (0, 65):
        for tile in tiles[1:] + ((few_rows[2],) if few_rows else ()):
            alone = triton_model.linear(x[row:row + 1], w, config=tile)
            assert torch.equal(alone[0], full[row]), tile
    assert torch.equal(triton_model.linear(x, w)[65], full[65])  # the tile linear_config picks


def test_linear_tiles_follow_the_shape_with_one_block_k():
    """Llama-3.1-8B shapes: the tiles the H100 measurements picked; one block_k per dtype (the
    only part of a tile that orders a row's sum)."""
    cfg = triton_model.linear_config
    bf16 = torch.bfloat16
    assert (cfg(1, 6144, bf16).block_m, cfg(1, 6144, bf16).block_n) == (16, 32)  # qkv
    assert (cfg(64, 6144, bf16).block_m, cfg(64, 6144, bf16).block_n) == (64, 64)
    assert cfg(1, 4096, bf16).block_n == 32 and cfg(64, 4096, bf16).block_n == 32  # o, down
    assert cfg(1, 28672, bf16).block_n == 128 and cfg(1, 28672, bf16).block_m == 64
    assert cfg(256, 28672, bf16).block_m == 128 and cfg(256, 4096, bf16).block_m == 64
    for itemsize, tiles in triton_model.LINEAR_TILES.items():
        assert len({t.block_k for t in tiles}) == 1, itemsize


def test_model_ops_choice():
    assert model_ops.get_model_ops("cpu") is model_ops.TORCH_MODEL_OPS


def test_strided_index_tensors_are_refused(device):
    """An expanded (stride-0) slot mapping would be read past its end: refused up front."""
    qkv, positions, cos, sin, cache, slot_mapping, hq, hkv = _rope_inputs(device, torch.float32)
    strided = torch.zeros(1, dtype=torch.long, device=device).expand(6)
    with pytest.raises(ValueError, match="slot_mapping must be a contiguous 1-D tensor"):
        triton_model.rope_cache_write(qkv, positions, cos, sin, cache[0], cache[1], strided,
                                      hq, hkv)

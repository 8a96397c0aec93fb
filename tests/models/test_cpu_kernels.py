"""The compiled bfloat16 linear layer (``verispec.models.cpu_kernels``): float32 accumulation
and one rounding to bfloat16, for every shape a model or a verify step gives it."""

from __future__ import annotations

import shutil

import pytest
import torch

from verispec.models import cpu_kernels

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(),
                                  reason="the bfloat16 CPU kernel is not for this machine")


def test_built_wherever_it_is_wanted():
    """On an AVX2 CPU without torch's fast bfloat16 path, with a C compiler, the kernel builds
    (so CI on such a machine runs the tests below instead of skipping them)."""
    if cpu_kernels._wanted() and (shutil.which("cc") or shutil.which("gcc")):
        assert cpu_kernels.available()


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("VERISPEC_CPU_KERNELS", "0")
    assert not cpu_kernels._wanted()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("in_features, out_features", [(32, 5), (48, 33), (31, 7), (576, 40),
                                                        (1536, 9), (18, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_rounds_the_float32_sum_once(rows, in_features, out_features, with_bias):
    """Against the exact product: within half a bfloat16 ulp plus float32 summation error; and
    within one bfloat16 ulp of torch's bfloat16 matmul (which differs only in summation order).
    Odd and non-multiple-of-16 input sizes take the scalar tails; 5 and 9 rows a partial group."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    ours = cpu_kernels.bf16_linear(x, weight, bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, out_features)
    exact = torch.nn.functional.linear(x.double(), weight.double(),
                                       None if bias is None else bias.double())
    torch.testing.assert_close(ours.double(), exact, rtol=2**-8, atol=1e-5 * in_features**0.5)
    torch_bf16 = torch.nn.functional.linear(x, weight, bias).double()
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    assert ((ours.double() - torch_bf16).abs() <= ulp + 1e-6).all()


@needs_kernel
def test_bf16_linear_any_leading_shape_and_strides():
    """[B, S, in] inputs, a transposed (non-contiguous) one, and an empty one."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(24, 40, generator=gen).bfloat16()
    x = torch.randn(2, 3, 40, generator=gen).bfloat16()
    ref = cpu_kernels.bf16_linear(x.reshape(6, 40), weight, None).reshape(2, 3, 24)
    assert torch.equal(cpu_kernels.bf16_linear(x, weight, None), ref)
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not xt.is_contiguous()
    assert torch.equal(cpu_kernels.bf16_linear(xt, weight, None), ref)
    empty = cpu_kernels.bf16_linear(x[:, :0], weight, None)
    assert empty.shape == (2, 0, 24)


@needs_kernel
def test_bf16_linear_special_values():
    """NaN and infinities propagate as in float32 arithmetic; overflow rounds to infinity."""
    weight = torch.ones(3, 16).bfloat16()
    x = torch.zeros(4, 16).bfloat16()
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    x[2, :] = 3e38  # the float32 sum overflows
    out = cpu_kernels.bf16_linear(x, weight, None).float()
    assert out[0].isnan().all() and (out[1] == float("inf")).all()
    assert (out[2] == float("inf")).all() and (out[3] == 0).all()

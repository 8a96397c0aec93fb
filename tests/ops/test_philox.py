"""The torch Philox must produce Triton's words bit for bit.

Strategy: run ``tl.randint4x`` / ``tl.rand`` in a tiny Triton kernel (CPU interpreter in CI, the GPU
when one is there) on adversarial seeds (0, negative, 2**63 - 1, -2**63) and offsets (0, 2**32 - 1,
random 64-bit) and compare with ``verispec.ops.philox``. Then check our draw layout (index v is
word v & 3 of counter v >> 2) and that uniforms are never 0.
"""

from __future__ import annotations

import pytest
import torch

from verispec.ops import philox

triton = pytest.importorskip("triton", reason="triton is not installed")
tl = pytest.importorskip("triton.language")


@triton.jit
def _philox_probe_kernel(seed_ptr, offset_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, u_ptr,
                         N: tl.constexpr):
    i = tl.arange(0, N)
    seed = tl.load(seed_ptr)
    offset = tl.load(offset_ptr + i)
    w0, w1, w2, w3 = tl.randint4x(seed, offset)
    tl.store(w0_ptr + i, w0.to(tl.int64) & 0xFFFFFFFF)
    tl.store(w1_ptr + i, w1.to(tl.int64) & 0xFFFFFFFF)
    tl.store(w2_ptr + i, w2.to(tl.int64) & 0xFFFFFFFF)
    tl.store(w3_ptr + i, w3.to(tl.int64) & 0xFFFFFFFF)
    tl.store(u_ptr + i, tl.rand(seed, offset))


def _triton_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("seed", [0, 1, 12345, -7, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0])
def test_randint4x_and_rand_bit_identical(seed):
    n = 128
    dev = _triton_device()
    gen = torch.Generator().manual_seed(seed & 0xFFFF)
    offset = torch.randint(0, 2**62, (n,), generator=gen, dtype=torch.int64)
    offset[:4] = torch.tensor([0, 1, 2**32 - 1, 2**32])
    offset[4:8] = philox.make_offset(torch.tensor([0, 5, 1000, 2**20]), philox.SAMPLE_STREAM, 7)
    seed_t = torch.tensor([seed], dtype=torch.int64)
    words = [torch.empty(n, dtype=torch.int64, device=dev) for _ in range(4)]
    u = torch.empty(n, dtype=torch.float32, device=dev)
    _philox_probe_kernel[(1,)](seed_t.to(dev), offset.to(dev), *words, u, N=n)
    ours = philox.randint4x(seed_t, offset)
    for w_triton, w_torch in zip(words, ours):
        assert torch.equal(w_triton.cpu(), w_torch)
    assert torch.equal(u.cpu(), philox.rand(seed_t, offset))


def test_vocab_layout_is_word_index_mod_4_of_counter_index_div_4():
    seeds = torch.tensor([3, -9], dtype=torch.int64)
    positions = torch.tensor([0, 77], dtype=torch.int64)
    vocab = 37  # not a multiple of 4
    u = philox.vocab_uniform(seeds, positions, philox.RESIDUAL_STREAM, vocab)
    assert u.shape == (2, vocab) and u.dtype == torch.float32
    for r in range(2):
        for v in (0, 1, 3, 4, 17, 36):
            offset = philox.make_offset(positions[r], philox.RESIDUAL_STREAM, v)
            word = philox.randint4x(seeds[r], offset)[v & 3]
            expected = torch.clamp_min(philox.uint_to_uniform(word), philox.MIN_UNIFORM)
            assert u[r, v] == expected
    # the scalar draw at index 0 is exactly tl.rand(seed, offset)
    scalar = philox.uniform(seeds, positions, philox.ACCEPT_STREAM)
    offset = philox.make_offset(positions, philox.ACCEPT_STREAM)
    assert torch.equal(scalar, torch.clamp_min(philox.rand(seeds, offset), philox.MIN_UNIFORM))


def test_block_noise_is_the_noise_at_those_indices():
    """``exponential_block`` (the race's in-block noise, one Philox evaluation per four
    indices) gives exactly ``exponential_at`` over the same consecutive indices, and the full
    row's noise there; per-row streams too."""
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (6,), generator=g)
    positions = torch.randint(0, 10_000, (6,), generator=g)
    start = torch.randint(0, 8, (6,), generator=g) * 16
    ids = start[:, None] + torch.arange(16)
    for stream in (philox.RESIDUAL_STREAM, torch.randint(0, philox.NUM_STREAMS, (6,), generator=g)):
        block = philox.exponential_block(seeds, positions, stream, start, 16)
        assert torch.equal(block, philox.exponential_at(seeds, positions, stream, ids))
    row = philox.exponential(seeds, positions, philox.SAMPLE_STREAM, 144)
    block = philox.exponential_block(seeds, positions, philox.SAMPLE_STREAM, start, 16)
    assert torch.equal(block, row.gather(1, ids))


def test_streams_and_positions_are_independent_draws():
    seed = torch.tensor([11])
    a = philox.vocab_uniform(seed, torch.tensor([5]), philox.DRAFT_STREAM, 64)
    b = philox.vocab_uniform(seed, torch.tensor([5]), philox.RESIDUAL_STREAM, 64)
    c = philox.vocab_uniform(seed, torch.tensor([6]), philox.DRAFT_STREAM, 64)
    d = philox.vocab_uniform(torch.tensor([12]), torch.tensor([5]), philox.DRAFT_STREAM, 64)
    for other in (b, c, d):
        assert not torch.equal(a, other)
    assert torch.equal(a, philox.vocab_uniform(seed, torch.tensor([5]), philox.DRAFT_STREAM, 64))


def test_uniform_is_never_zero():
    # Words 0 and 0xFFFFFFFF map to exactly 0.0 in tl.rand's conversion ...
    zero_words = torch.tensor([0, 0xFFFFFFFF], dtype=torch.int64)
    assert torch.equal(philox.uint_to_uniform(zero_words), torch.zeros(2))
    # ... and the largest words stay below 1.
    top = philox.uint_to_uniform(torch.tensor([0x7FFFFFFF, 0x80000000], dtype=torch.int64))
    assert bool((top < 1.0).all())
    # every uniform we hand out is clamped away from 0, so -log(u) is finite
    assert philox._nonzero(torch.zeros(3)).min() == philox.MIN_UNIFORM
    u = philox.vocab_uniform(torch.arange(64), torch.arange(64), philox.SAMPLE_STREAM, 4096)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert bool(torch.isfinite(philox.exponential(torch.arange(4), torch.arange(4), 3, 999)).all())


def test_uniform_moments():
    u = philox.vocab_uniform(torch.arange(16), torch.zeros(16, dtype=torch.int64), 3, 20000)
    assert abs(float(u.mean()) - 0.5) < 0.003
    assert abs(float(u.var()) - 1 / 12) < 0.002

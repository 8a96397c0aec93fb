"""Parity of the Triton Mamba2 state-update kernel with its torch twin.

Strategy: random states and operands, several requests of different token counts in one launch
(padding tokens), an empty slot (zero initial state), a head dim and state size that are not
powers of two (masked blocks), and one request feeding more tokens than the ring holds (entries
overwritten in order). The kernel and ``models.mamba2.ssm_state_update`` must give the same
outputs and the same ring, entries not written left bit for bit; the reductions sum in another
order, so values are compared to float32 rounding. Without CUDA the kernel runs in Triton's
interpreter (tests/conftest.py). Bad operands are one ValueError naming the tensor.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from verispec.models.mamba2 import ssm_state_update as torch_update  # noqa: E402
from verispec.ops import triton_ssm  # noqa: E402


def operands(device, counts, starts, slots, heads=2, head_dim=6, d_state=12, ring_size=5,
             num_slots=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    S, G = max(counts), len(counts)
    ring = torch.randn(num_slots, ring_size, heads, head_dim, d_state, generator=g)
    args = [
        torch.tensor(slots, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64),
        torch.tensor(counts, dtype=torch.int64),
        torch.randn(S, G, heads, head_dim, generator=g),
        0.3 * torch.randn(S, G, heads, d_state, generator=g),
        torch.rand(S, G, heads, generator=g),
        torch.randn(S, G, heads, d_state, generator=g),
    ]
    return ring.to(device), [a.to(device) for a in args]


@pytest.mark.parametrize(
    ("counts", "starts", "slots", "ring_size"),
    [([4, 1, 3], [0, 7, 2], [2, 0, 3], 5),  # padding, an empty slot, distinct ring offsets
     ([7], [4], [1], 3),  # more tokens than the ring holds: entries overwritten in order
     ([1, 1], [9, 3], [3, 1], 2)],  # decode of two requests
)
def test_kernel_matches_torch_twin(device, counts, starts, slots, ring_size):
    ring, args = operands(device, counts, starts, slots, ring_size=ring_size)
    ring_twin = ring.cpu().clone()
    y_twin = torch_update(ring_twin, *[a.cpu() for a in args])
    y = triton_ssm.ssm_state_update(ring, *args)
    torch.testing.assert_close(y.cpu(), y_twin, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ring.cpu(), ring_twin, atol=1e-5, rtol=1e-5)
    # padding tokens output zeros; ring entries no request wrote are untouched, bit for bit
    for g, n in enumerate(counts):
        assert not y[n:, g].any()
    written = torch.zeros(ring.shape[:2], dtype=torch.bool)
    for slot, start, n in zip(slots, starts, counts):
        for s in range(n):
            written[slot, (start + s + 1) % ring_size] = True
    fresh, _ = operands(device, counts, starts, slots, ring_size=ring_size)
    assert torch.equal(ring.cpu()[~written], fresh.cpu()[~written])


def test_bad_operands_are_one_clear_error(device):
    ring, args = operands(device, [2], [1], [0])
    with pytest.raises(ValueError, match="decay must be a contiguous float32"):
        triton_ssm.ssm_state_update(ring, *args[:5], args[5].double(), args[6])
    with pytest.raises(ValueError, match="counts must be a contiguous int64"):
        triton_ssm.ssm_state_update(ring, args[0], args[1], args[2].int(), *args[3:])
    with pytest.raises(ValueError, match="ssm_ring must be float32"):
        triton_ssm.ssm_state_update(ring[..., :5], *args)

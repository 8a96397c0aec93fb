"""The tensor-parallel all-reduce fused with the residual add and RMSNorm
(``ops.triton_peer``), one rank's side in Triton's interpreter: a second rank is played by hand
(its rows staged in its half of its buffer, its flags raised in this rank's array), so the
kernel's sum, its norm, its flags, its alternating halves and its give-up path are checked
without two GPUs. tests/runtime/test_tensor_parallel.py runs it across two GPUs.

float32 here: the interpreter rounds bfloat16 its own way (``triton_model.rms_norm`` and the
torch twin differ in it too); on the GPU the bfloat16 bits are compared with the unfused path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from verispec.ops import triton_model, triton_peer  # noqa: E402

PROGRAMS = triton_peer.PROGRAMS
DTYPE = torch.float32


class TwoRanks:
    """Rank 0's view of a two-rank group: both ranks' buffers in this process."""

    def __init__(self, rows: int, hidden: int) -> None:
        self.rows, self.hidden = rows, hidden
        self.half = rows * hidden * DTYPE.itemsize
        self.flags_offset = 2 * self.half
        self.buffers = [torch.zeros(self.flags_offset + 2 * PROGRAMS * 4, dtype=torch.uint8)
                        for _ in range(2)]
        self.bases = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64)
        self.counters = torch.zeros(PROGRAMS + 1, dtype=torch.int32)

    def flags(self, rank: int) -> torch.Tensor:
        return self.buffers[rank][self.flags_offset:].view(torch.int32).view(2, PROGRAMS)

    def half_rows(self, rank: int, half: int) -> torch.Tensor:
        start = half * self.half
        return self.buffers[rank][start:start + self.half].view(DTYPE).view(self.rows,
                                                                             self.hidden)

    def peer_arrives(self, call: int, partial: torch.Tensor) -> None:
        """Rank 1 at its ``call``-th call: its rows in half ``call % 2``, its flags up."""
        self.half_rows(1, call % 2)[: partial.shape[0]].copy_(partial)
        self.flags(0)[1] = call

    def reduce(self, x, residual, weight, max_polls=triton_peer.MAX_POLLS):
        return triton_peer.peer_reduce_rms_norm(
            x, residual, weight, 1e-5, self.bases, self.counters, 0, 2, self.half,
            self.flags_offset, max_polls)


@pytest.mark.parametrize("rows", [1, 3, PROGRAMS + 5])
def test_one_rank_sums_norms_and_signals(rows):
    g = torch.Generator().manual_seed(rows)
    hidden = 48  # not a power of two: masked columns
    ranks = TwoRanks(PROGRAMS + 5, hidden)
    weight = torch.randn(hidden, generator=g, dtype=DTYPE)
    residual = torch.randn(rows, hidden, generator=g, dtype=DTYPE)
    expected_residual = residual.clone()
    for call in (1, 2, 3):  # both halves, then the first again
        mine = torch.randn(rows, hidden, generator=g, dtype=DTYPE)
        theirs = torch.randn(rows, hidden, generator=g, dtype=DTYPE)
        ranks.peer_arrives(call, theirs)
        out = ranks.reduce(mine, residual, weight)
        expected = triton_model.rms_norm(mine + theirs, weight, 1e-5, expected_residual)
        assert torch.equal(out, expected)
        assert torch.equal(residual, expected_residual)
        assert torch.equal(ranks.half_rows(0, call % 2)[:rows], mine)  # staged for rank 1
        assert (ranks.flags(1)[0] == call).all()  # every program signalled rank 1
        assert (ranks.counters[:PROGRAMS] == call).all() and ranks.counters[PROGRAMS] == 0


def test_a_rank_that_never_arrives_is_recorded_not_waited_for():
    ranks = TwoRanks(2, 16)
    x = torch.ones(2, 16, dtype=DTYPE)
    ranks.reduce(x, torch.zeros_like(x), torch.ones(16, dtype=DTYPE), max_polls=3)
    assert ranks.counters[PROGRAMS] == 1


def test_rows_beyond_the_buffer_are_refused():
    ranks = TwoRanks(2, 16)
    x = torch.ones(3, 16, dtype=DTYPE)
    with pytest.raises(ValueError, match="3 rows of 16"):
        ranks.reduce(x, torch.zeros_like(x), torch.ones(16, dtype=DTYPE))

"""The pinned staging ring of host-to-device copies (``ops.staging``).

Strategy: the ring's bookkeeping runs on a CPU buffer with stand-in events that complete only
when the ring waits on them, so a copy is "in flight" until then; every slice handed out is
checked against the copies still in flight (none may overlap it), over random sizes that wrap
the ring in every way (the tail given up, one copy filling a quarter). On a GPU
(``VERISPEC_TEST_DEVICE=cuda``) ``ops.to_device`` through a small ring, with the stream kept
busy so copies are really in flight when the ring wraps, gives back every value.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec import ops
from verispec.ops import staging


class _Event:
    def __init__(self, log: list) -> None:
        self.done = False
        log.append(self)

    def synchronize(self) -> None:
        self.done = True


def test_no_slice_is_reused_while_a_copy_reads_it():
    events: list[_Event] = []
    ring = staging.StagingRing(torch.zeros(4096, dtype=torch.uint8), lambda: _Event(events))
    in_flight: list[tuple[int, int, _Event]] = []
    rng = np.random.default_rng(0)
    waits = 0
    for _ in range(2000):
        n = int(rng.integers(1, 257))  # int32 elements: up to a quarter of the ring
        data = torch.from_numpy(rng.integers(-2**31, 2**31 - 1, n, dtype=np.int64)
                                .astype(np.int32))
        assert ring.fits(data.numel() * 4)

        def send(staged):
            lo = staged.data_ptr() - ring.buffer.data_ptr()
            hi = lo + staged.numel() * staged.element_size()
            assert lo % staging.ALIGN == 0 and hi <= ring.capacity
            for a, b, event in in_flight:
                assert event.done or b <= lo or a >= hi, (lo, hi, a, b)
            in_flight.append((lo, hi, None))  # its event is made right after
            return staged.clone()

        before = sum(e.done for e in events)
        out = ring.copy(data, send)
        waits += sum(e.done for e in events) - before
        in_flight[-1] = (*in_flight[-1][:2], events[-1])
        assert torch.equal(out, data)
    # it waits only to reuse memory: about once per slice per lap, never per copy twice
    assert 0 < waits <= len(events)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32, torch.bfloat16])
def test_staged_copies_keep_values_shapes_and_dtypes(dtype):
    ring = staging.StagingRing(torch.zeros(1 << 16, dtype=torch.uint8), lambda: _Event([]))
    gen = torch.Generator().manual_seed(1)
    for shape in [(1,), (7,), (3, 5), (2, 3, 4)]:
        data = (torch.randn(shape, generator=gen) * 100).to(dtype)
        if len(shape) > 1:
            data = data.transpose(0, -1)  # not contiguous
        out = ring.copy(data, lambda staged: staged.clone())
        assert out.dtype == dtype and out.shape == data.shape and torch.equal(out, data)
    assert not ring.fits(0) and not ring.fits((1 << 16) // 4 + 1)


def test_to_device_through_a_small_ring(device, monkeypatch):
    """Many copies through a ring of 4 KiB while the stream is kept busy (on a GPU), each
    value read back once everything has run: no copy read a slice already overwritten."""
    monkeypatch.setattr(staging, "CAPACITY", 4096)
    monkeypatch.setattr(staging, "_rings", {})
    rng = np.random.default_rng(2)
    sent, outs = [], []
    for i in range(300):
        if device.type == "cuda" and i % 20 == 0:
            torch.cuda._sleep(1_000_000)  # the copies behind it stay queued
        values = rng.integers(0, 1000, int(rng.integers(1, 300)))
        sent.append(values)
        outs.append(ops.to_device(values, device))
    outs.append(ops.to_device(rng.integers(0, 1000, 5000), device))  # larger than the ring's 1/4
    assert all(np.array_equal(o.cpu().numpy(), v) for o, v in zip(outs, sent))
    assert outs[-1].numel() == 5000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned blocks: CUDA only")
def test_host_drafts_reuse_pinned_blocks_of_several_sizes():
    """Read copies of several sizes leave their pinned blocks for later ones; a later copy takes
    one that fits (found by position: blocks are tensors) and reads its own values."""
    for n in (300, 5000, 20_000, 300, 7000, 19_000, 256):
        ids = torch.arange(n, device="cuda") * 3
        assert staging.HostDrafts(ids).tolist() == (np.arange(n) * 3).tolist()
    assert len(staging.HostDrafts._free) <= staging.HostDrafts.KEPT

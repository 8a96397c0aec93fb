"""Logits processing and sampling (torch twin; device from VERISPEC_TEST_DEVICE).

Strategy: processed_probs is compared with the independent float64 reference on random rows and
on hand-made ties; ``sample`` and ``sample_draft`` get chi-square tests over 200 000 seeded rows
against the processed distribution, with greedy rows mixed in and checked exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.sample.stats import P_VALUE_THRESHOLD, chi_square_p_value, record, reference_probs
from verispec import ops
from verispec.ops import philox, sampling

SETTINGS = [
    # temperature, top_k, top_p, min_p
    (0.5, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (1.5, 0, 1.0, 0.0),
    (1.0, 7, 1.0, 0.0),
    (1.0, 0, 0.75, 0.0),
    (1.0, 0, 1.0, 0.15),
    (0.7, 20, 0.9, 0.02),
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_processed_probs_match_reference(setting, device):
    temperature, top_k, top_p, min_p = setting
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 61, generator=gen) * 2
    rows = logits.shape[0]
    probs = ops.processed_probs(
        logits.to(device),
        torch.full((rows,), temperature, device=device),
        torch.full((rows,), top_k, dtype=torch.int32, device=device),
        torch.full((rows,), top_p, device=device),
        torch.full((rows,), min_p, device=device),
    ).cpu().double().numpy()
    for r in range(rows):
        ref = reference_probs(logits[r].numpy(), temperature, top_k, top_p, min_p)
        np.testing.assert_array_equal(probs[r] > 0, ref > 0)
        np.testing.assert_allclose(probs[r], ref, rtol=2e-5, atol=1e-7)


def test_mask_ties_keep_every_tied_token(device):
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -1.0]], device=device)
    one = torch.ones(1, device=device)
    # top-k = 2 cuts inside a tie: all three tied tokens stay
    p = ops.processed_probs(logits, one, torch.tensor([2], device=device), None, None)
    assert (p[0] > 0).cpu().tolist() == [True, True, True, True, False, False]
    # top-p reaching into the tie keeps the whole tie
    p_full = torch.softmax(logits, -1)[0]
    top_p = float(p_full[0] + p_full[1] * 0.5)
    p = ops.processed_probs(logits, one, None, torch.tensor([top_p], device=device), None)
    assert (p[0] > 0).cpu().tolist() == [True, True, True, True, False, False]
    # top-p of 1.0 and top-k of 0 / -1 / >= V are off
    for k in (0, -1, 6, 100):
        p = ops.processed_probs(logits, one, torch.tensor([k], device=device),
                                torch.tensor([1.0], device=device), None)
        assert bool((p > 0).all())
    # min-p is relative to the top token
    p = ops.processed_probs(logits, one, None, None, torch.tensor([0.1], device=device))
    assert (p[0] > 0).cpu().tolist() == [True, True, True, True, False, False]


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS)
def test_sample_follows_processed_distribution(setting, device):
    temperature, top_k, top_p, min_p = setting
    gen = torch.Generator().manual_seed(11)
    vocab, rows = 45, 225_000  # 202 500 random rows after the greedy tenth
    logits = torch.randn(vocab, generator=gen) * 1.5
    temps = torch.full((rows,), temperature)
    temps[::10] = 0.0  # greedy rows mixed in
    out = ops.sample(
        logits.to(device).expand(rows, vocab).contiguous(),
        temps.to(device),
        torch.full((rows,), top_k, dtype=torch.int32, device=device) if top_k else None,
        torch.full((rows,), top_p, device=device) if top_p < 1 else None,
        torch.full((rows,), min_p, device=device) if min_p else None,
        torch.arange(rows, dtype=torch.int64, device=device) * 31 + 7,
        torch.full((rows,), 123, dtype=torch.int64, device=device),
    ).cpu()
    greedy = temps == 0
    assert bool((out[greedy] == logits.argmax()).all())
    counts = np.bincount(out[~greedy].numpy(), minlength=vocab)
    ref = reference_probs(logits.numpy(), temperature, top_k, top_p, min_p)
    value = chi_square_p_value(counts, ref)
    record(f"sample T={temperature} top_k={top_k} top_p={top_p} min_p={min_p}",
           int((~greedy).sum()), [value])
    assert value >= P_VALUE_THRESHOLD


def test_sample_draft_returns_q_and_samples_it(device):
    gen = torch.Generator().manual_seed(12)
    vocab, rows = 33, 200_000
    logits = torch.randn(vocab, generator=gen)
    temperature = 0.8
    ids, q = ops.sample_draft(
        logits.to(device).expand(rows, vocab).contiguous(),
        torch.full((rows,), temperature, device=device),
        torch.arange(rows, dtype=torch.int64, device=device),
        torch.full((rows,), 5, dtype=torch.int64, device=device),
    )
    expected_q = torch.softmax(logits / temperature, -1)
    torch.testing.assert_close(q[0].cpu(), expected_q, rtol=1e-5, atol=1e-7)
    counts = np.bincount(ids.cpu().numpy(), minlength=vocab)
    value = chi_square_p_value(counts, expected_q.double().numpy())
    record("sample_draft T=0.8", rows, [value])
    assert value >= P_VALUE_THRESHOLD
    # greedy drafting is the argmax
    ids, _ = ops.sample_draft(logits[None].to(device), torch.zeros(1, device=device),
                              torch.zeros(1, dtype=torch.int64, device=device),
                              torch.zeros(1, dtype=torch.int64, device=device))
    assert int(ids[0]) == int(logits.argmax())


def test_sample_uses_the_named_stream_and_position():
    logits = torch.zeros(4, 50)
    temps = torch.ones(4)
    seeds = torch.tensor([1, 1, 1, 2])
    positions = torch.tensor([5, 5, 6, 5])
    a = sampling.sample(logits, temps, None, None, None, seeds, positions)
    b = sampling.sample(logits, temps, None, None, None, seeds, positions)
    assert torch.equal(a, b)  # pure function of (seed, position, stream)
    noise = philox.exponential(seeds, positions, philox.SAMPLE_STREAM, 50)
    assert torch.equal(a, torch.argmax(1.0 / noise, dim=-1))
    c = sampling.sample(logits, temps, None, None, None, seeds, positions, philox.DRAFT_STREAM)
    assert not torch.equal(a, c)


def test_mixed_batch_tokens_are_each_rows_own():
    """Greedy and sampled rows in one batch (over a vocabulary of several race blocks, with
    per-row top-k / top-p / min-p) get the tokens each row gets alone and the tokens of every
    row processed and raced (the CPU samples only the sampled rows of a mixed batch)."""
    g = torch.Generator().manual_seed(3)
    R, V = 7, 2 * sampling.SAMPLING_BLOCK + 123
    logits = torch.randn(R, V, generator=g) * 3
    temps = torch.tensor([0.0, 0.7, 0.0, 1.0, 0.5, 0.0, 1.3])
    top_k = torch.tensor([0, 0, 5, 50, 0, 0, 0])
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 0.8])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0])
    seeds, positions = torch.arange(R) * 7 + 1, torch.arange(R) + 40
    mixed = sampling.sample(logits, temps, top_k, top_p, min_p, seeds, positions)
    for r in range(R):
        one = slice(r, r + 1)
        alone = sampling.sample(logits[one], temps[one], top_k[one], top_p[one], min_p[one],
                                seeds[one], positions[one])
        assert mixed[r] == alone[0], r
    every_row = sampling.race(sampling.processed_probs(logits, temps, top_k, top_p, min_p),
                              seeds, positions, philox.SAMPLE_STREAM)
    expected = torch.where(temps == 0, logits.argmax(-1), every_row)
    assert torch.equal(mixed, expected)
    assert torch.equal(mixed[temps == 0], logits.argmax(-1)[temps == 0])


def test_first_argmax_is_torch_argmax():
    """``sampling.first_argmax`` (torch.max's indices on the CPU) returns torch.argmax's index:
    the first maximum on ties, the first NaN where a row has one, in every dtype of logits."""
    g = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 7), (3, 4096), (5, 49152), (64, 50000)):
        x = torch.randint(0, 4, (rows, vocab), generator=g).float()  # many ties
        x[0, vocab // 3] = float("nan")
        x[0, vocab // 2] = float("nan")
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = x.to(dtype)
            assert torch.equal(sampling.first_argmax(y), torch.argmax(y, dim=-1)), (rows, vocab,
                                                                                   dtype)


@pytest.mark.parametrize("rows", [1, 4, 48])
def test_tokens_do_not_depend_on_the_cpu_thread_count(rows):
    """The torch backend samples small CPU logits on one thread (``backend.ONE_THREAD_ELEMENTS``)
    and larger ones on every thread: a row's tokens are the same either way (these ops split
    their work by rows), and the caller's thread count is restored."""
    from verispec.ops import backend

    V, k = 49152, 3
    # one row and four run on one thread, 48 rows' verify logits on every thread
    assert (rows * (k + 1) * V > backend.ONE_THREAD_ELEMENTS) == (rows == 48)
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows * (k + 1), V, generator=g) * 3
    drafts = torch.randint(0, V, (rows * k,), generator=g)
    cu = torch.arange(rows + 1) * k
    q = torch.softmax(torch.randn(rows * k, V, generator=g), -1)
    temps = torch.full((rows,), 0.8)
    seeds, positions = torch.arange(rows) + 11, torch.arange(rows) + 30
    threads = torch.get_num_threads()

    def run():
        return (ops.sample(logits[:rows], temps, None, None, None, seeds, positions),
                ops.sample_draft(logits[:rows], temps, seeds, positions)[0],
                ops.rejection_sample(logits, drafts, cu, q, temps, None, None, None, seeds,
                                     positions, k))

    both = run()
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)
    try:
        one = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(both, one):
        assert torch.equal(a, b)

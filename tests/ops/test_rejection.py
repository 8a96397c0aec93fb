"""Rejection sampler behaviour: the tables of docs/design.md §9, mixed batches, 0-draft requests,
the output contract, synthetic extremes and batch invariance.

Strategy: deterministic cases use peaked logits (one token at +20) so the greedy and random
paths have known answers; invariance runs one seeded batch, then the same requests shuffled and
mixed with strangers, and compares rows. Runs on the ``device`` fixture (VERISPEC_TEST_DEVICE).
"""

from __future__ import annotations

import pytest
import torch

from verispec import ops
from verispec.config import SpeculativeConfig
from verispec.ops import sampling
from verispec.ops.backend import load_backend
from verispec.sample import RejectionSampler, SamplingTensors
from verispec.sampling_params import SamplingParams

V = 11


def peaked(token_ids, vocab=V, device="cpu"):
    logits = torch.full((len(token_ids), vocab), -20.0, device=device)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 20.0
    return logits


def run(drafts, target_argmax, bonus, temperature, device, draft_probs=None, rates=None):
    """drafts: list per request; target_argmax: list per request; bonus: per request."""
    rows, cu = [], [0]
    for d, t, b in zip(drafts, target_argmax, bonus):
        rows += list(t) + [b]
        cu.append(cu[-1] + len(d))
    batch = len(drafts)
    return ops.rejection_sample(
        peaked(rows, device=device),
        torch.tensor([x for d in drafts for x in d], dtype=torch.int64, device=device),
        torch.tensor(cu, dtype=torch.int32, device=device),
        draft_probs,
        torch.full((batch,), float(temperature), device=device),
        None, None, None,
        torch.arange(batch, dtype=torch.int64, device=device) + 100,
        torch.full((batch,), 10, dtype=torch.int64, device=device),
        max(len(d) for d in drafts),
        None if rates is None else torch.tensor(rates, device=device),
    ).cpu().tolist()


TABLE = [
    ([[1, 2, 3]], [[1, 2, 3]], [4], [[1, 2, 3, 4]]),
    ([[1, 2, 3]], [[1, 5, 3]], [4], [[1, 5, -1, -1]]),
    ([[1, 2], [3]], [[1, 2], [3]], [5, 4], [[1, 2, 5], [3, 4, -1]]),
    ([[]], [[]], [5], [[5]]),
    ([[1]], [[2]], [3], [[2, -1]]),
]


@pytest.mark.parametrize(("drafts", "argmax", "bonus", "expected"), TABLE)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reference_table(drafts, argmax, bonus, expected, temperature, device):
    # Peaked logits make the random path deterministic too: p is (numerically) one-hot.
    assert run(drafts, argmax, bonus, temperature, device) == expected


def test_mixed_batch_greedy_random_and_zero_drafts(device):
    drafts = [[1, 2, 3], [], [4, 4], [7]]
    argmax = [[1, 9, 3], [], [4, 4], [7]]
    bonus = [0, 6, 8, 2]
    temps = [0.0, 1.0, 0.0, 1.0]
    rows, cu = [], [0]
    for d, t, b in zip(drafts, argmax, bonus):
        rows += t + [b]
        cu.append(cu[-1] + len(d))
    out = ops.rejection_sample(
        peaked(rows, device=device),
        torch.tensor([x for d in drafts for x in d], device=device),
        torch.tensor(cu, device=device),
        None,
        torch.tensor(temps, device=device),
        None, None, None,
        torch.tensor([1, 2, 3, 4], device=device),
        torch.tensor([0, 5, 9, 1000], device=device),
        3,
    )
    assert out.dtype == torch.int32 and out.shape == (4, 4)
    assert out.cpu().tolist() == [[1, 9, -1, -1], [6, -1, -1, -1], [4, 4, 8, -1], [7, 2, -1, -1]]
    assert ops.num_output_tokens(out).cpu().tolist() == [2, 1, 3, 2]


def test_synthetic_extremes_and_greedy_emission(device):
    # rates [1, 1]: every draft, then the bonus; [0, 0]: exactly one token per request.
    drafts, argmax, bonus = [[1, 2], [3, 4]], [[5, 5], [5, 5]], [6, 7]
    for temperature in (0.0, 1.0):
        assert run(drafts, argmax, bonus, temperature, device, rates=[1.0, 1.0]) == [
            [1, 2, 6], [3, 4, 7]
        ]
        # Rejected at position 0: the recovered token is made as in standard mode (argmax / p).
        assert run(drafts, argmax, bonus, temperature, device, rates=[0.0, 0.0]) == [
            [5, -1, -1], [5, -1, -1]
        ]


def test_output_contiguity_random_inputs(device):
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 64, 4, 23
    num_drafts = torch.randint(0, k + 1, (batch,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), num_drafts.cumsum(0)])
    n = int(cu[-1])
    logits = torch.randn(n + batch, vocab, generator=gen) * 2
    q_logits = torch.randn(n, vocab, generator=gen)
    temps = torch.where(torch.rand(batch, generator=gen) < 0.3, 0.0, 1.0)
    draft_req = torch.repeat_interleave(torch.arange(batch), num_drafts)
    seeds = torch.arange(batch, dtype=torch.int64)
    positions = torch.full((batch,), 3, dtype=torch.int64)
    draft_pos = positions[draft_req] + torch.arange(n) - cu[draft_req]
    drafts, q = sampling.sample_draft(q_logits, temps[draft_req], seeds[draft_req], draft_pos)
    for probs in (q, None):
        out = ops.rejection_sample(
            logits.to(device), drafts.to(device), cu.to(device),
            None if probs is None else probs.to(device), temps.to(device), None, None, None,
            seeds.to(device), positions.to(device), k,
        ).cpu()
        valid = out != -1
        counts = valid.sum(1)
        # valid entries are a prefix of each row, 1 <= count <= n_r + 1
        assert torch.equal(valid, torch.arange(k + 1)[None, :] < counts[:, None])
        assert bool((counts >= 1).all()) and bool((counts <= num_drafts + 1).all())
        # the accepted entries are the drafts themselves
        for r in range(batch):
            a = int(counts[r]) - 1
            assert out[r, :a].tolist() == drafts[cu[r]:cu[r] + a].tolist()


def _batch(requests, device, k):
    """requests: list of dicts with logits rows [n+1, V], q rows [n, V], temp, seed, pos, drafts."""
    rows = torch.cat([r["logits"] for r in requests])
    drafts = torch.cat([r["drafts"] for r in requests])
    q = torch.cat([r["q"] for r in requests])
    cu = torch.tensor([0] + [len(r["drafts"]) for r in requests]).cumsum(0)
    return ops.rejection_sample(
        rows.to(device), drafts.to(device), cu.to(device), q.to(device),
        torch.tensor([r["temp"] for r in requests], device=device),
        torch.tensor([r["top_k"] for r in requests], device=device, dtype=torch.int32),
        torch.tensor([r["top_p"] for r in requests], device=device),
        None,
        torch.tensor([r["seed"] for r in requests], device=device, dtype=torch.int64),
        torch.tensor([r["pos"] for r in requests], device=device, dtype=torch.int64),
        k,
    ).cpu()


def test_seeded_request_is_batch_invariant(device):
    gen = torch.Generator().manual_seed(1)
    k, vocab = 3, 29

    def request(seed):
        n = int(torch.randint(0, k + 1, (1,), generator=gen))
        q_logits = torch.randn(n, vocab, generator=gen)
        temp = [0.0, 0.7, 1.0, 1.3][int(torch.randint(0, 4, (1,), generator=gen))]
        pos = int(torch.randint(0, 500, (1,), generator=gen))
        t = torch.full((n,), temp if temp > 0 else 1.0)
        drafts, q = sampling.sample_draft(
            q_logits, t, torch.full((n,), seed), pos + torch.arange(n)
        )
        return {
            "logits": torch.randn(n + 1, vocab, generator=gen) + q_logits.mean(),
            "drafts": drafts, "q": q, "temp": temp, "seed": seed, "pos": pos,
            "top_k": int(torch.randint(0, 12, (1,), generator=gen)),
            "top_p": [1.0, 0.8][int(torch.randint(0, 2, (1,), generator=gen))],
        }

    mine = [request(seed) for seed in range(10, 18)]
    strangers = [request(seed) for seed in range(1000, 1040)]
    alone = _batch(mine, device, k)
    order = torch.randperm(len(mine) + len(strangers), generator=gen).tolist()
    everyone = mine + strangers
    mixed = _batch([everyone[i] for i in order], device, k)
    for row, i in enumerate(order):
        if i < len(mine):
            assert mixed[row].tolist() == alone[i].tolist()
    for i, r in enumerate(mine):  # and one at a time
        assert _batch([r], device, k)[0].tolist() == alone[i].tolist()


def test_rejection_sampler_class_binds_config(device):
    cfg = SpeculativeConfig(
        num_speculative_tokens=2, rejection_sample_method="synthetic",
        synthetic_acceptance_rates=[1.0, 1.0],
    )
    sampler = RejectionSampler(cfg, device=device)
    assert sampler.synthetic_conditional_rates.tolist() == [1.0, 1.0]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)]
    tensors = SamplingTensors.from_params(params, [0, 3], device=device)
    out = sampler(
        peaked([9, 9, 4, 9, 9, 5], device=device), torch.tensor([1, 2, 3, 4], device=device),
        torch.tensor([0, 2, 4], device=device), None, tensors,
        torch.tensor([7, 7], device=device),
    )
    assert out.cpu().tolist() == [[1, 2, 4], [3, 4, 5]]
    assert sampler.num_output_tokens(out).cpu().tolist() == [3, 3]


def test_bad_shapes_raise(device):
    with pytest.raises(ValueError, match="target_logits"):
        ops.rejection_sample(
            torch.zeros(3, V, device=device), torch.tensor([1], device=device),
            torch.tensor([0, 1], device=device), None, torch.zeros(1, device=device),
            None, None, None, torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device), 1,
        )
    with pytest.raises(ValueError, match="draft_probs"):
        ops.rejection_sample(
            torch.zeros(2, V, device=device), torch.tensor([1], device=device),
            torch.tensor([0, 1], device=device), torch.zeros(1, V + 1, device=device),
            torch.zeros(1, device=device), None, None, None,
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device), 1,
        )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_minus_one_draft_is_no_draft_here(temperature, device):
    """Regression (issue 26): a draft of -1 crashed the torch op and was read as token V - 1 by
    the Triton op. It ends the request's drafts: its row is sampled as the bonus row (here the
    row's argmax, 5), and drafts after it are ignored."""
    assert run([[1, -1, 3]], [[1, 5, 3]], [4], temperature, device) == [[1, 5, -1, -1]]
    assert run([[-1, 2]], [[7, 2]], [4], temperature, device) == [[7, -1, -1]]


@pytest.mark.parametrize("bad", [-2, V, 10 * V])
def test_draft_ids_outside_the_vocabulary_raise(bad, device):
    """One ValueError naming the field and the value, whichever backend runs the op."""
    with pytest.raises(ValueError, match=f"draft_token_ids must lie in .*{bad}"):
        run([[1, bad]], [[1, 2]], [4], 1.0, device)


def _good_call(device):
    """The arguments of a valid two-request verify call (drafts 2 and 1, V tokens)."""
    longs = dict(dtype=torch.int64, device=device)
    return dict(
        target_logits=torch.zeros(5, V, device=device),
        draft_token_ids=torch.tensor([1, 2, 3], device=device),
        cu_num_draft_tokens=torch.tensor([0, 2, 3], device=device),
        draft_probs=torch.full((3, V), 1.0 / V, device=device),
        temperature=torch.ones(2, device=device), top_k=torch.full((2,), 5, device=device),
        top_p=torch.ones(2, device=device), min_p=torch.zeros(2, device=device),
        seeds=torch.zeros(2, **longs), positions=torch.zeros(2, **longs),
        max_num_draft_tokens=2, synthetic_conditional_rates=None)


BAD_INPUTS = [
    ("temperature", lambda c: c["temperature"][:1]),
    ("temperature", lambda c: c["temperature"].to(torch.int32)),
    ("top_k", lambda c: c["top_k"].float()),
    ("top_p", lambda c: c["top_p"][:, None]),
    ("min_p", lambda c: [0.0, 0.0]),
    ("seeds", lambda c: c["seeds"].float()),
    ("positions", lambda c: c["positions"][:1]),
    ("cu_num_draft_tokens", lambda c: c["cu_num_draft_tokens"][None]),
    ("draft_token_ids", lambda c: c["draft_token_ids"].float()),
    ("target_logits", lambda c: c["target_logits"].to(torch.int32)),
    ("draft_probs", lambda c: c["draft_probs"].half()),
    ("synthetic_conditional_rates", lambda c: torch.ones(1, device=c["seeds"].device)),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("field, bad", BAD_INPUTS, ids=[f"{f}-{i}" for i, (f, _) in
                                                        enumerate(BAD_INPUTS)])
def test_every_input_is_checked_naming_it(field, bad, backend, device):
    """Both backends check every input against the contract (the Triton op once per kind of
    call, when it makes the plan) and raise one ValueError naming the field."""
    op = load_backend(backend).rejection_sample
    call = _good_call(device)
    op(**call)
    call[field] = bad(call)
    with pytest.raises(ValueError, match=field):
        op(**call)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sampling_inputs_are_checked_naming_them(backend, device):
    ops_ = load_backend(backend)
    logits = torch.zeros(2, V, device=device)
    ones = torch.ones(2, device=device)
    zeros = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="seeds"):
        ops_.sample(logits, ones, None, None, None, zeros[:1], zeros)
    with pytest.raises(ValueError, match="top_p"):
        ops_.sample(logits, ones, None, ones.to(torch.int64), None, zeros, zeros)
    with pytest.raises(ValueError, match="temperature"):
        ops_.sample_draft(logits, ones[:1], zeros, zeros)
    with pytest.raises(ValueError, match="temperature"):
        ops_.processed_probs(logits, ones[:1])

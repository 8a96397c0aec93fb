"""Statistical proof that rejection sampling preserves the processed target distribution.

Strategy: each case fixes k + 1 target rows (k verify rows, one bonus row) and k proposer rows, then
runs 200 000 independently seeded requests through the real draft sampler (``sample_draft``, draft
stream) and ``rejection_sample`` in large batches. Output column i is present exactly when the
first i drafts were accepted; given that, its token must follow p_i, the *processed* target
distribution (temperature, top-k, top-p, min-p). Each present column gets a chi-square
goodness-of-fit test against an independent float64 reference of p_i (p-value >= 1e-6), and a token
of probability 0 must never appear. Greedy targets are checked exactly. A deliberately biased
sampler (residual drawn with the noise that chose the draft) must fail the same test.

Runs on the ``device`` fixture: ``VERISPEC_TEST_DEVICE=cuda`` runs it on the GPU backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.sample.stats import P_VALUE_THRESHOLD, chi_square_p_value, record, reference_probs
from verispec import ops
from verispec.ops import backend, philox, sampling
from verispec.ops import rejection as torch_rejection

NUM_REQUESTS = 200_000
CHUNK = 25_000
NEG_INF = float("-inf")


@dataclass
class Case:
    name: str
    target_logits: np.ndarray  # [k + 1, V]
    draft_logits: np.ndarray  # [k, V]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    rule: str = "full"  # "full": sampled drafts + q; "onehot": greedy drafts, no q
    draft_temperature: float | None = None  # default: the request's temperature

    @property
    def k(self) -> int:
        return self.draft_logits.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.target_logits.shape[1]


def _rng(seed):
    return np.random.default_rng(seed)


def _random_case(name, seed, vocab=37, k=3, scale=1.5, **kw) -> Case:
    rng = _rng(seed)
    target = rng.normal(size=(k + 1, vocab)) * scale
    # the draft resembles the target (realistic acceptance) but is not equal to it
    draft = target[:k] + rng.normal(size=(k, vocab)) * 0.8
    return Case(name, target, draft, **kw)


def _adversarial_cases() -> list[Case]:
    rng = _rng(7)
    k, vocab = 3, 41
    target = rng.normal(size=(k + 1, vocab))
    cases = [Case("q_equals_p", target, target[:k].copy())]
    # disjoint supports: p lives on the first half, q on the second
    half = vocab // 2
    t = target.copy()
    t[:, half:] = NEG_INF
    d = rng.normal(size=(k, vocab))
    d[:, :half] = NEG_INF
    cases.append(Case("disjoint_supports", t, d))
    # q concentrated where p is small
    d = np.full((k, vocab), -4.0)
    low = np.argsort(target[:k], axis=1)[:, :2]
    np.put_along_axis(d, low, 4.0, axis=1)
    cases.append(Case("q_peaked_where_p_small", target, d))
    # p zero (top-k mask) where q is large
    d = np.full((k, vocab), -3.0)
    high = np.argsort(-target[:k], axis=1)[:, 3:6]  # just outside the target's top 3
    np.put_along_axis(d, high, 5.0, axis=1)
    cases.append(Case("p_zero_where_q_large", target, d, top_k=3))
    # tiny probabilities: a few tokens carry the mass, 90 share ~1e-4 of it
    vocab_tiny = 101
    t = np.full((k + 1, vocab_tiny), -14.0)
    t[:, :11] = rng.normal(size=(k + 1, 11))
    d = rng.normal(size=(k, vocab_tiny)) * 3
    cases.append(Case("tiny_probabilities", t, d))
    return cases


FULL_CASES = (
    [_random_case(f"full_T{t}", 1, temperature=t) for t in (0.5, 1.0, 1.5)]
    + [
        _random_case("full_top_k", 2, top_k=5),
        _random_case("full_top_p", 3, top_p=0.7),
        _random_case("full_min_p", 4, min_p=0.1),
        _random_case("full_all_masks_T0.8", 5, vocab=53, temperature=0.8, top_k=12, top_p=0.9,
                     min_p=0.05),
        _random_case("full_k4_V131", 6, vocab=131, k=4, scale=2.5),
    ]
    + _adversarial_cases()
)

ONEHOT_CASES = [
    _random_case(f"onehot_T{t}", 11, rule="onehot", temperature=t) for t in (0.5, 1.0, 1.5)
] + [
    _random_case("onehot_top_k_top_p", 12, rule="onehot", top_k=8, top_p=0.8),
    _random_case("onehot_min_p_T1.5", 13, rule="onehot", temperature=1.5, min_p=0.2),
]


def _onehot_adversarial() -> list[Case]:
    rng = _rng(17)
    k, vocab = 3, 29
    target = rng.normal(size=(k + 1, vocab))
    cases = []
    # the greedy draft is a token the target masks out (p(d) = 0: always rejected)
    d = np.zeros((k, vocab))
    d[np.arange(k), np.argsort(target[:k], axis=1)[:, 0]] = 5.0
    cases.append(Case("onehot_draft_has_p_zero", target, d, rule="onehot", top_k=4))
    # the target is nearly a point mass on the draft
    t = target.copy()
    best = np.argmax(t[:k], axis=1)
    t[np.arange(k), best] += 9.0
    d = np.zeros((k, vocab))
    d[np.arange(k), best] = 5.0
    cases.append(Case("onehot_p_nearly_one_hot", t, d, rule="onehot"))
    return cases


ONEHOT_CASES += _onehot_adversarial()


def run_case(case: Case, device, num_requests=NUM_REQUESTS, rejection_sample=None):
    """Returns per-column token counts [k + 1, V] and the number of requests."""
    rejection_sample = rejection_sample or ops.rejection_sample
    k, vocab = case.k, case.vocab_size
    counts = np.zeros((k + 1, vocab), dtype=np.int64)
    target = torch.tensor(case.target_logits, dtype=torch.float32, device=device)
    draft_logits = torch.tensor(case.draft_logits, dtype=torch.float32, device=device)
    draft_temperature = (
        case.temperature if case.draft_temperature is None else case.draft_temperature
    )
    for start in range(0, num_requests, CHUNK):
        batch = min(CHUNK, num_requests - start)
        seeds = torch.arange(start, start + batch, dtype=torch.int64, device=device) * 7919 + 1
        positions = torch.full((batch,), 40, dtype=torch.int64, device=device)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * k
        draft_seeds = seeds.repeat_interleave(k)
        draft_positions = (positions[:, None] + torch.arange(k, device=device)).reshape(-1)
        if case.rule == "full":
            drafts, q = ops.sample_draft(
                draft_logits.repeat(batch, 1),
                torch.full((batch * k,), draft_temperature, device=device),
                draft_seeds,
                draft_positions,
            )
        else:
            drafts, q = draft_logits.argmax(-1).repeat(batch), None
        out = rejection_sample(
            target.repeat(batch, 1),
            drafts,
            cu,
            q,
            torch.full((batch,), case.temperature, device=device),
            None if case.top_k == 0 else torch.full((batch,), case.top_k, device=device,
                                                    dtype=torch.int32),
            None if case.top_p == 1.0 else torch.full((batch,), case.top_p, device=device),
            None if case.min_p == 0.0 else torch.full((batch,), case.min_p, device=device),
            seeds,
            positions,
            k,
        ).cpu().numpy()
        for col in range(k + 1):
            tokens = out[:, col]
            tokens = tokens[tokens >= 0]
            counts[col] += np.bincount(tokens, minlength=vocab)
    return counts


def p_values(case: Case, counts: np.ndarray) -> list[float]:
    result = []
    for col in range(case.k + 1):
        p = reference_probs(case.target_logits[col], case.temperature, case.top_k, case.top_p,
                            case.min_p)
        result.append(chi_square_p_value(counts[col], p))
    return result


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL_CASES + ONEHOT_CASES, ids=lambda c: c.name)
def test_emitted_tokens_follow_processed_target(case, device):
    counts = run_case(case, device)
    # column 0 is always present: every request contributes at least one sample
    assert counts[0].sum() == NUM_REQUESTS
    values = p_values(case, counts)
    record(case.name, NUM_REQUESTS, values)
    for col, value in enumerate(values):
        assert value >= P_VALUE_THRESHOLD, (
            f"{case.name}: output position {col} ({counts[col].sum()} samples) "
            f"p-value {value:.3g}"
        )


# The two-level race (sampling.race) over blocks of 16 tokens, so that these vocabularies (29 to
# 131) hold 2 to 9 blocks: the plain cases, masks, an empty residual (q = p), disjoint supports,
# a draft with p(d) = 0 and a target that is nearly a point mass on the draft (the rest of the
# draft's block carries almost no residual).
BLOCK_CASE_NAMES = {"full_T1.0", "full_all_masks_T0.8", "full_k4_V131", "q_equals_p",
                    "disjoint_supports", "tiny_probabilities", "onehot_T0.5",
                    "onehot_top_k_top_p", "onehot_draft_has_p_zero", "onehot_p_nearly_one_hot"}
BLOCK_CASES = [c for c in FULL_CASES + ONEHOT_CASES if c.name in BLOCK_CASE_NAMES]
assert len(BLOCK_CASES) == len(BLOCK_CASE_NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c.name)
def test_two_level_race_follows_processed_target(case, device, monkeypatch):
    monkeypatch.setattr(sampling, "SAMPLING_BLOCK", 16)
    _assert_case_passes(case, device, "blocks of 16")


def _assert_case_passes(case, device, label: str) -> None:
    """Run ``case`` and require every output position's p-value above the threshold."""
    counts = run_case(case, device)
    values = p_values(case, counts)
    record(f"{case.name}, {label}", NUM_REQUESTS, values)
    for col, value in enumerate(values):
        assert value >= P_VALUE_THRESHOLD, (
            f"{case.name} ({label}): output position {col} ({counts[col].sum()} samples) "
            f"p-value {value:.3g}"
        )


# The Triton backend's plans: the batches of ``run_case`` (25 000 requests) read two chunks of a
# row per statistics program; these cases run again with one chunk per program (the plan below
# batch 64), under both rules, with and without masks.
GROUP_CASE_NAMES = {"full_T1.0", "full_all_masks_T0.8", "q_equals_p", "onehot_T0.5",
                    "onehot_top_k_top_p", "onehot_p_nearly_one_hot"}
GROUP_CASES = [c for c in FULL_CASES + ONEHOT_CASES if c.name in GROUP_CASE_NAMES]
assert len(GROUP_CASES) == len(GROUP_CASE_NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: c.name)
def test_one_chunk_programs_follow_processed_target(case, device, monkeypatch):
    if backend.default_backend_name(device) != "triton":
        pytest.skip("statistics programs belong to the Triton backend (a CUDA device)")
    from verispec.ops import triton_ops

    monkeypatch.setattr(triton_ops, "_PLANS", {})
    monkeypatch.setattr(triton_ops, "_GROUP_BATCH", 1 << 30)
    _assert_case_passes(case, device, "one chunk per statistics program")


@pytest.mark.parametrize("draft_temperature", [1.0, 0.0])
def test_greedy_target_emits_argmax_exactly(draft_temperature, device):
    case = _random_case("greedy_target", 21, temperature=0.0, draft_temperature=draft_temperature)
    # make the draft agree with the target often, so late positions are reached too
    case.draft_logits = case.target_logits[: case.k] * 3
    counts = run_case(case, device, num_requests=20_000)
    for col in range(case.k + 1):
        best = int(np.argmax(case.target_logits[col]))
        assert counts[col].sum() > 0
        assert counts[col].sum() == counts[col, best], f"column {col} emitted a non-argmax token"
    if draft_temperature == 0.0:  # greedy draft == greedy target: everything accepted
        assert counts[case.k].sum() == 20_000
    record(f"greedy_target_draft_T{draft_temperature}", 20_000, [1.0])


def test_biased_sampler_fails_the_test(monkeypatch):
    """The test of the test: drawing the recovered token with the noise that chose the draft
    (one stream for both, the bug docs/design.md §4 warns of) must be caught. Torch backend only:
    the bias is injected by pointing its residual stream at the draft stream."""
    case = _random_case("biased_residual", 31, vocab=23, k=2, scale=1.0)
    monkeypatch.setattr(philox, "RESIDUAL_STREAM", philox.DRAFT_STREAM)
    counts = run_case(case, "cpu", rejection_sample=torch_rejection.rejection_sample)
    values = p_values(case, counts)
    record("biased_residual (must fail)", NUM_REQUESTS, values)
    assert min(values) < P_VALUE_THRESHOLD, f"biased sampler went unnoticed: {values}"
    monkeypatch.undo()
    values = p_values(case, run_case(case, "cpu",
                                     rejection_sample=torch_rejection.rejection_sample))
    assert min(values) >= P_VALUE_THRESHOLD, values

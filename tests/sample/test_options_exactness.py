"""Statistical proof that the sampling options stay exact under speculation (docs/design.md §15).

Strategy: as tests/sample/test_exactness.py, with one difference that matters: the processed
target distribution of a verify row now depends on the drafts before it (penalties count them,
min_tokens's mask depends on the position, bad words on the prefix). Each case fixes one
request (prompt, output so far, options), k + 1 target rows and k proposer rows, and runs many
independently seeded copies of it through the real draft sampler (``sample_draft``, draft
stream, or greedy drafts under the one-hot rule), the real options processing
(``SamplingOptions.process`` over the drafts on the device) and the real ``rejection_sample``.
Output column i is present when d_1..d_i were accepted; given that prefix, its token must follow
what one-token-at-a-time decoding samples from after prompt + output + d_1..d_i: an independent
float64 reference (``reference_option_logits``, then ``reference_probs``). Every (column,
accepted prefix) group with enough samples gets a chi-square test (p >= 1e-6), and a token of
probability 0 must never appear in any group. The draft rows put extra mass on a few tokens so
that drafts repeat tokens of the output and of each other, and propose masked tokens.

The torch backend runs every case; the Triton backend (its interpreter without a GPU) must give
the same tokens for the same processed logits and seeds (docs/design.md §4), checked on a smaller
batch.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from tests.sample.stats import (
    P_VALUE_THRESHOLD,
    chi_square_p_value,
    record,
    reference_option_logits,
    reference_probs,
)
from tests.sample.test_options import TOKENIZER, make_request
from verispec import ops
from verispec.ops.backend import get_backend, load_backend
from verispec.sample.options import SamplingOptions, bad_word_token_ids

V = 29  # as tests/sample/test_options.py (tokens 1..26 are the letters a..z)
K = 3
EOS = 0
PROMPT = [1, 2, 3]
OUTPUT = [5, 9, 9]  # "eii"
NUM_REQUESTS = 40_000
CHUNK = 10_000
MIN_GROUP = 100  # samples a (column, prefix) group needs for a chi-square test

CASES = {
    "penalties": dict(repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.5),
    "penalties_T0.8_top_p": dict(repetition_penalty=0.8, frequency_penalty=-0.6,
                                 temperature=0.8, top_p=0.9),
    # output of 3 tokens: EOS and 4 masked at rows 0 and 1, free at rows 2 and 3
    "min_tokens": dict(min_tokens=5, stop_token_ids=[4]),
    "logit_bias": dict(logit_bias={2: 2.0, 7: -100.0, 11: 1.5, EOS: -1.0}),
    # "ie" masks e (5) after i (9), as the output ends now; "eeb" masks b after two e's
    # (drafts 5, 5); "g" masks 7 always; "bi" masks i after b
    "bad_words": dict(bad_words=["ie", "eeb", "g", "bi"]),
    "allowed": dict(allowed_token_ids=[0, 1, 2, 3, 5, 8, 9, 13, 21]),
    "all": dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                logit_bias={9: 1.0}, bad_words=["ie", "eeb"], min_tokens=4,
                allowed_token_ids=list(range(0, 15)), temperature=1.2, top_k=10),
}
RULES = ("full", "onehot")
FAVOURED = (EOS, 2, 5, 9)  # tokens the draft rows push: repeats and masked tokens
GREEDY_DRAFTS = [2, 5, 5]


def target_and_draft_logits(rule: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    target = rng.normal(size=(K + 1, V)) * 1.5
    target[:, list(FAVOURED)] += 1.0
    draft = target[:K] + rng.normal(size=(K, V)) * 0.8
    if rule == "full":
        draft[:, list(FAVOURED)] += 1.5
    else:  # greedy drafts b, e, e: "bi" and "eeb" completed by them, e repeated
        draft[np.arange(K), GREEDY_DRAFTS] += 20.0
        target[np.arange(K), GREEDY_DRAFTS] += 3.0  # accepted often enough to reach row 3
    return target, draft


def run(name: str, rule: str, num_requests: int, backend: str | None = None,
        ignore_drafts: bool = False, device: torch.device | str = "cpu") -> np.ndarray:
    """[num_requests, K + 1] output tokens (-1 padded) of the case's request, sampled on
    ``device`` with ``backend`` (default: the device's). ``ignore_drafts`` processes every row
    as if no draft came before it (the bug of docs/design.md §15)."""
    device = torch.device(device)
    kwargs = dict(CASES[name])
    temperature = kwargs.pop("temperature", 1.0)
    top_k, top_p = kwargs.pop("top_k", 0), kwargs.pop("top_p", 1.0)
    request = make_request(1, 0, PROMPT, OUTPUT, **kwargs)
    target, draft = (torch.tensor(x, dtype=torch.float32, device=device)
                     for x in target_and_draft_logits(rule))
    options = SamplingOptions(1, V, device)
    rejection_sample = (get_backend(device) if backend is None
                        else load_backend(backend)).rejection_sample
    outputs = []
    for start in range(0, num_requests, CHUNK):
        batch = min(CHUNK, num_requests - start)
        seeds = torch.arange(start, start + batch, dtype=torch.int64, device=device) * 7919 + 3
        positions = torch.full((batch,), len(PROMPT) + len(OUTPUT), dtype=torch.int64,
                               device=device)
        if rule == "full":
            drafts, q = ops.sample_draft(
                draft.repeat(batch, 1), torch.full((batch * K,), temperature, device=device),
                seeds.repeat_interleave(K),
                (positions[:, None] + torch.arange(K, device=device)).reshape(-1))
        else:
            drafts, q = draft.argmax(-1).repeat(batch), None
        # the same request in every row of the batch (one slot): independent seeds. Its rows
        # after the options depend on its drafts alone, so each distinct draft sequence is
        # processed once and its rows repeated (the same numbers as processing every copy)
        distinct, inverse = np.unique(drafts.reshape(batch, K).numpy(), axis=0,
                                      return_inverse=True)
        logits = options.process(target.repeat(len(distinct), 1), [request] * len(distinct),
                                 np.full(len(distinct), K), torch.from_numpy(distinct).view(-1))
        logits = logits.view(len(distinct), K + 1, V)[torch.from_numpy(inverse.reshape(-1))]
        logits = logits.view(-1, V)
        if ignore_drafts:
            logits = options.process(target.clone(), [request] * (K + 1)).repeat(batch, 1)
        outputs.append(rejection_sample(
            logits, drafts, torch.arange(batch + 1, dtype=torch.int32, device=device) * K, q,
            torch.full((batch,), temperature, device=device),
            torch.full((batch,), top_k, dtype=torch.int32, device=device) if top_k else None,
            torch.full((batch,), top_p, device=device) if top_p < 1.0 else None, None,
            seeds, positions, K).cpu().numpy())
    return np.concatenate(outputs)


def reference(name: str, column: int, prefix: tuple[int, ...], rule: str) -> np.ndarray:
    """p of output column ``column`` after the accepted drafts ``prefix``, one token at a time."""
    kwargs = dict(CASES[name])
    temperature = kwargs.pop("temperature", 1.0)
    top_k, top_p = kwargs.pop("top_k", 0), kwargs.pop("top_p", 1.0)
    target, _ = target_and_draft_logits(rule)
    z = reference_option_logits(
        target[column], PROMPT, OUTPUT + list(prefix),
        repetition_penalty=kwargs.get("repetition_penalty", 1.0),
        frequency_penalty=kwargs.get("frequency_penalty", 0.0),
        presence_penalty=kwargs.get("presence_penalty", 0.0),
        logit_bias=kwargs.get("logit_bias"), allowed_token_ids=kwargs.get("allowed_token_ids"),
        bad_words=bad_word_token_ids(kwargs.get("bad_words", ()), TOKENIZER),
        min_tokens=kwargs.get("min_tokens", 0),
        stop_ids=kwargs.get("stop_token_ids", []) + [EOS])
    return reference_probs(z, temperature, top_k, top_p)


def group_p_values(name: str, rule: str, out: np.ndarray) -> dict:
    """(column, prefix) -> (samples, p-value) for every group; 0.0 where a token of
    probability 0 was emitted, whatever the group's size."""
    groups = defaultdict(list)
    for column in range(K + 1):
        present = out[:, column] >= 0
        for row in out[present, : column + 1]:
            groups[(column, tuple(row[:column].tolist()))].append(row[column])
    result = {}
    for (column, prefix), tokens in groups.items():
        counts = np.bincount(tokens, minlength=V)
        probs = reference(name, column, prefix, rule)
        if counts[probs == 0].sum():
            result[(column, prefix)] = (len(tokens), 0.0)
        elif len(tokens) >= MIN_GROUP:
            result[(column, prefix)] = (len(tokens), chi_square_p_value(counts, probs))
    return result


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("name", list(CASES))
def test_each_position_follows_one_token_at_a_time(name, rule, device):
    out = run(name, rule, NUM_REQUESTS, device=device)
    assert (out[:, 0] >= 0).all()
    results = group_p_values(name, rule, out)
    tested = {key: value for key, value in results.items() if value[0] >= MIN_GROUP}
    # the test reaches past the first position (drafts are accepted) and tests most samples
    assert any(column >= 2 for column, _ in tested), sorted(results)
    assert sum(n for n, _ in tested.values()) >= 0.75 * (out >= 0).sum()
    record(f"options_{name}_{rule}", NUM_REQUESTS, [p for _, p in results.values()])
    for (column, prefix), (n, p) in results.items():
        assert p >= P_VALUE_THRESHOLD, (
            f"{name}/{rule}: position {column} after drafts {prefix} ({n} samples): p-value "
            f"{p:.3g}")


def test_greedy_target_emits_the_processed_argmax(device):
    """Temperature 0: every emitted token is the argmax of the processed row after its prefix."""
    for name in ("penalties", "bad_words", "min_tokens", "all"):
        CASES["greedy"] = dict(CASES[name], temperature=0.0)
        CASES["greedy"].pop("top_k", None)
        try:
            for rule in RULES:
                out = run("greedy", rule, 2_000, device=device)
                argmax = {}  # of the processed row after each prefix, computed once
                for column in range(K + 1):
                    for row in out[out[:, column] >= 0]:
                        prefix = tuple(row[:column])
                        if prefix not in argmax:
                            argmax[prefix] = int(np.argmax(
                                reference("greedy", column, prefix, rule)))
                        assert row[column] == argmax[prefix], (name, rule, column)
        finally:
            del CASES["greedy"]


@pytest.mark.parametrize("name", ["penalties", "bad_words"])
def test_triton_backend_gives_the_same_tokens(name, device):
    """The Triton backend (its interpreter on the CPU) emits the torch backend's tokens for the
    same processed logits and seeds on the same device, so the statistics above hold for both."""
    for rule in RULES:
        assert np.array_equal(run(name, rule, 32, "triton", device=device),
                              run(name, rule, 32, "torch", device=device))


@pytest.mark.slow
def test_options_that_ignore_the_drafts_fail_the_test():
    """The test of the test: penalties that do not count the drafts before a row (vLLM's
    #18902) must be caught, under both rules."""
    for rule in RULES:
        out = run("penalties", rule, NUM_REQUESTS, ignore_drafts=True)
        values = [p for _, p in group_p_values("penalties", rule, out).values()]
        record(f"options_penalties_{rule}_ignoring_drafts (must fail)", NUM_REQUESTS, values)
        assert min(values) < P_VALUE_THRESHOLD, values

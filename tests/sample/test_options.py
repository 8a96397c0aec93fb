"""The sampling options' logits processing (ops.options, sample.options).

Strategy: three properties, exact (no statistics).
- Against an independent float64 reference (tests/sample/stats.py) for one-row-per-request
  steps covering every option at once and each alone.
- Under speculation, row i of a request equals the row a plain step computes after that request
  committed d_1..d_i (docs/design.md §15): repeated tokens inside the drafts, min_tokens crossing
  its boundary inside the drafts, bad words completed by drafts.
- The per-slot counts follow the committed tokens: later commits are added, a slot taken by
  another request is counted afresh, requests without options leave the logits untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.sample.stats import reference_option_logits
from verispec.engine.request import Request
from verispec.sample.options import RequestOptions, SamplingOptions, bad_word_token_ids
from verispec.sampling_params import SamplingParams

V = 29
EOS = 0


class LetterTokenizer:
    """Letters a..z are tokens 1..26; spaces are dropped."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 96 for c in text if c != " "]


TOKENIZER = LetterTokenizer()


def make_request(request_id, slot, prompt, output, grammars=None, **kwargs):
    """``grammars``: the compiler of ``structured_outputs`` (``RequestOptions.build``)."""
    params = SamplingParams(max_tokens=40, **kwargs)
    r = Request(request_id, None, list(prompt), params, seed=request_id, max_model_len=100)
    for t in output:
        r.append(t)
    r.slot = slot
    r.options = RequestOptions.build(params, V, [EOS], TOKENIZER, grammars)
    return r


def reference(logits_row, r, drafts=()):
    p = r.params
    words = bad_word_token_ids(p.bad_words or (), TOKENIZER)
    return reference_option_logits(
        logits_row, r.token_ids[: r.num_prompt_tokens].tolist(),
        r.output_token_ids.tolist() + list(drafts),
        repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty, logit_bias=p.logit_bias,
        allowed_token_ids=p.allowed_token_ids, bad_words=words, min_tokens=p.min_tokens,
        stop_ids=list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS]))


OPTION_SETS = {
    "penalties": dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=-0.3),
    "repetition_below_one": dict(repetition_penalty=0.7),
    "logit_bias": dict(logit_bias={2: 3.0, 5: -100.0, 28: 0.5}),
    "allowed": dict(allowed_token_ids=[1, 2, 3, 5, 8, 13, 21]),
    "bad_words": dict(bad_words=["ab", "bcb", "z"]),
    "min_tokens": dict(min_tokens=6, stop_token_ids=[7]),
    "all": dict(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.4,
                logit_bias={3: 1.0}, allowed_token_ids=list(range(0, 20)),
                bad_words=["cb", "d"], min_tokens=5),
}


def logits_rows(num_rows, seed=0):
    return torch.tensor(np.random.default_rng(seed).normal(size=(num_rows, V)) * 2,
                        dtype=torch.float32)


def test_plain_rows_match_the_reference():
    requests = [make_request(i, i, [1, 2, 3, 2], [2, 1, 2, 3, 2], **kw)
                for i, kw in enumerate(OPTION_SETS.values())]
    requests.append(make_request(99, len(requests), [4], [5, 6]))  # no options
    logits = logits_rows(len(requests))
    out = SamplingOptions(8, V, torch.device("cpu")).process(logits, requests)
    for r, row, got in zip(requests, logits, out):
        np.testing.assert_allclose(got.numpy(), reference(row.numpy(), r), rtol=1e-6, atol=1e-5,
                                   err_msg=str(r.params))
    assert torch.equal(out[-1], logits[-1])


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_verify_rows_equal_one_token_at_a_time(name):
    """Row i of a verify step == a plain step after committing d_1..d_i (docs/design.md §15)."""
    kwargs = OPTION_SETS[name]
    # drafts repeat tokens of the output and of each other; "ab", "bcb" get completed by them
    batch_drafts = [[2, 2, 3], [], [1, 2, 3, 2], [3, 2]]
    outputs = [[1], [], [2, 3], [2, 3, 2, 1, 2]]  # min_tokens=5/6 is crossed inside the drafts
    batch = [make_request(i, i, [2, 5, 9], outputs[i], **kwargs) for i in range(4)]
    num_drafts = np.array([len(d) for d in batch_drafts])
    drafts = torch.tensor([t for d in batch_drafts for t in d], dtype=torch.int64)
    logits = logits_rows(int(num_drafts.sum()) + len(batch), seed=1)
    got = SamplingOptions(8, V, torch.device("cpu")).process(logits, batch, num_drafts, drafts)
    row = 0
    for b, d in enumerate(batch_drafts):
        for i in range(len(d) + 1):
            # a fresh request that committed d_1..d_i, in a fresh engine state
            one = make_request(100 + b, b, [2, 5, 9], outputs[b] + d[:i], **kwargs)
            want = SamplingOptions(8, V, torch.device("cpu")).process(logits[row:row + 1], [one])
            assert torch.equal(got[row], want[0]), (b, i)
            np.testing.assert_allclose(got[row].numpy(), reference(logits[row].numpy(), one),
                                       rtol=1e-6, atol=1e-5)
            row += 1
    assert row == logits.shape[0]


def test_counts_follow_commits_and_slot_reuse():
    state = SamplingOptions(4, V, torch.device("cpu"))
    kw = OPTION_SETS["penalties"]
    r = make_request(1, 2, [4, 4], [5], **kw)
    logits = logits_rows(1, seed=2)
    state.process(logits, [r])
    for t in (5, 6, 6):  # committed later: added to the counts
        r.append(t)
    np.testing.assert_allclose(state.process(logits, [r])[0].numpy(),
                               reference(logits[0].numpy(), r), rtol=1e-6, atol=1e-5)
    assert state.output_counts[2, 6] == 2 and state.output_counts[2, 5] == 2
    other = make_request(2, 2, [7], [8], **kw)  # the slot's next request: counted afresh
    np.testing.assert_allclose(state.process(logits, [other])[0].numpy(),
                               reference(logits[0].numpy(), other), rtol=1e-6, atol=1e-5)
    assert state.output_counts[2].sum() == 1 and not state.prompt_mask[2, 4]


def test_requests_without_options_pay_nothing():
    state = SamplingOptions(4, V, torch.device("cpu"))
    r = make_request(1, 0, [4], [5], temperature=0.5, top_k=3)
    assert r.options is None
    logits = logits_rows(3)
    assert state.process(logits, [r], np.array([2]), torch.tensor([1, 2])) is logits
    assert state.output_counts is None  # no per-slot state allocated


def test_option_token_ids_outside_the_vocabulary_name_the_field():
    for kwargs, field in ((dict(logit_bias={V: 1.0}), "logit_bias"),
                          (dict(allowed_token_ids=[0, V + 5]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=f"{field} token ids .*{V}"):
            RequestOptions.build(SamplingParams(**kwargs), V, [EOS])
    with pytest.raises(ValueError, match="bad_words.*tokenizer"):
        RequestOptions.build(SamplingParams(bad_words=["x"]), V, [EOS], None)


def test_bad_words_spellings():
    assert bad_word_token_ids(["ab", " c"], TOKENIZER) == [(1, 2), (3,)]

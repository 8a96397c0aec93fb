"""SamplingParams validation: each invalid value raises one ValueError naming field and value."""

from __future__ import annotations

import pytest

from verispec import SamplingParams


def test_defaults_and_flags():
    p = SamplingParams()
    assert p.temperature == 1.0 and not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert not (p.uses_top_k or p.uses_top_p or p.uses_min_p)
    q = SamplingParams(top_k=5, top_p=0.9, min_p=0.1, stop="END", stop_token_ids=[2])
    assert q.uses_top_k and q.uses_top_p and q.uses_min_p
    assert q.stop == ("END",) and q.stop_token_ids == (2,)
    assert SamplingParams(top_k=-1).top_k == -1 and not SamplingParams(top_k=-1).uses_top_k


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"temperature": -0.1}, r"temperature .*-0\.1"),
        ({"temperature": float("nan")}, r"temperature .*nan"),
        ({"temperature": "hot"}, r"temperature .*'hot'"),
        ({"top_k": -3}, r"top_k .*-3"),
        ({"top_k": 2.5}, r"top_k .*2\.5"),
        ({"top_p": 0.0}, r"top_p .*0\.0"),
        ({"top_p": 1.5}, r"top_p .*1\.5"),
        ({"min_p": -0.2}, r"min_p .*-0\.2"),
        ({"min_p": 1.1}, r"min_p .*1\.1"),
        ({"seed": 2**64}, r"seed .*18446744073709551616"),
        ({"seed": "7"}, r"seed .*'7'"),
        ({"max_tokens": 0}, r"max_tokens .*got 0"),
        ({"stop": [""]}, r"stop .*\[''\]"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids .*\[-1\]"),
        ({"ignore_eos": 1}, r"ignore_eos .*1"),
        ({"max_tokens": 2**70}, r"max_tokens .*1180591620717411303424"),
        ({"repetition_penalty": 0}, r"repetition_penalty .*got 0"),
        ({"repetition_penalty": -1.0}, r"repetition_penalty .*-1\.0"),
        ({"presence_penalty": 2.5}, r"presence_penalty .*2\.5"),
        ({"frequency_penalty": -3}, r"frequency_penalty .*-3"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias .*-1"),
        ({"logit_bias": {1: float("nan")}}, r"logit_bias .*nan"),
        ({"allowed_token_ids": []}, r"allowed_token_ids .*\[\]"),
        ({"allowed_token_ids": [1, -2]}, r"allowed_token_ids .*-2"),
        ({"bad_words": [""]}, r"bad_words .*''"),
        ({"min_tokens": -1}, r"min_tokens .*-1"),
        ({"min_tokens": 17}, r"min_tokens .*max_tokens=16.*17"),
        ({"n": 0}, r"n must .*got 0"),
        ({"n": 3, "best_of": 2}, r"best_of .*n=3.*got 2"),
        ({"best_of": 1.5}, r"best_of .*1\.5"),
    ],
)
def test_invalid_values(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_logits_options():
    p = SamplingParams()
    assert not p.uses_penalties and not p.uses_logits_options
    q = SamplingParams(logit_bias={3: 500, 4: -1e9}, bad_words="no", allowed_token_ids=[2, 1])
    assert q.logit_bias == {3: 100.0, 4: -100.0}  # clamped as vLLM's server does
    assert q.bad_words == ("no",) and q.allowed_token_ids == (2, 1)
    assert q.uses_logits_options and not q.uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(min_tokens=3).uses_logits_options

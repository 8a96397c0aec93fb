"""``SamplingParams(logprobs=N)`` through ``LLM.generate``, on a tiny random model.

Strategy: the logprob of each output token is log p under the processed target distribution of
its position, so it must (1) equal the same computation done directly on the model's logits for
the whole sequence, (2) be the same with speculation as without (greedy: same tokens, drafts
accepted), (3) come with the N most likely tokens in descending order, and (4) stop exactly with
the committed tokens (a stop inside an accepted run drops the logprobs of the tokens after it).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.proposers.test_draft_model import save_llama
from verispec import LLM, SamplingParams
from verispec.ops import processed_probs

VOCAB = 64
MAX_MODEL_LEN = 96
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]  # repetitive, so the n-gram proposer drafts


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("target"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def plain(target_dir):
    return LLM(target_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=2)


@pytest.fixture(scope="module")
def spec(target_dir):
    return LLM(target_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
               speculative_config=NGRAM)


def direct_logprobs(llm: LLM, prompt: list[int], output: list[int], params: SamplingParams):
    """log p of each output token from one forward over the whole sequence (a fresh slot)."""
    ids = prompt + output
    logits = llm.runner.forward([0], [ids], logits="all")[len(prompt) - 1: len(ids) - 1]
    llm.runner.kv_cache.free(0)
    n = len(output)
    probs = processed_probs(
        logits, torch.full((n,), params.temperature),
        torch.full((n,), params.top_k, dtype=torch.int32) if params.top_k else None,
        torch.full((n,), params.top_p) if params.top_p < 1 else None, None)
    return torch.log(probs).gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def test_logprobs_equal_direct_computation_and_top_n_order(plain):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_tokens=20,
                            logprobs=4, ignore_eos=True)
    out = plain.generate(PROMPT, params)[0]
    assert len(out.logprobs) == len(out.token_ids) == 20
    direct = direct_logprobs(plain, PROMPT, out.token_ids, params)
    for token_id, entry, expected in zip(out.token_ids, out.logprobs, direct):
        assert entry[token_id] == pytest.approx(expected, abs=1e-5)
        top = list(entry.values())[:4]
        assert top == sorted(top, reverse=True) and len(entry) in (4, 5)
        assert math.isfinite(entry[token_id])  # a sampled token is never masked
    assert plain.generate(PROMPT, SamplingParams(max_tokens=3))[0].logprobs is None


def test_logprobs_same_with_and_without_speculation(plain, spec):
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, ignore_eos=True)
    accepted = spec.get_metrics()["spec_decoding"]["num_accepted_tokens"]
    a, b = plain.generate(PROMPT, params)[0], spec.generate(PROMPT, params)[0]
    assert spec.get_metrics()["spec_decoding"]["num_accepted_tokens"] > accepted
    assert a.token_ids == b.token_ids
    for entry_a, entry_b in zip(a.logprobs, b.logprobs):
        assert list(entry_a) == list(entry_b)
        assert list(entry_a.values()) == pytest.approx(list(entry_b.values()), abs=1e-5)


def test_logprobs_stop_with_the_committed_tokens(spec):
    """A stop token inside an accepted run: the tokens after it are not committed, nor are their
    logprobs."""
    free = spec.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=30,
                                                ignore_eos=True))[0]
    stop_id = free.token_ids[len(free.token_ids) // 2]
    out = spec.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                               stop_token_ids=[stop_id], logprobs=0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_id
    assert len(out.logprobs) == len(out.token_ids)
    assert all(list(entry) == [t] for t, entry in zip(out.token_ids, out.logprobs))


def test_bad_logprobs_are_one_clear_error(plain):
    with pytest.raises(ValueError, match="logprobs must be an integer >= 0 or None, got -1"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match=f"logprobs=100 exceeds the model's vocabulary size "
                                         f"{VOCAB}"):
        plain.generate(PROMPT, SamplingParams(logprobs=100))

"""Several samples of one prompt (``n``) and prompt logprobs, through the whole engine.

Strategy: exact properties on the tiny random models of the preemption tests.
- Sample j of a seeded request with ``n`` is the request with ``seed + j`` alone (vLLM's rule),
  with and without speculation; samples 1.. reuse sample 0's prompt blocks (prefix-cache hits).
- ``best_of``: the n returned are the n of highest cumulative logprob among the best_of samples
  of the same seed (with and without speculation), best first, without logprobs unless asked.
- Prompt logprobs of token t equal the logprobs a one-token request over the first t tokens
  reports for that token (temperature 1, no mask: the raw distribution), the same with chunked
  prefill, with a warm prefix cache and under speculation.
"""

from __future__ import annotations

import math

import pytest

from tests.engine.test_preemption import BLOCK_SIZE, VOCAB, save_target, speculative_config
from tests.engine.test_sampling_options import engine, workload
from verispec import SamplingParams
from verispec.engine.samples import sample_params

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_target(tmp_path_factory, MAX_MODEL_LEN)


def test_sample_params_follow_vllm_seed_rule():
    samples = sample_params(SamplingParams(n=3, seed=2**63 - 2, prompt_logprobs=1))
    assert [p.seed for p in samples] == [2**63 - 2, 2**63 - 1, -(2**63)]
    assert [p.n for p in samples] == [1, 1, 1]
    assert [p.prompt_logprobs for p in samples] == [1, None, None]
    assert [p.seed for p in sample_params(SamplingParams(n=2))] == [None, None]


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_sample_j_is_the_request_with_seed_plus_j(target_dir, spec):
    llm = engine(target_dir, None if spec is None else speculative_config(spec, None, None))
    prompts = workload()[:2]
    params = SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=12, ignore_eos=True,
                            logprobs=1)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert [o.index for o in out.outputs] == [0, 1, 2]
        assert out.token_ids == out.outputs[0].token_ids and out.finish_reason == "length"
        for j, sample in enumerate(out.outputs):
            alone = llm.generate(prompt, SamplingParams(temperature=0.9, seed=7 + j,
                                                        max_tokens=12, ignore_eos=True,
                                                        logprobs=1))[0]
            assert sample.token_ids == alone.token_ids, j
            assert sample.logprobs == alone.logprobs
        assert len({tuple(o.token_ids) for o in out.outputs}) > 1


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_best_of_returns_the_n_most_likely_samples(target_dir, spec):
    llm = engine(target_dir, None if spec is None else speculative_config(spec, None, None))
    prompt = workload()[0]
    common = dict(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    every = llm.generate(prompt, SamplingParams(n=6, logprobs=0, **common))[0].outputs
    cumulative = [o.cumulative_logprob for o in every]
    assert cumulative == [math.fsum(lp[t] for t, lp in zip(o.token_ids, o.logprobs))
                          for o in every]
    best = sorted(range(6), key=lambda j: -cumulative[j])[:2]
    out = llm.generate(prompt, SamplingParams(n=2, best_of=6, **common))[0]
    assert [o.index for o in out.outputs] == [0, 1]
    assert [o.token_ids for o in out.outputs] == [every[j].token_ids for j in best]
    assert [o.cumulative_logprob for o in out.outputs] == [cumulative[j] for j in best]
    assert out.logprobs is None and all(o.logprobs is None for o in out.outputs)
    assert out.token_ids == out.outputs[0].token_ids
    asked = llm.generate(prompt, SamplingParams(n=2, best_of=6, logprobs=1, **common))[0]
    assert [o.token_ids for o in asked.outputs] == [o.token_ids for o in out.outputs]
    assert asked.outputs[0].logprobs is not None


def test_samples_share_the_prompt_blocks(target_dir):
    llm = engine(target_dir)
    prompt = workload()[1]  # 23 tokens: 5 full blocks of 4
    before = llm.get_metrics()["prefix_cache"]["hits"]
    [out] = llm.generate(prompt, SamplingParams(n=4, max_tokens=3, ignore_eos=True))
    hits = llm.get_metrics()["prefix_cache"]["hits"] - before
    assert hits == 3 * ((len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE)
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 3 for o in out.outputs)


def test_n_is_refused_where_one_request_is_made(target_dir):
    llm = engine(target_dir)
    with pytest.raises(ValueError, match="n=2"):
        llm.add_request(workload()[0], SamplingParams(n=2))
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def reference_prompt_logprobs(llm, prompt):
    """log p(prompt[t] | prompt[:t]) from one-token requests (temperature 1, every token)."""
    result = [None]
    for t in range(1, len(prompt)):
        [out] = llm.generate(prompt[:t], SamplingParams(max_tokens=1, logprobs=VOCAB, seed=0))
        result.append(out.logprobs[0][prompt[t]])
    return result


@pytest.mark.parametrize("setup", ["plain", "chunked", "warm_cache", "ngram"])
def test_prompt_logprobs_are_the_one_token_logprobs(target_dir, setup):
    prompt = workload()[1]
    kwargs = {"max_num_batched_tokens": 6} if setup == "chunked" else {}
    spec = speculative_config("ngram", None, None) if setup == "ngram" else None
    llm = engine(target_dir, spec, **kwargs)
    want = reference_prompt_logprobs(engine(target_dir), prompt)
    if setup == "warm_cache":
        llm.generate(prompt, SamplingParams(max_tokens=2))
    [out] = llm.generate(prompt, SamplingParams(max_tokens=4, prompt_logprobs=2, temperature=0))
    got = out.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    assert out.num_cached_tokens == 0  # asked for prompt logprobs: the whole prompt computed
    for t in range(1, len(prompt)):
        entry = got[t]
        assert math.isclose(entry[prompt[t]], want[t], rel_tol=1e-5, abs_tol=1e-5), t
        top = list(entry.items())[:2]
        assert top[0][1] >= top[1][1] and len(entry) in (2, 3)
    # sample 0 alone carries them
    [out] = llm.generate(prompt, SamplingParams(max_tokens=2, n=2, prompt_logprobs=0))
    assert [entry and list(entry) for entry in out.prompt_logprobs][1:] == [
        [t] for t in prompt[1:]]

"""Preemption under a deliberately tiny KV pool: every request finishes with exactly the tokens of
an unpressured run (docs/design.md §13), with and without speculation, and bad memory flags get
one clear error each.

Strategy: the same mixed batch (greedy and seeded temperature-0.8 requests, prompts of different
lengths, outputs long enough to outgrow the pool) runs once with a pool that holds everything and
once with a pool of a few blocks more than one full-length request, so the scheduler must preempt
(recompute) the newest requests again and again. Tokens must be identical request by request
(batch invariance and per-request seeds make this exact, not statistical), preemptions must have
happened, and every block must be back in the pool at the end. Covers plain decoding, n-gram, a
draft model and an EAGLE-3 head; float32 and bfloat16 for plain decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.proposers.test_draft_model import save_llama
from tests.proposers.test_eagle_loader import eagle_checkpoint, write_checkpoint
from verispec import LLM, SamplingParams
from verispec.models import load_model

VOCAB = 64
MAX_MODEL_LEN = 96
BLOCK_SIZE = 4


def save_target(tmp_path_factory, max_model_len: int) -> str:
    """The tiny random target of the engine tests (3 layers, vocabulary VOCAB)."""
    return save_llama(tmp_path_factory.mktemp("target"), num_layers=3, vocab_size=VOCAB,
                      max_position_embeddings=max_model_len)


def save_draft(tmp_path_factory, max_model_len: int) -> str:
    """A one-layer random draft model with the target's vocabulary."""
    return save_llama(tmp_path_factory.mktemp("draft"), num_layers=1, vocab_size=VOCAB, seed=3,
                      max_position_embeddings=max_model_len)


def save_head(target_dir: str, tmp_path_factory) -> str:
    """A random EAGLE-3 head for ``target_dir`` (a reduced draft vocabulary of 40)."""
    config, state = eagle_checkpoint("eagle3", load_model(target_dir).config, seed=11,
                                     draft_vocab_size=40)
    return write_checkpoint(tmp_path_factory.mktemp("eagle3"), config, state)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_target(tmp_path_factory, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save_draft(tmp_path_factory, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    return save_head(target_dir, tmp_path_factory)


def workload():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (9, 23, 5, 31, 14, 18, 7, 26)]
    # repeat a phrase so the n-gram proposer finds matches
    prompts[2] = prompts[2] + prompts[2] + prompts[2]
    params = [SamplingParams(max_tokens=40 + 3 * i, ignore_eos=True,
                             temperature=0.0 if i % 2 else 0.8, seed=100 + i)
              for i in range(len(prompts))]
    return prompts, params


def speculative_config(method, draft_dir, head_dir):
    if method is None:
        return None
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        config.update(model=draft_dir, draft_sample_method="probabilistic")
    elif method == "eagle3":
        config.update(model=head_dir)
    return config


def run(target_dir, spec, dtype, num_blocks=None):
    kwargs = {}
    if num_blocks is not None:
        probe = LLM(target_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                    speculative_config=spec, block_size=BLOCK_SIZE)
        kwargs["kv_cache_memory"] = num_blocks * probe.kv_plan.bytes_per_block
    llm = LLM(target_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
              speculative_config=spec, block_size=BLOCK_SIZE, **kwargs)
    prompts, params = workload()
    outputs = llm.generate(prompts, params)
    return llm, [o.token_ids for o in outputs]


@pytest.mark.parametrize("method, dtype", [(None, "float32"), (None, "bfloat16"),
                                           ("ngram", "float32"), ("draft_model", "float32"),
                                           ("eagle3", "float32")])
def test_preempted_requests_finish_with_the_unpressured_tokens(method, dtype, target_dir,
                                                                draft_dir, head_dir):
    spec = speculative_config(method, draft_dir, head_dir)
    free_llm, expected = run(target_dir, spec, dtype)
    assert free_llm.scheduler.num_preemptions == 0
    # one full-length request (24 blocks of 4) and a little more: the batch must take turns
    llm, got = run(target_dir, spec, dtype, num_blocks=1 + MAX_MODEL_LEN // BLOCK_SIZE + 6)
    assert llm.scheduler.num_preemptions > 0
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a == b, f"request {i}"
    pool = llm.runner.kv_cache.pool
    assert pool.num_free == pool.num_usable and llm.scheduler.kv_cache_usage == 0.0


def test_bad_memory_flags_get_one_clear_error_each(target_dir):
    common = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    cases = [
        (dict(gpu_memory_utilization=0), "gpu_memory_utilization must be a fraction"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be a fraction"),
        (dict(kv_cache_memory="lots"), "kv_cache_memory must be a number of bytes"),
        (dict(kv_cache_memory=100), r"max_model_len=96 needs 6 KV blocks"),
        (dict(kv_cache_memory="1KiB", block_size=4), r"max_model_len=96 needs 24 KV blocks"),
        (dict(block_size=12), "block_size must be a power of two"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(target_dir, **{**common, **kwargs})


def test_default_plan_holds_full_length_requests_and_says_so(target_dir, caplog):
    llm = LLM(target_dir, max_num_seqs=3)
    plan = llm.kv_plan
    assert llm.max_model_len == MAX_MODEL_LEN  # the model's max_position_embeddings
    assert plan.max_full_length_requests == 3  # the default CPU pool: every slot at full length
    assert "requests of max_model_len=96 fit at once" in plan.summary()

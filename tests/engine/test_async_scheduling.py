"""Async scheduling (``engine.overlap``): steps queued one ahead of the host's commit give every
request exactly the tokens of steps run in order.

Strategy: the same requests through an engine with ``async_scheduling=False`` and one with
``True``, on the CPU (the bookkeeping is the device's: placeholders, the next step's inputs taken
from the queued step's tokens, requests ending a step early, blocks freed under a queued step);
a spy checks that steps were in fact queued ahead. Cases: greedy and seeded sampled requests of
different lengths with chunked prefill (prefill chunks beside decodes), stop tokens and EOS that
end requests at a step whose next one is queued already, prefix-cache hits, a request that needs
the host between steps (logprobs: steps run in order while it is there), a KV pool so small that
the scheduler preempts (steps run in order near a full pool), and an abort between steps. On a
GPU (``VERISPEC_TEST_DEVICE=cuda``) the same through CUDA graphs and the device copy of the
queued tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.proposers.test_draft_model import save_llama
from verispec import LLM, SamplingParams
from verispec.engine import builder as builder_module
from verispec.engine import overlap
from verispec.runtime.model_runner import ModelRunner

VOCAB = 64
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    # head_dim 16: the GPU attention kernel's least (VERISPEC_TEST_DEVICE=cuda)
    return save_llama(tmp_path_factory.mktemp("target"), num_layers=3, vocab_size=VOCAB,
                      hidden_size=64, max_position_embeddings=MAX_MODEL_LEN)


def _engine(target_dir, device, async_scheduling, **kwargs):
    return LLM(model=target_dir, dtype="float32", device=str(device),
               max_model_len=MAX_MODEL_LEN, async_scheduling=async_scheduling, **kwargs)


class _FlatRunner(ModelRunner):
    """The GPU path's flat layout and its (here uncaptured) graph steps, on the CPU."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("flat_layout", True)
        super().__init__(*args, **kwargs)


@pytest.fixture(params=["padded", "flat"])
def layout(request, monkeypatch):
    """Both layouts: on the flat one the queued tokens reach the next step's inputs on the
    device (the decode graph's and the eager mixed step's), on the CPU's they are read."""
    if request.param == "flat":
        monkeypatch.setattr(builder_module, "ModelRunner", _FlatRunner)
    return request.param


def _requests(seed=0, n=10):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, VOCAB, 20).tolist()  # a prefix some prompts share
    prompts, params = [], []
    for i in range(n):
        tail = rng.integers(3, VOCAB, int(rng.integers(2, 30))).tolist()
        prompts.append(shared + tail if i % 3 == 0 else tail)
        params.append(SamplingParams(max_tokens=int(rng.integers(3, 40)), ignore_eos=i % 4 != 1,
                                     temperature=0.0 if i % 2 else 0.8, seed=100 + i))
    return prompts, params


def _tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


class _Spy:
    """Counts the steps queued ahead of the host."""

    def __init__(self, monkeypatch):
        self.queued = 0
        original = overlap.OverlappedSteps._overlapped_step

        def counted(engine):
            self.queued += 1
            return original(engine)

        monkeypatch.setattr(overlap.OverlappedSteps, "_overlapped_step", counted)


def test_queued_steps_give_the_tokens_of_steps_in_order(target_dir, device, monkeypatch,
                                                         layout):
    prompts, params = _requests()
    kwargs = dict(max_num_seqs=4, max_num_batched_tokens=24)  # chunks beside decodes
    expected = _tokens(_engine(target_dir, device, False, **kwargs), prompts, params)
    # stop tokens that end requests mid-batch: each request's 4th token where it has one
    stopped = [dataclasses.replace(p, stop_token_ids=[out[3]]) if len(out) > 4 else p
               for p, out in zip(params, expected)]
    expected_stopped = _tokens(_engine(target_dir, device, False, **kwargs), prompts, stopped)
    spy = _Spy(monkeypatch)
    llm = _engine(target_dir, device, True, **kwargs)
    assert llm.runner.flat == (layout == "flat" or device.type == "cuda")
    assert _tokens(llm, prompts, params) == expected
    assert _tokens(llm, prompts, stopped) == expected_stopped  # a warm prefix cache too
    assert spy.queued > 20
    assert llm.scheduler.kv_cache.pool.num_free == llm.scheduler.kv_cache.pool.num_usable
    assert any(len(a) < len(b) for a, b in zip(expected_stopped, expected))


def test_a_request_needing_the_host_runs_its_steps_in_order(target_dir, device, monkeypatch):
    prompts, params = _requests(seed=1, n=6)
    params[2] = SamplingParams(max_tokens=12, logprobs=2, seed=7, temperature=0.8)
    expected = LLM.generate(_engine(target_dir, device, False, max_num_seqs=6), prompts, params)
    spy = _Spy(monkeypatch)
    outputs = _engine(target_dir, device, True, max_num_seqs=6).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert outputs[2].logprobs == expected[2].logprobs
    assert spy.queued > 0  # before it arrived and after it finished


def test_an_aborted_waiting_request_needing_the_host_lets_steps_queue_again(target_dir, device,
                                                                            monkeypatch):
    """A waiting request with logprobs holds steps in order until it is aborted."""
    prompts, params = _requests(seed=4, n=2)
    llm = _engine(target_dir, device, True, max_num_seqs=2)
    requests = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    waiting = llm.add_request(prompts[0], SamplingParams(max_tokens=5, logprobs=1))
    assert llm.scheduler.in_order_ids
    llm.abort_request(waiting)
    assert not llm.scheduler.in_order_ids
    spy = _Spy(monkeypatch)
    while llm.has_unfinished_requests:
        llm.step()
    assert spy.queued > 0
    assert [llm.get_output(r).finish_reason for r in requests] == ["length", "length"]


def test_a_small_kv_pool_preempts_and_keeps_the_tokens(target_dir, device, monkeypatch):
    prompts, params = _requests(seed=2, n=8)
    kwargs = dict(max_num_seqs=8, block_size=4, kv_cache_memory=_pool_bytes(target_dir, 60))
    expected = _tokens(_engine(target_dir, device, False, max_num_seqs=8), prompts, params)
    spy = _Spy(monkeypatch)
    llm = _engine(target_dir, device, True, **kwargs)
    assert llm.runner.flat == (layout == "flat" or device.type == "cuda")
    assert _tokens(llm, prompts, params) == expected
    assert llm.scheduler.num_preemptions > 0 and spy.queued > 0


def _pool_bytes(target_dir, blocks):
    """Bytes of a KV pool of ``blocks`` blocks of 4 tokens for the test target (fp32)."""
    from verispec.models import load_model

    config = load_model(target_dir).config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4
    return blocks * 4 * per_token


def test_an_abort_between_queued_steps(target_dir, device, layout):
    prompts, params = _requests(seed=3, n=4)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, seed=i) for i in range(4)]
    expected = _tokens(_engine(target_dir, device, False, max_num_seqs=4), prompts, params)
    llm = _engine(target_dir, device, True, max_num_seqs=4)
    requests = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(8):
        llm.step()
    llm.abort_request(requests[1])
    cut = list(llm.get_output(requests[1]).token_ids)
    while llm.has_unfinished_requests:
        llm.step()
    outputs = [llm.get_output(r) for r in requests]
    assert outputs[1].finish_reason == "abort" and outputs[1].token_ids == cut
    assert cut == expected[1][:len(cut)]
    for i in (0, 2, 3):
        assert outputs[i].token_ids == expected[i] and outputs[i].finish_reason == "length"
    assert llm.scheduler.kv_cache.pool.num_free == llm.scheduler.kv_cache.pool.num_usable


def test_async_scheduling_is_refused_where_it_cannot_run(target_dir):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(model=target_dir, async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        LLM(model=target_dir, async_scheduling="yes")

"""Sampling options through the whole engine, on the tiny random models of the preemption tests.

Strategy: exact properties.
- Greedy speculation with each option (penalties, logit_bias, allowed_token_ids, bad_words,
  min_tokens, all at once) emits exactly the plain greedy tokens, for every proposer (n-gram, a
  draft model with greedy and with probabilistic drafts, an EAGLE-3 head): row i of a verify
  step is processed after d_1..d_i (docs/design.md §15), so it is the row a plain step uses.
  The same with token trees (a draft model's static tree, the target drafting its own, an
  EAGLE-3 head's dynamic tree): a node's row is processed after the drafts on its path.
- Seeded sampling with penalties gives the same tokens under preemption (the per-slot counts
  are rebuilt for a recomputed request) as without.
- The options do what they say on the output: no banned or disallowed token, no stop token
  before min_tokens, and a bad value fails its own request only, naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.test_eagle_trees import DYNAMIC
from tests.engine.test_preemption import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    VOCAB,
    save_draft,
    save_head,
    save_target,
    speculative_config,
)
from tests.engine.test_token_trees import BINARY, tree_config
from verispec import LLM, SamplingParams
from verispec.engine import builder as builder_module
from verispec.runtime.model_runner import ModelRunner
from verispec.sample.options import SamplingOptions


class LetterTokenizer:
    """Letters a..z are tokens 1..26 (spaces dropped); decodes to nothing."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 96 for c in text if c != " "]

    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_target(tmp_path_factory, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save_draft(tmp_path_factory, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    return save_head(target_dir, tmp_path_factory)


OPTIONS = {
    "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
    "repetition_below_one": dict(repetition_penalty=0.6),  # favours repeats: drafts accepted
    "logit_bias": dict(logit_bias={5: 4.0, 7: -100.0, 9: 2.5}),
    "allowed": dict(allowed_token_ids=list(range(3, 40))),
    "bad_words": dict(bad_words=["ab", "cdc", "e"]),
    "min_tokens": dict(min_tokens=12, ignore_eos=False),
    "all": dict(repetition_penalty=0.8, presence_penalty=0.2, logit_bias={4: 1.0},
                allowed_token_ids=list(range(1, 50)), bad_words=["ab"], min_tokens=6),
}


def workload(seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (9, 23, 5, 17)]
    prompts[2] = prompts[2] * 3  # repeats: the n-gram proposer finds matches
    return prompts


def engine(target_dir, spec=None, **kwargs):
    llm = LLM(target_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
              speculative_config=spec, block_size=BLOCK_SIZE, **kwargs)
    llm.tokenizer = LetterTokenizer()
    return llm


def greedy_params():
    return [SamplingParams(**{"temperature": 0.0, "max_tokens": 30, "ignore_eos": True, **kw})
            for kw in OPTIONS.values()]


@pytest.fixture(scope="module")
def plain_tokens(target_dir):
    llm = engine(target_dir)
    prompts = workload()
    return {name: [o.token_ids for o in llm.generate(prompts, [params] * len(prompts))]
            for name, params in zip(OPTIONS, greedy_params())}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_model_greedy", "eagle3"])
def test_greedy_speculation_with_each_option_equals_plain(method, target_dir, draft_dir,
                                                          head_dir, plain_tokens):
    spec = speculative_config(method.removesuffix("_greedy"), draft_dir, head_dir)
    if method == "draft_model_greedy":
        spec["draft_sample_method"] = "greedy"
    llm = engine(target_dir, spec)
    prompts = workload()
    for name, params in zip(OPTIONS, greedy_params()):
        outputs = llm.generate(prompts, [params] * len(prompts))
        for i, (o, want) in enumerate(zip(outputs, plain_tokens[name])):
            assert o.token_ids == want, f"{name}, prompt {i}"
    metrics = llm.get_metrics()["spec_decoding"]
    assert metrics["num_drafts"] > 0
    if method != "eagle3":  # the random head's drafts are all rejected; the others reach later rows
        assert metrics["num_accepted_tokens"] > 0


def tree_spec(tree: str, target_dir: str, draft_dir: str, head_dir: str) -> dict:
    if tree == "draft_model-static":
        return tree_config(draft_dir, BINARY, "probabilistic")
    if tree == "self_draft-static":  # the target drafts for itself: paths deep into the tree
        return tree_config(target_dir, BINARY, "greedy")
    return {"method": "eagle3", "model": head_dir, "num_speculative_tokens": 3, **DYNAMIC}


@pytest.mark.parametrize("tree", ["draft_model-static", "self_draft-static", "eagle3-dynamic"])
def test_greedy_tree_speculation_with_each_option_equals_plain(tree, target_dir, draft_dir,
                                                               head_dir, plain_tokens):
    """A node's row sees the drafts on its path from the root (docs/design.md §16), so greedy
    tree speculation emits the plain greedy tokens with every option."""
    llm = engine(target_dir, tree_spec(tree, target_dir, draft_dir, head_dir))
    llm.spec.adaptive = False  # the whole tree at every step, whatever it pays on this CPU
    prompts = workload()
    for name, params in zip(OPTIONS, greedy_params()):
        outputs = llm.generate(prompts, [params] * len(prompts))
        for i, (o, want) in enumerate(zip(outputs, plain_tokens[name])):
            assert o.error is None and o.token_ids == want, f"{name}, prompt {i}"
    stats = llm.spec.stats
    assert stats.num_drafts > 0
    if tree != "eagle3-dynamic":  # the random head's drafts are all rejected
        assert stats.num_accepted_tokens > 0
    if tree == "self_draft-static":
        assert stats.mean_acceptance_length > 2.0


def test_options_hold_on_the_output(target_dir, plain_tokens):
    plain = plain_tokens
    for tokens in plain["allowed"]:
        assert all(3 <= t < 40 for t in tokens)
    for tokens in plain["bad_words"]:
        assert 5 not in tokens  # "e"
        assert all(not (a == 1 and b == 2) for a, b in zip(tokens, tokens[1:]))  # "ab"
        assert all(tokens[i:i + 3] != [3, 4, 3] for i in range(len(tokens)))  # "cdc"
    assert all(7 not in tokens for tokens in plain["logit_bias"])
    llm = engine(target_dir)
    prompts = workload()
    first = [o.token_ids[0] for o in llm.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=1))]
    # the greedy first token made a stop token: masked until min_tokens
    outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=20, min_tokens=8,
                                                    stop_token_ids=[t]) for t in first])
    for o, t in zip(outputs, first):
        assert t not in o.token_ids[:8] and len(o.token_ids) >= 8


def test_penalties_survive_preemption(target_dir):
    """Seeded sampling with penalties: the same tokens with a pool that forces recomputation
    (the per-slot counts of a recomputed request are rebuilt) as without."""
    spec = speculative_config("ngram", None, None)
    prompts = workload(1) * 2
    params = [SamplingParams(temperature=0.8, seed=10 + i, max_tokens=40, ignore_eos=True,
                             repetition_penalty=1.2, frequency_penalty=0.4)
              for i in range(len(prompts))]
    free = [o.token_ids for o in engine(target_dir, spec).generate(prompts, params)]
    probe = engine(target_dir, spec)
    tight = engine(target_dir, spec, kv_cache_memory=probe.kv_plan.bytes_per_block * (
        1 + MAX_MODEL_LEN // BLOCK_SIZE + 6))
    assert [o.token_ids for o in tight.generate(prompts, params)] == free
    assert tight.scheduler.num_preemptions > 0


def test_a_bad_option_fails_its_request_only(target_dir):
    llm = engine(target_dir)
    prompts = workload()[:3]
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=4, ignore_eos=True),
                                     SamplingParams(max_tokens=4, logit_bias={VOCAB + 1: 1.0}),
                                     SamplingParams(max_tokens=4, allowed_token_ids=[10**9])])
    assert len(outputs[0].token_ids) == 4 and outputs[0].error is None
    assert outputs[1].finish_reason == "error" and "logit_bias" in outputs[1].error
    assert "allowed_token_ids" in outputs[2].error and str(10**9) in outputs[2].error
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(prompts[0], SamplingParams(stop_token_ids=[10**9]))


class _FlatRunner(ModelRunner):
    """The GPU path's runner (flat layout, captured steps run eagerly on their static buffers)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("flat_layout", True)
        super().__init__(*args, **kwargs)


def _recording(llm):
    """Record the processed logits of every step of ``llm`` (and whether its forward applied
    the penalties)."""
    steps = []
    real_process = llm.options.process

    def process(logits, batch, num_drafts=None, draft_token_ids=None, penalties=None,
                host_drafts=None, parent_ids=None):
        out = real_process(logits, batch, num_drafts, draft_token_ids, penalties, host_drafts,
                           parent_ids)
        steps.append((out.clone(), penalties is not None and penalties.applied))
        return out

    llm.options.process = process
    return steps


@pytest.mark.parametrize("method", [None, "ngram"])
def test_captured_steps_apply_penalties_with_the_same_bits(method, target_dir, monkeypatch):
    """On the GPU path the captured decode and verify forwards apply the penalties themselves
    (``ops.apply_penalties``); a request that also has a logit_bias keeps them after its bias.
    Every step's processed logits equal, bit for bit, those of the same engine whose captured
    steps leave the penalties to the eager pass after the forward; the captured steps did apply
    them, and seeded tokens equal the CPU path's."""
    spec = None if method is None else speculative_config(method, None, None)
    prompts = workload(2)
    # penalties that favour repeats, so that the n-gram proposer finds drafts
    kinds = [dict(repetition_penalty=0.6, frequency_penalty=-0.4, presence_penalty=0.3),
             dict(repetition_penalty=0.7, logit_bias={4: 1.5, 9: -2.0}),
             dict(frequency_penalty=-0.8, bad_words=["ab"], min_tokens=5, ignore_eos=False),
             dict()]
    params = [SamplingParams(**{"temperature": 0.9, "seed": 40 + i, "max_tokens": 30,
                                "ignore_eos": True, **kind})
              for i, kind in enumerate(kinds)]
    want = [o.token_ids for o in engine(target_dir, spec).generate(prompts, params)]
    runs = {}
    for in_graph in (False, True):
        with monkeypatch.context() as patch:
            patch.setattr(builder_module, "ModelRunner", _FlatRunner)
            if not in_graph:  # the same captured steps, without the penalties
                patch.setattr(SamplingOptions, "attach", lambda self, runner: None)
            llm = engine(target_dir, spec)
        assert llm.runner.graphs is not None
        assert (llm.runner.penalty_counts is not None) == in_graph
        steps = _recording(llm)
        runs[in_graph] = ([o.token_ids for o in llm.generate(prompts, params)], steps)
    (eager_tokens, eager_steps), (tokens, steps) = runs[False], runs[True]
    assert tokens == eager_tokens == want
    assert len(steps) == len(eager_steps)
    for (got, _), (expected, _) in zip(steps, eager_steps):
        assert torch.equal(got, expected)
    assert any(applied for _, applied in steps)
    assert not any(applied for _, applied in eager_steps)
    if spec is not None:
        assert llm.get_metrics()["spec_decoding"]["num_accepted_tokens"] > 0

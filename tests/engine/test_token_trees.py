"""Token-tree speculation through the engine (docs/design.md §16): a draft model drafts a static
tree per request, the target verifies it in one forward, ``tree_rejection_sample`` walks it.
The first two properties below are checked on both layouts: the CPU path and the GPU path's
flat layout (every runner built with ``flat_layout=True``: the torch twins, trees eagerly, the
chains' captured steps on their static buffers). One thread: these tiny models only wait on
more.

- greedy tree speculation emits exactly the plain greedy tokens of its layout (several shapes,
  the chain-shaped tree included, a batch with requests cut by ``max_tokens`` and
  ``max_model_len``);
- a seeded sampled request emits the same tokens alone and batched;
- with the target as its own draft every drafted path is accepted (the draft cache keeps the
  accepted path's K/V at the right rows, and q is the distribution the children came from);
- the first token of many seeded requests at temperature 1 follows the target's distribution
  (chi-square);
- the configurations trees do not support yet are refused (logits options run with trees:
  tests/engine/test_sampling_options.py, tests/engine/test_structured_outputs.py).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest
import torch

from tests.engine.test_preemption import save_draft, save_target
from tests.models.test_granite_hybrid import one_thread  # noqa: F401 (autouse fixture)
from tests.sample.stats import P_VALUE_THRESHOLD, chi_square_p_value, reference_probs
from verispec import LLM, SamplingParams
from verispec.engine import builder as builder_module
from verispec.proposers import draft_model as draft_model_module
from verispec.proposers import eagle as eagle_module
from verispec.runtime.flat_layout import TREE_GRAPH_MAX_BATCH
from verispec.runtime.model_runner import ModelRunner

VOCAB = 64
MAX_MODEL_LEN = 96

CHAIN = [(0,), (0, 0), (0, 0, 0)]
BINARY = [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 1, 0)]
MIXED = [(0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (0, 0, 1), (1, 0)]  # not breadth-first


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_target(tmp_path_factory, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save_draft(tmp_path_factory, MAX_MODEL_LEN)


def tree_config(draft_dir, tree, method="greedy"):
    return {"method": "draft_model", "model": draft_dir, "num_speculative_tokens":
            max(len(p) for p in tree), "speculative_token_tree": tree,
            "draft_sample_method": method}


def workload(temperature=None):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (7, 19, 4, 30, 12)]
    prompts.append(rng.integers(3, VOCAB, size=MAX_MODEL_LEN - 6).tolist())  # max_model_len
    params = [SamplingParams(max_tokens=m, ignore_eos=True, seed=50 + i,
                             temperature=(0.0 if i % 2 else 0.9) if temperature is None
                             else temperature)
              for i, m in enumerate((25, 2, 17, 30, 1, 40))]
    return prompts, params


class FlatRunner(ModelRunner):
    """The GPU path's runner (flat layout; on CPU the torch twins, captured steps run eagerly
    on their static buffers)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("flat_layout", True)
        super().__init__(*args, **kwargs)


@contextlib.contextmanager
def runners_on(layout: str):
    """Engines built inside put every runner (the target's, a draft model's, an EAGLE head's)
    on ``layout``: "cpu" (the CPU path) or "flat"."""
    if layout == "cpu":
        yield
        return
    with (mock.patch.object(builder_module, "ModelRunner", FlatRunner),
          mock.patch.object(draft_model_module, "ModelRunner", FlatRunner),
          mock.patch.object(eagle_module, "ModelRunner", FlatRunner)):
        yield


def generate(target_dir, spec, prompts, params, max_num_seqs=8, layout="cpu", adaptive=True):
    """``adaptive=False``: every step drafts the whole (cut) tree, whatever it pays."""
    with runners_on(layout):
        llm = LLM(target_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
                  speculative_config=spec)
    if llm.spec is not None:
        llm.spec.adaptive = adaptive
    assert llm.runner.flat == (layout == "flat")
    proposer_runner = None if llm.spec is None else llm.spec.proposer.runner
    assert proposer_runner is None or proposer_runner.flat == (layout == "flat")
    return llm, [o.token_ids for o in llm.generate(prompts, params)]


def plain_greedy_per_layout(target_dir) -> dict[str, list[list[int]]]:
    """Plain greedy tokens of the workload, per layout."""
    prompts, params = workload(temperature=0.0)
    return {layout: generate(target_dir, None, prompts, params, layout=layout)[1]
            for layout in ("cpu", "flat")}


@pytest.fixture(scope="module")
def plain_greedy(target_dir):
    return plain_greedy_per_layout(target_dir)


@pytest.mark.parametrize("layout", ["cpu", "flat"])
@pytest.mark.parametrize("tree", [CHAIN, BINARY, MIXED], ids=["chain", "binary", "mixed"])
@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_greedy_tree_equals_plain_greedy(target_dir, draft_dir, plain_greedy, tree, method,
                                         layout):
    prompts, params = workload(temperature=0.0)
    llm, tokens = generate(target_dir, tree_config(draft_dir, tree, method), prompts, params,
                           layout=layout)
    assert tokens == plain_greedy[layout]
    assert llm.spec.stats.num_drafts > 0


@pytest.mark.parametrize("max_num_seqs", [4, 16])
def test_tree_verify_replays_its_graph_up_to_its_batch(target_dir, draft_dir, plain_greedy,
                                                      max_num_seqs):
    """On the flat layout the tree verify replays the captured tree step (its static buffers,
    eagerly on the CPU) for batches up to ``TREE_GRAPH_MAX_BATCH`` and runs eagerly beyond;
    the tokens are the plain greedy ones either way."""
    prompts, params = workload(temperature=0.0)
    with runners_on("flat"):
        llm = LLM(target_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
                  speculative_config=tree_config(draft_dir, BINARY))
    runner = llm.runner
    name = runner.tree_graph_name(len(BINARY) + 1, 3)
    assert runner.tree_graph == (len(BINARY) + 1, 3) and runner.graphs.has(name)
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda step, rows: replays.append((step, len(rows["ids"]))) or run(
        step, rows)
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens == plain_greedy["flat"]
    tree_batches = [b for step, b in replays if step == name]
    assert tree_batches and max(tree_batches) <= TREE_GRAPH_MAX_BATCH
    if max_num_seqs > TREE_GRAPH_MAX_BATCH:  # 6 requests: all fit; a larger batch would not
        assert not runner.graphs.fits(name, TREE_GRAPH_MAX_BATCH + 1)


@pytest.mark.parametrize("layout", ["cpu", "flat"])
@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_sampled_alone_equals_batched(target_dir, draft_dir, method, layout):
    prompts, params = workload()
    spec = tree_config(draft_dir, BINARY, method)
    llm, batched = generate(target_dir, spec, prompts, params, layout=layout)
    alone = [[o.token_ids for o in llm.generate([p], q)][0] for p, q in zip(prompts, params)]
    assert alone == batched


@pytest.mark.parametrize("method, temperature", [("greedy", 0.0), ("probabilistic", 0.8)])
def test_self_draft_accepts_every_path(target_dir, method, temperature):
    """The target as its own draft: p == q at every node, so every step accepts its whole
    depth (depth k until max_tokens cuts it; the whole tree at every step: a draft as costly
    as the target would otherwise make the planner cut the trees)."""
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [3]]
    params = [SamplingParams(max_tokens=21, ignore_eos=True, seed=i, temperature=temperature)
              for i in range(3)]
    llm, _ = generate(target_dir, tree_config(target_dir, BINARY, method), prompts, params,
                      adaptive=False)
    stats = llm.spec.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.mean_acceptance_length > 3.5


@pytest.mark.slow
def test_first_token_distribution(target_dir, draft_dir):
    """Temperature 1, sampled drafts from a draft that disagrees with the target: the first
    token of 3000 seeded requests (each a tree of depth 2 over a 6-node shape) follows the
    target's softmax at the prompt."""
    from transformers import AutoModelForCausalLM

    prompt = [7, 21, 33, 5]
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(target_dir).eval()(
            torch.tensor([prompt])).logits[0, -1].double().numpy()
    tree = [(0,), (1,), (2,), (0, 0), (1, 0), (0, 1)]
    llm = LLM(target_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=32,
              speculative_config=tree_config(draft_dir, tree, "probabilistic"))
    n = 3000
    params = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=1000 + i)
              for i in range(n)]
    outputs = llm.generate([prompt] * n, params)
    counts = np.bincount([o.token_ids[0] for o in outputs], minlength=VOCAB)
    assert llm.spec.stats.num_drafts >= n
    assert chi_square_p_value(counts, reference_probs(logits)) > P_VALUE_THRESHOLD


def test_refusals(target_dir, draft_dir):
    spec = tree_config(draft_dir, BINARY)
    with pytest.raises(ValueError, match="tensor parallelism"):
        LLM(target_dir, max_model_len=MAX_MODEL_LEN, speculative_config=spec,
            tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_token_tree"):
        LLM(target_dir, max_model_len=MAX_MODEL_LEN, speculative_config={
            "method": "early_exit", "num_draft_layers": 1, "num_speculative_tokens": 3,
            "speculative_token_tree": BINARY})


def test_trees_that_do_not_pay_are_switched_off(target_dir, draft_dir, plain_greedy):
    """A random draft model's trees are nearly always rejected: the planner (``tree_costs``,
    the acceptance estimate) cuts them to no tree, a plain row, after a few steps and probes
    now and then, as it does for chains; the tokens stay the plain greedy ones. Without it
    every step drafts the tree."""
    prompts, params = workload(temperature=0.0)
    spec = tree_config(draft_dir, BINARY)
    llm, tokens = generate(target_dir, spec, prompts, params)
    full, tokens_full = generate(target_dir, spec, prompts, params, adaptive=False)
    assert tokens == tokens_full == plain_greedy["cpu"]
    assert full.spec.stats.num_accepted_tokens < full.spec.stats.num_draft_tokens / 4
    assert 0 < llm.spec.stats.num_drafts < full.spec.stats.num_drafts / 2

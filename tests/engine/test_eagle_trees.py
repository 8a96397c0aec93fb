"""Token trees drafted by EAGLE heads through the engine (docs/design.md §16): a static shape
(``speculative_token_tree``) or EAGLE-2's dynamic tree (``speculative_eagle_topk``,
``speculative_num_draft_tokens``), verified in one target forward.

Strategy: the tiny random target of the engine tests and random EAGLE-1 / EAGLE-3 heads
(reduced draft vocabulary for EAGLE-3), on the CPU path and, but for the statistical tests and
the refusals, on the GPU path's flat layout too (``test_token_trees.runners_on``).

- greedy tree speculation emits exactly the plain greedy tokens of its layout (both heads,
  static and dynamic, greedy and sampled drafting, requests cut by ``max_tokens`` and
  ``max_model_len``);
- a chain-shaped tree drafts and verifies what the chain does: with drafting never switched off,
  a static chain-shaped tree (sampled drafts) and a dynamic tree of one child per node (greedy
  drafts) emit the chain's tokens at every temperature and accept as many drafts. This pins the
  head's tree forward (positions by depth, the tree mask over its own cache) and the hidden
  states it reads after a step (the accepted path's), which a random head accepting little
  would not show through token equality with plain decoding alone;
- a seeded sampled request emits the same tokens alone and batched;
- at temperature 1 with sampled drafts, the first token and the second given the first follow
  the target's distribution (chi-square; slow), and verifying the dynamic tree's distinct
  children as i.i.d. ones fails that test;
- the combinations trees do not run with are refused, naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.test_preemption import save_target
from tests.engine.test_token_trees import (
    MAX_MODEL_LEN,
    VOCAB,
    generate,
    plain_greedy_per_layout,
    workload,
)
from tests.models.test_granite_hybrid import one_thread  # noqa: F401 (autouse fixture)
from tests.proposers.test_eagle_loader import eagle_checkpoint, write_checkpoint
from tests.sample.stats import P_VALUE_THRESHOLD, chi_square_p_value, record, reference_probs
from verispec import LLM, SamplingParams
from verispec.engine import draft_planner, spec_decode
from verispec.models import load_model

CHAIN = [(0,), (0, 0), (0, 0, 0)]
BINARY = [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 1, 0)]
STATIC = {"speculative_token_tree": BINARY}
DYNAMIC = {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 9}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_target(tmp_path_factory, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def heads(target_dir, tmp_path_factory):
    config = load_model(target_dir).config
    out = {}
    for method in ("eagle", "eagle3"):
        hf, state = eagle_checkpoint(method, config, seed=11,
                                     draft_vocab_size=40 if method == "eagle3" else None)
        out[method] = write_checkpoint(tmp_path_factory.mktemp(method), hf, state)
    return out


def spec(heads, method="eagle3", tree=None, draft="greedy", k=3):
    return {"method": method, "model": heads[method], "num_speculative_tokens": k,
            "draft_sample_method": draft, **(tree or {})}


@pytest.fixture(scope="module")
def plain_greedy(target_dir):
    return plain_greedy_per_layout(target_dir)


@pytest.mark.parametrize("layout", ["cpu", "flat"])
@pytest.mark.parametrize("method, tree, draft", [
    ("eagle", STATIC, "greedy"), ("eagle", DYNAMIC, "probabilistic"),
    ("eagle3", DYNAMIC, "greedy"), ("eagle3", STATIC, "probabilistic"),
], ids=["eagle-static", "eagle-dynamic-sampled", "eagle3-dynamic", "eagle3-static-sampled"])
def test_greedy_tree_equals_plain_greedy(target_dir, heads, plain_greedy, method, tree, draft,
                                         layout):
    prompts, params = workload(temperature=0.0)
    llm, tokens = generate(target_dir, spec(heads, method, tree, draft), prompts, params,
                           layout=layout)
    assert tokens == plain_greedy[layout]
    assert llm.spec.stats.num_drafts > 0


@pytest.mark.parametrize("method, tree, draft", [
    ("eagle3", {"speculative_token_tree": CHAIN}, "probabilistic"),
    ("eagle", {"speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}, "greedy"),
], ids=["eagle3-static-chain-sampled", "eagle-dynamic-topk1-greedy"])
@pytest.mark.parametrize("layout", ["cpu", "flat"])
def test_chain_shaped_tree_equals_chain(target_dir, heads, monkeypatch, method, tree, draft,
                                        layout):
    """Sampled drafts of a static chain use the chain's draws (rank 0 at each depth); greedy
    drafts use no draws. So, k drafts every step, both emit the chain's tokens."""
    monkeypatch.setattr(draft_planner, "best_num_drafts", lambda alpha, n, costs: n)
    prompts, params = workload()
    chain_llm, chain = generate(target_dir, spec(heads, method, None, draft), prompts, params,
                                layout=layout)
    tree_llm, tokens = generate(target_dir, spec(heads, method, tree, draft), prompts, params,
                                layout=layout)
    assert tokens == chain
    assert tree_llm.spec.stats.num_accepted_tokens == chain_llm.spec.stats.num_accepted_tokens
    assert chain_llm.spec.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("layout", ["cpu", "flat"])
@pytest.mark.parametrize("tree, draft", [(STATIC, "probabilistic"), (DYNAMIC, "probabilistic")],
                         ids=["static-sampled", "dynamic-sampled"])
def test_sampled_alone_equals_batched(target_dir, heads, tree, draft, layout):
    prompts, params = workload()
    llm, batched = generate(target_dir, spec(heads, "eagle3", tree, draft), prompts, params,
                            layout=layout)
    alone = [[o.token_ids for o in llm.generate([p], q)][0] for p, q in zip(prompts, params)]
    assert alone == batched


def first_two_tokens_p_values(target_dir, heads, tree) -> list[float]:
    """Temperature 1, drafts sampled from the EAGLE-3 head's tree: chi-square p-values of the
    first token of 3000 seeded requests against the target's softmax at the prompt, and of
    the second, among the requests whose first token was the commonest, against its softmax
    after that token."""
    from transformers import AutoModelForCausalLM

    prompt = [7, 21, 33, 5]
    n = 3000
    llm = LLM(target_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
              speculative_config=spec(heads, "eagle3", tree, "probabilistic", k=2))
    params = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=1000 + i)
              for i in range(n)]
    outputs = [o.token_ids for o in llm.generate([prompt] * n, params)]
    assert llm.spec.stats.num_drafts >= n
    assert llm.spec.stats.num_accepted_tokens > 0
    first = np.array([o[0] for o in outputs])
    common = int(np.bincount(first, minlength=VOCAB).argmax())
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    values = []
    with torch.no_grad():
        for context, emitted in ((prompt, first),
                                 (prompt + [common], [o[1] for o in outputs if o[0] == common])):
            logits = model(torch.tensor([context])).logits[0, -1].double().numpy()
            counts = np.bincount(emitted, minlength=VOCAB)
            assert counts.sum() >= 200
            values.append(chi_square_p_value(counts, reference_probs(logits)))
    return values


DISTRIBUTION_TREES = {
    "static": {"speculative_token_tree": [(0,), (1,), (2,), (0, 0), (1, 0), (0, 1)]},
    "dynamic": {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 7},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DISTRIBUTION_TREES))
def test_first_tokens_distribution(target_dir, heads, name):
    values = first_two_tokens_p_values(target_dir, heads, DISTRIBUTION_TREES[name])
    record(f"eagle3 {name} tree, first two tokens", 3000, values)
    assert min(values) > P_VALUE_THRESHOLD


@pytest.mark.slow
def test_distinct_children_verified_as_iid_fails(target_dir, heads, monkeypatch):
    """The test of the test: the dynamic tree's distinct children verified with the i.i.d.
    rule (q not updated after a rejected sibling) must fail it."""
    verify = spec_decode.ops_tree_rejection.tree_rejection_sample

    def as_iid(*args, **kwargs):
        return verify(*args, **dict(kwargs, without_replacement=False))

    monkeypatch.setattr(spec_decode.ops_tree_rejection, "tree_rejection_sample", as_iid)
    values = first_two_tokens_p_values(target_dir, heads, DISTRIBUTION_TREES["dynamic"])
    record("eagle3 dynamic tree, distinct children as i.i.d. (must fail)", 3000, values)
    assert min(values) < P_VALUE_THRESHOLD


def test_refusals(target_dir, heads):
    with pytest.raises(ValueError, match="speculative_eagle_topk"):
        LLM(target_dir, max_model_len=MAX_MODEL_LEN,
            speculative_config=spec(heads, tree=DYNAMIC), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_eagle_topk"):  # a draft model
        LLM(target_dir, max_model_len=MAX_MODEL_LEN, speculative_config={
            "method": "draft_model", "model": target_dir, **DYNAMIC})
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        LLM(target_dir, max_model_len=MAX_MODEL_LEN, speculative_config=spec(
            heads, tree={"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 40}))
    with pytest.raises(ValueError, match="exclude each other"):
        LLM(target_dir, max_model_len=MAX_MODEL_LEN, speculative_config=spec(
            heads, tree={**STATIC, **DYNAMIC}))

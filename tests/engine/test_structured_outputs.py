"""Structured output through the whole engine (docs/design.md §15).

Strategy: a tiny random Llama with the bundled model's tokenizer (vocabulary 49152), so the
grammar engine sees a real vocabulary while the model is fast.
- The output follows the request: JSON that parses and validates against the schema, a string
  the regex matches in full, one of the choices, a sentence of the grammar.
- Greedy speculation with a grammar (n-gram; a draft model with probabilistic and with greedy
  drafts; random EAGLE-1 and EAGLE-3 heads, the EAGLE-3 one over a draft vocabulary of its own)
  emits exactly the plain greedy tokens: verify row i is masked by the matcher advanced along
  d_1..d_i, so it is the row a plain step uses, and the matcher rolls back to what was accepted.
  Every draft an EAGLE head proposes is one the grammar allows, read from the proposer's own
  proposals (unless the grammar allows no token of the head's vocabulary there).
- Grammar-aware drafting raises the acceptance rate on JSON-schema output (the random one-layer
  draft model and the random heads, chains and trees: next to none accepted without it, most
  with it; n-gram: fewer drafts refused) and keeps greedy speculation equal to plain greedy
  with it and without it.
- Greedy tree speculation with a grammar (a draft model's static tree, the target drafting its
  own, EAGLE-1 / EAGLE-3 heads' static and dynamic trees) emits the plain greedy tokens: a
  node's row is masked by the matcher advanced along its path; every node is drafted inside
  the grammar (read from the proposer's trees), and the self-drafting target accepts whole
  paths.
- A grammar the engine cannot compile is a ValueError naming the field, and fails its own
  request only in a batch.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.engine.test_eagle_trees import DYNAMIC
from tests.engine.test_token_trees import BINARY
from tests.models.utils import copy_bundled_tokenizer, requires_bundled, save_tiny_model
from tests.proposers.test_eagle_loader import eagle_checkpoint, write_checkpoint
from verispec import LLM, SamplingParams, StructuredOutputsParams
from verispec.engine import intake

jsonschema = pytest.importorskip("jsonschema")  # a test extra (pyproject): skip where absent
pytestmark = requires_bundled

MAX_MODEL_LEN = 256
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "count"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"type": "string", "maxLength": 5}}}}
REGEX = r"[0-9]{3}-(red|green|blue)"
CHOICES = ["alpha", "beta", "gamma delta"]
GBNF = 'root ::= "(" item ("," item)? ")"\nitem ::= "x" | "yy" | "z"'
CASES = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GBNF),
}
PROMPTS = ['{"answer": "yes", "count": 12} {"answer": "yes", "count": 12} {"answer":',
           "123-red 456-blue 123-red 456-", "alpha beta gamma delta alpha beta", "(x,yy) (x,"]


def check(name: str, text: str) -> None:
    if name == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    elif name == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\((x|yy|z)(,(x|yy|z))?\)", text), text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_grammar")
    save_tiny_model(path, "LlamaForCausalLM", vocab_size=49152,
                    max_position_embeddings=MAX_MODEL_LEN)
    copy_bundled_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_grammar_draft")
    save_tiny_model(path, "LlamaForCausalLM", vocab_size=49152, num_hidden_layers=1,
                    max_position_embeddings=MAX_MODEL_LEN)
    copy_bundled_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def eagle_dirs(model_dir, plain_tokens, tmp_path_factory) -> dict[str, str]:
    """Random heads on the target: EAGLE-1, and EAGLE-3 over 2048 of the 49152 tokens, every
    token of the plain outputs among them (else the grammar's tokens are often outside the
    head's vocabulary, and the head drafts unmasked)."""
    with open(f"{model_dir}/config.json") as f:
        hf = json.load(f)
    target = SimpleNamespace(hidden_size=hf["hidden_size"], vocab_size=hf["vocab_size"])
    dirs = {}
    for method in ("eagle", "eagle3"):
        vocab = 2048 if method == "eagle3" else None
        config, state = eagle_checkpoint(method, target, seed=5, draft_vocab_size=vocab,
                                         aux_layer_ids=(0, 1, 1) if vocab else None)
        if vocab:
            used = sorted({t for outputs in plain_tokens.values() for o in outputs for t in o})
            rest = np.setdiff1d(np.random.default_rng(0).permutation(hf["vocab_size"]), used)
            ids = torch.from_numpy(np.sort(np.concatenate([used, rest[:vocab - len(used)]])))
            state["d2t"] = ids - torch.arange(vocab)
            state["t2d"] = torch.zeros(hf["vocab_size"], dtype=torch.bool)
            state["t2d"][ids] = True
        dirs[method] = write_checkpoint(tmp_path_factory.mktemp(method), config, state)
    return dirs


def engine(model_dir, spec=None):
    return LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
               speculative_config=spec)


def params(name, **kwargs):
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 60, "seed": 1,
                             "structured_outputs": CASES[name], **kwargs})


@pytest.fixture(scope="module")
def plain_tokens(model_dir):
    llm = engine(model_dir)
    result = {}
    for name in CASES:
        outputs = llm.generate(PROMPTS, params(name))
        for o in outputs:
            assert o.finish_reason == "stop", (name, o.text)
            check(name, o.text)
        result[name] = [o.token_ids for o in outputs]
    return result


def test_outputs_follow_the_grammar_when_sampled(model_dir):
    llm = engine(model_dir)
    for name in CASES:
        outputs = llm.generate(PROMPTS, params(name, temperature=1.0, n=2))
        for o in outputs:
            for sample in o.outputs:
                assert sample.finish_reason == "stop", (name, sample.text)
                check(name, sample.text)


def spec_config(method: str, draft_dir: str, eagle_dirs: dict[str, str]) -> dict:
    """``method``, ``_greedy`` appended for greedy drafts (model-based proposers)."""
    name = method.removesuffix("_greedy")
    spec = {"method": name, "num_speculative_tokens": 3}
    if name == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    else:
        spec.update(model=eagle_dirs.get(name, draft_dir),
                    draft_sample_method="greedy" if "greedy" in method else "probabilistic")
    return spec


def engine_for(model_dir, spec: dict) -> LLM:
    llm = engine(model_dir, spec)
    if spec["method"] != "ngram":  # the tiny draft costs about what the target does: draft anyway
        llm.spec.costs = tuple(1.0 + 1e-3 * n for n in range(len(llm.spec.costs)))
        if llm.spec.tree is not None:  # and trees too (a verify of 9 tokens costs ~2 here)
            llm.spec.tree_costs = tuple(1.0 + 1e-3 * d for d in range(len(llm.spec.tree_costs)))
    return llm


def check_drafts_in_grammar(proposer, eos_token_ids) -> dict[str, int]:
    """Wrap ``proposer.propose``: every draft of a request with a grammar must be one its
    matcher (at the committed output, after the walk rolled back) accepts after the drafts
    before it, unless a draft before it ended the output (EOS: what follows is never
    verified) or the grammar allows no token of the head's vocabulary there (the head then
    drafts unmasked; verification rejects the draft). Returns the counts of drafts the grammar
    accepts and of refused ones, filled as it runs."""
    propose, seen = proposer.propose, {"drafts": 0, "refused": 0}
    head_ids = getattr(proposer, "draft_to_target_np", None)

    def checked(requests):
        proposal = propose(requests)
        cu = proposal.cu_num_draft_tokens.tolist()
        ids = proposal.draft_token_ids.tolist()
        for r, request in enumerate(requests):
            drafts, grammar = ids[cu[r]:cu[r + 1]], request.grammar
            if grammar is None or not drafts:
                continue
            num_valid = grammar.num_valid(drafts)
            seen["drafts"] += num_valid
            if num_valid < len(drafts) and drafts[num_valid - 1] not in eos_token_ids:
                seen["refused"] += 1  # nothing of the head's vocabulary is allowed there
                mask = grammar.masks(drafts[:num_valid])[-1]
                tokens = np.arange(grammar.vocab_size) if head_ids is None else head_ids
                assert not ((mask[tokens >> 5] >> (tokens & 31)) & 1).any(), (
                    drafts, num_valid)
        return proposal

    proposer.propose = checked
    return seen


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_model_greedy", "eagle_greedy",
                                    "eagle3", "eagle3_greedy"])
def test_greedy_speculation_with_a_grammar_equals_plain(method, model_dir, draft_dir,
                                                       eagle_dirs, plain_tokens):
    llm = engine_for(model_dir, spec_config(method, draft_dir, eagle_dirs))
    seen = (check_drafts_in_grammar(llm.spec.proposer, llm.eos_token_ids) if "eagle" in method
            else None)
    for name in CASES:
        outputs = llm.generate(PROMPTS, params(name))
        assert [o.token_ids for o in outputs] == plain_tokens[name], name
    metrics = llm.get_metrics()["spec_decoding"]
    assert metrics["num_drafts"] > 0
    if method == "ngram":  # the random draft model's drafts (and the grammar) reject nearly all
        assert metrics["num_accepted_tokens"] > 0
    if seen is not None:
        print(method, seen)
        assert seen["drafts"] > 0


def test_masks_on_several_threads_give_the_same_tokens(model_dir, draft_dir, eagle_dirs,
                                                       plain_tokens, monkeypatch):
    """A GPU engine computes a batch's masks on several threads, its requests spread over
    several compilations of their grammar (``GrammarCompiler``): the same tokens."""
    monkeypatch.setattr(intake, "mask_threads", lambda device_type: 3)
    llm = engine_for(model_dir, spec_config("draft_model", draft_dir, eagle_dirs))
    for name in CASES:
        outputs = llm.generate(PROMPTS, params(name))
        assert [o.token_ids for o in outputs] == plain_tokens[name], name
    compiler = llm._grammars()
    assert compiler.threads == 3 and compiler.executor is not None
    assert max(len(lanes) for lanes, _ in compiler._compiled.values()) == min(3, len(PROMPTS))


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3",
                                    "draft_model-static", "eagle3-dynamic"])
def test_grammar_aware_drafting_raises_acceptance(method, model_dir, draft_dir, eagle_dirs,
                                                  plain_tokens):
    spec = (tree_spec_config(method, model_dir, draft_dir, eagle_dirs) if "-" in method
            else spec_config(method, draft_dir, eagle_dirs))
    rates = {}
    for aware in (False, True):
        llm = engine_for(model_dir, spec)
        llm.spec.proposer.grammar_aware = aware
        outputs = llm.generate(PROMPTS, params("json"))
        assert [o.token_ids for o in outputs] == plain_tokens["json"], aware
        metrics = llm.get_metrics()["spec_decoding"]
        rates[aware] = metrics["num_accepted_tokens"] / metrics["num_draft_tokens"]
    print(f"{method}: draft acceptance rate without / with grammar-aware drafting "
          f"{rates[False]:.3f} / {rates[True]:.3f}")
    assert rates[True] > rates[False] + 0.2, rates


def tree_spec_config(name: str, model_dir: str, draft_dir: str,
                     eagle_dirs: dict[str, str]) -> dict:
    """``proposer-shape``, ``_greedy`` appended for greedy drafts; ``self_draft``: the target
    drafts for itself (under the grammar it drafts what it emits: every path is accepted)."""
    proposer, shape = name.removesuffix("_greedy").split("-")
    spec = {"method": "draft_model" if proposer == "self_draft" else proposer,
            "model": {"self_draft": model_dir, "draft_model": draft_dir}.get(
                proposer, eagle_dirs.get(proposer)),
            "num_speculative_tokens": 3,
            "draft_sample_method": "greedy" if "greedy" in name else "probabilistic"}
    return {**spec, **({"speculative_token_tree": BINARY} if shape == "static" else DYNAMIC)}


def check_tree_drafts_in_grammar(proposer) -> dict[str, int]:
    """Wrap ``proposer.propose_tree``: every node of a request with a grammar must be one its
    matcher allows after the node's parent's path, unless the grammar allows no token of the
    head's vocabulary there (the head then drafts unmasked; the node and its subtree are
    rejected). Returns the counts of nodes inside the grammar and of such refused ones."""
    propose_tree, seen = proposer.propose_tree, {"drafts": 0, "refused": 0}
    head_ids = getattr(proposer, "draft_to_target_np", None)

    def checked(requests, shape, depths):
        proposal = propose_tree(requests, shape, depths)
        ids, start = proposal.draft_token_ids.tolist(), 0
        for request, n in zip(requests, proposal.num_draft_tokens.tolist()):
            drafts = ids[start:start + n]
            parents = proposal.parent_ids[start:start + n].tolist()
            start += n
            if request.grammar is None or not n:
                continue
            masks, outside = request.grammar.masks(drafts, parents), set()
            for i, (token, parent) in enumerate(zip(drafts, parents)):
                if parent in outside:
                    outside.add(i)
                    continue
                mask = masks[parent + 1]
                if (mask[token >> 5] >> (token & 31)) & 1:
                    seen["drafts"] += 1
                    continue
                seen["refused"] += 1
                outside.add(i)
                tokens = np.arange(request.grammar.vocab_size) if head_ids is None else head_ids
                assert not ((mask[tokens >> 5] >> (tokens & 31)) & 1).any(), (drafts, parents)
        return proposal

    proposer.propose_tree = checked
    return seen


@pytest.mark.parametrize("name", ["draft_model-static", "self_draft-static_greedy",
                                  "eagle-dynamic_greedy", "eagle3-static", "eagle3-dynamic"])
def test_greedy_tree_speculation_with_a_grammar_equals_plain(name, model_dir, draft_dir,
                                                            eagle_dirs, plain_tokens):
    """Token trees (docs/design.md §16): a node's row is masked by the matcher advanced along
    its path, and the proposers draft each node's children under the mask of its path."""
    llm = engine_for(model_dir, tree_spec_config(name, model_dir, draft_dir, eagle_dirs))
    seen = check_tree_drafts_in_grammar(llm.spec.proposer)
    for case in CASES:
        outputs = llm.generate(PROMPTS, params(case))
        assert [o.token_ids for o in outputs] == plain_tokens[case], case
    stats = llm.spec.stats
    print(name, seen, stats.num_draft_tokens, stats.num_accepted_tokens)
    assert stats.num_drafts > 0 and seen["drafts"] > 0
    if name.startswith("self_draft"):  # drafts what it emits: whole paths accepted
        assert stats.mean_acceptance_length > 3.0


def test_bad_grammars_name_the_field(model_dir):
    llm = engine(model_dir)
    bad = {"json": {"type": "nonsense"}, "regex": "a(b", "grammar": 'root ::= "a'}
    outputs = llm.generate(["hi"] * 4, [params("choice")] + [
        SamplingParams(structured_outputs={name: value}) for name, value in bad.items()])
    assert outputs[0].text in CHOICES
    for o, name in zip(outputs[1:], bad):
        assert o.finish_reason == "error" and f"structured_outputs.{name}" in o.error, o.error
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})

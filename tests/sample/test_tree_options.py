"""Sampling options and structured output over token trees (docs/design.md §15, §16).

Strategy: the row of node u of a tree must be the row one-token-at-a-time decoding uses after
the drafts on the path from the root to u.

- Bit for bit: for random trees (a batch of requests, sizes 0 to 12, one chain-shaped) and every
  option set of tests/sample/test_options.py plus a branching regex grammar, each row
  ``SamplingOptions.process`` builds from the parents equals the last row of the chain case
  built for the node's path alone, and the row of a plain step after committing that path
  (for the grammar: where the path stays inside it); the matchers end where the committed
  output put them.
- Statistically: many independently seeded copies of one request draft a fixed tree through the
  real tree draft sampler (``sample_children``: i.i.d. from a peaked q, so siblings repeat each
  other and paths repeat the output; without replacement; greedy top-m), the rows are processed
  with the tree's parents and walked by the real ``tree_rejection_sample``. The token emitted
  right after slot s, given the accepted path's tokens, must follow the one-token-at-a-time
  distribution of s's target row after prompt + output + path: an independent float64
  reference (``reference_option_logits``; for the grammar, the row masked by a fresh matcher
  that consumed output + path). Every (slot, path) group with enough samples gets a chi-square
  test (p >= 1e-6), and a token of probability 0 must never appear. Drafts are not guided by
  the grammar (many leave it and are rejected), except in the guided case, where each node's
  children are drawn from the proposer's row masked along its path (the proposers'
  ``TreeGrammarMasks``). Rows processed as if the nodes were a chain (the bug of reading node
  order as depth) must fail the same test.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from tests.sample.stats import P_VALUE_THRESHOLD, chi_square_p_value, record, reference_probs
from tests.sample.test_grammar_exactness import COMPILER, REGEX, allowed
from tests.sample.test_options import OPTION_SETS, V, logits_rows, make_request, reference
from verispec.ops.tree import sample_children
from verispec.ops.tree_rejection import tree_rejection_sample
from verispec.proposers.grammar_walk import TreeGrammarMasks
from verispec.sample.options import SamplingOptions
from verispec.sampling_params import StructuredOutputsParams

EOS = 0
PROMPT = [2, 5, 9]
GRAMMAR = dict(structured_outputs=StructuredOutputsParams(regex=REGEX))  # [a-f]{1,3}(x|yz)e*
TREE_OPTION_SETS = {**OPTION_SETS, "grammar": GRAMMAR,
                    "grammar_and_penalties": dict(GRAMMAR, repetition_penalty=1.4,
                                                  frequency_penalty=0.6, min_tokens=4)}
# letters, "ab", "x", "y", "z", "yz", EOS: inside the grammar at some nodes, outside at others
GRAMMAR_TOKENS = [1, 2, 3, 5, 27, 24, 25, 26, 28, EOS]


def grammars(kwargs: dict):
    return (lambda: COMPILER) if "structured_outputs" in kwargs else None


def path_to(parents: list[int], slot: int) -> list[int]:
    """The nodes from the root to slot ``slot`` (the root 0, node i at i + 1), root first."""
    path = []
    while slot > 0:
        path.append(slot - 1)
        slot = parents[slot - 1] + 1
    return path[::-1]


def inside_grammar(tokens: list[int]) -> bool:
    return COMPILER.matcher(GRAMMAR["structured_outputs"]).num_valid(tokens) == len(tokens)


def random_trees(rng: np.random.Generator, tokens: list[int],
                 outputs: list[list[int]] | None = None) -> list[tuple[list, list]]:
    """(drafts, parents) per request: random trees of 7, 0, 12 and 9 nodes, and a chain of 4.
    ``outputs``: under the grammar, a node below a path inside it is drawn from the tokens
    the grammar allows there with probability 0.7 (so that paths go deep inside it)."""
    trees = []
    for b, n in enumerate((7, 0, 12, 9, 4)):
        parents = [int(rng.integers(-1, i)) for i in range(n)] if b < 4 else list(range(-1, 3))
        drafts = []
        for i in range(n):
            choice = tokens
            if outputs is not None and rng.random() < 0.7:
                context = outputs[b] + [drafts[j] for j in path_to(parents, parents[i] + 1)]
                if inside_grammar(context):
                    choice = [t for t in tokens if allowed(context)[t]] or tokens
            drafts.append(int(rng.choice(choice)))
        trees.append((drafts, parents))
    return trees


@pytest.mark.parametrize("name", list(TREE_OPTION_SETS))
def test_tree_rows_equal_their_paths_as_chains(name):
    kwargs = TREE_OPTION_SETS[name]
    compiler = grammars(kwargs)
    rng = np.random.default_rng(sorted(TREE_OPTION_SETS).index(name))
    if compiler is None:  # repeats of the output and of each other; bad words completed
        trees = random_trees(rng, [1, 2, 3, 5])
        outputs = [[1], [], [2, 3], [2, 3, 2, 1, 2], [3]]  # min_tokens crossed in the tree
    else:
        outputs = [[1], [1, 2], [], [2, 3], [1]]
        trees = random_trees(rng, GRAMMAR_TOKENS, outputs)
    batch = [make_request(b, b, PROMPT, outputs[b], compiler, **kwargs) for b in range(5)]
    num_drafts = np.array([len(d) for d, _ in trees])
    drafts = torch.tensor([t for d, _ in trees for t in d], dtype=torch.int64)
    parent_ids = np.array([p for _, parents in trees for p in parents], dtype=np.int64)
    logits = logits_rows(int(num_drafts.sum()) + len(batch), seed=5)
    got = SamplingOptions(8, V, torch.device("cpu")).process(logits, batch, num_drafts, drafts,
                                                             parent_ids=parent_ids)
    row, compared_plain, refused = 0, 0, 0
    for b, (tree_drafts, parents) in enumerate(trees):
        for slot in range(len(tree_drafts) + 1):
            path = [tree_drafts[i] for i in path_to(parents, slot)]
            # the chain of the path alone, in a fresh engine state: its last row
            chain = make_request(100 + b, b, PROMPT, outputs[b], compiler, **kwargs)
            rows = logits[row:row + 1].expand(len(path) + 1, -1).contiguous()
            want = SamplingOptions(8, V, torch.device("cpu")).process(
                rows, [chain], np.array([len(path)]), torch.tensor(path, dtype=torch.int64))
            assert torch.equal(got[row], want[-1]), (b, slot, path)
            # a plain step after committing the path (for the grammar: a path inside it)
            if compiler is None or chain.options.grammar.num_valid(path) == len(path):
                one = make_request(100 + b, b, PROMPT, outputs[b] + path, compiler, **kwargs)
                plain = SamplingOptions(8, V, torch.device("cpu")).process(
                    logits[row:row + 1], [one])
                assert torch.equal(got[row], plain[0]), (b, slot, path)
                compared_plain += len(path) >= 2
            else:
                refused += 1
                if compiler is None:
                    np.testing.assert_allclose(got[row].numpy(),
                                               reference(logits[row].numpy(), one),
                                               rtol=1e-6, atol=1e-5)
            row += 1
    assert row == logits.shape[0]
    assert compared_plain >= 10 and (compiler is None or refused >= 5), (compared_plain, refused)
    for b, r in enumerate(batch):  # every drafted node rolled back
        if compiler is not None:
            fresh = make_request(200 + b, b, PROMPT, outputs[b], compiler, **kwargs)
            fresh.options.grammar.sync(fresh.output_token_ids)
            assert np.array_equal(r.options.grammar.masks([]), fresh.options.grammar.masks([]))


def test_a_refused_node_repeats_its_parents_mask():
    """Below a node the grammar refuses, every row repeats the mask of the parent's row."""
    r = make_request(1, 0, PROMPT, [1], lambda: COMPILER, **GRAMMAR)
    grammar = r.options.grammar
    grammar.sync(r.output_token_ids)
    # "a" then: "z" (refused), its child "b"; "b", its children "x", "yz" and "z" (refused)
    drafts, parents = [26, 2, 2, 24, 28, 26], [-1, 0, -1, 2, 2, 2]
    masks = grammar.masks(drafts, parents)
    assert np.array_equal(masks[1], masks[0]) and np.array_equal(masks[2], masks[0])
    assert np.array_equal(masks[6], masks[3])
    for slot, prefix in ((3, [2]), (4, [2, 24]), (5, [2, 28])):
        bits = masks[slot]
        assert [v for v in range(V) if (bits[v >> 5] >> (v & 31)) & 1] == np.flatnonzero(
            allowed([1] + prefix)).tolist(), slot
    assert np.array_equal(grammar.masks([]), grammar.masks([], [])[:1])


# ----------------------------------------------------------------- statistics

NUM_REQUESTS = 40_000
CHUNK = 10_000
MIN_GROUP = 100
POSITION = 40
# widths 2, 2, 1, 2, 1 over depth 3 (slots: the root 0, node i at i + 1)
SHAPE = [-1, -1, 0, 0, 1, 2, 2, 4]
OUTPUT = [5, 9, 9]  # "eii"
GRAMMAR_OUTPUT = [1]  # "a"
STAT_CASES = {
    # q peaked on tokens of the output: i.i.d. siblings repeat each other, paths repeat tokens
    "penalties_iid": (dict(repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.5),
                      "iid"),
    "penalties_onehot": (dict(repetition_penalty=0.7, frequency_penalty=-0.5), "onehot"),
    # min_tokens: EOS masked at depths 0 and 1 only; "ie" and "eeb" depend on the path's tail
    "all_wor": (dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                     logit_bias={9: 1.0}, bad_words=["ie", "eeb"], min_tokens=5,
                     allowed_token_ids=list(range(0, 15))), "wor"),
    "grammar_wor": (GRAMMAR, "wor"),
    "grammar_iid": (GRAMMAR, "iid"),
    # grammar-aware drafting: a node's children drawn from the proposer's row masked by the
    # matcher along the node's path (proposers.grammar_walk.TreeGrammarMasks), q masked too
    "grammar_guided_wor": (GRAMMAR, "wor"),
}
FAVOURED = {"options": (EOS, 2, 5, 9), "grammar": (EOS, 2, 3, 24, 25, 26, 27, 28, 5)}


def stat_logits(name: str) -> tuple[np.ndarray, np.ndarray]:
    """[n + 1, V] target rows and proposer rows, one per slot."""
    rng = np.random.default_rng(sorted(STAT_CASES).index(name) + 11)
    favoured = list(FAVOURED["grammar" if name.startswith("grammar") else "options"])
    target = rng.normal(size=(len(SHAPE) + 1, V)) * 1.5
    target[:, favoured] += 1.5
    draft = target + rng.normal(size=target.shape) * 0.6
    draft[:, favoured] += 2.0
    return target, draft


def stat_request(name: str):
    kwargs, _ = STAT_CASES[name]
    compiler = grammars(kwargs)
    output = OUTPUT if compiler is None else GRAMMAR_OUTPUT
    return make_request(1, 0, PROMPT, output, compiler, **kwargs)


def run(name: str, num_requests: int, as_chain: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(token_ids [N, depth + 1], accepted_nodes [N, depth]) of ``num_requests`` seeded copies
    of the case's request. ``as_chain``: rows processed as if node i followed nodes 0..i - 1."""
    _, rule = STAT_CASES[name]
    request = stat_request(name)
    target, draft = (torch.tensor(x, dtype=torch.float32) for x in stat_logits(name))
    n = len(SHAPE)
    children = defaultdict(list)
    depths = [0]
    for i, parent in enumerate(SHAPE):
        children[parent + 1].append(i)
        depths.append(depths[parent + 1] + 1)
    options = SamplingOptions(1, V, torch.device("cpu"))
    guided = TreeGrammarMasks([request.options.grammar]) if "guided" in name else None
    if guided:
        request.options.grammar.sync(request.output_token_ids)
    tokens_out, nodes_out = [], []
    for start in range(0, num_requests, CHUNK):
        batch = min(CHUNK, num_requests - start)
        seeds = torch.arange(start, start + batch, dtype=torch.int64) * 7919 + 5
        positions = torch.full((batch,), POSITION, dtype=torch.int64)
        tokens = torch.full((batch, n), -1, dtype=torch.int64)
        q_nodes = torch.zeros(batch, n, V)
        for slot, kids in children.items():  # a slot's path is drawn before its children
            logits = draft[slot].expand(batch, -1)
            if guided:
                logits = guided.apply(logits[:, None], np.zeros(batch, dtype=np.int64),
                                      tokens.numpy(), np.broadcast_to(SHAPE, (batch, n)),
                                      np.full((batch, 1), slot))[:, 0]
            ids, q = sample_children(
                logits,
                torch.full((batch,), 0.0 if rule == "onehot" else 1.0), seeds,
                positions + depths[slot], len(kids), rule == "wor")
            tokens[:, kids] = ids
            q_nodes[:, kids] = q[:, None, :]
        # as the proposers do: a node past q's support (-1) is left out with its subtree
        kept = np.zeros((batch, n), dtype=bool)
        for i, parent in enumerate(SHAPE):
            kept[:, i] = (tokens[:, i] >= 0).numpy() & (parent < 0 or kept[:, parent])
        assert guided or kept.all()
        renumber = np.cumsum(kept, 1) - 1
        parents = np.where(np.array(SHAPE) < 0, -1, renumber[:, np.maximum(SHAPE, 0)])
        rows_b, nodes_b = np.nonzero(kept)  # the kept nodes, request by request
        num_drafts = kept.sum(1)
        cu = np.concatenate([[0], np.cumsum(num_drafts)])
        slots = np.insert(nodes_b + 1, cu[:-1], 0)  # each request: the root, its kept nodes
        drafts = tokens[torch.from_numpy(rows_b), torch.from_numpy(nodes_b)]
        parent_ids = parents[rows_b, nodes_b]
        logits = options.process(target[torch.from_numpy(slots)], [request] * batch, num_drafts,
                                 drafts, parent_ids=None if as_chain else parent_ids)
        out, nodes = tree_rejection_sample(
            logits, drafts, torch.from_numpy(parent_ids), torch.from_numpy(cu),
            None if rule == "onehot" else q_nodes[torch.from_numpy(rows_b),
                                                  torch.from_numpy(nodes_b)],
            torch.ones(batch), None, None, None, seeds, positions, n, max(depths), 2,
            without_replacement=rule == "wor", check=start == 0)
        nodes = nodes.numpy()  # back to the shape's node indices
        shape_nodes = np.full((batch, n), -1)
        shape_nodes[rows_b, np.arange(rows_b.size) - cu[rows_b]] = nodes_b
        tokens_out.append(out.numpy())
        nodes_out.append(np.where(nodes >= 0, shape_nodes[np.arange(batch)[:, None],
                                                          np.maximum(nodes, 0)], -1))
    return np.concatenate(tokens_out), np.concatenate(nodes_out)


def stat_reference(name: str, slot: int, path: tuple[int, ...]) -> np.ndarray:
    """p of the token after slot ``slot`` reached by ``path``, one token at a time."""
    target, _ = stat_logits(name)
    request = stat_request(name)
    if request.options.grammar is not None:
        if not inside_grammar(GRAMMAR_OUTPUT + list(path)):  # never accepted: nothing follows
            return np.zeros(V)
        return reference_probs(np.where(allowed(GRAMMAR_OUTPUT + list(path)), target[slot],
                                        -np.inf))
    return reference_probs(reference(target[slot], request, path))


def group_p_values(name: str, out: np.ndarray, nodes: np.ndarray) -> dict:
    """(slot, path) -> (samples, p-value) of the token emitted right after the slot, for every
    group with ``MIN_GROUP`` samples; p-value 0.0 where a token of probability 0 was emitted,
    whatever the group's size. An EOS ends the output (what follows it is never committed)."""
    groups = defaultdict(list)
    for tokens, path_nodes in zip(out.tolist(), nodes.tolist()):
        for column in range(len(tokens)):
            if tokens[column] < 0 or (column and tokens[column - 1] == EOS):
                break
            slot = 0 if column == 0 else path_nodes[column - 1] + 1
            groups[(slot, tuple(tokens[:column]))].append(tokens[column])
    result = {}
    for (slot, path), emitted in groups.items():
        counts = np.bincount(emitted, minlength=V)
        probs = stat_reference(name, slot, path)
        if counts[probs == 0].sum():
            result[(slot, path)] = (len(emitted), 0.0)
        elif len(emitted) >= MIN_GROUP:
            result[(slot, path)] = (len(emitted), chi_square_p_value(counts, probs))
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STAT_CASES))
def test_each_node_follows_one_token_at_a_time(name):
    out, nodes = run(name, NUM_REQUESTS)
    results = group_p_values(name, out, nodes)
    depth = {0: 0}
    for i, parent in enumerate(SHAPE):
        depth[i + 1] = depth[parent + 1] + 1
    # the walk goes past the root's children (drafts are accepted below depth 1) and tests
    # most samples; siblings other than the first are reached
    assert any(depth[slot] >= 2 for slot, _ in results), sorted(results)
    assert {slot for slot, _ in results} & {2, 4}, sorted(results)
    assert sum(n for n, _ in results.values()) >= 0.6 * (out >= 0).sum()
    record(f"tree_options_{name}", NUM_REQUESTS, [p for _, p in results.values()])
    for (slot, path), (n, p) in results.items():
        assert p >= P_VALUE_THRESHOLD, (
            f"{name}: slot {slot} after {path} ({n} samples): p-value {p:.3g}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["all_wor", "grammar_wor"])
def test_rows_read_as_a_chain_fail_the_test(name):
    """The test of the test: rows processed in node order as a chain (node u sees every node
    before it, not its path: min_tokens by the wrong depth, the grammar walked along the wrong
    drafts) must be caught. (The penalties alone shift p by less than 40 000 samples split by
    path resolve; ``test_tree_rows_equal_their_paths_as_chains`` pins them bit for bit.)"""
    out, nodes = run(name, NUM_REQUESTS // 4, as_chain=True)
    values = [p for _, p in group_p_values(name, out, nodes).values()]
    record(f"tree_options_{name} as a chain (must fail)", NUM_REQUESTS // 4, values)
    assert min(values) < P_VALUE_THRESHOLD, values

"""Token-tree verification (``ops.tree_rejection``) and the tree layout (``ops.tree``).

Strategy: a chain is a tree, so on chains the op must return ``rejection_sample``'s tokens bit for
bit (same draws, same residuals) under every rule; greedy targets are checked against a plain
Python walk of random trees; a request's tokens must not change when it is shuffled among
strangers; the layout helpers are checked on vLLM's ``speculative_token_tree`` example and on
malformed trees. The distributional proof is tests/sample/test_tree_exactness.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.ops import sampling, tree
from verispec.ops.rejection import rejection_sample
from verispec.ops.tree_rejection import tree_rejection_sample


def _chain_batch(batch, k, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch * (k + 1), vocab, generator=gen) * 2
    draft = target.view(batch, k + 1, vocab)[:, :k].reshape(-1, vocab) + torch.randn(
        batch * k, vocab, generator=gen)
    seeds = torch.arange(batch, dtype=torch.int64) * 31 + 5
    positions = torch.arange(batch, dtype=torch.int64) + 7
    temperature = torch.full((batch,), 0.9)
    temperature[::4] = 0.0
    ids, q = sampling.sample_draft(draft, temperature.repeat_interleave(k),
                                   seeds.repeat_interleave(k),
                                   (positions[:, None] + torch.arange(k)).reshape(-1))
    return target, ids, q, temperature, seeds, positions


@pytest.mark.parametrize("rule", ["full", "onehot", "full_top_k_top_p"])
def test_chain_tree_equals_chain_rejection(rule):
    batch, k, vocab = 400, 4, 23
    target, ids, q, temperature, seeds, positions = _chain_batch(batch, k, vocab, 1)
    cu = torch.arange(batch + 1) * k
    parents = (torch.arange(k) - 1).repeat(batch)
    draft_probs = None if rule == "onehot" else q
    masks = (None, None, None)
    if rule == "full_top_k_top_p":
        masks = (torch.full((batch,), 6, dtype=torch.int32), torch.full((batch,), 0.8), None)
    expected = rejection_sample(target, ids, cu, draft_probs, temperature, *masks, seeds,
                                positions, k)
    for without_replacement in (False, True):  # a chain has no siblings: both rules agree
        got, nodes = tree_rejection_sample(target, ids, parents, cu, draft_probs, temperature,
                                           *masks, seeds, positions, k, k, 1,
                                           without_replacement=without_replacement)
        assert torch.equal(got, expected)
    num_accepted = (expected != -1).sum(1) - 1
    columns = torch.arange(k)[None, :]
    assert torch.equal(nodes, torch.where(columns < num_accepted[:, None], columns, -1))


def _random_tree(rng, n):
    return [int(rng.integers(-1, i)) for i in range(n)]


def _greedy_walk(parents, tokens, argmax):
    """Reference: from the root, descend into the first child equal to the slot's argmax."""
    slot, path = 0, []
    while True:
        kids = [i for i, p in enumerate(parents) if p + 1 == slot]
        match = [i for i in kids if tokens[i] == argmax[slot]]
        if not match:
            return [tokens[i] for i in path] + [argmax[slot]], path
        slot = match[0] + 1
        path.append(match[0])


def test_greedy_random_trees_match_reference_walk():
    rng = np.random.default_rng(3)
    vocab, batch, max_nodes = 4, 300, 9  # a small vocabulary: children often match
    sizes = rng.integers(0, max_nodes + 1, size=batch)
    trees = [_random_tree(rng, int(n)) for n in sizes]
    tokens = [rng.integers(0, vocab, size=len(t)).tolist() for t in trees]
    logits = [torch.randn(len(t) + 1, vocab, generator=torch.Generator().manual_seed(i))
              for i, t in enumerate(trees)]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]))
    out, nodes = tree_rejection_sample(
        torch.cat(logits), torch.tensor(sum(tokens, [])), torch.tensor(sum(trees, [])), cu,
        None, torch.zeros(batch), None, None, None, torch.arange(batch), torch.zeros(batch,
                                                                                  dtype=torch.int64),
        max_nodes, max_nodes, max_nodes)
    for r in range(batch):
        emitted, path = _greedy_walk(trees[r], tokens[r], logits[r].argmax(1).tolist())
        assert out[r].tolist() == emitted + [-1] * (max_nodes + 1 - len(emitted)), r
        assert nodes[r].tolist() == path + [-1] * (max_nodes - len(path)), r


@pytest.mark.parametrize("without_replacement", [False, True])
def test_batch_invariance(without_replacement):
    """Each request's tokens are the same alone, in a batch and shuffled among strangers."""
    rng = np.random.default_rng(5)
    vocab, batch = 17, 24
    trees = [_random_tree(rng, int(rng.integers(0, 7))) for _ in range(batch)]

    def rows(r):
        gen = torch.Generator().manual_seed(100 + r)
        n = len(trees[r])
        target = torch.randn(n + 1, vocab, generator=gen)
        q = torch.softmax(torch.randn(n, vocab, generator=gen), -1)
        tokens = torch.randint(0, vocab, (n,), generator=gen)
        return target, q, tokens

    def run(order):
        data = [rows(r) for r in order]
        sizes = [len(trees[r]) for r in order]
        out, _ = tree_rejection_sample(
            torch.cat([d[0] for d in data]), torch.cat([d[2] for d in data]),
            torch.tensor(sum((trees[r] for r in order), []), dtype=torch.int64),
            torch.tensor(np.concatenate([[0], np.cumsum(sizes)])), torch.cat([d[1] for d in data]),
            torch.tensor([0.0 if r % 5 == 0 else 1.0 for r in order]), None, None, None,
            torch.tensor(order, dtype=torch.int64) * 13, torch.tensor(order, dtype=torch.int64),
            6, 6, 6, without_replacement=without_replacement)
        return {r: out[i] for i, r in enumerate(order)}

    together = run(list(range(batch)))
    shuffled = run(rng.permutation(batch).tolist())
    for r in range(batch):
        assert torch.equal(together[r], shuffled[r])
        assert torch.equal(together[r], run([r])[r])


def test_empty_tree_emits_the_bonus_token():
    target = torch.randn(2, 9)
    out, nodes = tree_rejection_sample(
        target, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
        torch.tensor([0, 0, 0]), None, torch.tensor([0.0, 1.0]), None, None, None,
        torch.tensor([1, 2]), torch.tensor([3, 3]), 2, 2, 2)
    assert out[0].tolist() == [int(target[0].argmax()), -1, -1]
    assert out[1, 0] >= 0 and out[1, 1:].tolist() == [-1, -1]
    assert nodes.tolist() == [[-1, -1], [-1, -1]]


def test_parents_from_vllm_paths():
    assert tree.parents_from_paths([(0,), (1,), (0, 0), (0, 1)]) == [-1, -1, 0, 0]
    assert tree.parents_from_paths([(0,), (0, 0), (0, 0, 0)]) == [-1, 0, 1]
    for bad in ([(0, 0)], [(1,)], [(0,), (0,)], [(0,), (0, 1)]):
        with pytest.raises(ValueError, match="speculative_token_tree"):
            tree.parents_from_paths(bad)


def test_layout_helpers():
    parents, _, _ = tree.padded_parents(torch.tensor([-1, -1, 0, 0, 2, -1]),
                                        torch.tensor([0, 5, 6]), 5)
    ranks = tree.sibling_ranks(parents)
    assert ranks.tolist() == [[0, 1, 0, 1, 0], [0, 0, 0, 0, 0]]
    table = tree.child_table(parents, ranks, 2)
    assert table[0].tolist() == [[0, 1, -1], [2, 3, -1], [-1, -1, -1], [4, -1, -1],
                                 [-1, -1, -1], [-1, -1, -1]]
    assert table[1, 0].tolist() == [0, -1, -1]
    assert tree.slot_depths(parents, 3)[0].tolist() == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize(("parents", "bounds", "message"), [
    ([-1, 1], (2, 2, 2), "own index"),
    ([-1, 0, 1], (3, 2, 2), "deeper"),
    ([-1, -1, -1], (3, 3, 2), "children"),
    ([-1, 0, 1], (2, 3, 3), "more than max_num_draft_tokens"),
])
def test_malformed_trees_are_refused(parents, bounds, message):
    n = len(parents)
    with pytest.raises(ValueError, match=message):
        tree_rejection_sample(torch.randn(n + 1, 5), torch.zeros(n, dtype=torch.int64),
                              torch.tensor(parents), torch.tensor([0, n]), None,
                              torch.zeros(1), None, None, None, torch.tensor([1]),
                              torch.tensor([0]), *bounds)

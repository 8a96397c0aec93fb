"""Tree verification forwards (``runtime.tree_verify``, ``ops.tree``, ``ops.tree_feed``) on the
CPU path and on the flat layout of the GPU path.

Strategy: a tiny random float32 model (Llama, and Qwen3 for q/k norms; batch-invariant matmuls)
verifies token trees in one forward; the logits of every node must equal, bit for bit (with the
compiled CPU kernels and without), those of feeding its root-to-node path as a chain to another
slot holding the same context (each query sees the same keys in the same order, only at other
cache rows). After ``commit_tree_path`` the next decode step must equal the chain's too: the
accepted path's K/V sit at consecutive positions. The flat layout does the same eagerly, also
where a captured verify step of the tree's width exists: bit for bit with the GPU's ops (Triton,
in the interpreter on CPU), within float32 rounding with the torch twins (whose products are
not row-invariant); ``keep_path_hidden`` leaves the chain's hidden states there. Hybrid models
are refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.utils import save_tiny_model
from verispec.models import load_model
from verispec.ops import tree
from verispec.ops.model_ops import triton_model_ops
from verispec.runtime.model_runner import ModelRunner
from verispec.runtime.tree_verify import commit_tree_path, keep_path_hidden, verify_tree

PROMPTS = [[5, 17, 33, 2, 90, 11, 64, 3, 8], [7, 3, 21, 44]]
TREES = [  # (parents, tokens)
    ([-1, -1, 0, 0, 1, 2, 2, 5, -1], [10, 11, 12, 13, 14, 15, 16, 17, 11]),
    ([-1, 0, 0, 1], [40, 41, 42, 43]),
]


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(path, request.param)
    model = load_model(str(path), "float32").model
    model.checkpoint = str(path)  # (``_flat_runner`` loads it again on the GPU)
    return model


def _path(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _chain_logits(runner, slot, prompt, tokens):
    """Logits of ``tokens`` fed as a chain after ``prompt`` in ``slot`` (left as it was)."""
    out = runner.forward([slot], [tokens], logits="all")
    runner.kv_cache.truncate(slot, len(prompt))
    return out


@pytest.mark.parametrize("kernels", [True, False], ids=["c_kernels", "torch"])
def test_tree_node_logits_equal_their_chains(model, kernels, monkeypatch):
    if not kernels:  # invariant_attention and torch matmuls instead of the compiled kernels
        monkeypatch.setenv("VERISPEC_CPU_KERNELS", "0")
    runner = ModelRunner(model, 4, 64)
    for slot, prompt in zip((0, 1, 2, 3), PROMPTS + PROMPTS):
        runner.forward([slot], [prompt[:-1]], logits="none")  # the last token is the root
    roots = [p[-1] for p in PROMPTS]
    parents = np.concatenate([np.array(p) for p, _ in TREES])
    tokens = np.concatenate([np.array(t) for _, t in TREES])
    logits = verify_tree(runner, [0, 1], roots, tokens, parents,
                         np.array([len(p) for p, _ in TREES]), max_depth=4)
    offset = 0
    for b, (prompt, (tree_parents, tree_tokens)) in enumerate(zip(PROMPTS, TREES)):
        chain_slot = 2 + b
        rows = logits[offset: offset + len(tree_tokens) + 1]
        offset += len(tree_tokens) + 1
        assert torch.equal(rows[0], _chain_logits(runner, chain_slot, prompt[:-1],
                                                  [roots[b]])[-1])
        for node in range(len(tree_tokens)):
            chain = [roots[b]] + [tree_tokens[i] for i in _path(tree_parents, node)]
            expected = _chain_logits(runner, chain_slot, prompt[:-1], chain)[-1]
            assert torch.equal(rows[node + 1], expected), (b, node)


def _verify_first_tree(runner) -> int:
    """Slots 0 and 1 hold the first prompt but its last token; slot 0 verifies the first tree
    from it. Returns the root's row."""
    prompt = PROMPTS[0]
    for slot in (0, 1):
        runner.forward([slot], [prompt[:-1]], logits="none")
    parents, tokens = TREES[0]
    start = runner.kv_cache.length(0)
    verify_tree(runner, [0], [prompt[-1]], np.array(tokens), np.array(parents),
                np.array([len(tokens)]), max_depth=4)
    return start


def test_commit_moves_the_accepted_path(model):
    runner = ModelRunner(model, 2, 64)
    start = _verify_first_tree(runner)
    accepted = np.array([[1, 4, -1, -1]])  # root -> node 1 -> node 4
    commit_tree_path(runner.kv_cache, [0], np.array([start]), accepted)
    assert runner.kv_cache.length(0) == start + 3
    after = runner.forward([0], [[99]], logits="all")[-1]
    root, tokens = PROMPTS[0][-1], TREES[0][1]
    expected = runner.forward([1], [[root, tokens[1], tokens[4], 99]], logits="all")[-1]
    assert torch.equal(after, expected)


def test_tree_attention_mask_and_positions():
    parents, _, _ = tree.padded_parents(torch.tensor([-1, -1, 0, -1]), torch.tensor([0, 3, 4]),
                                        3)
    positions, mask = tree.tree_attention(parents, torch.tensor([2, 5]), kv_len=7, max_depth=2)
    assert positions[0].tolist() == [2, 3, 3, 4]
    assert positions[1, :2].tolist() == [5, 6]
    # request 0: rows 0-1 context, row 2 root, rows 3-5 nodes 0-2 (node 2 is a child of node 0)
    assert mask[0, 0].int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 0, 1, 0],
    ]
    assert mask[1, 0, 1].int().tolist() == [1, 1, 1, 1, 1, 1, 1]
    _, windowed = tree.tree_attention(parents, torch.tensor([2, 5]), kv_len=7, max_depth=2,
                                      window=2)
    assert windowed[0, 0, 3].int().tolist() == [0, 0, 0, 1, 0, 1, 0]  # positions 3, 4 from 4


def test_hybrid_targets_are_refused(model):
    runner = ModelRunner(model, 1, 32)
    runner.hybrid = True
    with pytest.raises(ValueError, match="hybrid"):
        verify_tree(runner, [0], [1], np.array([2]), np.array([-1]), np.array([1]), 1)


def _flat_runner(model, ops_name):
    """A flat-layout runner (the GPU path's, eager on CPU) with a captured verify step as wide
    as the first tree, and the GPU's Triton ops or the torch twins."""
    device = "cpu"
    if ops_name == "triton" and torch.cuda.is_available():
        # the Triton ops launch on the GPU where there is one (on a CPU, the interpreter)
        device = "cuda"
        model = load_model(model.checkpoint, "float32").model.to(device)
    runner = ModelRunner(model, 4, 64, device=device, flat_layout=True, max_step_tokens=10)
    if ops_name == "triton":
        pytest.importorskip("triton")
        runner.ops = triton_model_ops(True)
    runner.capture([1, 10])
    return runner


def _same(a: torch.Tensor, b: torch.Tensor, ops_name: str) -> None:
    if ops_name == "triton":
        assert torch.equal(a, b)
    else:
        err = (a - b).abs().max().item()
        assert err <= 1e-4 * b.abs().max().item(), err


@pytest.mark.parametrize("ops_name", ["twin", "triton"])
def test_flat_tree_node_logits_equal_their_chains(model, ops_name, monkeypatch):
    runner = _flat_runner(model, ops_name)
    for slot, prompt in zip((0, 1, 2, 3), PROMPTS + PROMPTS):
        runner.forward([slot], [prompt[:-1]], logits="none")
    roots = [p[-1] for p in PROMPTS]
    parents = np.concatenate([np.array(p) for p, _ in TREES])
    tokens = np.concatenate([np.array(t) for _, t in TREES])
    replays = []
    real_run = runner.graphs.run
    monkeypatch.setattr(runner.graphs, "run", lambda *a, **k: replays.append(a) or real_run(
        *a, **k))
    logits = verify_tree(runner, [0, 1], roots, tokens, parents,
                         np.array([len(p) for p, _ in TREES]), max_depth=4)
    assert not replays  # the captured forward_s10 fits the step, yet trees run eagerly
    offset = 0
    for b, (prompt, (tree_parents, tree_tokens)) in enumerate(zip(PROMPTS, TREES)):
        rows = logits[offset: offset + len(tree_tokens) + 1]
        offset += len(tree_tokens) + 1
        leaves = sorted(set(range(len(tree_tokens))) - set(tree_parents))
        for leaf in leaves:  # a chain's rows: the root's, then its path's nodes'
            path = _path(tree_parents, leaf)
            chain = _chain_logits(runner, 2 + b, prompt[:-1],
                                  [roots[b]] + [tree_tokens[i] for i in path])
            _same(rows[[0] + [1 + i for i in path]], chain, ops_name)


@pytest.mark.parametrize("ops_name", ["twin", "triton"])
def test_flat_commit_keeps_the_accepted_path_and_its_hidden_states(model, ops_name):
    """After the verify forward and ``commit_tree_path``, a decode equals the chain's; the
    hidden states ``keep_path_hidden`` leaves (an EAGLE head's input) are the chain's."""
    runner = _flat_runner(model, ops_name)
    runner.capture_layers = (1, model.config.num_hidden_layers)
    start = _verify_first_tree(runner)
    accepted = np.array([[0, 2, 5, -1]])  # root -> node 0 -> node 2 -> node 5
    commit_tree_path(runner.kv_cache, [0], np.array([start]), accepted)
    keep_path_hidden(runner, accepted)
    kept = runner.captured_hidden
    assert runner.kv_cache.length(0) == start + 4
    assert kept.counts.tolist() == [4] and kept.starts.tolist() == [start]
    kept_rows = kept.rows[:4].clone()
    root, tokens = PROMPTS[0][-1], TREES[0][1]
    chain = [root, tokens[0], tokens[2], tokens[5]]
    expected = runner.forward([1], [chain + [99]], logits="all")[-1]
    _same(kept_rows, runner.captured_hidden.rows[:4], ops_name)
    _same(runner.forward([0], [[99]], logits="all")[-1], expected, ops_name)

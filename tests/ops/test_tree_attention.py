"""Attention over token trees on the flat layout (``rope_cache_attention`` with ``tree_paths``,
docs/design.md §16): the torch twin and the Triton kernel (Triton's interpreter on CPU, the GPU
with ``VERISPEC_TEST_DEVICE=cuda``).

Strategy: one step of three requests with different trees and context lengths over a paged
cache of small blocks handed out shuffled, so that trees straddle block boundaries: a verify
of a whole branching tree, a chain-shaped tree, and a drafter's feed of one level whose
ancestors an earlier forward wrote. Against a dense float64 reference (an explicit mask over
the context and each token's ancestors, RoPE at root row + depth) both ops agree to the
tolerance of the chain tests (tests/ops/test_model_ops.py), and the kernel writes the twin's
K/V. Bit for bit: every tree token equals the same query in the chain holding its path
(verify-shaped, from its root), in the kernel and in the twin alike, for K/V written inside
the attention launch and in a launch of their own, and with G heads per KV head above the
16 rows of a tile, in float32 and (on a GPU) bfloat16; the trees give the bits of the same
trees laid out in consecutive blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.test_model_ops import _attention_inputs, _logical, _rope_attention
from verispec.ops import model_ops
from verispec.ops.tree import padded_parents
from verispec.ops.tree_feed import TreeFeed

triton_model = pytest.importorskip("verispec.ops.triton_model")
triton_attention = pytest.importorskip("verispec.ops.triton_attention")

# (parents, root row, first slot fed): a verify of a branching tree; a chain-shaped tree across
# a block boundary; one level of a draft (slots 3 .. 6), slots 0 .. 2 written before
TREES = (([-1, -1, 0, 0, 1, 2, 3], 6, 0),
         ([-1, 0, 1, 2], 13, 0),
         ([-1, -1, 0, 1, 1, 3], 2, 3))
# a tree wider than a verify step (20 nodes, depth 3): written inside the attention launch too
WIDE_TREE = ([-1, -1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 5, 9], 5, 0)
MAX_DEPTH = 4


def _ancestors(parents: list[int], slot: int) -> list[int]:
    """Slots of the root-to-``slot`` path (the root 0)."""
    path = [slot]
    while path[-1] > 0:
        path.append(parents[path[-1] - 1] + 1)
    return path[::-1]


def _tree_inputs(device, trees=TREES, hq=4, hkv=2, block_size=4, in_order=False, seed=3,
                 max_len=32, dtype=torch.float32):
    """``_attention_inputs`` of a step feeding the trees' slots: positions root + depth and the
    paths of ``TreeFeed``. Returns (inputs, [(parents, root, first slot, count)])."""
    counts, contexts, positions, paths, layout = [], [], [], [], []
    for parents, root, first in trees:
        count = len(parents) + 1 - first
        feed = TreeFeed(padded_parents(torch.tensor(parents), torch.tensor([0, len(parents)]),
                                       len(parents))[0], np.array([root]), first, MAX_DEPTH)
        pos, path = feed.flat(np.array([count]))
        counts.append(count)
        contexts.append(root + first + count)
        positions.append(torch.from_numpy(pos))
        paths.append(path)
        layout.append((parents, root, first, count))
    inputs = _attention_inputs(device, dtype, counts, contexts, hq=hq, hkv=hkv,
                               max_len=max_len, block_size=block_size, in_order=in_order,
                               seed=seed)
    inputs.update(positions=torch.cat(positions).to(device), tree_paths=torch.cat(paths).to(device))
    return inputs, layout


def _dense_reference(inputs, layout, k_cache, v_cache, window):
    """[T, Hq, D] float64: softmax over every cache row a tree token sees (the context, its
    ancestors and itself; within the window), with q rotated at its position by the twin."""
    hq, hkv = inputs["num_heads"], inputs["num_kv_heads"]
    scratch = dict(inputs, k_cache=k_cache.clone(), v_cache=v_cache.clone())
    q = model_ops.rope_cache_write(*(scratch[k] for k in (
        "qkv", "positions", "cos", "sin", "k_cache", "v_cache", "slot_mapping")), hq, hkv)
    table = inputs["block_tables"].cpu()
    slots = inputs["slot_ids"].tolist()
    keys = _logical(k_cache.cpu(), table, len(table), 32).double()
    values = _logical(v_cache.cpu(), table, len(table), 32).double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    token = 0
    for b, (parents, root, first, count) in enumerate(layout):
        depth = [len(_ancestors(parents, s)) - 1 for s in range(len(parents) + 1)]
        key_pos = torch.tensor(list(range(root)) + [root + d for d in depth])
        for slot in range(first, first + count):
            visible = torch.zeros(root + len(parents) + 1, dtype=torch.bool)
            visible[:root] = True
            visible[[root + s for s in _ancestors(parents, slot)]] = True
            if window is not None:
                visible &= root + depth[slot] - key_pos < window
            k = keys[slots[b], :visible.numel()].repeat_interleave(hq // hkv, 1)
            v = values[slots[b], :visible.numel()].repeat_interleave(hq // hkv, 1)
            scores = torch.einsum("hd,khd->hk", q[token].cpu().double(), k) * inputs["scale"]
            scores = scores.masked_fill(~visible[None], float("-inf"))
            out[token] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
            token += 1
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_tree_attention_matches_dense_reference(device, window):
    inputs, layout = _tree_inputs(device)
    out, k, v = _rope_attention(triton_model.rope_cache_attention, inputs, window=window)
    ref_out, ref_k, ref_v = _rope_attention(model_ops.rope_cache_attention, inputs, window=window)
    dense = _dense_reference(inputs, layout, ref_k, ref_v, window)
    for got in (out, ref_out):
        err = (got.cpu().double() - dense).norm() / dense.norm()
        assert err < 1e-5, err
    assert torch.allclose(k, ref_k, rtol=1e-5, atol=1e-6)  # tolerance: the twin's RoPE
    assert torch.allclose(v, ref_v, rtol=0, atol=0)


def _chain_of(inputs, layout, b, slot, fn, one_at_a_time=False):
    """(output [depth + 1, Hq, D], k cache, v cache) of request b's path to ``slot`` fed as a
    chain from its root (the tree step's qkv rows of the path, positions and cache rows root ..
    root + depth) in one step, or ``one_at_a_time`` (decodes), on copies of the caches as they
    were before the tree step."""
    parents, root, _, _ = layout[b]
    first_token = sum(count for *_, count in layout[:b])
    path = _ancestors(parents, slot)
    device = inputs["qkv"].device
    table = inputs["block_tables"].cpu()
    block_size = inputs["k_cache"].shape[1]
    k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    pieces = [path[i:i + 1] for i in range(len(path))] if one_at_a_time else [path]
    outs, depth = [], 0
    for piece in pieces:
        rows = torch.tensor([first_token + s for s in piece], device=device)
        positions = torch.arange(root + depth, root + depth + len(piece))
        depth += len(piece)
        slot_mapping = table[int(inputs["slot_ids"][b]), positions // block_size].long() * (
            block_size) + positions % block_size
        outs.append(fn(**dict(
            inputs, qkv=inputs["qkv"][rows], positions=positions.to(device),
            slot_mapping=slot_mapping.to(device), k_cache=k_cache, v_cache=v_cache,
            slot_ids=inputs["slot_ids"][b:b + 1],
            context_lens=torch.tensor([root + depth], device=device),
            query_start=torch.tensor([0, len(piece)], device=device),
            max_queries=len(piece), tree_paths=None)))
    return torch.cat(outs), k_cache, v_cache


@pytest.mark.parametrize("op, write, heads, dtype", [
    ("triton", "fused", (4, 2), torch.float32), ("triton", "separate", (4, 2), torch.float32),
    ("triton", "fused", (32, 1), torch.float32), ("triton", "fused", (4, 2), torch.bfloat16),
    ("triton", "fused", (32, 1), torch.bfloat16), ("twin", "fused", (4, 2), torch.float32),
    ("triton", "fused-wide", (4, 2), torch.float32),
    ("triton", "separate-wide", (4, 2), torch.float32),
], ids=["triton-gqa2", "triton-separate-write", "triton-gqa32", "triton-gqa2-bf16",
        "triton-gqa32-bf16", "twin", "triton-wide", "triton-wide-separate-write"])
def test_tree_tokens_equal_their_chains_bitwise(device, op, write, heads, dtype, monkeypatch):
    """Each token of the verified trees (the first two requests) gives the bits of its chain:
    the path fed one token at a time (decodes), and in the kernel the path fed in one verify
    step as well (the twin's chain attention, one product for all of a step's queries, differs
    in the last bits between the two, hence within 1e-6 of it); the chain-shaped tree writes
    its chain's K/V. ``-wide``: a tree of 20 nodes beside them."""
    if dtype == torch.bfloat16 and torch.device(device).type != "cuda":
        pytest.skip("bfloat16 tl.dot runs on a GPU only (the interpreter does not emulate it)")
    if write.startswith("separate"):
        monkeypatch.setattr(triton_attention, "FUSED_WRITE_MAX_QUERIES", 0)
        monkeypatch.setattr(triton_attention, "FUSED_WRITE_MAX_TREE_QUERIES", 0)
    fn = triton_model.rope_cache_attention if op == "triton" else model_ops.rope_cache_attention
    hq, hkv = heads
    trees = TREES + (WIDE_TREE,) if write.endswith("wide") else TREES
    inputs, layout = _tree_inputs(device, trees, hq=hq, hkv=hkv, dtype=dtype)
    out, k_tree, v_tree = _rope_attention(fn, inputs)
    for b, (parents, _, first, count) in enumerate(layout):
        if first > 0:  # a draft's level: its ancestors' rows hold other values
            continue
        first_token = sum(c for *_, c in layout[:b])
        for slot in range(count):
            tokens = [first_token + s for s in _ancestors(parents, slot)]
            decoded = _chain_of(inputs, layout, b, slot, fn, one_at_a_time=True)[0]
            assert torch.equal(decoded, out[tokens]), (b, slot)
            verified = _chain_of(inputs, layout, b, slot, fn)[0]
            if op == "triton":
                assert torch.equal(verified, out[tokens]), (b, slot)
            else:
                assert torch.allclose(verified, out[tokens], rtol=0, atol=1e-6)
    _, root, _, count = layout[1]  # chain-shaped
    _, chain_k, chain_v = _chain_of(inputs, layout, 1, count - 1, fn)
    table = inputs["block_tables"].cpu()
    slot_id = int(inputs["slot_ids"][1])
    for tree_cache, chain_cache in ((k_tree, chain_k), (v_tree, chain_v)):
        rows = [_logical(c.cpu(), table, len(table), 32)[slot_id, root:root + count]
                for c in (tree_cache, chain_cache)]
        assert torch.equal(*rows)


@pytest.mark.parametrize("op", ["triton", "twin"])
def test_paged_trees_equal_contiguous_bitwise(device, op):
    """Block sizes 1, 4 and 16, blocks shuffled or consecutive: the same outputs and cache
    contents (keys are read by position whatever block holds them)."""
    fn = triton_model.rope_cache_attention if op == "triton" else model_ops.rope_cache_attention
    for block_size in (1, 4, 16):
        results = []
        for in_order in (True, False):
            inputs, _ = _tree_inputs(device, block_size=block_size, in_order=in_order)
            out, k, v = _rope_attention(fn, inputs)
            table = inputs["block_tables"].cpu()
            results.append((out, _logical(k.cpu(), table, 4, 32), _logical(v.cpu(), table, 4, 32)))
        for a, b in zip(*results):
            assert torch.equal(a.cpu(), b.cpu()), block_size


@pytest.mark.parametrize("partitions", [(64, 0, 64, 2), (64, 2, 128, 2)])
def test_trees_split_over_partitions_keep_their_chains_bits(device, monkeypatch, partitions):
    """Trees over contexts of several partitions (64 keys, at most 2 a query: 128 past position
    128; or 64 keys below position 128, then 128), verified with split-KV over 1, 2 or 3
    programs a tile: the same bits and caches each way, and each token the bits of its path
    decoded one token at a time."""
    for name, value in zip(("SMALL_PARTITION_KEYS", "SMALL_PARTITIONS", "PARTITION_KEYS",
                            "MAX_PARTITIONS"), partitions):
        monkeypatch.setattr(triton_attention, name, value)
    trees = (([-1, -1, 0, 0, 1, 2, 3], 125, 0), ([-1, 0, 1, 2], 190, 0),
             ([-1, -1, 0, 1, 1, 3], 60, 3))
    inputs, layout = _tree_inputs(device, trees=trees, max_len=224, block_size=16)
    runs = [_rope_attention(triton_model.rope_cache_attention, inputs, split_programs=n)
            for n in (1, 2, 3)]
    for out, k, v in runs[1:]:
        assert torch.equal(out, runs[0][0])
        assert torch.equal(k, runs[0][1]) and torch.equal(v, runs[0][2])
    out = runs[2][0]
    for b, (parents, _, first, count) in enumerate(layout):
        if first > 0:
            continue
        first_token = sum(c for *_, c in layout[:b])
        for slot in range(count):
            tokens = [first_token + s for s in _ancestors(parents, slot)]
            decoded = _chain_of(inputs, layout, b, slot, triton_model.rope_cache_attention,
                                one_at_a_time=True)[0]
            assert torch.equal(decoded, out[tokens]), (b, slot)

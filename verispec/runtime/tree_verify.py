"""Token trees: the verify forward over a tree, and moving the accepted path's K/V to
consecutive positions afterwards (docs/design.md §16). Both layouts: the CPU path and the flat
one of the GPU path (eager).

The verify forward writes request b's root (its last committed token) and its n_b nodes at cache
rows ``start_b .. start_b + n_b`` in node order, like a chain's verify; only the positions (by
depth) and the attention (context + ancestors) differ (``ops.tree_feed``: a mask on the CPU
path, each token's path on the flat layout). After
verification the accepted path's rows are copied down to ``start_b + 1 ..`` and the slot is
rolled back to the context, the root and the path (``commit_tree_path``); the recovered or bonus
token is the next step's root, as with chains.

With an EAGLE head (the runner's ``capture_layers``) the verify forward keeps the hidden states
of the root and of every node; ``keep_path_hidden`` then leaves those of the root and the
accepted path, in path order: the rows of the positions the request committed, which the head
reads next (``EagleProposer.on_commit``), as after a chain's verify.
"""

from __future__ import annotations

import numpy as np
import torch

from verispec import ops
from verispec.ops import tree
from verispec.ops.tree_feed import TreeFeed
from verispec.runtime.kv_cache import KVCache
from verispec.runtime.model_runner import CapturedHidden, ModelRunner


@torch.inference_mode()
def verify_tree(
    runner: ModelRunner,
    slots: list[int],
    last_token_ids: list[int],
    draft_token_ids: np.ndarray,
    parent_ids: np.ndarray,
    num_draft_tokens: np.ndarray,
    max_depth: int,
) -> torch.Tensor:
    """The verify forward over each request's token tree.

    Parameters
    ----------
    runner : the runner of an attention-only model, either layout (the flat one runs the
        forward eagerly, never a captured graph)
    slots : B distinct cache slots
    last_token_ids : B committed tokens, the trees' roots
    draft_token_ids : [sum n_b] int, the nodes of every tree (``ops.tree`` layout)
    parent_ids : [sum n_b] int, each node's parent as a local index (-1 = the root)
    num_draft_tokens : [B] int, n_b
    max_depth : static bound on a tree's depth

    Returns
    -------
    [sum(n_b + 1), V] float32 target logits: request b's root row, then a row per node
    (the layout ``tree_rejection_sample`` reads). Each slot's length grows by n_b + 1; commit
    with ``commit_tree_path``.
    """
    if runner.hybrid:
        raise ValueError("token trees need an attention-only target: a hybrid model's "
                         "recurrent state cannot branch")
    num_draft_tokens = np.asarray(num_draft_tokens, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(num_draft_tokens)])
    drafts = np.asarray(draft_token_ids, dtype=np.int64).tolist()
    token_ids = [[int(root)] + drafts[cu[b]:cu[b + 1]] for b, root in enumerate(last_token_ids)]
    parents, _, _ = tree.padded_parents(torch.as_tensor(np.asarray(parent_ids, np.int64)),
                                        torch.from_numpy(cu), int(num_draft_tokens.max()))
    feed = TreeFeed(parents, runner.kv_cache.lengths_np[slots].copy(), 0, max_depth)
    return runner.forward(slots, token_ids, logits="all", tree=feed)


def commit_tree_path(cache: KVCache, slots: list[int], starts: np.ndarray,
                     accepted_nodes: np.ndarray) -> None:
    """Keep each request's accepted path, drop the rest of its tree.

    Parameters
    ----------
    cache : the target's KV cache, after ``verify_tree``
    slots : B slots
    starts : [B] int, each slot's length before ``verify_tree`` (the root's position)
    accepted_nodes : [B, max_depth] int, local node indices root to leaf, -1 padded
        (``tree_rejection_sample``'s second output, on the host)

    Node i was written at position ``start + 1 + i``; path node j (0-based) moves to
    ``start + 1 + j``. Afterwards slot b holds ``start_b + 1 + d_b`` tokens: the context, the
    root and the d_b accepted nodes.
    """
    accepted_nodes = np.asarray(accepted_nodes, dtype=np.int64)
    depth = (accepted_nodes >= 0).sum(1)
    row, col = np.nonzero(accepted_nodes >= 0)
    starts = np.asarray(starts, dtype=np.int64)
    src = starts[row] + 1 + accepted_nodes[row, col]
    dst = starts[row] + 1 + col
    moved = src != dst
    if moved.any():
        cache.copy_positions(np.asarray(slots, np.int64)[row[moved]], src[moved], dst[moved])
    for b, slot in enumerate(slots):
        cache.truncate(slot, int(starts[b] + 1 + depth[b]))


def keep_path_hidden(runner: ModelRunner, accepted_nodes: np.ndarray) -> None:
    """After ``verify_tree`` with ``capture_layers``: keep, of request b's captured rows, the
    root's and those of its accepted path's nodes (``accepted_nodes`` [B, max_depth], local
    indices root to leaf, -1 padded), in that order: positions ``start_b .. start_b + d_b``,
    the rows a chain's verify leaves for the same committed tokens. No-op without captured
    hidden states."""
    captured = runner.captured_hidden
    if captured is None:
        return
    accepted_nodes = np.asarray(accepted_nodes, dtype=np.int64)
    rows = [captured.row_start[b] + np.concatenate([[0], 1 + path[path >= 0]])
            for b, path in enumerate(accepted_nodes)]
    counts = np.array([r.size for r in rows], dtype=np.int64)
    index = ops.to_device(np.concatenate(rows), captured.rows.device)
    runner.captured_hidden = CapturedHidden(list(captured.slots), captured.starts.copy(), counts,
                                            np.cumsum(counts) - counts, captured.rows[index])

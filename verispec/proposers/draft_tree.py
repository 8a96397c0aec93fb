"""Token trees drafted by a model-based proposer (docs/design.md §16): the tree drafting of
``proposers.model_proposer.ModelProposer`` (a draft model; early exit shares it), on either layout.

The catch-up forward gives the root's logits; then for t = 1 .. depth the children of every
node of depth t - 1 are drawn at once, and, while a request's tree goes deeper, one forward
feeds all its nodes of depth t. A node is written at the draft cache's row ``num_tokens + i``
(i its index in the shape's breadth-first order: the target's verify layout), at position
``num_tokens - 1 + depth``, seeing the context and its ancestors (``ops.tree_feed``); after
verification ``commit_tree`` keeps the accepted path's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from verispec import ops
from verispec.ops import tree
from verispec.ops.tree import StaticTree
from verispec.ops.tree_feed import TreeFeed
from verispec.proposers.base import ProposalRequest
from verispec.proposers.grammar_walk import TreeGrammarMasks
from verispec.runtime.tree_verify import commit_tree_path


class TreeProposal(NamedTuple):
    """One step's token trees in the layout of ``verispec.ops.tree``.

    ``draft_token_ids`` [sum n_r] int64 on the device; ``parent_ids`` [sum n_r] int64 host
    (local indices, -1 = the root); ``num_draft_tokens`` [B] int64 host (n_r, 0 allowed);
    ``draft_probs`` [sum n_r, V] float32 (q at each node's parent, the full rule, children
    drawn without replacement) or None (greedy drafting: the one-hot rule)."""

    draft_token_ids: torch.Tensor
    parent_ids: np.ndarray
    num_draft_tokens: np.ndarray
    draft_probs: torch.Tensor | None


def context_tail(token_ids, start: int):
    """``token_ids[start:]`` as the runner takes it (a numpy or list slice; tensors as numpy),
    without converting the whole context."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.numpy()
    return token_ids[start:]


class DraftTreeDrafting:
    """Tree drafting for a proposer with ``runner``, ``num_layers``, ``greedy``, ``device``,
    ``vocab_size`` and ``draft_grammar`` (``ModelProposer``)."""

    @torch.inference_mode()
    def propose_tree(self, requests: Sequence[ProposalRequest], shape: StaticTree,
                     depths: np.ndarray) -> TreeProposal:
        """Draft ``shape`` cut to ``depths[r]`` for every request (docs/design.md §16).

        The catch-up forward gives the root's logits; then for t = 1 .. depth the children of
        every node of depth t - 1 are drawn at once with ``ops.tree.sample_children`` (greedy
        drafting or a greedy request: the top m tokens; probabilistic drafting: m distinct
        tokens without replacement from q), and, while a request's tree goes deeper, one
        forward feeds all its nodes of depth t (eagerly on the flat layout). A node is written
        at cache row ``num_tokens + i`` (i its index in ``shape``'s breadth-first order: the
        target's verify layout), at position ``num_tokens - 1 + depth``, seeing the context and
        its ancestors (``ops.tree_feed``); so its K/V are those a chain holding its path would
        have. ``commit_tree`` keeps the accepted path's rows.
        Under a grammar the logits at each parent are masked by the matcher advanced along its
        path (``grammar_walk.TreeGrammarMasks``): q is the masked distribution.

        Nodes past q's support (fewer than m tokens with q > 0, without replacement) are left
        out with their subtrees; the returned parents are renumbered accordingly.
        """
        runner, cache = self.runner, self.runner.kv_cache
        depths = np.asarray(depths, dtype=np.int64)
        active = np.flatnonzero(depths > 0)
        batch_size, vocab_size = len(requests), self.vocab_size
        self._tree_nodes = {}
        if not active.size:
            return TreeProposal(torch.zeros(0, dtype=torch.int64), np.zeros(0, np.int64),
                                np.zeros(batch_size, np.int64), None)
        self._ahead, self._replayed_all = None, False
        slots = np.array([requests[r].slot for r in active], dtype=np.int64)
        num_tokens = np.array([len(requests[r].token_ids) for r in active], dtype=np.int64)
        depth_a = depths[active]
        n_max = shape.num_nodes(int(depth_a.max()))
        feeds = []
        for slot, r, length in zip(slots.tolist(), active.tolist(), num_tokens.tolist()):
            num_cached = min(cache.length(slot), length - 1)
            cache.truncate(slot, num_cached)
            feeds.append(context_tail(requests[r].token_ids, num_cached))
        # [B_a, V]: what follows the last committed token (the root)
        level_logits = runner.forward(slots.tolist(), feeds, "last", self.num_layers)
        greedy_drafts, device = self.greedy, self.device
        temperature = ops.to_device([0.0 if greedy_drafts else float(requests[r].temperature)
                                     for r in active], device, torch.float32)
        seeds = ops.to_device([int(requests[r].seed) for r in active], device, torch.int64)
        tokens = np.full((active.size, n_max), -1, dtype=np.int64)  # host: the next feed
        probs = None if greedy_drafts else torch.zeros(active.size, n_max, vocab_size,
                                                       device=device)
        parents = torch.from_numpy(np.broadcast_to(shape.parents[:n_max],
                                                   (active.size, n_max)).copy())
        level_rows = np.arange(active.size)  # the requests whose last level was fed
        # structured output: a node's children only where its path's grammar allows
        grammars = TreeGrammarMasks([self.draft_grammar(requests[r]) for r in active])
        for t in range(1, int(depth_a.max()) + 1):
            lo, hi = shape.level_starts[t - 1], shape.level_starts[t]
            rows = level_rows[depth_a[level_rows] >= t]
            # the level's parents: the root (t = 1) or the nodes of depth t - 1
            parent_slots = (np.zeros(1, np.int64) if t == 1 else
                            np.arange(shape.level_starts[t - 2], lo) + 1)
            keep_rows = np.searchsorted(level_rows, rows)
            logits = level_logits.view(level_rows.size, parent_slots.size, -1)[keep_rows]
            if grammars:
                logits = grammars.apply(
                    logits, rows, tokens[rows, :lo],
                    np.broadcast_to(shape.parents[:lo], (rows.size, lo)),
                    np.broadcast_to(parent_slots, (rows.size, parent_slots.size)))
            m = int(shape.num_children[parent_slots].max())
            row_index = ops.to_device(rows, device)
            child_ids, q = tree.sample_children(
                logits.reshape(-1, vocab_size),
                temperature[row_index].repeat_interleave(parent_slots.size),
                seeds[row_index].repeat_interleave(parent_slots.size),
                ops.to_device(num_tokens[rows] + t - 1, device).repeat_interleave(
                    parent_slots.size),
                m, without_replacement=True, kernels=self.runner.backend.cpu)
            # (on a GPU a sync per level: the host builds the level's feed)
            child_ids = child_ids.view(rows.size, parent_slots.size, m).cpu().numpy()
            # node i of this level: parent slot parents[i] + 1, rank sibling_rank[i]
            which = shape.parents[lo:hi] + 1 - parent_slots[0]
            tokens[rows, lo:hi] = child_ids[:, which, shape.sibling_rank[lo:hi]]
            if probs is not None:
                probs[row_index[:, None], torch.arange(lo, hi, device=device)[None, :]] = q.view(
                    rows.size, parent_slots.size, vocab_size)[:, ops.to_device(which, device)]
            level_rows = rows[depth_a[rows] > t]
            if not level_rows.size:
                break
            # feed the level (a node past q's support as token 0: it is dropped below) at
            # cache rows num_tokens + lo .., the root's row num_tokens - 1
            feed = np.maximum(tokens[level_rows, lo:hi], 0)
            level_feed = TreeFeed(parents[torch.from_numpy(level_rows)],
                                  num_tokens[level_rows] - 1, 1 + lo, shape.depth)
            level_logits = runner.forward(slots[level_rows].tolist(), feed.tolist(), "all",
                                          self.num_layers, tree=level_feed)
        # the layout of ops.tree, leaving out nodes past q's support and their subtrees
        flat_tokens, flat_parents, flat_probs = [], [], []
        num_draft_tokens = np.zeros(batch_size, dtype=np.int64)
        for a, r in enumerate(active.tolist()):
            n = shape.num_nodes(int(depth_a[a]))
            kept = np.zeros(n, dtype=bool)
            renumber = np.full(n, -1, dtype=np.int64)
            for i in range(n):
                p = shape.parents[i]
                kept[i] = tokens[a, i] >= 0 and (p < 0 or kept[p])
                if kept[i]:
                    renumber[i] = int(kept[:i].sum())
            index = np.flatnonzero(kept)
            self._tree_nodes[int(slots[a])] = index  # proposal node -> shape node
            num_draft_tokens[r] = index.size
            flat_tokens.append(tokens[a, index])
            p = shape.parents[index]
            flat_parents.append(np.where(p < 0, -1, renumber[np.maximum(p, 0)]))
            if probs is not None:
                flat_probs.append(probs[a, ops.to_device(index, device)])
        draft_probs = None if probs is None else torch.cat(flat_probs)
        return TreeProposal(ops.to_device(np.concatenate(flat_tokens), self.device),
                            np.concatenate(flat_parents), num_draft_tokens, draft_probs)

    def commit_tree(self, slots: Sequence[int], num_tokens: Sequence[int],
                    accepted_nodes: np.ndarray) -> None:
        """After verification: keep the accepted path's K/V of each drafted tree at
        consecutive rows (``runtime.tree_verify.commit_tree_path`` on the draft's cache) and
        drop the rest. ``num_tokens`` are the requests' committed lengths when they drafted,
        ``accepted_nodes`` [B, depth] ``tree_rejection_sample``'s (proposal node indices, -1
        padded). A path node of the last level drafted was never fed: the path is cut there
        and ``on_commit``'s rule rolls the slot back to what it holds."""
        cache = self.runner.kv_cache
        keep_slots, starts, paths = [], [], []
        for slot, length, path in zip(slots, num_tokens, np.asarray(accepted_nodes)):
            index = self._tree_nodes.get(int(slot))
            if index is None:
                continue
            fed = cache.length(slot) - length  # tree rows the draft's cache holds
            shape_path = np.array([index[i] if i >= 0 else -1 for i in path], dtype=np.int64)
            # a path is a prefix: cut it at its first node beyond the rows fed
            beyond = np.flatnonzero((shape_path < 0) | (shape_path >= fed))
            cut = beyond[0] if beyond.size else shape_path.size
            shape_path[cut:] = -1
            keep_slots.append(int(slot))
            starts.append(int(length) - 1)
            paths.append(shape_path)
        if keep_slots:
            commit_tree_path(cache, keep_slots, np.array(starts, np.int64), np.stack(paths))
        self._tree_nodes = {}

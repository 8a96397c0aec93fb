"""Token trees drafted by an EAGLE head (docs/design.md §16), on either layout (the flat one of
the GPU path eagerly, the host reading each level's children).

A step, for the requests whose tree has depth > 0 (N committed tokens, the head's cache at
N - 1 positions with the pending pairs still to feed):

    forward 0:  the pending pairs (target hidden, token) at positions .. N - 2, as for a chain
                -> the head's distribution at the root, its output hidden g_root
    level t:    the children of the level's parents are drawn (``ops.tree.sample_children``);
                the nodes that get children of their own are fed as (g_parent, token) at head
                position N - 2 + t, each attending to the context and its fed ancestors
                (``ops.tree_feed`` with the root at row N - 2): the K/V a chain holding the
                node's path would have

then every slot's cache goes back to N - 1 rows, as after a chain's draft: rows fed with the
head's own hidden states are never kept. After verification the target keeps the hidden states
of the root and the accepted path (``runtime.tree_verify.keep_path_hidden``), which
``on_commit`` hands to the head as the pending pairs of the committed positions: the head's
inputs follow the accepted path.

Shapes:

- a static tree (``ops.tree.StaticTree``): every node of a level is fed, the children of every
  node drawn at once, nodes of one depth sharing the draws of their position (the shape does
  not depend on the draws);
- EAGLE-2's dynamic tree (``ops.tree.DynamicTree``): the root gets ``topk`` children; at each
  further level the ``topk`` candidates of the level above with the highest path score get
  ``topk`` children each; the ``num_nodes`` candidates of highest score are kept. Each parent
  draws its children with draws of its own (``sample_children``'s ``node_ids``), and a child's
  score does not depend on which token it is, so whether a node keeps its j-th child depends on
  other nodes' draws only: given that, its children are still the first draws without
  replacement from q, which the verifier's rule for distinct children assumes.

Children are the top m of the head's logits (greedy drafting, or a greedy request) or m
distinct draws from q (probabilistic drafting), over the head's draft vocabulary, mapped to
target ids; q is scattered onto the target vocabulary (zero outside the head's map). Under a
grammar the head's logits at each parent are masked by the matcher advanced along its path
(``grammar_walk.TreeGrammarMasks``; a column is allowed when its target id is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from verispec import ops
from verispec.ops import tree
from verispec.ops.tree import DynamicTree, StaticTree
from verispec.ops.tree_feed import TreeFeed
from verispec.proposers.base import ProposalRequest
from verispec.proposers.draft_tree import TreeProposal
from verispec.proposers.grammar_walk import TreeGrammarMasks


class EagleTreeDrafting:
    """``propose_tree`` / ``commit_tree`` of ``EagleProposer`` (a mixin over its head, its
    runner and its pending pairs)."""

    drafts_dynamic_trees = True

    @torch.inference_mode()
    def propose_tree(self, requests: Sequence[ProposalRequest], shape: StaticTree | DynamicTree,
                     depths: np.ndarray) -> TreeProposal:
        """Draft ``shape`` cut to ``depths[r]`` for every request (the module docstring)."""
        runner, device = self.runner, self.device
        depths = np.asarray(depths, dtype=np.int64)
        batch_size = len(requests)
        self._catch_up_idle(requests)
        active = np.flatnonzero(depths > 0)
        if not active.size:
            return TreeProposal(torch.zeros(0, dtype=torch.int64), np.zeros(0, np.int64),
                                np.zeros(batch_size, np.int64), None)
        self._ahead, self._replayed_all = None, False
        slots = np.array([requests[r].slot for r in active], dtype=np.int64)
        num_tokens, feeds, pending = self._take_pending(requests, active, slots)
        levels = _Levels(
            slots=slots, num_tokens=num_tokens, depths=depths[active],
            temperature=ops.to_device([0.0 if self.greedy else float(requests[r].temperature)
                                       for r in active], device, torch.float32),
            seeds=ops.to_device([int(requests[r].seed) for r in active], device, torch.int64),
            max_depth=shape.depth,
            grammars=TreeGrammarMasks([self.draft_grammar(requests[r]) for r in active],
                                      self.draft_to_target_np))
        try:
            logits, out = self._head_forward(slots.tolist(), feeds, torch.cat(pending), True)
            draft = self._draft_dynamic if isinstance(shape, DynamicTree) else self._draft_static
            trees = draft(levels, shape, logits[:, None], out[:, None])
        finally:
            cache = runner.kv_cache
            for slot, n in zip(slots.tolist(), num_tokens.tolist()):
                cache.truncate(slot, n - 1)  # only rows fed with target hidden states stay
        num_draft_tokens = np.zeros(batch_size, dtype=np.int64)
        num_draft_tokens[active] = [t.size for t, _, _ in trees]
        draft_probs = None
        if not self.greedy:
            draft_probs = torch.cat([self._target_q(q) for _, _, q in trees])
        return TreeProposal(ops.to_device(np.concatenate([t for t, _, _ in trees]), device),
                            np.concatenate([p for _, p, _ in trees]), num_draft_tokens,
                            draft_probs)

    def commit_tree(self, slots: Sequence[int], num_tokens: Sequence[int],
                    accepted_nodes: np.ndarray) -> None:
        """Nothing to keep: the head's cache holds no tree row after drafting, and the accepted
        path's target hidden states reach it through ``on_commit``."""

    # ----------------------------------------------------------------- helpers

    def _target_q(self, q: torch.Tensor) -> torch.Tensor:
        """[n, V_draft] q on the draft vocabulary -> [n, V] float32 on the target's."""
        if self.draft_to_target is None:
            return q
        full = q.new_zeros((q.shape[0], self.vocab_size))
        full[:, self.draft_to_target] = q
        return full

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (-1 kept) -> target ids."""
        if self.draft_to_target is None:
            return ids
        return torch.where(ids >= 0, self.draft_to_target[ids.clamp_min(0)], -1)

    def _children(self, levels: _Levels, rows: np.ndarray, logits: torch.Tensor, depth: int,
                  m: int, node_ids: torch.Tensor | None):
        """``m`` children of each of the P parents of ``rows`` (``logits`` [R, P, V_draft]) at
        ``depth``: (target ids [R, P, m] int64 (-1: past q's support, or masked), q
        [R, P, V_draft] or None (greedy drafting), the j-th largest probability of each
        parent's distribution [R, P, m])."""
        num_rows, num_parents, vocab = logits.shape
        if self.greedy:  # the top m of the logits, no draws; softmax scores the children
            values, ids = torch.topk(logits.float(), m, dim=-1)
            ids = torch.where(values > float("-inf"), ids, -1)  # a token the grammar masks
            top = torch.exp(values - torch.logsumexp(logits.float(), -1, keepdim=True))
            return self._to_target(ids), None, top
        index = ops.to_device(rows, self.device)
        ids, q = tree.sample_children(
            logits.reshape(-1, vocab), levels.temperature[index].repeat_interleave(num_parents),
            levels.seeds[index].repeat_interleave(num_parents),
            ops.to_device(levels.num_tokens[rows] + depth - 1, self.device).repeat_interleave(
                num_parents),
            m, without_replacement=True,
            node_ids=None if node_ids is None else ops.to_device(node_ids, self.device),
            kernels=self.runner.backend.cpu)
        # the j-th largest probability: child j's own for greedy children (top m of the
        # logits); for sampled ones a score that does not depend on which token was drawn
        top = torch.topk(q, m, dim=-1).values
        return (self._to_target(ids).view(num_rows, num_parents, m),
                q.view(num_rows, num_parents, vocab), top.view(num_rows, num_parents, m))

    def _tree_forward(self, levels: _Levels, rows: np.ndarray, ids: np.ndarray,
                      hidden: torch.Tensor, fed_parents: np.ndarray
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``rows``' next W nodes: ``ids`` [R, W] target ids with their parents' output
        hidden states ``hidden`` [R, W, H], the last W of the fed nodes ``fed_parents`` [R, F]
        (local parents among the fed nodes, -1 = the root). Returns (logits [R, W, V_draft],
        output hidden [R, W, H])."""
        runner, cache = self.runner, self.runner.kv_cache
        slots = levels.slots[rows]
        num_rows, width = ids.shape
        counts = np.full(num_rows, width, dtype=np.int64)
        row_starts = cache.lengths_np[slots].copy()  # the root's row + 1 + lo
        cache.check_append_many(slots, counts)
        feed = TreeFeed(torch.from_numpy(fed_parents), levels.num_tokens[rows] - 2,
                        1 + fed_parents.shape[1] - width, levels.max_depth)
        if runner.flat:
            normed, out = self.head.forward_flat(
                ops.to_device(ids.reshape(-1), self.device), hidden.reshape(num_rows * width, -1),
                False, runner.flat_batch(slots.tolist(), counts, row_starts, feed),
                cache.k_layers, cache.v_layers)
        else:
            meta, _, _ = runner._metadata(slots.tolist(), counts, row_starts, width, feed)
            normed, out = self.head(ops.to_device(ids, self.device), hidden, False, meta,
                                    cache.k_layers, cache.v_layers)
        cache.advance(slots.tolist(), counts.tolist())
        logits = self.head.compute_logits(normed.reshape(num_rows * width, -1),
                                          runner.ops if runner.flat else None)
        return logits.view(num_rows, width, -1), out.view(num_rows, width, -1)

    # ----------------------------------------------------------------- the two shapes

    def _draft_static(self, levels: _Levels, shape: StaticTree, logits: torch.Tensor,
                      out: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray, torch.Tensor]]:
        """Every level of ``shape``; per request (tokens [n] int64, parents [n] int64, q
        [n, V_draft]), nodes past q's support left out with their subtrees."""
        depth_a = levels.depths
        num_active = depth_a.size
        n_max = shape.num_nodes(int(depth_a.max()))
        tokens = np.full((num_active, n_max), -1, dtype=np.int64)
        probs = torch.zeros(num_active, n_max, 0 if self.greedy else logits.shape[-1],
                            device=self.device)
        parents = np.broadcast_to(shape.parents[:n_max], (num_active, n_max))
        level_rows = np.arange(num_active)  # the requests whose last level was fed
        for t in range(1, int(depth_a.max()) + 1):
            lo, hi = shape.level_starts[t - 1], shape.level_starts[t]
            rows = level_rows[depth_a[level_rows] >= t]
            keep = ops.to_device(np.searchsorted(level_rows, rows), self.device)
            parent_slots = (np.zeros(1, np.int64) if t == 1 else
                            np.arange(shape.level_starts[t - 2], lo) + 1)
            m = int(shape.num_children[parent_slots].max())
            level_logits = logits[keep]
            if levels.grammars:
                level_logits = levels.grammars.apply(
                    level_logits, rows, tokens[rows, :lo],
                    np.broadcast_to(shape.parents[:lo], (rows.size, lo)),
                    np.broadcast_to(parent_slots, (rows.size, parent_slots.size)))
            child_ids, q, _ = self._children(levels, rows, level_logits, t, m, None)
            # node i of this level: parent slot parents[i] + 1, rank sibling_rank[i]
            which = ops.to_device(shape.parents[lo:hi] + 1 - parent_slots[0], self.device)
            rank = ops.to_device(shape.sibling_rank[lo:hi], self.device)
            tokens[rows, lo:hi] = child_ids[:, which, rank].cpu().numpy()  # the next feed
            if q is not None:
                probs[ops.to_device(rows, self.device)[:, None],
                      torch.arange(lo, hi, device=self.device)[None, :]] = q[:, which]
            parent_out = out[keep][:, which]  # [R, hi - lo, H]
            deeper = depth_a[rows] > t
            if not deeper.any():
                break
            level_rows = rows[deeper]
            logits, out = self._tree_forward(
                levels, level_rows, np.maximum(tokens[level_rows, lo:hi], 0),  # -1: dropped
                parent_out[ops.to_device(np.flatnonzero(deeper), self.device)],
                np.ascontiguousarray(parents[level_rows, :hi]))
        trees = []
        for a in range(num_active):
            n = shape.num_nodes(int(depth_a[a]))
            kept = np.zeros(n, dtype=bool)
            for i in range(n):
                p = shape.parents[i]
                kept[i] = tokens[a, i] >= 0 and (p < 0 or kept[p])
            index = np.flatnonzero(kept)
            renumber = np.cumsum(kept) - 1
            p = shape.parents[index]
            trees.append((tokens[a, index], np.where(p < 0, -1, renumber[np.maximum(p, 0)]),
                          probs[a, ops.to_device(index, self.device)]))
        return trees

    def _draft_dynamic(self, levels: _Levels, shape: DynamicTree, logits: torch.Tensor,
                       out: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray, torch.Tensor]]:
        """EAGLE-2's expansion and pruning (``DynamicTree``); per request (tokens, parents,
        q) of the kept candidates in candidate order (parents first, siblings in drawing
        order)."""
        depth_a = levels.depths
        num_active, width, vocab = depth_a.size, shape.max_width, logits.shape[-1]
        max_depth = int(depth_a.max())
        num_candidates = DynamicTree.num_candidates(max_depth, width)
        cand_tokens = np.full((num_active, num_candidates), -1, dtype=np.int64)
        cand_parents = np.full((num_active, num_candidates), -1, dtype=np.int64)
        device = self.device
        cand_scores = torch.full((num_active, num_candidates), float("-inf"), device=device)
        cand_q = np.zeros((num_active, num_candidates), dtype=np.int64)  # row of q_rows
        q_rows = torch.zeros(num_active, 1 + (max_depth - 1) * width, 0 if self.greedy else vocab,
                             device=device)
        fed_parents = np.full((num_active, (max_depth - 1) * width), -1, dtype=np.int64)
        # the level's parents: candidate index (-1 the root), fed index, score, q row
        parent_cand = np.full((num_active, 1), -1, dtype=np.int64)
        parent_fed = np.full((num_active, 1), -1, dtype=np.int64)
        parent_score = torch.zeros(num_active, 1, device=device)
        parent_q = np.zeros((num_active, 1), dtype=np.int64)
        rows = np.arange(num_active)
        for t in range(1, max_depth + 1):
            first = DynamicTree.num_candidates(t - 1, width)
            num_parents = parent_cand.shape[1]
            size = num_parents * width
            index = ops.to_device(rows, device)
            node_ids = torch.from_numpy(parent_cand + 1).reshape(-1)  # the root 0
            if levels.grammars:
                logits = levels.grammars.apply(logits, rows, cand_tokens[rows, :first],
                                               cand_parents[rows, :first], parent_cand + 1)
            child_ids, q, top = self._children(levels, rows, logits, t, width, node_ids)
            scores = parent_score[:, :, None] + torch.log(top).clamp_max(0.0)
            scores = torch.where(child_ids >= 0, scores, float("-inf")).reshape(-1, size)
            cand_tokens[rows, first:first + size] = child_ids.reshape(-1, size).cpu().numpy()
            cand_parents[rows, first:first + size] = np.repeat(parent_cand, width, axis=1)
            cand_scores[index, first:first + size] = scores
            cand_q[rows, first:first + size] = np.repeat(parent_q, width, axis=1)
            if q is not None:
                q_rows[index[:, None], ops.to_device(parent_q, device)] = q
            deeper = depth_a[rows] > t
            if not deeper.any():
                break
            # expand the `width` best candidates of this level (ties: the earlier one)
            keep = np.flatnonzero(deeper)
            rows = rows[keep]
            keep_t = ops.to_device(keep, device)
            order = torch.sort(scores[keep_t], dim=1, descending=True,
                               stable=True).indices[:, :width].cpu().numpy()  # [R, width]
            chosen = first + order
            fed_lo = (t - 1) * width
            pick = np.arange(rows.size)[:, None]
            fed_parents[rows, fed_lo:fed_lo + width] = parent_fed[keep][pick, order // width]
            parent_out = out[keep_t[:, None], ops.to_device(order // width, device)]
            logits, out = self._tree_forward(
                levels, rows, np.maximum(cand_tokens[rows[:, None], chosen], 0),  # -1: -inf
                parent_out, np.ascontiguousarray(fed_parents[rows, :fed_lo + width]))
            parent_cand = chosen
            parent_fed = np.broadcast_to(fed_lo + np.arange(width), chosen.shape).copy()
            parent_score = cand_scores[ops.to_device(rows, device)[:, None],
                                       ops.to_device(chosen, device)]
            parent_q = np.broadcast_to(1 + fed_lo + np.arange(width), chosen.shape).copy()
        trees = []
        for a in range(num_active):
            count = DynamicTree.num_candidates(int(depth_a[a]), width)
            scores = cand_scores[a, :count]
            order = torch.sort(scores, descending=True, stable=True).indices
            order = order[:shape.num_nodes(int(depth_a[a]))]
            index = np.sort(order[torch.isfinite(scores[order])].cpu().numpy())
            renumber = np.full(count, -1, dtype=np.int64)
            renumber[index] = np.arange(index.size)
            p = cand_parents[a, index]
            parents = np.where(p < 0, -1, renumber[np.maximum(p, 0)])
            assert (parents < np.arange(index.size)).all() and (parents >= -1).all()
            trees.append((cand_tokens[a, index], parents,
                          q_rows[a, ops.to_device(cand_q[a, index], self.device)]))
        return trees


@dataclasses.dataclass
class _Levels:
    """One tree draft's per-request inputs (the active requests, in order)."""

    slots: np.ndarray  # [A] int64
    num_tokens: np.ndarray  # [A] int64 N, the committed lengths
    depths: np.ndarray  # [A] int64, each tree's depth (>= 1)
    temperature: torch.Tensor  # [A] float32, 0 = greedy children
    seeds: torch.Tensor  # [A] int64
    max_depth: int  # the shape's depth (a static bound)
    grammars: TreeGrammarMasks  # structured output: the masks at each parent

"""Exact verification of token trees, torch (docs/design.md §16, the rules of §3 over siblings).

Layout: ``verispec.ops.tree``. Request r's target rows are its slots' rows: ``cu[r] + r`` is the
root's (what follows the last committed token), ``cu[r] + r + 1 + i`` node i's. p_s is the
processed target distribution of slot s's row; q is the draft distribution a node was drawn
from (the proposer's distribution at its parent; siblings share it).

The walk starts at the root with ``p = p_root`` and tries the children ``c_1..c_m`` of the
current node in drafting order; each try decides one node, so ``max_num_draft_tokens`` steps
finish every request:

    full rule, children i.i.d. from q (with replacement):
        q_j = q
        accept c_j  iff  u_j * q_j(c_j) < p(c_j)                 (min(1, p/q_j) at c_j)
        on rejection  p <- norm(max(p - q_j, 0))                  (the residual)
    full rule, children drawn without replacement from q:
        q_j = norm(q with c_1..c_{j-1} zeroed)                    (c_j's actual distribution)
        the same test and residual with this q_j
    one-hot rule (greedy or other deterministic children, no q):
        accept c_j  iff  u_j < p(c_j);  on rejection  p <- norm(p with c_j zeroed)
    greedy target (temperature 0):
        accept c_j  iff  c_j == argmax p_node

An accepted child becomes the current node (``p = p_child``, the next tries start at its first
child). Where no child is left, the request emits one token: the recovered token
``~ p`` (the last residual) if a child of this node was rejected, else the bonus token ``~
p_node``; argmax for a greedy target. Why this is exact: given any history, the try of c_j is a
rejection step with proposal q_j (c_j's true distribution given the earlier siblings) and target
p, so what it emits (c_j, or what the later tries emit from the residual) follows p, by induction
from the last sibling (docs/design.md §16). A residual that is all zero (p = q_j up to rounding)
keeps p. A child with q_j(c_j) = 0 cannot have been drawn from q_j: it is rejected.

Randomness (docs/design.md §4): the try of a node at depth t (sibling rank j) uses the acceptance
stream's draw ``(seed, position + t - 1, index j)``; the emitted token the residual or sample
stream at ``position + depth``. A chain (every rank 0) draws what ``rejection_sample`` draws and
returns its tokens; no draw depends on the rest of the batch. No host sync.
"""

from __future__ import annotations

from types import ModuleType

import torch

from verispec.ops import philox
from verispec.ops.rejection import PLACEHOLDER_TOKEN_ID, check_rows
from verispec.ops.sampling import _processed_probs, check_params, first_argmax, race
from verispec.ops.tree import (
    check_tree,
    child_table,
    padded_parents,
    sibling_ranks,
    slot_depths,
)


def full_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``max(p - q, 0)`` ([B, V] float32), what p becomes (normalised) after a rejected child of
    the full rule."""
    return torch.clamp_min(p - q, 0.0)


def tree_rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    parent_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_num_draft_tokens: int,
    max_depth: int,
    max_width: int,
    without_replacement: bool = False,
    all_greedy: bool = False,
    *,
    check: bool = True,
    kernels: ModuleType | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of token trees; return each request's output tokens and accepted path.

    Parameters
    ----------
    target_logits : [num_draft_tokens + B, V] float32 / bfloat16 / float16
        Request r's rows: its root row, then one row per node in node order.
    draft_token_ids : [num_draft_tokens] int32 / int64, every request's nodes concatenated.
    parent_ids : [num_draft_tokens] int32 / int64, each node's parent as a local index in its
        request (-1 = the root); parents come before their children.
    cu_num_draft_tokens : [B + 1] int32 / int64, leading 0; request r owns ``[cu[r], cu[r+1])``.
    draft_probs : [num_draft_tokens, V] float32 or None
        The distribution q each node was drawn from (full rule); None selects the one-hot rule.
    temperature, top_k, top_p, min_p : [B] sampling settings, as in ``rejection_sample``.
    seeds : [B] int64 request seeds.
    positions : [B] int64, the position a child of the root occupies (the committed length).
    max_num_draft_tokens, max_depth, max_width : static bounds on the nodes of a tree, its depth
        and the children of one node (they size the loops and the output without a host sync).
    without_replacement : the children of a node were drawn from q without replacement (the
        proposer samples distinct children); False: i.i.d. Only the full rule reads it.
    all_greedy : the caller's host-side knowledge that every request is greedy (skips p).
    check : run ``check_tree`` (reads the trees on the host; proposers' trees are valid by
        construction and turn it off).
    kernels : the compiled CPU kernels (``Backend.cpu``) for the draws and the race, or None.

    Returns
    -------
    token_ids : [B, max_depth + 1] int32
        Row r: the accepted path's tokens, then the recovered or bonus token, then -1 padding
        (the contract of ``rejection_sample``'s output).
    accepted_nodes : [B, max_depth] int64
        Row r: the local indices of the accepted path's nodes, root to leaf, then -1.
    """
    device = target_logits.device
    batch_size = cu_num_draft_tokens.shape[0] - 1
    num_draft_tokens = draft_token_ids.shape[0]
    vocab_size = target_logits.shape[1]
    n = max_num_draft_tokens
    check_rows(target_logits, draft_token_ids, draft_probs, batch_size, n)
    check_params(batch_size, device, temperature, top_k, top_p, min_p, seeds, positions)
    if check:
        check_tree(draft_token_ids, parent_ids, cu_num_draft_tokens, vocab_size, n, max_depth,
                   max_width)

    cu = cu_num_draft_tokens.to(torch.int64)
    req_ids = torch.arange(batch_size, device=device)
    parents, draft_req, draft_index = padded_parents(parent_ids, cu, n)
    ranks = sibling_ranks(parents)  # [B, n]
    children = child_table(parents, ranks, max_width)  # [B, n + 1, W + 1]
    depths = slot_depths(parents, max_depth)  # [B, n + 1]
    draft_ids = draft_token_ids.to(torch.int64)
    root_rows = cu[:-1] + req_ids  # [B]; slot s of request r is row root_rows[r] + s

    greedy = temperature == 0  # [B]
    argmax_rows = first_argmax(target_logits)  # [N + B]
    probs = None
    if not all_greedy:
        row_req = torch.repeat_interleave(req_ids, cu[1:] - cu[:-1] + 1,
                                          output_size=num_draft_tokens + batch_size)
        probs = _processed_probs(target_logits, temperature[row_req],
                                 *(None if x is None else x[row_req]
                                   for x in (top_k, top_p, min_p)))  # [N + B, V] float32
        # u of every node: acceptance stream at the node's position, index = its sibling rank
        node_depth = depths[draft_req, draft_index + 1]
        u_nodes = philox.uniform_at(seeds[draft_req], positions[draft_req] + node_depth - 1,
                                    philox.ACCEPT_STREAM, ranks[draft_req, draft_index],
                                    kernels)  # [N]

    cur = torch.zeros(batch_size, dtype=torch.int64, device=device)  # current slot
    tried = torch.zeros_like(cur)  # children of the current slot tried (all rejected)
    path = torch.full((batch_size, max_depth + 1), -1, dtype=torch.int64, device=device)
    if probs is not None:
        # p of the current slot is w * scale: w unnormalised (the race needs no normalising,
        # and scale = 1 until the first rejection keeps p's own bits, as a chain has them)
        w = probs[root_rows]  # [B, V]
        scale = torch.ones(batch_size, 1, device=device)
        if without_replacement and draft_probs is not None:
            keep = torch.ones(batch_size, vocab_size, device=device)  # 0 at tried children

    # each step decides one node: n steps finish every tree
    for _ in range(n if num_draft_tokens else 0):
        child = children[req_ids, cur, tried.clamp_max(max_width)]  # [B] local index or -1
        has_child = child >= 0
        node = (cu[:-1] + child).clamp(0, num_draft_tokens - 1)  # [B] global
        token = draft_ids[node]  # [B]
        accepted = token == argmax_rows[root_rows + cur]  # greedy target
        if probs is not None:
            p_token = w.gather(1, token[:, None])[:, 0] * scale[:, 0]
            u = u_nodes[node]
            if draft_probs is not None:
                q = draft_probs[node]  # [B, V]
                if without_replacement:
                    masked = q * keep
                    mass = masked.sum(-1, keepdim=True)
                    masked = torch.where(mass > 0, masked / mass.clamp_min(1e-30), 0.0)
                    q = torch.where((tried > 0)[:, None], masked, q)
                q_token = q.gather(1, token[:, None])[:, 0]
                accept_random = (u * q_token < p_token) & (q_token > 0)
                residual = full_residual(w * scale, q)
            else:
                accept_random = u < p_token  # p(c) = 0 never passes: u > 0
                residual = w.scatter(1, token[:, None], 0.0)
            accepted = torch.where(greedy, accepted, accept_random)
        accepted = accepted & has_child
        rejected = has_child & ~accepted

        depth = depths[req_ids, cur]
        path[req_ids, torch.where(accepted, depth, max_depth)] = torch.where(
            accepted, child, path[req_ids, max_depth])
        next_slot = torch.where(accepted, child + 1, cur)
        if probs is not None:
            mass = residual.sum(-1, keepdim=True)
            new_residual = rejected[:, None] & (mass > 0)  # else p = q_j: keep p
            w = torch.where(new_residual, residual, w)
            scale = torch.where(new_residual, 1.0 / mass.clamp_min(1e-30), scale)
            w = torch.where(accepted[:, None], probs[root_rows + next_slot], w)
            scale = torch.where(accepted[:, None], 1.0, scale)
            if without_replacement and draft_probs is not None:
                keep[req_ids, token] = torch.where(rejected, 0.0, keep[req_ids, token])
                keep = torch.where(accepted[:, None], 1.0, keep)
        tried = torch.where(accepted, 0, tried + rejected.to(torch.int64))
        cur = next_slot

    # --- the one token each request emits at its last node ---
    depth = depths[req_ids, cur]  # [B] accepted tokens
    final_ids = argmax_rows[root_rows + cur]
    if probs is not None:
        stream = torch.where(tried > 0, philox.RESIDUAL_STREAM, philox.SAMPLE_STREAM)
        random_ids = race(w, seeds, positions + depth, stream, kernels)
        final_ids = torch.where(greedy, final_ids, random_ids)

    accepted_nodes = path[:, :max_depth]
    columns = torch.arange(max_depth + 1, device=device)[None, :]
    path_tokens = draft_ids[(cu[:-1, None] + path.clamp_min(0)).clamp(
        0, max(num_draft_tokens - 1, 0))] if num_draft_tokens else torch.zeros_like(path)
    token_ids = torch.where(columns < depth[:, None], path_tokens, PLACEHOLDER_TOKEN_ID)
    token_ids = torch.where(columns == depth[:, None], final_ids[:, None], token_ids)
    return token_ids.to(torch.int32), accepted_nodes

"""Token trees in the flattened batch layout: structure, positions, the tree attention mask and
the drafts each slot sees (``SlotPaths``, for the sampling options) (docs/design.md §16).

Request r owns the tree nodes ``[cu[r], cu[r+1])`` (n_r of them, possibly 0): node i of the
request (its *local* index) holds draft token ``draft_token_ids[cu[r] + i]`` and its parent's
local index ``parent_ids[cu[r] + i]`` (-1: the root, i.e. the last committed token). Parents come
before their children (``parent_ids[cu[r] + i] < i``) and siblings are listed in the order they
were drafted, which is the order verification tries them. A *slot* numbers the root 0 and node i
as i + 1; the target scores one row per slot (the root row, then a row per node), so a chain is
the tree whose node i has parent i - 1 and the rows are exactly a chain's verify rows and bonus
row (docs/design.md §2).

Every function here is tensor ops with static bounds (``max_num_draft_tokens``, ``max_depth``,
``max_width``): no host sync. ``check_tree`` is the one host-side check.

The children of a node are drafted by ``sample_children`` from the proposer's distribution q
at the node: greedy (the top m tokens of the logits, one-hot rule), i.i.d. from q, or without
replacement from q. The draws come from the draft stream at the children's position
(docs/design.md §4); nodes of one depth share that position and its draws, which costs no
exactness because verification descends into one node per depth.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from verispec.ops import philox
from verispec.ops.sampling import draft_probs

ABSENT = -2  # parent value of padding slots in the per-request layout (matches nothing)


def padded_parents(
    parent_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor, max_num_draft_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parents in a per-request layout.

    Returns
    -------
    parents : [B, max_num_draft_tokens] int64, local parent index (-1 = root), ``ABSENT`` past
        n_r.
    draft_req : [num_draft_tokens] int64, request of each node.
    draft_index : [num_draft_tokens] int64, local index of each node.
    """
    device = parent_ids.device
    cu = cu_num_draft_tokens.to(torch.int64)
    batch_size = cu.shape[0] - 1
    num_draft_tokens = parent_ids.shape[0]
    draft_req = torch.repeat_interleave(torch.arange(batch_size, device=device), cu[1:] - cu[:-1],
                                        output_size=num_draft_tokens)
    draft_index = torch.arange(num_draft_tokens, device=device) - cu[draft_req]
    parents = torch.full((batch_size, max_num_draft_tokens), ABSENT, dtype=torch.int64,
                         device=device)
    parents[draft_req, draft_index] = parent_ids.to(torch.int64)
    return parents, draft_req, draft_index


def sibling_ranks(parents: torch.Tensor) -> torch.Tensor:
    """[B, n] int64: rank of each node among its siblings (0 = drafted first; 0 for padding),
    from ``padded_parents``' [B, n] parents."""
    n = parents.shape[1]
    same = parents[:, :, None] == parents[:, None, :]  # [B, n, n]: node i and j share a parent
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)  # j < i
    return (same & earlier).sum(-1) * (parents != ABSENT)


def child_table(parents: torch.Tensor, ranks: torch.Tensor, max_width: int) -> torch.Tensor:
    """[B, n + 1, max_width + 1] int64: entry ``[r, s, j]`` is the local index of slot s's j-th
    child, -1 where there is none (the last column is always -1, so ``j == max_width`` reads as
    "no more children"). ``parents`` and ``ranks`` [B, n] as above."""
    batch_size, n = parents.shape
    table = torch.full((batch_size, n + 2, max_width + 1), -1, dtype=torch.int64,
                       device=parents.device)
    present = parents != ABSENT
    # absent nodes and ranks past max_width land in the dump row n + 1, sliced off below
    row = torch.where(present & (ranks < max_width), parents + 1, n + 1)
    col = ranks.clamp_max(max_width)
    batch = torch.arange(batch_size, device=parents.device)[:, None].expand(-1, n)
    local = torch.arange(n, device=parents.device).expand(batch_size, -1)
    table[batch, row, col] = local
    table[:, :, max_width] = -1
    return table[:, : n + 1]


def slot_depths(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, n + 1] int64 depth of every slot: the root 0, a child of the root 1, and so on
    (padding slots get a meaningless value). ``parents`` [B, n] as above."""
    batch_size, n = parents.shape
    depth = torch.zeros(batch_size, n + 1, dtype=torch.int64, device=parents.device)
    parent_slot = (parents + 1).clamp_min(0)  # [B, n]
    for _ in range(max_depth):  # a parent's depth is final one iteration before its child's
        depth[:, 1:] = depth.gather(1, parent_slot) + 1
    return depth


def check_tree(draft_token_ids: torch.Tensor, parent_ids: torch.Tensor,
               cu_num_draft_tokens: torch.Tensor, vocab_size: int, max_num_draft_tokens: int,
               max_depth: int, max_width: int) -> None:
    """``ValueError`` unless the trees keep the layout's contract: ids in [0, V), every parent in
    [-1, own local index), n_r <= max_num_draft_tokens, depth <= max_depth, at most max_width
    children per node. Reads the tree on the host (a sync on a GPU)."""
    cu = cu_num_draft_tokens.to(torch.int64).cpu()
    num_drafts = cu[1:] - cu[:-1]
    if parent_ids.shape != draft_token_ids.shape:
        raise ValueError(f"parent_ids must be [{draft_token_ids.shape[0]}], got "
                         f"{list(parent_ids.shape)}")
    if num_drafts.numel() and int(num_drafts.max()) > max_num_draft_tokens:
        raise ValueError(f"a tree has {int(num_drafts.max())} nodes, more than "
                         f"max_num_draft_tokens = {max_num_draft_tokens}")
    if draft_token_ids.numel() == 0:
        return
    ids = draft_token_ids.cpu()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft_token_ids must lie in [0, {vocab_size})")
    parents, _, draft_index = padded_parents(parent_ids.cpu(), cu, max_num_draft_tokens)
    flat = parent_ids.cpu().to(torch.int64)
    if bool(((flat < -1) | (flat >= draft_index)).any()):
        raise ValueError("parent_ids must lie in [-1, the node's own index in its request)")
    depth = slot_depths(parents, max_num_draft_tokens)
    present = torch.cat([torch.ones_like(parents[:, :1], dtype=torch.bool),
                         parents != ABSENT], 1)
    if bool((depth[present] > max_depth).any()):
        raise ValueError(f"a tree is deeper than max_depth = {max_depth}")
    if bool((sibling_ranks(parents)[parents != ABSENT] >= max_width).any()):
        raise ValueError(f"a node has more than max_width = {max_width} children")


def parents_from_paths(paths: list[tuple[int, ...]]) -> list[int]:
    """Local parent indices of a tree given as vLLM's ``speculative_token_tree``: one tuple per
    node, the child indices leading to it from the root, e.g. ``[(0,), (1,), (0, 0), (0, 1)]``
    → ``[-1, -1, 0, 0]``. The nodes keep the given order, which must list every path after its
    prefix and the children of a node in the order of their indices."""
    index = {(): -1}
    parents = []
    for i, path in enumerate(paths):
        path = tuple(path)
        if not path or path in index or path[:-1] not in index:
            raise ValueError(f"speculative_token_tree: path {path} must be new, non-empty and "
                             f"come after its prefix {path[:-1]}")
        expected = sum(1 for p in index if len(p) == len(path) and p[:-1] == path[:-1])
        if path[-1] != expected:
            raise ValueError(f"speculative_token_tree: path {path} should end in {expected} "
                             "(siblings are numbered 0, 1, ... in order)")
        parents.append(index[path[:-1]])
        index[path] = i
    return parents


class SlotPaths:
    """The drafts each slot of one request's tree sees (its row's context, docs/design.md §15,
    §16): the root (slot 0) none, node i (slot i + 1) the drafts on the path from the root to
    node i, in depth order. A chain is the tree whose node i has parent i - 1: slot i sees
    d_1..d_i.

    ``parent_ids`` [n] int64 host, local parent indices (-1 = the root, parents first);
    ``width`` the tokens of context a slot needs (``context``: the longest bad-word prefix).
    """

    def __init__(self, parent_ids: np.ndarray, width: int) -> None:
        n = len(parent_ids)
        self.width = width
        parent_slot = np.concatenate([[0], np.asarray(parent_ids, dtype=np.int64) + 1])
        # above[s, j]: the slot j steps above slot s (the root is slot 0, node i slot i + 1),
        # 0 from the root on; at least `width` columns
        walk, columns = np.arange(n + 1), []
        while walk.any() or len(columns) < width:
            columns.append(walk)
            walk = parent_slot[walk]
        self.above = (np.stack(columns, 1) if columns
                      else np.zeros((n + 1, 0), dtype=np.int64))  # [n + 1, max(depth, L)]
        on_path = self.above > 0
        self.depths = on_path.sum(1)  # [n + 1] int64, the drafts each slot sees
        slots, steps = np.nonzero(on_path)
        # ([P] slot, [P] node): one pair per draft a slot sees
        self.pairs = (slots, self.above[slots, steps] - 1)

    def context(self, tail_base: int, draft_base: int) -> np.ndarray:
        """[n + 1, width] int64: the last ``width`` tokens each slot sees (oldest first), as
        indices into a token source holding the request's ``width`` last output tokens at
        ``tail_base`` and its drafts at ``draft_base``."""
        width = self.width
        steps = np.arange(width - 1, -1, -1)  # column c: `steps[c]` tokens before the last
        back = steps[None, :] - self.depths[:, None]  # >= 0: from the output's tail
        node = self.above[:, steps] - 1  # < depth: the draft of the node that far up
        return np.where(back < 0, draft_base + node, tail_base + width - 1 - back)


# Sibling j of an i.i.d. draw races with the draft stream's draws at indices j * stride + v,
# beyond any vocabulary index (and below the two-level race's block draws at 2**33).
SIBLING_INDEX_STRIDE = 1 << 24


def sample_children(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    num_children: int,
    without_replacement: bool,
    node_ids: torch.Tensor | None = None,
    kernels: ModuleType | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft the children of one node per row.

    Parameters
    ----------
    logits : [R, V] the proposer's logits at each node
    temperature : [R] float32; 0 = greedy drafting: the ``num_children`` largest logits, in
        order (distinct, deterministic: verified by the one-hot rule)
    seeds : [R] int64
    positions : [R] int64, the position the children occupy
    num_children : m, the children per node
    without_replacement : draw distinct children: the order of ``q_v / E_v`` (``E_v ~ Exp(1)``,
        one draw per token) is a sample of q without replacement, first to last. Else i.i.d.:
        child j is ``argmax_v q_v / E_jv`` with its own draws (``SIBLING_INDEX_STRIDE``).
    node_ids : [R] int64 or None. None: the rows' nodes share the draws of their position (a
        static shape). Else, without replacement only, each row races with draws of its own,
        at indices ``node_ids * SIBLING_INDEX_STRIDE + v``: a dynamic tree, whose shape
        depends on other nodes' children, needs every node's children independent of them.
    kernels : the compiled CPU kernels (``Backend.cpu``) for the draws, or None

    Returns
    -------
    (child_token_ids [R, m] int64, q [R, V] float32). Without replacement, a child past q's
    support (fewer than m tokens with q > 0) is -1, and so is a greedy child of logit -inf (a
    token a grammar masks): the proposer must leave it out.
    """
    num_rows, vocab_size = logits.shape
    q = draft_probs(logits, temperature)
    greedy_logits, greedy_ids = torch.topk(logits.to(torch.float32), num_children, dim=-1)
    greedy_ids = torch.where(greedy_logits > float("-inf"), greedy_ids, -1)  # masked: none
    if without_replacement:
        if node_ids is None:
            noise = philox.exponential(seeds, positions, philox.DRAFT_STREAM, vocab_size,
                                       kernels)
        else:
            vocab = torch.arange(vocab_size, device=logits.device)
            noise = philox.exponential_at(seeds, positions, philox.DRAFT_STREAM,
                                          node_ids[:, None] * SIBLING_INDEX_STRIDE + vocab,
                                          kernels)
        scores, random_ids = torch.topk(q / noise, num_children, dim=-1)
        random_ids = torch.where(scores > 0, random_ids, -1)
    else:
        vocab = torch.arange(vocab_size, device=logits.device)
        random_ids = torch.stack([
            (q / philox.exponential_at(seeds, positions, philox.DRAFT_STREAM,
                                       (j * SIBLING_INDEX_STRIDE + vocab).expand(num_rows, -1),
                                       kernels)).argmax(-1)
            for j in range(num_children)], dim=1)
    return torch.where((temperature == 0)[:, None], greedy_ids, random_ids), q


def tree_attention(
    parents: torch.Tensor, starts: torch.Tensor, kv_len: int, max_depth: int,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and attention mask of a verify forward over token trees (docs/design.md §16).

    Slot s of request b (the root 0, node i at i + 1) is written at cache row ``starts[b] + s``
    and occupies position ``starts[b] + depth(s)``: the context length (the root included) +
    the node's depth - 1. It attends to the context (rows below ``starts[b]``) and to the rows
    of its ancestors and itself, which in row order are its root-to-node path in depth order:
    the same keys, in the same order, as a chain holding that path.

    Parameters
    ----------
    parents : [B, n] int64, ``padded_parents``' layout (padding slots see the context and
        their own row; their outputs are meant to be discarded)
    starts : [B] int64, each request's committed length (the root's row)
    kv_len : int, the rows the forward attends over (>= starts + n_b + 1 for every request)
    max_depth : static bound on the depth of a tree
    window : sliding-window size or None: a key at position k is seen from position p only
        if p - k < window

    Returns
    -------
    positions : [B, n + 1] int64, the position of every slot
    attn_mask : [B, 1, n + 1, kv_len] bool, True = attend (``AttentionMetadata.attn_mask``)
    """
    batch_size, n = parents.shape
    device = parents.device
    depths = slot_depths(parents, max_depth)  # [B, n + 1]
    positions = starts[:, None] + depths
    parent_slot = torch.cat([torch.zeros(batch_size, 1, dtype=torch.int64, device=device),
                             (parents + 1).clamp_min(0)], 1)  # [B, n + 1], the root its own
    ancestors = torch.zeros(batch_size, n + 1, n + 1, dtype=torch.bool, device=device)
    walk = torch.arange(n + 1, device=device).expand(batch_size, -1).clone()  # [B, n + 1]
    for _ in range(max_depth + 1):  # self, parent, ..., root
        ancestors.scatter_(2, walk[..., None], True)
        walk = parent_slot.gather(1, walk)
    keys = torch.arange(kv_len, device=device)
    rel = keys[None, :] - starts[:, None]  # [B, kv_len]: key row - root row
    in_tree = (rel >= 0) & (rel <= n)
    slot_of_key = rel.clamp(0, n)
    mask = ancestors.gather(2, slot_of_key[:, None, :].expand(-1, n + 1, -1))
    mask = (mask & in_tree[:, None, :]) | (rel < 0)[:, None, :]  # [B, n + 1, kv_len]
    if window is not None:
        key_positions = torch.where(rel < 0, keys[None, :],
                                    starts[:, None] + depths.gather(1, slot_of_key))
        mask &= positions[:, :, None] - key_positions[:, None, :] < window
    return positions, mask[:, None]


class StaticTree:
    """A fixed tree shape in breadth-first order, as the engine drafts and verifies it.

    ``parents`` (local parent indices, -1 = the root, parents before children) is reordered
    by depth, keeping the given order within a depth: the order still lists parents before
    children and each node's children in their given order, and now the nodes of depth t are
    the contiguous range ``[level_starts[t - 1], level_starts[t])``. So the tree cut to depth
    D (a request near ``max_tokens``) is its first ``num_nodes(D)`` nodes with the same
    parents, and a drafter writes one level after the other at consecutive cache rows.

    Attributes (host numpy int64): ``parents`` [N], ``depths`` [N] (1 = a child of the root),
    ``level_starts`` [depth + 1] (``level_starts[0] = 0``), ``num_children`` [N + 1] per slot
    (the root's first), ``sibling_rank`` [N]; ``depth``, ``max_width`` ints.
    """

    def __init__(self, parents: list[int]) -> None:
        parents = list(parents)
        depth_of = []
        for p in parents:
            depth_of.append(1 if p < 0 else depth_of[p] + 1)
        order = sorted(range(len(parents)), key=lambda i: (depth_of[i], i))
        new_index = {old: new for new, old in enumerate(order)}
        self.parents = np.array([-1 if parents[i] < 0 else new_index[parents[i]] for i in order],
                                dtype=np.int64)
        self.depths = np.array([depth_of[i] for i in order], dtype=np.int64)
        self.depth = int(self.depths.max())
        self.level_starts = np.searchsorted(self.depths, np.arange(1, self.depth + 2)).astype(
            np.int64)
        self.level_starts[0] = 0
        self.num_children = np.bincount(self.parents + 1, minlength=len(parents) + 1).astype(
            np.int64)
        self.sibling_rank = np.zeros(len(parents), dtype=np.int64)
        seen = np.zeros(len(parents) + 1, dtype=np.int64)
        for i, p in enumerate(self.parents):
            self.sibling_rank[i] = seen[p + 1]
            seen[p + 1] += 1
        self.max_width = int(self.num_children.max())

    @property
    def num_nodes_total(self) -> int:
        return int(self.parents.shape[0])

    def num_nodes(self, depth: int) -> int:
        """Nodes of the tree cut to ``depth`` (0: none)."""
        return int(self.level_starts[max(0, min(depth, self.depth))])

    def max_depth_within(self, max_nodes: int) -> int:
        """The deepest cut with at most ``max_nodes`` nodes."""
        return int(np.searchsorted(self.level_starts, max_nodes, side="right") - 1)


# The most candidates a dynamic tree drafts per request: its node ids (the root 0, candidate i
# as i + 1) index the draft stream's draws below the two-level race's block draws (2**33).
MAX_DYNAMIC_CANDIDATES = 500


class DynamicTree:
    """EAGLE-2's dynamic tree (docs/design.md §16): drafted level by level, ``topk`` children
    for each of the ``topk`` candidates of the level above with the highest path score (the
    root alone at depth 1), to ``depth`` levels; then the ``num_nodes_total`` candidates with
    the highest path score are kept (the proposer drafts it: ``EagleProposer.propose_tree``).

    The path score of child j (0-based) of node A is ``score(A) * q_A^(j)``, with ``q_A^(j)``
    the j-th largest probability of the proposer's distribution at A (greedy drafting:
    softmax(logits), whose top m are the children, so the score is the path's probability as
    in EAGLE-2; sampled drafting: q, a score that does not depend on which token child j is).
    A child's score is at most its parent's and at most its earlier siblings', so the kept set
    holds every kept node's parent and earlier siblings (ties go to the earlier candidate).

    The same interface as ``StaticTree`` for the engine: ``depth``, ``max_width``,
    ``num_nodes_total``, ``num_nodes(depth)`` (the most nodes a tree cut to ``depth`` keeps)
    and ``max_depth_within``.
    """

    def __init__(self, depth: int, topk: int, num_nodes: int) -> None:
        self.depth = int(depth)
        self.max_width = int(topk)
        self.num_nodes_total = int(num_nodes)

    @staticmethod
    def num_candidates(depth: int, topk: int) -> int:
        """Candidates drafted to ``depth`` levels: topk, then topk * topk per level."""
        return 0 if depth <= 0 else topk + (depth - 1) * topk * topk

    def num_nodes(self, depth: int) -> int:
        """The most nodes of the tree cut to ``depth`` (0: none)."""
        depth = max(0, min(depth, self.depth))
        return min(self.num_nodes_total, self.num_candidates(depth, self.max_width))

    def max_depth_within(self, max_nodes: int) -> int:
        """The deepest cut with at most ``max_nodes`` nodes."""
        best = 0
        for depth in range(1, self.depth + 1):
            if self.num_nodes(depth) <= max_nodes:
                best = depth
        return best

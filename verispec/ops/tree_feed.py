"""A forward that feeds the slots of token trees (docs/design.md §16): the positions of the fed
tokens and what each attends to, as an attention mask (the CPU path) or as paths (the flat
layout of the GPU path, ``ops.model_ops.cache_attention``).

Request b's tree has its root (slot 0, the last committed token) at cache row ``roots[b]`` and
slot s at row ``roots[b] + s``, slots in node order (``ops.tree``'s layout: parents before
children). A forward feeds slots ``first_slot .. first_slot + n_b - 1`` of each tree at the rows
its cache appends next, so the cache holds ``roots[b] + first_slot`` rows before it: the verify
forward feeds every slot (first_slot 0), a drafter one level after the other. A fed slot sits
at position ``roots[b] + depth`` and attends to the context (rows below the root) and to the
rows of its ancestors and itself: in row order its root-to-node path, the keys of the chain
holding that path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verispec.ops.tree import slot_depths, tree_attention


def slot_paths(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth and root-to-slot path of every slot.

    Parameters
    ----------
    parents : [B, n] int64, ``ops.tree.padded_parents``' layout (-1 = the root)
    max_depth : static bound on a tree's depth

    Returns
    -------
    depths : [B, n + 1] int64, ``ops.tree.slot_depths``
    paths : [B, n + 1, max_depth + 1] int32: entry ``[b, s, i]`` is the slot of s's ancestor at
        depth i (the root 0, s itself at its depth), -1 past s's depth. Padding slots get
        meaningless paths.
    """
    # the walk in numpy on the host: a tree step builds these before its forward, on the
    # critical path (a few small array operations per depth instead of as many torch calls)
    parents = parents.cpu()
    depths = slot_depths(parents, max_depth).numpy()
    batch_size, n = parents.shape
    parent_slot = np.zeros((batch_size, n + 1), dtype=np.int64)  # the root its own parent
    parent_slot[:, 1:] = np.maximum(parents.numpy() + 1, 0)
    rows, cols = np.arange(batch_size)[:, None], np.arange(n + 1)[None, :]
    # one spare column: where the walk past the root writes (dropped)
    paths = np.full((batch_size, n + 1, max_depth + 2), -1, dtype=np.int32)
    walk = np.broadcast_to(cols, (batch_size, n + 1))
    for up in range(max_depth + 1):  # self, parent, ..., root
        depth = depths - up
        column = np.minimum(np.where(depth >= 0, depth, max_depth + 1), max_depth + 1)
        paths[rows, cols, column] = walk
        walk = parent_slot[rows, walk]
    return torch.from_numpy(depths), torch.from_numpy(paths[..., : max_depth + 1].copy())


@dataclass(frozen=True)
class TreeFeed:
    """The tree slots a forward feeds (module docstring); host tensors."""

    parents: torch.Tensor  # [B, n] int64 local parents (padded_parents' layout)
    roots: np.ndarray  # [B] int64: each root's cache row
    first_slot: int  # the first slot fed: request b feeds first_slot .. first_slot + n_b - 1
    max_depth: int  # static bound on a tree's depth

    def check_rows(self, starts: np.ndarray) -> None:
        """``ValueError`` unless the caches hold exactly the rows below the first fed slot."""
        expected = np.asarray(self.roots, dtype=np.int64) + self.first_slot
        if not np.array_equal(np.asarray(starts, dtype=np.int64), expected):
            raise ValueError(f"a tree forward feeds slot {self.first_slot} on: the caches must "
                             f"hold {expected.tolist()} rows, they hold {list(starts)}")

    def attention(self, width: int, kv_len: int, window: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU path's padded [B, width] layout: (positions [B, width] int64, attention mask
        [B, 1, width, kv_len] bool, ``AttentionMetadata.attn_mask``)."""
        positions, mask = tree_attention(self.parents, torch.as_tensor(self.roots), kv_len,
                                         self.max_depth, window)
        cols = slice(self.first_slot, self.first_slot + width)
        return positions[:, cols], mask[:, :, cols]

    def padded(self, counts: np.ndarray, width: int, max_depth: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """A captured verify's layout (first slot 0, request b's ``counts[b]`` slots padded
        to ``width``): (depths [B, width] int64, paths [B, width, max_depth + 1] int32) with
        ``max_depth`` >= this feed's. A padding slot sits at the root's position and sees the
        root only (its depth 0, its path the root's)."""
        depths, paths = slot_paths(self.parents, max_depth)  # [B, n + 1], [B, n + 1, D + 1]
        batch_size, n = depths.shape
        out_depths = np.zeros((batch_size, width), dtype=np.int64)
        out_paths = np.full((batch_size, width, max_depth + 1), -1, dtype=np.int32)
        out_paths[:, :, 0] = 0
        real = np.arange(n)[None, :] < np.asarray(counts)[:, None]  # [B, n]
        out_depths[:, :n] = np.where(real, depths.numpy(), 0)
        out_paths[:, :n] = np.where(real[..., None], paths.numpy(), out_paths[:, :n])
        return out_depths, out_paths

    def flat(self, counts: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """The flat layout's T = sum(counts) tokens: (positions [T] int64, paths [T,
        max_depth + 1] int32, ``FlatBatch.tree_paths``)."""
        depths, paths = slot_paths(self.parents, self.max_depth)
        counts = np.asarray(counts, dtype=np.int64)
        req = np.repeat(np.arange(counts.size), counts)
        slot = self.first_slot + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts,
                                                                     counts)
        positions = np.asarray(self.roots, dtype=np.int64)[req] + depths.numpy()[req, slot]
        index = torch.from_numpy(req), torch.from_numpy(slot)
        return positions, paths[index].contiguous()

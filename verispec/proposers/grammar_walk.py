"""Grammar-aware drafting for model-based proposers (docs/design.md §15).

A request with structured output verifies each draft under the mask of its matcher advanced
along the drafts before it; a draft outside the grammar has p = 0 and is always rejected. So a
model-based proposer masks its own logits the same way: at draft position i it walks a request's
matcher along d_1..d_i (``GrammarMatcher.begin_draft`` / ``extend_draft``), sets every token the
mask refuses to -inf, and samples (or takes the argmax) from what is left. The draft distribution
q the rejection sampler receives is the one the draft was sampled from, softmax of the masked
logits / T (zero outside the grammar), so the full rule stays exact; with greedy drafts the one-hot
rule needs no q at all. After drafting, the walk rolls the matcher back to the committed output
(``end_draft``), keeping the masks for the verify step.

An EAGLE-3 head drafts over a vocabulary of its own, a subset of the target's: its logits'
columns are target ids ``token_ids`` (the head's map), and a column is allowed when its target id
is. A mask that allows no column (a matcher in error, or a head whose vocabulary lacks every
token the grammar allows there) leaves the logits as they are: the target rejects such drafts
anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verispec import ops
from verispec.ops.options import apply_token_bitmask


class GrammarWalks:
    """The walks of one eager draft: ``grammars[a]`` is active request a's matcher or None;
    ``token_ids`` [V'] int64 host array, the target id of each column of the logits drafted
    from (an EAGLE-3 head's map), or None where column v is token v."""

    def __init__(self, grammars: Sequence, token_ids: np.ndarray | None = None) -> None:
        self.grammars = list(grammars)
        self.token_ids = token_ids
        self._token_ids_device: torch.Tensor | None = None  # token_ids where the logits are
        # active request -> [ceil(V / 32)] int32 mask its next draft is drafted under
        self.masks = {a: g.begin_draft() for a, g in enumerate(self.grammars) if g is not None}

    def __bool__(self) -> bool:
        return bool(self.masks)

    def _allows_a_column(self, mask: np.ndarray) -> bool:
        """Whether ``mask`` allows a column of the logits (any token at all, without a map)."""
        if self.token_ids is None:
            return bool(mask.any())
        ids = self.token_ids
        return bool(((mask[ids >> 5] >> (ids & 31)) & 1).any())

    def apply(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """``logits`` [len(rows), V'] of active requests ``rows``, masked by their walks' masks
        (a new tensor when any row is masked)."""
        picked = [(j, a) for j, a in enumerate(rows.tolist())
                  if a in self.masks and self._allows_a_column(self.masks[a])]
        if not picked:
            return logits
        index = ops.to_device(np.array([j for j, _ in picked], dtype=np.int64), logits.device)
        bitmask = ops.to_device(np.stack([self.masks[a] for _, a in picked]), logits.device,
                                torch.int32)
        if self.token_ids is not None and self._token_ids_device is None:
            self._token_ids_device = ops.to_device(self.token_ids, logits.device)
        logits = logits.clone()
        apply_token_bitmask(logits, index, bitmask, self._token_ids_device)
        return logits

    def advance(self, draft_ids: torch.Tensor, rows: np.ndarray, last: np.ndarray) -> None:
        """Walk each of ``rows``' matchers along its new draft (``draft_ids`` [len(rows)], one
        host read); a request whose draft was its last (``last`` [len(rows)] bool) ends its
        walk."""
        walked = [(j, a) for j, a in enumerate(rows.tolist()) if a in self.masks]
        if not walked:
            return
        index = ops.to_device(np.array([j for j, _ in walked], dtype=np.int64), draft_ids.device)
        for (j, a), token_id in zip(walked, draft_ids[index].tolist()):
            self.masks[a] = self.grammars[a].extend_draft(int(token_id))
            if last[j]:
                self.grammars[a].end_draft()
                del self.masks[a]

    def close(self) -> None:
        """End every walk still open (the matchers back at the committed output)."""
        for a in list(self.masks):
            self.grammars[a].end_draft()
        self.masks.clear()

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

Token trees (``TreeGrammarMasks``): a level's children are drawn from the logits at their
parents, each masked by the matcher advanced along that parent's path from the root (the
matcher walks the tree drafted so far depth first, ``GrammarMatcher.masks`` with its parents).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from verispec import ops
from verispec.sample.grammar import begin_drafts, compute_masks, extend_drafts


class _ColumnMasks:
    """Grammar masks onto logits whose columns are target ids: ``token_ids`` [V'] int64 host
    array, the target id of each column (an EAGLE-3 head's map), or None where column v is
    token v."""

    def __init__(self, token_ids: np.ndarray | None) -> None:
        self.token_ids = token_ids
        self._token_ids_device: torch.Tensor | None = None  # token_ids where the logits are

    def _allowing(self, bitmask: np.ndarray) -> np.ndarray:
        """[G] bool: which rows of ``bitmask`` [G, ceil(V / 32)] allow a column of the logits
        (any token at all, without a map)."""
        if self.token_ids is None:
            return bitmask.any(axis=1)
        ids = self.token_ids
        return ((bitmask[:, ids >> 5] >> (ids & 31)) & 1).any(axis=1)

    def _masked(self, logits: torch.Tensor, masks: Sequence[tuple[int, np.ndarray]]
                ) -> torch.Tensor:
        """``logits`` [R, V'] with row j masked by m for each (j, m) of ``masks`` ([ceil(V / 32)]
        int32) that allows a column (a new tensor when any row is masked)."""
        if not masks:
            return logits
        rows = np.array([j for j, _ in masks], dtype=np.int64)
        bitmask = np.stack([mask for _, mask in masks])
        allowing = self._allowing(bitmask)
        if not allowing.any():
            return logits
        if not allowing.all():
            rows, bitmask = rows[allowing], bitmask[allowing]
        # one copy to the device: the masks, each with its row in a last column
        packed = np.empty((len(rows), bitmask.shape[1] + 1), dtype=np.int32)
        packed[:, :-1] = bitmask
        packed[:, -1] = rows
        packed = ops.to_device(packed, logits.device)
        if self.token_ids is not None and self._token_ids_device is None:
            self._token_ids_device = ops.to_device(self.token_ids, logits.device)
        logits = logits.clone()
        ops.apply_token_bitmask(logits, packed[:, -1], packed[:, :-1], self._token_ids_device)
        return logits


class GrammarWalks(_ColumnMasks):
    """The walks of one eager draft: ``grammars[a]`` is active request a's matcher or None;
    ``token_ids`` as ``_ColumnMasks``.

    ``greedy``: the drafts are argmaxes (``argmax``), and a walk computes a mask only where the
    unmasked argmax is one the grammar refuses: the argmax of the masked logits is the
    unmasked one whenever the grammar allows that (ties too: the lowest allowed index of the
    tied is the lowest of them), and checking a token costs ~2 us against ~25-40 us a mask.
    The masks it computed are kept for the verify step, which computes the others
    (``fill_chain_masks``) while the device runs the target forward."""

    def __init__(self, grammars: Sequence, token_ids: np.ndarray | None = None,
                 greedy: bool = False) -> None:
        super().__init__(token_ids)
        self.grammars = list(grammars)
        self.greedy = greedy
        # active request -> [ceil(V / 32)] int32 mask its next draft is drafted under (greedy:
        # None, the walks compute masks only where an argmax is refused)
        walking = [a for a, g in enumerate(self.grammars) if g is not None]
        if greedy:
            for a in walking:
                self.grammars[a]._restart_walk()
            self.masks = dict.fromkeys(walking)
        else:
            self.masks = dict(zip(walking, begin_drafts([self.grammars[a] for a in walking])))

    def __bool__(self) -> bool:
        return bool(self.masks)

    def apply(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """``logits`` [len(rows), V'] of active requests ``rows``, masked by their walks' masks
        (a new tensor when any row is masked)."""
        return self._masked(logits, [(j, self.masks[a]) for j, a in enumerate(rows.tolist())
                                     if a in self.masks])

    def argmax(self, logits: torch.Tensor, rows: np.ndarray,
               argmax: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """Greedy walks: (``argmax(logits)`` [len(rows)], the target ids of the argmaxes of
        ``logits`` [len(rows), V'] of active requests ``rows``, each walking row's taken under
        its grammar, on the device; the same ids read on the host). One read; a second, of the
        refused rows alone, where the grammar refuses an unmasked argmax."""
        draft_ids = argmax(logits)
        host = draft_ids.tolist()
        refused = []
        for j, a in enumerate(rows.tolist()):
            if a in self.masks:
                grammar = self.grammars[a]
                grammar._draft_masks.append(None)  # this row's mask, where it is computed
                if not grammar._allows(host[j]):
                    refused.append((j, a))
        if refused:
            picked = np.array([j for j, _ in refused], dtype=np.int64)
            masks = compute_masks([self.grammars[a] for _, a in refused])
            for (_, a), mask in zip(refused, masks):  # kept for the verify step
                self.grammars[a]._draft_masks[-1] = mask
            index = ops.to_device(picked, logits.device)
            masked = self._masked(logits[index], list(enumerate(masks)))
            fixed = argmax(masked)
            draft_ids = draft_ids.clone()
            draft_ids[index] = fixed
            for j, t in zip(picked.tolist(), fixed.tolist()):
                host[j] = t
        return draft_ids, host

    def advance(self, draft_ids: torch.Tensor | list[int], rows: np.ndarray,
                last: np.ndarray) -> None:
        """Walk each of ``rows``' matchers along its new draft (``draft_ids`` [len(rows)]: on
        the device, one host read, or already read). A request whose draft was its last
        (``last`` [len(rows)] bool) ends its walk without it: the mask after the last draft is
        the verify step's bonus row, computed there while the device runs the target forward
        (``fill_chain_masks``), so a batch whose every draft was its last reads nothing."""
        walked = []
        for j, a in enumerate(rows.tolist()):
            if a not in self.masks:
                continue
            if last[j]:
                self.grammars[a].end_draft()
                del self.masks[a]
            else:
                walked.append((j, a))
        if not walked:
            return
        picked = [j for j, _ in walked]
        if isinstance(draft_ids, list):
            ids = [draft_ids[j] for j in picked]
        else:
            ids = draft_ids[ops.to_device(np.array(picked, dtype=np.int64),
                                          draft_ids.device)].tolist()
        if self.greedy:  # the walk moves; masks only where ``argmax`` meets a refusal
            for (_, a), token in zip(walked, ids):
                self.grammars[a]._walk(token)
            return
        masks = extend_drafts([self.grammars[a] for _, a in walked], ids)
        for (_, a), mask in zip(walked, masks):
            self.masks[a] = mask

    def close(self) -> None:
        """End every walk still open (the matchers back at the committed output)."""
        for a in list(self.masks):
            self.grammars[a].end_draft()
        self.masks.clear()


class TreeGrammarMasks(_ColumnMasks):
    """Grammar-aware tree drafting (docs/design.md §16): the logits a node's children are drawn
    from are masked by its matcher advanced along the node's path (``GrammarMatcher.masks``
    with the tree's parents), so q is the masked distribution the children come from and they
    stay inside the grammar. ``grammars[a]``: active request a's matcher at its committed
    output, or None; ``token_ids`` as ``_ColumnMasks``."""

    def __init__(self, grammars: Sequence, token_ids: np.ndarray | None = None) -> None:
        super().__init__(token_ids)
        self.grammars = list(grammars)

    def __bool__(self) -> bool:
        return any(g is not None for g in self.grammars)

    def apply(self, logits: torch.Tensor, rows: np.ndarray, token_ids: np.ndarray,
              parent_ids: np.ndarray, parent_slots: np.ndarray) -> torch.Tensor:
        """``logits`` [R, P, V'] at P parents of active requests ``rows`` [R], masked.

        ``token_ids`` [R, n] int64 and ``parent_ids`` [R, n] int64: each tree drafted so far
        (target ids, -1 for a node left out; local parents, -1 = the root); ``parent_slots``
        [R, P] int64: the slot of each parent (the root 0, node i at i + 1). A new tensor when
        any row is masked."""
        num_rows, num_parents, vocab = logits.shape
        masks = []
        for j, a in enumerate(rows.tolist()):
            grammar = self.grammars[a]
            if grammar is None:
                continue
            node_masks = grammar.masks(token_ids[j].tolist(), parent_ids[j].tolist())
            masks.extend((j * num_parents + k, node_masks[slot])
                         for k, slot in enumerate(parent_slots[j].tolist()))
        flat = self._masked(logits.reshape(num_rows * num_parents, vocab), masks)
        return flat.reshape(num_rows, num_parents, vocab)

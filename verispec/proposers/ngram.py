"""n-gram proposer (prompt lookup, docs/design.md §5): drafts copied from earlier in the context.

For a context ``t_0 .. t_{L-1}`` the suffix of length n is ``t_{L-n} .. t_{L-1}``. Find the
longest n in ``[prompt_lookup_min, prompt_lookup_max]`` whose suffix also occurs earlier, i.e.
ending at some ``e <= L - 2`` (occurrences may overlap the suffix itself); among occurrences of
that length take the earliest. The drafts are the up to k tokens that followed it,
``t_{e+1} .. t_{e+k}``, fewer when the context ends first. ``L <= prompt_lookup_min`` leaves no
earlier occurrence possible: no drafts.

The search is vectorised: one comparison of the whole context against its last token gives the
candidate ends, then each further suffix token filters the survivors (``t_{e-j} == t_{L-1-j}``).
The longest surviving length wins, and the survivors stay sorted, so the first one is the
earliest. A 4 000-token context costs tens of microseconds, so the lookup never shows in a
profile next to a model forward; it runs on the host, with no device work at all.

Under a grammar (structured output, docs/design.md §15) the proposer drafts only what the
grammar allows: it tries the matches in the same order of preference (longest n first, earliest
first; ``ngram_matches``), keeps the longest prefix of each continuation that the request's
matcher accepts after the committed output, and proposes the first continuation whose k drafts
are all accepted, else the longest accepted prefix (the most preferred of equal length; possibly
none). The drafts are still a function of the context, so the one-hot rule stays exact; only
acceptance changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verispec import ops
from verispec.config import SpeculativeConfig
from verispec.proposers.base import (
    DraftProposal,
    ProposalRequest,
    Proposer,
    ProposerContext,
    register_proposer,
)

_EMPTY = np.zeros(0, dtype=np.int64)


def ngram_lookup(
    token_ids: np.ndarray,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    max_num_draft_tokens: int,
) -> np.ndarray:
    """Prompt-lookup drafts for one context.

    Parameters
    ----------
    token_ids : [L] int, the committed tokens (prompt + output)
    prompt_lookup_min, prompt_lookup_max : the range of suffix lengths n tried, longest first
    max_num_draft_tokens : k for this request (0 gives no drafts)

    Returns
    -------
    [n_r] int64 drafts, ``0 <= n_r <= max_num_draft_tokens``: the tokens that followed the
    earliest earlier occurrence of the longest matching suffix.

    >>> ngram_lookup(np.array([1, 2, 3, 4, 1, 2, 3]), 2, 2, 3).tolist()
    [4, 1, 2]
    """
    num_tokens = token_ids.shape[0]
    # An earlier occurrence of a length-n suffix needs L >= n + 1.
    max_n = min(prompt_lookup_max, num_tokens - 1)
    if max_num_draft_tokens <= 0 or max_n < prompt_lookup_min:
        return _EMPTY
    # ends[i]: end index e <= L - 2 of an occurrence of the suffix matched so far, ascending.
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
    best_end = -1
    for n in range(1, max_n + 1):
        if n > 1:
            j = n - 1  # compare t_{e-j} with t_{L-1-j}
            ends = ends[ends >= j]
            ends = ends[token_ids[ends - j] == token_ids[num_tokens - 1 - j]]
        if ends.shape[0] == 0:
            break
        if n >= prompt_lookup_min:
            best_end = int(ends[0])  # earliest occurrence of the longest length so far
    if best_end < 0:
        return _EMPTY
    start = best_end + 1
    return token_ids[start : start + max_num_draft_tokens].astype(np.int64, copy=False)


# Matches whose continuation is checked against a grammar per request and step (each check is
# one llguidance validate_tokens over at most k tokens: microseconds).
MAX_GRAMMAR_CANDIDATES = 16


def ngram_matches(token_ids: np.ndarray, prompt_lookup_min: int, prompt_lookup_max: int,
                  max_num_matches: int) -> np.ndarray:
    """End indices of the earlier occurrences of the context's suffix, in ``ngram_lookup``'s
    order of preference: longest n in ``[prompt_lookup_min, prompt_lookup_max]`` first, earliest
    first among those of one length, each end once. The first is ``ngram_lookup``'s match.

    Returns
    -------
    [m] int64, ``m <= max_num_matches``; the drafts of end e are ``token_ids[e + 1: e + 1 + k]``.
    """
    num_tokens = token_ids.shape[0]
    max_n = min(prompt_lookup_max, num_tokens - 1)
    if max_n < prompt_lookup_min:
        return _EMPTY
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
    by_length = []  # survivors of each length >= prompt_lookup_min, shortest first
    for n in range(1, max_n + 1):
        if n > 1:
            j = n - 1
            ends = ends[ends >= j]
            ends = ends[token_ids[ends - j] == token_ids[num_tokens - 1 - j]]
        if ends.shape[0] == 0:
            break
        if n >= prompt_lookup_min:
            by_length.append(ends)
    if not by_length:
        return _EMPTY
    ordered = np.concatenate(by_length[::-1])
    _, first = np.unique(ordered, return_index=True)  # each end at its most preferred place
    return ordered[np.sort(first)][:max_num_matches].astype(np.int64, copy=False)


def grammar_drafts(token_ids: np.ndarray, prompt_lookup_min: int, prompt_lookup_max: int,
                   max_num_draft_tokens: int, grammar) -> np.ndarray:
    """Prompt-lookup drafts the grammar allows (module docstring): ``grammar.num_valid(drafts)``
    counts the leading drafts the request's matcher accepts."""
    if max_num_draft_tokens <= 0:
        return _EMPTY
    best = _EMPTY
    for end in ngram_matches(token_ids, prompt_lookup_min, prompt_lookup_max,
                             MAX_GRAMMAR_CANDIDATES).tolist():
        drafts = token_ids[end + 1:end + 1 + max_num_draft_tokens]
        num_valid = grammar.num_valid(drafts.tolist())
        if num_valid > best.shape[0]:
            best = drafts[:num_valid]
            if num_valid == max_num_draft_tokens:
                break
    return best.astype(np.int64, copy=False)


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Prompt lookup on the host; drafts carry no distribution.

    ``draft_probs`` is None and the rejection sampler uses the one-hot rule (docs/design.md §3 rule
    2). A request whose ``token_ids`` is a numpy array is read in place. Any other sequence (a
    Python list) is mirrored into a per-slot host array that grows by the newly committed tokens
    only, so a step costs O(new tokens) of conversion instead of O(context); ``free(slot)``
    drops the mirror. The mirror is re-read whole if the request in a slot looks different
    (shorter, or another first or last mirrored token), which catches a missed ``free`` in the
    common cases; drafts only ever change acceptance, never the output distribution.
    """

    uses_draft_probs = False

    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        super().__init__(config, context)
        # SpeculativeConfig fills both bounds (default 5) and checks min <= max.
        self.prompt_lookup_min = int(config.prompt_lookup_min)
        self.prompt_lookup_max = int(config.prompt_lookup_max)
        # slot -> (buffer [capacity] int64, number of valid tokens): host mirrors of list contexts.
        self._mirrors: dict[int, tuple[np.ndarray, int]] = {}

    def propose(self, requests: Sequence[ProposalRequest]) -> DraftProposal:
        """Drafts for every request; see ``Proposer.propose`` for the layout."""
        cu_num_draft_tokens = np.zeros(len(requests) + 1, dtype=np.int64)  # [B + 1]
        drafts = []
        k = self.num_speculative_tokens
        for r, request in enumerate(requests):
            max_num_draft_tokens = min(int(request.max_num_draft_tokens), k)
            draft = _EMPTY
            grammar = self.draft_grammar(request)
            if max_num_draft_tokens > 0 and grammar is not None:
                draft = grammar_drafts(self._context(request), self.prompt_lookup_min,
                                       self.prompt_lookup_max, max_num_draft_tokens, grammar)
            elif max_num_draft_tokens > 0:
                draft = ngram_lookup(
                    self._context(request),
                    self.prompt_lookup_min,
                    self.prompt_lookup_max,
                    max_num_draft_tokens,
                )
            drafts.append(draft)
            cu_num_draft_tokens[r + 1] = cu_num_draft_tokens[r] + draft.shape[0]
        draft_token_ids = np.concatenate(drafts) if drafts else _EMPTY  # [num_draft_tokens]
        return DraftProposal(
            draft_token_ids=ops.to_device(draft_token_ids.astype(np.int64), self.device),
            cu_num_draft_tokens=torch.from_numpy(cu_num_draft_tokens),
            draft_probs=None,
        )

    def free(self, slot: int) -> None:
        self._mirrors.pop(slot, None)

    def _context(self, request: ProposalRequest) -> np.ndarray:
        """[L] int64 view of the request's committed tokens."""
        token_ids = request.token_ids
        if isinstance(token_ids, np.ndarray):
            return token_ids
        if isinstance(token_ids, torch.Tensor):
            return token_ids.numpy()
        num_tokens = len(token_ids)
        buffer, num_valid = self._mirrors.get(request.slot, (_EMPTY, 0))
        if num_valid > num_tokens or (
            num_valid > 0
            and (buffer[0] != token_ids[0] or buffer[num_valid - 1] != token_ids[num_valid - 1])
        ):
            num_valid = 0  # another request in this slot: re-read it whole
        if num_tokens > buffer.shape[0]:
            grown = np.empty(max(2 * buffer.shape[0], num_tokens, 64), dtype=np.int64)
            grown[:num_valid] = buffer[:num_valid]
            buffer = grown
        if num_tokens > num_valid:
            tail = token_ids[num_valid:]
            buffer[num_valid:num_tokens] = np.fromiter(tail, dtype=np.int64, count=len(tail))
        self._mirrors[request.slot] = (buffer, num_tokens)
        return buffer[:num_tokens]

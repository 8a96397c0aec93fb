"""Structured output: a request's grammar as a token mask at every row of a step
(docs/design.md §15).

The grammar engine is llguidance; its compilation and the reasons for the choice are in
``verispec.sample.grammar_compiler``.

Speculation. A request's ``GrammarMatcher`` follows its committed output (``sync`` consumes the
tokens committed since its last step, so rejected drafts never enter it). For a verify step with
drafts d_1..d_n, ``masks`` gives row i the mask of the matcher advanced along d_1..d_i, exactly
the mask one-token-at-a-time decoding uses there; it advances only along the drafts the grammar
accepts (``validate_tokens``): where d_j is outside the grammar, row j - 1 gives it p = 0 and it
is rejected, so the rows after it are never reached (they repeat row j - 1's mask). It then
rolls the drafts back. The drafts are read on the host, once per step that has a grammar.

Token trees (docs/design.md §16). Given each node's parent, ``masks`` gives every node's row the
mask after the drafts on its path from the root: it walks the tree depth first, consuming a node
on the way down and rolling it back on the way up, and a node the grammar refuses is not consumed
(it has p = 0 at its parent's row and is rejected; its row and those below it, never reached,
repeat the parent's mask). A chain-shaped tree takes the chain's walk.

Grammar-aware drafting. A proposer may draft only what the grammar allows (docs/design.md §15):
``num_valid`` says how many leading tokens of a candidate draft the grammar accepts (the n-gram
proposer cuts its drafts there), and ``begin_draft`` / ``extend_draft`` / ``end_draft`` walk the
matcher along the drafts as a model drafts them, giving the mask at each draft position (a
draft model, early exit or an EAGLE head masks its own logits with it, so q is the masked,
renormalised distribution it samples from). ``end_draft`` rolls the matcher back and keeps the
masks it computed: they are the verify step's masks for those drafts, so ``masks`` does not
compute them again.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import llguidance
import numpy as np


class GrammarMatcher:
    """One request's grammar state, following its committed output (module docstring)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, lane: int = 0,
                 executor: llguidance.LLExecutor | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.lane = lane  # its compilation's (``GrammarCompiler``)
        self.executor = executor
        self.num_words = (vocab_size + 31) // 32
        self.num_consumed = 0  # output tokens consumed
        self._memo: dict[tuple[int, ...], np.ndarray] = {}  # drafts -> masks, this output
        # drafts -> the masks a greedy walk computed along them ([ceil(V / 32)] int32 or None
        # per row), this output: ``fill_chain_masks`` computes only the others
        self._partial: dict[tuple[int, ...], list[np.ndarray | None]] = {}
        # the walk of begin_draft / extend_draft: drafts, their masks, tokens consumed
        self._draft_ids: list[int] = []
        self._draft_masks: list[np.ndarray] = []
        self._draft_consumed = 0
        self._draft_left = False  # a draft the grammar refuses was met: masks stay put

    def sync(self, output_token_ids: np.ndarray) -> None:
        """Consume the output tokens committed since the last call."""
        new = output_token_ids[self.num_consumed:]
        if not len(new):
            return
        self._memo.clear()
        self._partial.clear()
        self.num_consumed = len(output_token_ids)
        # (a matcher that stops, its grammar complete, consumes nothing after: done, EOS with
        # ignore_eos, max_tokens)
        _consume(self.matcher, new)

    def masks(self, drafts: Sequence[int], parent_ids: Sequence[int] | None = None
              ) -> np.ndarray:
        """[len(drafts) + 1, ceil(V / 32)] int32 bitmasks (bit v of word v // 32 set = token v
        allowed): row i after the committed output and d_1..d_i (module docstring).

        ``parent_ids`` [len(drafts)]: the drafts are a token tree (``verispec.ops.tree``'s
        local parent indices, -1 = the root); row 0 is the root's, row i + 1 node i's, after
        the drafts on the path from the root to node i. None (or a chain's parents): a chain.
        """
        if parent_ids is not None and any(p != i - 1 for i, p in enumerate(parent_ids)):
            return self._tree_masks(drafts, parent_ids)
        key = tuple(drafts)
        if key not in self._memo:
            fill_chain_masks([self], [key])
        return self._memo[key]

    def _tree_masks(self, drafts: Sequence[int], parent_ids: Sequence[int]) -> np.ndarray:
        """``masks`` of a token tree: depth first, each node consumed on the way down and
        rolled back on the way up; a refused node and its subtree repeat its parent's mask."""
        key = (tuple(drafts), tuple(parent_ids))
        cached = self._memo.get(key)
        if cached is not None:
            return cached
        n = len(drafts)
        children = [[] for _ in range(n + 1)]  # per slot (the root 0, node i at i + 1)
        for i, parent in enumerate(parent_ids):
            children[parent + 1].append(i + 1)
        out = np.empty((n + 1, self.num_words), dtype=np.int32)
        m = self.matcher
        m.unsafe_compute_mask_ptr(out[0].ctypes.data, out[0].nbytes)
        # (slot, whether the matcher stands after its path); a slot is pushed after its
        # subtree's marker, so popping the marker rolls the slot's token back
        stack = [(child, True) for child in reversed(children[0])]
        while stack:
            slot, inside = stack.pop()
            if slot < 0:  # leaving the subtree of slot -slot - 1: roll its token back
                m.rollback(1)
                continue
            parent = parent_ids[slot - 1] + 1
            token = int(drafts[slot - 1])
            if inside and self._allows(token):
                m.consume_token(token)
                m.unsafe_compute_mask_ptr(out[slot].ctypes.data, out[slot].nbytes)
                stack.append((-slot - 1, True))
            else:
                out[slot] = out[parent]  # never reached: p = 0 at the parent's row
                inside = False
            stack.extend((child, inside) for child in reversed(children[slot]))
        self._memo[key] = out
        return out

    def _allows(self, token_id: int) -> bool:
        """Whether the grammar accepts ``token_id`` where the matcher is (it stays there)."""
        m = self.matcher
        return (0 <= token_id < self.vocab_size and not m.is_stopped()
                and m.validate_tokens([token_id]) == 1)

    def num_valid(self, drafts: Sequence[int]) -> int:
        """How many leading tokens of ``drafts`` the grammar allows after the committed output
        (the matcher stays where it is)."""
        prefix = list(itertools.takewhile(lambda d: 0 <= d < self.vocab_size, drafts))
        if not prefix or self.matcher.is_stopped():
            return 0
        return self.matcher.validate_tokens(prefix)

    def begin_draft(self) -> np.ndarray:
        """Start a walk along drafts from the committed output; returns its mask
        [ceil(V / 32)] int32, the one d_1 is drafted under (``begin_drafts`` of one)."""
        return begin_drafts([self])[0]

    def extend_draft(self, token_id: int) -> np.ndarray:
        """Advance the walk along the next draft; returns the mask after it (the one the next
        draft is drafted under). From the first draft the grammar refuses on, the walk stays
        where it was and repeats its mask (as ``masks`` does: those rows are never reached).
        ``extend_drafts`` of one."""
        return extend_drafts([self], [token_id])[0]

    def _restart_walk(self) -> None:
        if self._draft_consumed:
            self.matcher.rollback(self._draft_consumed)
        self._draft_ids, self._draft_consumed, self._draft_left = [], 0, False
        self._draft_masks = []

    def _walk(self, token_id: int) -> bool:
        """Record the walk's next draft; consume it where the grammar allows it (then the walk
        needs a new mask: True)."""
        self._draft_ids.append(int(token_id))
        if not self._draft_left and self._allows(token_id):
            self.matcher.consume_token(token_id)
            self._draft_consumed += 1
            return True
        self._draft_left = True
        return False

    def end_draft(self) -> None:
        """End the walk: roll the matcher back to the committed output and keep the walk's
        masks for the verify step of these drafts (``masks``)."""
        if self._draft_consumed:
            self.matcher.rollback(self._draft_consumed)
        if self._draft_masks:
            key = tuple(self._draft_ids)
            if any(mask is None for mask in self._draft_masks):  # a greedy walk's
                self._partial[key] = self._draft_masks
            else:
                self._memo[key] = np.stack(self._draft_masks)
        self._draft_ids, self._draft_masks, self._draft_consumed = [], [], 0

    def _known_rows(self, drafts: tuple[int, ...]) -> list[np.ndarray | None]:
        """The rows of ``masks(drafts)`` a walk along all drafts but the last computed (None
        where it did not; the last row is never known)."""
        rows: list[np.ndarray | None] = [None] * (len(drafts) + 1)
        if drafts:
            walked = self._memo.get(drafts[:-1])
            if walked is None:
                walked = self._partial.get(drafts[:-1])
            if walked is not None:
                rows[:len(drafts)] = list(walked)
        return rows


def compute_masks(grammars: Sequence[GrammarMatcher]) -> np.ndarray:
    """[len(grammars), ceil(V / 32)] int32: each matcher's mask where it stands (distinct
    matchers). On their compiler's threads where it has them: the matchers are handed over in
    the order of their lanes, so that each thread takes a run of one lane's (``GrammarCompiler``).
    """
    num_words = grammars[0].num_words if grammars else 0
    out = np.empty((len(grammars), num_words), dtype=np.int32)
    executor = grammars[0].executor if len(grammars) > 1 else None
    if executor is not None and len({id(g) for g in grammars}) == len(grammars):
        order = sorted(range(len(grammars)), key=lambda i: grammars[i].lane)
        executor.unsafe_compute_mask_ptr([(grammars[i].matcher, i) for i in order],
                                         out.ctypes.data, out.shape[1] * 4, len(grammars))
        return out
    for g, row in zip(grammars, out):
        g.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    return out


def fill_chain_masks(grammars: Sequence[GrammarMatcher],
                     drafts: Sequence[Sequence[int]]) -> None:
    """Put into each matcher's memo the masks ``GrammarMatcher.masks`` gives its chain of
    ``drafts`` (the verify step's rows), depth by depth, each depth's masks in one
    ``compute_masks`` over the requests. A matcher listed more than once walks its distinct
    chains one after the other: round r takes the r-th of each matcher (linear in the
    chains)."""
    chains: dict[int, tuple[GrammarMatcher, dict]] = {}  # id -> (matcher, its chains in order)
    for g, d in zip(grammars, drafts):
        chains.setdefault(id(g), (g, {}))[1][tuple(int(t) for t in d)] = None
    queues = [(g, [d for d in ds if d not in g._memo]) for g, ds in chains.values()]
    for r in range(max((len(ds) for _, ds in queues), default=0)):
        _fill_distinct([(g, ds[r]) for g, ds in queues if r < len(ds)])


def _fill_distinct(todo: list[tuple[GrammarMatcher, tuple[int, ...]]]) -> None:
    """``fill_chain_masks`` of distinct matchers. A chain whose drafts but the last were walked
    (``end_draft`` kept the masks of d_1..d_{n-1}, all of them or a greedy walk's few: a
    proposer does not wait for its last draft) computes only the rows the walk did not. A
    matcher that stops along a chain (its grammar complete: only the end is left) consumes
    nothing more (an end token there would put it in error, and no rollback undoes that): the
    rows after are never reached, an accepted end token ending the request, and repeat its
    last."""
    valid = [g.num_valid(d) for g, d in todo]
    outs = [np.empty((len(d) + 1, g.num_words), dtype=np.int32) for g, d in todo]
    known = [g._known_rows(d) for g, d in todo]
    consumed = [0] * len(todo)
    depth = 0
    while depth <= max(valid, default=-1):
        here = [i for i, v in enumerate(valid) if depth <= v]
        missing = [i for i in here if known[i][depth] is None]
        for i, mask in zip(missing, compute_masks([todo[i][0] for i in missing])
                           if missing else ()):
            known[i][depth] = mask
        for i in here:
            outs[i][depth] = known[i][depth]
            if depth < valid[i]:
                if _consume(todo[i][0].matcher, todo[i][1][depth:depth + 1]):
                    consumed[i] += 1
                else:  # stopped: the rows after are never reached
                    valid[i] = depth
        depth += 1
    for (g, d), v, n, out in zip(todo, valid, consumed, outs):
        out[v + 1:] = out[v]  # rows past a draft the grammar refuses: never reached
        if n:
            g.matcher.rollback(n)
        g._memo[d] = out


def _consume(matcher: llguidance.LLMatcher, tokens: Sequence[int]) -> int:
    """Consume ``tokens`` (ones the grammar allows) until the matcher stops; how many."""
    for n, token in enumerate(tokens):
        if matcher.is_stopped():
            return n
        matcher.consume_token(int(token))
    return len(tokens)


def begin_drafts(grammars: Sequence[GrammarMatcher]) -> list[np.ndarray]:
    """``begin_draft`` for every matcher, their masks in one ``compute_masks``."""
    for g in grammars:
        g._restart_walk()
    masks = list(compute_masks(grammars))
    for g, mask in zip(grammars, masks):
        g._draft_masks = [mask]
    return masks


def extend_drafts(grammars: Sequence[GrammarMatcher], token_ids: Sequence[int]
                  ) -> list[np.ndarray]:
    """``extend_draft`` of each matcher along its token, the new masks in one
    ``compute_masks``."""
    moved = [g._walk(int(t)) for g, t in zip(grammars, token_ids)]
    fresh = iter(compute_masks([g for g, m in zip(grammars, moved) if m]))
    out = []
    for g, m in zip(grammars, moved):
        mask = next(fresh) if m else g._draft_masks[-1]
        g._draft_masks.append(mask)
        out.append(mask)
    return out

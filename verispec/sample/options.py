"""Sampling options of a batch: each request's options compiled once, the per-slot token counts,
and the per-row inputs of ``ops.options.apply_options`` built for every step (docs/design.md §15).

Rows. A step hands the op R rows of logits; request b owns ``num_rows[b]`` consecutive rows from
``first_rows[b]``: one in a plain step, n_b + 1 in a verify step (its n_b verify rows, then its
bonus row). Row i of request b sees the committed tokens plus the drafts d_1..d_i, exactly what
one-token-at-a-time decoding would see there, so the processed distribution p of every row is
the one a plain step would sample from after accepting those drafts. With token trees
(docs/design.md §16) a request's rows are its root's, then one per node, and the row of node u
sees the drafts on the path from the root to u (``ops.tree.SlotPaths``; a chain is the tree
whose node i has parent i - 1). The drafts stay on the device; the host knows only how many
each request has and, for trees, their parents, which is all the index tensors need.

Token counts. The penalties need, per row, the count of every token of the output (and, for the
repetition penalty, which tokens the prompt holds). They live in two persistent tensors indexed
by slot, ``output_counts`` [max_num_seqs, V] int32 and ``prompt_mask`` [max_num_seqs, V] bool,
allocated when the first request with a penalty arrives. They follow the committed tokens: at
each step the tokens a request committed since its last step are added (a few per request, one
``index_put_``), so rejected drafts never enter them; a request found in a slot that another
request used last is counted afresh from its tokens (a new or a recomputed request). A row adds
its own drafts d_1..d_i on the device, in a copy of its slot's counts. Requests without any
option cost nothing: a step where no request uses one skips all of this.

Captured steps. With CUDA graphs the counts exist from the start (``attach``: the graphs read
them), and the captured decode and verify forwards apply the penalties themselves
(``step_penalties`` names the requests, ``runtime.model_runner.StepPenalties``); ``process`` then
skips them for those requests, and a request with nothing else costs nothing after the forward.
A request with a finite ``logit_bias`` keeps its penalties here, after its bias.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verispec import ops
from verispec.ops.options import NEG_INF, WILDCARD, OptionTensors, apply_options
from verispec.ops.staging import HostDrafts
from verispec.ops.tree import SlotPaths
from verispec.runtime.model_runner import ModelRunner, StepPenalties
from verispec.sample.grammar import GrammarMatcher, fill_chain_masks
from verispec.sample.grammar_compiler import GrammarCompiler
from verispec.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestOptions:
    """One request's logits options as token-id arrays (built once, when it is added)."""

    params: SamplingParams
    bias_ids: np.ndarray  # [nb] int64
    bias_values: np.ndarray  # [nb] float32
    allowed_ids: np.ndarray | None  # [na] int64, or None (every token allowed)
    min_tokens_ids: np.ndarray  # [ns] int64, masked while the output is shorter than min_tokens
    bad_single_ids: np.ndarray  # [n1] int64, bad words of one token: always masked
    bad_words: tuple[tuple[int, ...], ...]  # bad words of several tokens, as token ids
    grammar: GrammarMatcher | None = None  # structured_outputs: its (mutable) matcher

    @classmethod
    def build(cls, params: SamplingParams, vocab_size: int, eos_token_ids: Sequence[int],
              tokenizer=None,
              grammars: Callable[[], GrammarCompiler] | None = None) -> RequestOptions | None:
        """None when ``params`` uses no logits option; ValueError naming the field when one
        names a token outside ``[0, vocab_size)``, bad_words cannot be tokenised or the
        structured output cannot be compiled (``grammars()`` gives the compiler)."""
        if not params.uses_logits_options:
            return None
        grammar = None
        if params.structured_outputs is not None:
            if grammars is None:
                raise ValueError("structured_outputs needs the model's tokenizer")
            grammar = grammars().matcher(params.structured_outputs)
        check_token_ids(params, vocab_size)
        bias = params.logit_bias or {}
        stops = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos_token_ids))
        single, several = [], []
        for ids in bad_word_token_ids(params.bad_words or (), tokenizer):
            (single if len(ids) == 1 else several).append(ids)
        return cls(
            params=params,
            bias_ids=np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
            bias_values=np.fromiter(bias.values(), dtype=np.float32, count=len(bias)),
            allowed_ids=None if params.allowed_token_ids is None
            else np.unique(np.asarray(params.allowed_token_ids, dtype=np.int64)),
            min_tokens_ids=np.unique(np.asarray(stops, dtype=np.int64)) if params.min_tokens
            else np.zeros(0, dtype=np.int64),
            bad_single_ids=np.unique(np.asarray([ids[0] for ids in single], dtype=np.int64)),
            bad_words=tuple(dict.fromkeys(several)),
            grammar=grammar,
        )

    @property
    def graph_penalties(self) -> bool:
        """Whether a captured step may apply this request's penalties (module docstring)."""
        return self.params.uses_penalties and not self.bias_ids.size

    @property
    def beyond_penalties(self) -> bool:
        """Whether the request has an option other than the penalties."""
        return bool(self.bias_ids.size or self.allowed_ids is not None
                    or self.min_tokens_ids.size or self.bad_single_ids.size or self.bad_words
                    or self.grammar is not None)


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the field for a token id of the options outside the vocabulary."""
    for name, ids in (("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise ValueError(f"{name} token ids {outside[:5]!r} are outside the model's "
                             f"vocabulary [0, {vocab_size})")


def bad_word_token_ids(words: Sequence[str], tokenizer) -> list[tuple[int, ...]]:
    """Each bad word's token ids, as written and with one leading space (how a word is spelled
    at the start of a text and after another word), distinct spellings only."""
    if words and tokenizer is None:
        raise ValueError(f"bad_words={list(words)!r} needs the model's tokenizer, and this model "
                         "has none")
    spellings = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in spellings:
                spellings.append(ids)
    return spellings


class SamplingOptions:
    """The engine's side of the logits options: per-slot token counts and the step's inputs."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts: torch.Tensor | None = None  # [max_num_seqs, V] int32, lazily
        self.prompt_mask: torch.Tensor | None = None  # [max_num_seqs, V] bool, lazily
        self._owner = np.full(max_num_seqs, -1, dtype=np.int64)  # request id counted per slot
        self._num_counted = np.zeros(max_num_seqs, dtype=np.int64)  # its output tokens counted
        self.attached = False  # a runner's captured steps apply penalties (``attach``)

    def attach(self, runner: ModelRunner) -> None:
        """Let ``runner``'s captured steps apply penalties (call before its ``capture``): the
        counts are allocated now, as the graphs read them. No-op for a runner without graphs."""
        if runner.graphs is None:
            return
        self._allocate()
        runner.penalty_counts = (self.output_counts, self.prompt_mask)
        self.attached = True

    def step_penalties(self, batch: Sequence) -> StepPenalties | None:
        """The penalties a captured step may apply for ``batch`` (its counts brought up to
        date), or None when no request of it has any, or nothing is attached."""
        if not self.attached or not any(
                r.options is not None and r.options.graph_penalties for r in batch):
            return None
        slots = np.full(len(batch), -1, dtype=np.int64)
        params = np.ones((len(batch), 3), dtype=np.float32)
        counted = []
        for b, r in enumerate(batch):
            if r.options is not None and r.options.graph_penalties:
                p = r.options.params
                slots[b] = r.slot
                params[b] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                counted.append(r)
        self._count(counted)
        return StepPenalties(slots, params)

    def fetch_drafts(self, batch: Sequence, draft_token_ids: torch.Tensor) -> HostDrafts | None:
        """Start copying the step's drafts to the host when a request of ``batch`` has a grammar
        (its matcher walks them), before the verify forward is launched: ``process`` then waits
        for the drafts alone and builds the masks while the GPU verifies. None otherwise."""
        if not any(r.options is not None and r.options.grammar is not None for r in batch):
            return None
        return HostDrafts(draft_token_ids)

    @staticmethod
    def sync_grammars(batch: Sequence) -> None:
        """Bring each request's grammar matcher up to its committed output (before a proposer
        drafts under it; ``build`` does it again for requests that did not draft)."""
        for r in batch:
            if r.options is not None and r.options.grammar is not None:
                r.options.grammar.sync(r.output_token_ids)

    def process(self, logits: torch.Tensor, batch: Sequence, num_drafts: np.ndarray | None = None,
                draft_token_ids: torch.Tensor | None = None,
                penalties: StepPenalties | None = None,
                host_drafts: HostDrafts | None = None,
                parent_ids: np.ndarray | None = None) -> torch.Tensor:
        """``logits`` [R, V] of a step after each request's options; ``logits`` itself when no
        request of ``batch`` uses one. ``num_drafts`` [B] (host): request b owns
        ``num_drafts[b] + 1`` rows (None: one row each, a plain step); ``draft_token_ids``
        [sum(num_drafts)] on the device, the drafts in batch order. ``penalties``: those the
        step's forward was given (``step_penalties``); the ones it applied are skipped.
        ``host_drafts``: the drafts' copy ``fetch_drafts`` started (else they are read here).
        ``parent_ids`` [sum(num_drafts)] int64 (host): the drafts are token trees, each
        node's parent as a local index in its request (-1 = the root, ``verispec.ops.tree``);
        None: chains."""
        done = np.zeros(len(batch), dtype=bool)
        if penalties is not None and penalties.applied:
            done = penalties.slots >= 0
        if not any(r.options is not None and (not done[b] or r.options.beyond_penalties)
                   for b, r in enumerate(batch)):
            return logits
        if num_drafts is None:
            num_drafts = np.zeros(len(batch), dtype=np.int64)
        options = self.build(batch, np.asarray(num_drafts), draft_token_ids, done, host_drafts,
                             parent_ids)
        with ops.few_rows_on_one_thread(logits.device, logits.numel()):  # as the sampling ops
            # the grammar's masks by the device's kernel (one launch on CUDA)
            return apply_options(logits, options, ops.apply_token_bitmask)

    def build(self, batch: Sequence, num_drafts: np.ndarray,
              draft_token_ids: torch.Tensor | None,
              penalised: np.ndarray | None = None,
              host_drafts: HostDrafts | None = None,
              parent_ids: np.ndarray | None = None) -> OptionTensors:
        """The per-row inputs of ``apply_options`` for ``batch`` (see the module docstring);
        ``penalised`` [B] bool: requests whose penalties are applied already; ``host_drafts``
        the drafts on their way to the host (``fetch_drafts``); ``parent_ids`` [sum(num_drafts)]
        the trees' parents (None: chains), as in ``process``."""
        rows_per_request = num_drafts + 1
        first_rows = np.concatenate([[0], np.cumsum(rows_per_request)[:-1]])
        first_drafts = np.concatenate([[0], np.cumsum(num_drafts)[:-1]])
        members = [b for b, r in enumerate(batch) if r.options is not None]
        words = [len(w) - 1 for b in members for w in batch[b].options.bad_words]
        width = max(words, default=0)  # L: the longest bad-word prefix
        # token_source = [last `width` output tokens of each member (-1 padded), drafts, -1]
        tails = np.full((len(members), width), -1, dtype=np.int64)
        num_drafts_total = int(num_drafts.sum())
        draft_base = tails.size
        none_index = draft_base + num_drafts_total
        add, allowed, allowed_pairs, bad, penalty, draft_pairs = [], [], [], [], [], []
        grammar_rows, grammar_masks = [], []
        num_allowed_rows = num_penalty_rows = 0
        drafts_cpu = None
        if draft_token_ids is not None and any(
                batch[b].options.grammar is not None for b in members):
            # the matchers run on the host: one wait, for the drafts only
            drafts_cpu = (host_drafts or HostDrafts(draft_token_ids)).tolist()
            if parent_ids is None:  # the chains' masks, computed in parallel across requests
                chains = [b for b in members if batch[b].options.grammar is not None]
                for b in chains:
                    batch[b].options.grammar.sync(batch[b].output_token_ids)
                fill_chain_masks(
                    [batch[b].options.grammar for b in chains],
                    [drafts_cpu[first_drafts[b]:first_drafts[b] + int(num_drafts[b])]
                     for b in chains])
        for m, b in enumerate(members):
            r, o = batch[b], batch[b].options
            p, n = o.params, int(num_drafts[b])
            rows = first_rows[b] + np.arange(n + 1)  # [n + 1]
            parents = (None if parent_ids is None
                       else parent_ids[first_drafts[b]:first_drafts[b] + n])
            # the drafts each row sees, where an option needs them (a grammar alone does not)
            path = (SlotPaths(np.arange(n) - 1 if parents is None else parents, width)
                    if o.min_tokens_ids.size or o.bad_words or p.uses_penalties else None)
            if o.bias_ids.size:
                add.append((np.repeat(rows, o.bias_ids.size), np.tile(o.bias_ids, n + 1),
                            np.tile(o.bias_values, n + 1)))
            if o.min_tokens_ids.size:
                short = rows[r.num_output_tokens + path.depths < p.min_tokens]
                add.append(_ban(short, o.min_tokens_ids))
            if o.bad_single_ids.size:
                add.append(_ban(rows, o.bad_single_ids))
            if o.grammar is not None:
                o.grammar.sync(r.output_token_ids)
                drafts = [] if drafts_cpu is None else drafts_cpu[
                    first_drafts[b]:first_drafts[b] + n]
                grammar_rows.append(rows)
                grammar_masks.append(o.grammar.masks(
                    drafts, None if parents is None else parents.tolist()))
            if o.allowed_ids is not None:
                allowed.append(rows)
                allowed_pairs.append((np.repeat(num_allowed_rows + np.arange(n + 1),
                                                o.allowed_ids.size),
                                      np.tile(o.allowed_ids, n + 1)))
                num_allowed_rows += n + 1
            if o.bad_words:
                out = r.output_token_ids[max(r.num_output_tokens - width, 0):]
                tails[m, width - len(out):] = out
                # token_source index of the context of each row: its last `width` tokens
                context = path.context(m * width, draft_base + first_drafts[b])  # [n + 1, L]
                for word in o.bad_words:
                    prefix = np.full(width, WILDCARD, dtype=np.int64)
                    prefix[width - len(word) + 1:] = word[:-1]
                    bad.append((rows, np.full(n + 1, word[-1]), np.tile(prefix, (n + 1, 1)),
                                context))
            if p.uses_penalties and (penalised is None or not penalised[b]):
                penalty.append((rows, np.full(n + 1, r.slot),
                                np.full(n + 1, p.repetition_penalty, dtype=np.float32),
                                np.full(n + 1, p.frequency_penalty, dtype=np.float32),
                                np.full(n + 1, p.presence_penalty, dtype=np.float32)))
                row, node = path.pairs  # row counts every draft on its path
                draft_pairs.append((num_penalty_rows + row, draft_base + first_drafts[b] + node))
                num_penalty_rows += n + 1
        if penalty:
            self._count([batch[b] for b in members if batch[b].options.params.uses_penalties])

        grammar = None if not grammar_rows else (np.concatenate(grammar_rows),
                                                 np.concatenate(grammar_masks))
        return self._tensors(tails, draft_token_ids, none_index, add, allowed, allowed_pairs,
                             bad, penalty, draft_pairs, grammar)

    def _tensors(self, tails, draft_token_ids, none_index, add, allowed, allowed_pairs, bad,
                 penalty, draft_pairs, grammar) -> OptionTensors:
        device = self.device

        def put(array, dtype=torch.int64):
            return ops.to_device(np.ascontiguousarray(array), device, dtype)

        drafts = (torch.zeros(0, dtype=torch.int64, device=device) if draft_token_ids is None
                  else draft_token_ids.to(device=device, dtype=torch.int64))
        source = torch.cat([put(tails.reshape(-1)), drafts,
                            torch.full((1,), -1, dtype=torch.int64, device=device)])
        assert source.shape[0] == none_index + 1
        fields = dict.fromkeys(OptionTensors.__dataclass_fields__)
        fields["token_source"] = source
        if grammar is not None:
            fields["grammar_rows"] = put(grammar[0])
            fields["grammar_bitmask"] = put(grammar[1], torch.int32)
        if add:
            fields["add_rows"] = put(np.concatenate([a[0] for a in add]))
            fields["add_ids"] = put(np.concatenate([a[1] for a in add]))
            fields["add_values"] = put(np.concatenate([a[2] for a in add]), torch.float32)
        if allowed:
            fields["allowed_rows"] = put(np.concatenate(allowed))
            fields["allowed_pair_rows"] = put(np.concatenate([a[0] for a in allowed_pairs]))
            fields["allowed_ids"] = put(np.concatenate([a[1] for a in allowed_pairs]))
        if bad:
            for name, column in zip(("bad_rows", "bad_ids", "bad_prefix", "bad_context"),
                                    zip(*bad)):
                fields[name] = put(np.concatenate(column))
        if penalty:
            names = ("penalty_rows", "penalty_slots", "repetition", "frequency", "presence")
            neutral = {"repetition": 1.0, "frequency": 0.0, "presence": 0.0}
            for name, column in zip(names, zip(*penalty)):
                column = np.concatenate(column)
                if name in neutral:  # a penalty no row uses is skipped
                    if (column != neutral[name]).any():
                        fields[name] = put(column, torch.float32)
                else:
                    fields[name] = put(column)
            pairs = [np.concatenate(column) for column in zip(*draft_pairs)]
            if pairs[0].size:
                fields["draft_count_rows"] = put(pairs[0])
                fields["draft_count_source"] = put(pairs[1])
            fields["output_counts"] = self.output_counts
            fields["prompt_mask"] = self.prompt_mask
        return OptionTensors(**fields)

    def _allocate(self) -> None:
        if self.output_counts is None:
            shape = (self.max_num_seqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def _count(self, requests: Sequence) -> None:
        """Bring the per-slot counts of ``requests`` up to their committed tokens."""
        self._allocate()
        slots, tokens = [], []
        for r in requests:
            slot = r.slot
            if self._owner[slot] != r.request_id:  # new here: count from scratch
                self._owner[slot] = r.request_id
                self._num_counted[slot] = 0
                self.output_counts[slot].zero_()
                self.prompt_mask[slot].zero_()
                prompt = np.unique(r.token_ids[: r.num_prompt_tokens])
                self.prompt_mask[slot, ops.to_device(prompt, self.device)] = True
            new = r.output_token_ids[self._num_counted[slot]:]
            if len(new):
                slots.append(np.full(len(new), slot))
                tokens.append(new)
                self._num_counted[slot] = r.num_output_tokens
        if slots:
            index = (ops.to_device(np.concatenate(slots), self.device, torch.int64),
                     ops.to_device(np.concatenate(tokens), self.device, torch.int64))
            self.output_counts.index_put_(index, torch.ones_like(index[0], dtype=torch.int32),
                                          accumulate=True)


def _ban(rows: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, ids, -inf) pairs masking ``ids`` in every row of ``rows``."""
    return (np.repeat(rows, ids.size), np.tile(ids, rows.size),
            np.full(rows.size * ids.size, NEG_INF, dtype=np.float32))

"""Captured drafting of a model-based proposer (docs/design.md §5): the CUDA graphs and drafting
ahead of ``verispec.proposers.model_proposer.ModelProposer`` (its eager drafting is there).

On CUDA the whole draft of a step is one captured CUDA graph per batch bucket (``capture``):

    forward 0:  feed the last two committed tokens, at positions num_tokens - 2, num_tokens - 1
                (a request whose cache lacks only the last one rewrites the one before with the
                same token, the same K/V) -> d_1 from the last row
    forward i:  feed d_i                                  -> d_{i+1}, for i = 1 .. k - 1

drafting k tokens for every request of the batch (requests planned for fewer ignore the rest;
their cache rows are past the committed tokens and rolled back like any rejected draft). The
graph writes the drafts, and q for probabilistic drafting, straight into the per-slot buffers,
which therefore must stay the tensors that existed at capture (checked at every replay). A
request whose cache lacks more than the last two tokens (its first step after the prompt) is
first fed the rest in one eager forward without logits; batches larger than every graph, and
requests of a single token, draft eagerly (``ModelProposer._draft``).

Drafting ahead (``draft_ahead``, CUDA graphs only): after a step whose whole batch drafted through
the graph, the next step's draft is queued on the device right behind the rejection sampler,
before the host has read the step's output tokens. Its inputs come from those tokens on the
device: with ``a + 1`` output tokens (``a`` accepted drafts), the last two committed tokens are
``out[a - 1], out[a]`` (``a = 0``: the step's fed token, then ``out[0]``) at positions
``num_tokens + a - 1`` and ``num_tokens + a``, and the cache already holds every position below
(the step fed d_1 .. d_{k-1} after its last two tokens, and the accepted ones are committed). So
the device drafts while the host commits, plans and launches the verify forward. ``propose`` uses
the queued drafts only if its requests are the same ones, in the same order, each with exactly
the tokens ``on_commit`` reported (a request that finished, joined or stepped otherwise sends the
step down the usual path, which rewrites every row the queued draft touched).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verispec import ops
from verispec.ops.rejection import PLACEHOLDER_TOKEN_ID
from verispec.proposers.base import ProposalRequest
from verispec.proposers.draft_tree import context_tail
from verispec.runtime.cuda_graphs import StepInput


@dataclass
class AheadDraft:
    """Drafts queued by ``draft_ahead``: for these requests, in this order, each continuing
    with the committed length ``on_commit`` then reports (slot -> num_tokens)."""

    requests: list
    num_tokens: dict[int, int] | None = None


class ModelGraphDrafting:
    """The captured k-step draft, the captured forwards of one position and drafting ahead,
    for a proposer with ``runner``, ``num_layers``, ``greedy``, ``device``, the per-slot draft
    buffers and ``draft_grammar`` (``ModelProposer``, whose ``propose`` and ``_draft`` call
    them and whose ``on_commit`` calls ``_note_commit``)."""

    # Whether ``capture`` also captures the draft's forwards one position at a time, which a
    # batch with a grammar replays between its host-side masks (``_draft``); the proposers
    # whose ``_draft`` drafts from the runner's logits alone.
    captures_positions = False

    def _draft_inputs(self) -> dict:
        """The captured draft's own static inputs, beside the slots, the start positions and
        the sampling parameters: the last two committed tokens."""

        return {"ids": StepInput(2, torch.int64)}

    def capture(self) -> None:
        """Capture the k-step draft (``_draft_step`` over ``_draft_inputs``) for every batch
        bucket (no-op without the runner's CUDA graphs)."""

        graphs = self.runner.graphs
        if graphs is None or graphs.has(self.graph_name):
            return
        inputs = {**self._draft_inputs(),
                  "slots": StepInput(1, torch.int64, self.runner.kv_cache.scratch_slot),
                  "starts": StepInput(1, torch.int64, 0)}
        if not self.greedy:
            inputs.update(temperature=StepInput(1, torch.float32, 1.0),
                          seeds=StepInput(1, torch.int64, 0))
        with torch.inference_mode():
            graphs.add(self.graph_name, inputs, self._draft_step)
            if self.captures_positions:
                # logits of every slot's last fed token, for the grammar batches' drafts
                self.draft_logits_buffer = torch.zeros(
                    self.draft_token_buffer.shape[0], self.runner.config.vocab_size,
                    dtype=torch.float32, device=self.device)
                positions = {"slots": inputs["slots"], "starts": inputs["starts"]}
                for width in (1, 2):
                    graphs.add(self._position_graph(width),
                               {"ids": StepInput(width, torch.int64), **positions},
                               functools.partial(self._position_step, width=width))
        self._captured_buffers = (self.draft_token_buffer, self.draft_probs_buffer)

    @property
    def graph_name(self) -> str:
        return "draft" + ("" if self.num_layers is None else f"_l{self.num_layers}")

    def _draft_step(self, x: dict[str, torch.Tensor]) -> None:
        """The captured draft: ``x["ids"]`` [B, 2] the last two committed tokens at positions
        ``x["starts"]``, ``x["starts"] + 1``; writes d_1..d_k (and q) into the slot rows."""
        runner, k = self.runner, self.num_speculative_tokens
        slots, starts = x["slots"].view(-1), x["starts"].view(-1)
        hidden = runner.fixed_step_hidden(x["ids"].view(-1), slots, starts, 2, self.num_layers)
        logits = runner.compute_logits(hidden[1::2])  # [B, V] at position num_tokens - 1
        for i in range(k):
            positions = starts + 2 + i  # d_{i+1} occupies position num_tokens + i
            if self.greedy:
                draft_ids = runner.ops.argmax(logits)
            else:
                draft_ids, q = ops.sample_draft(logits, x["temperature"].view(-1),
                                                x["seeds"].view(-1), positions)
                self.draft_probs_buffer[slots, i] = q
            self.draft_token_buffer[slots, i] = draft_ids
            if i + 1 < k:
                logits = runner.compute_logits(runner.fixed_step_hidden(
                    draft_ids, slots, positions, 1, self.num_layers))

    def _position_graph(self, width: int) -> str:
        return f"{self.graph_name}_position{width}"

    def _position_step(self, x: dict[str, torch.Tensor], width: int) -> None:
        """A captured draft forward of ``width`` tokens per request (``x["ids"]`` [B, width] at
        positions ``x["starts"]`` ..): the logits of each request's last token into its row of
        ``draft_logits_buffer``."""
        runner, slots = self.runner, x["slots"].view(-1)
        hidden = runner.fixed_step_hidden(x["ids"].view(-1), slots, x["starts"].view(-1), width,
                                          self.num_layers)
        self.draft_logits_buffer[slots] = runner.compute_logits(hidden[width - 1::width])

    def _replays_positions(self, requests, active: np.ndarray) -> bool:
        """Whether a batch that drafts eagerly (a grammar's masks come from the host between
        positions) replays the captured forwards of one position: graphs, a batch that fits,
        two committed tokens per request."""
        graphs = self.runner.graphs
        return (self.captures_positions and graphs is not None
                and graphs.has(self._position_graph(1))
                and graphs.fits(self._position_graph(1), active.size)
                and all(len(requests[r].token_ids) >= 2 for r in active))

    def _position_logits(self, slots: np.ndarray, ids, starts: np.ndarray,
                         slots_device: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the position forward of ``ids`` [B, width] (host array or device tensor) at
        positions ``starts`` [B] .. in ``slots`` (``slots_device``: the same on the device,
        where the caller has them); [B, V] logits of each request's last token."""
        width = ids.shape[1]
        cache = self.runner.kv_cache
        cache.prepare_write(slots, lambda: starts + width)
        self.runner.graphs.run(self._position_graph(width), {
            "ids": ids, "slots": slots[:, None], "starts": starts[:, None]})
        cache.set_lengths(slots, starts + width)
        if slots_device is None:
            slots_device = ops.to_device(slots, self.device)
        return self.draft_logits_buffer[slots_device]

    def _can_replay(self, requests, active: np.ndarray, slots: np.ndarray) -> bool:
        """Whether the captured draft applies: graphs, a batch that fits, two committed tokens
        per request. A cache that lacks more than the last two is first caught up eagerly
        (``_catch_up``), so a request's first step after its prompt replays too."""
        graphs = self.runner.graphs
        if graphs is None or not graphs.fits(self.graph_name, active.size):
            return False
        # the captured draft masks nothing: a request with a grammar drafts eagerly under it
        return all(len(requests[r].token_ids) >= 2 and self.draft_grammar(requests[r]) is None
                   for r in active)

    def _catch_up(self, requests, active: np.ndarray, slots: np.ndarray) -> None:
        """Feed the committed tokens before the last two that a request's cache lacks (its
        prompt, on its first step) in one eager forward without logits."""
        cache = self.runner.kv_cache
        lag_slots, feeds = [], []
        for r, slot in zip(active.tolist(), slots.tolist()):
            context = requests[r].token_ids
            num_cached, target = cache.length(slot), len(context) - 2
            if num_cached < target:
                lag_slots.append(slot)
                feeds.append(context_tail(context, num_cached)[: target - num_cached])
        if lag_slots:
            self.runner.forward(lag_slots, feeds, "none", self.num_layers)

    def _check_captured_buffers(self) -> None:
        captured = self._captured_buffers
        if captured[0] is not self.draft_token_buffer or captured[1] is not self.draft_probs_buffer:
            raise RuntimeError(
                "the draft buffers were replaced after the CUDA graph was captured: a replay "
                "writes only the tensors that existed at capture")

    def _replay(self, requests, active: np.ndarray, slots: np.ndarray, ids, starts) -> None:
        """Replay the captured draft for ``requests[active]`` in ``slots``: ``ids`` [B_a, 2] the
        last two committed tokens at positions ``starts`` [B_a] (host arrays or device
        tensors)."""
        self._check_captured_buffers()
        # the step writes the two fed tokens and k - 1 drafts from ``starts``
        self.runner.kv_cache.prepare_write(slots, lambda: np.asarray(
            starts.cpu() if isinstance(starts, torch.Tensor) else starts).reshape(-1)
            + self.num_speculative_tokens + 1)
        rows = {"ids": ids, "slots": slots[:, None], "starts": starts.reshape(-1, 1)}
        if not self.greedy:
            rows["temperature"] = np.array([[float(requests[r].temperature)] for r in active],
                                           dtype=np.float32)
            rows["seeds"] = np.array([[int(requests[r].seed)] for r in active], dtype=np.int64)
        self.runner.graphs.run(self.graph_name, rows)

    def _draft_replay(self, requests, active: np.ndarray, slots: np.ndarray) -> None:
        """Draft k tokens for every active request with the captured graph."""
        num_tokens = np.array([len(requests[r].token_ids) for r in active], dtype=np.int64)
        ids = np.stack([np.asarray(context_tail(requests[r].token_ids, n - 2), dtype=np.int64)
                        for r, n in zip(active, num_tokens)])
        self._replay(requests, active, slots, ids, num_tokens - 2)
        # the cache now holds everything fed: num_tokens - 2 + 2 + (k - 1) tokens
        self.runner.kv_cache.set_lengths(slots, num_tokens + self.num_speculative_tokens - 1)

    def draft_ahead(self, requests: Sequence[ProposalRequest],
                    output_token_ids: torch.Tensor) -> bool:
        """Queue the next step's captured draft from this step's output tokens on the device
        (see the module docstring); only after a step whose whole batch replayed the graph."""
        self._ahead = None
        if not self._replayed_all or getattr(self, "shares_target_cache", False):
            return False
        active = np.arange(len(requests))
        slots = np.array([r.slot for r in requests], dtype=np.int64)
        if not self._can_replay(requests, active, slots):
            return False
        out = output_token_ids.to(torch.int64)  # [B, k + 1], -1 padded
        num_out = (out != PLACEHOLDER_TOKEN_ID).sum(1)  # [B] a + 1 >= 1
        last = out.gather(1, (num_out - 1)[:, None])[:, 0]
        before = out.gather(1, (num_out - 2).clamp_min(0)[:, None])[:, 0]
        fed = ops.to_device(np.array([r.token_ids[-1] for r in requests], dtype=np.int64),
                            self.device)  # the token this step fed before its drafts
        num_tokens = np.array([len(r.token_ids) for r in requests], dtype=np.int64)
        ids = torch.stack([torch.where(num_out >= 2, before, fed), last], dim=1)  # [B, 2]
        starts = ops.to_device(num_tokens, self.device) + num_out - 2
        self._replay(requests, active, slots, ids, starts)
        self._ahead = AheadDraft(list(requests))
        return True

    def _ahead_matches(self, requests: Sequence[ProposalRequest]) -> bool:
        """Whether the queued drafts (consumed by this call) are for ``requests``: the same
        requests in the same order, each with the committed length ``on_commit`` reported."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.num_tokens is None or len(ahead.requests) != len(requests):
            return False
        return all(r is queued and len(r.token_ids) == ahead.num_tokens.get(r.slot)
                   for r, queued in zip(requests, ahead.requests))

    def _note_commit(self, slots: Sequence[int], num_committed_tokens: Sequence[int]) -> None:
        """Record, for queued drafts, the committed lengths of the step they were queued after
        (a second commit means they belong to no step any more)."""
        if self._ahead is None:
            return
        if self._ahead.num_tokens is None:
            self._ahead.num_tokens = {int(s): int(n) for s, n in
                                      zip(slots, num_committed_tokens)}
        else:
            self._ahead = None

    def _take_ahead(self, requests: Sequence[ProposalRequest]) -> bool:
        """Whether the queued drafts are this step's (then the cache holds what they fed)."""
        if not self._ahead_matches(requests):
            return False
        slots = np.array([r.slot for r in requests], dtype=np.int64)
        num_tokens = np.array([len(r.token_ids) for r in requests], dtype=np.int64)
        self.runner.kv_cache.set_lengths(slots, num_tokens + self.num_speculative_tokens - 1)
        return True

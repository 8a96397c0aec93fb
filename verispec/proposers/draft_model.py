"""Draft-model proposer (docs/design.md §5): a second, smaller Llama-family model drafts k tokens.

``ModelProposer`` holds what every model-based proposer shares (``draft_model`` here,
``early_exit`` in ``verispec.proposers.early_exit``): a ``ModelRunner`` whose per-slot KV cache
holds the tokens the proposer has consumed, the catch-up feed, the n_r batched autoregressive
steps and the per-slot draft buffers (token trees: ``proposers.draft_tree``).
``DraftModelProposer`` adds loading the draft model and checking its vocabulary against the
target's.

One step, for the requests with n_r > 0 (n_r = min(k, max_num_draft_tokens), known on the host):

    forward 0:  feed token_ids[num_cached_tokens[slot]:]  -> logits at position num_tokens - 1
                d_1 = argmax (greedy) | sample_draft(logits, T, seed, num_tokens) (probabilistic)
    forward i:  feed d_i (requests with n_r > i only)    -> d_{i+1} at position num_tokens + i

so a step costs max_r n_r forwards whatever the batch size, and the cache then holds
``num_tokens + n_r - 1`` tokens (d_{n_r} is produced, never consumed). ``on_commit`` moves each
slot's length back to ``min(num_cached_tokens, num_committed_tokens - 1)``: positions below it hold
accepted drafts (identical to the committed tokens), and the recovered or bonus token was never
fed. When every draft was accepted, the next catch-up feeds ``d_k`` and the bonus token.

A request with structured output drafts under its grammar (``verispec.proposers.grammar_walk``):
each forward's logits are masked by its matcher walked along the drafts so far before d_{i+1} is
drawn, so q is the masked distribution, and such a batch drafts eagerly (the captured draft
masks nothing).

The number of tokens a slot's cache holds is the runner's ``kv_cache.lengths_np[slot]``; nothing
else keeps count, so the two cannot drift apart.

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
requests of a single token, draft eagerly as above.

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
from verispec.config import SpeculativeConfig
from verispec.models.loader import load_model
from verispec.ops.rejection import PLACEHOLDER_TOKEN_ID
from verispec.proposers.base import (
    DraftProposal,
    ProposalRequest,
    Proposer,
    ProposerContext,
    matmul_weight_bytes,
    register_proposer,
)
from verispec.proposers.draft_tree import DraftTreeDrafting, context_tail
from verispec.proposers.grammar_walk import GrammarWalks
from verispec.runtime.cuda_graphs import StepInput
from verispec.runtime.model_runner import ModelRunner


class ModelProposer(DraftTreeDrafting, Proposer):
    """Drafting with a ``ModelRunner``: catch-up, n_r batched autoregressive steps, rollback.

    A subclass builds ``self.runner`` (whose ``kv_cache`` rows are the proposer's cache) and
    calls ``_init_buffers``; ``num_layers`` (None = all) is passed to every forward.

    Buffers, allocated once and indexed by slot (docs/design.md §5; a CUDA-graph replay writes only
    buffers that existed at capture):

    - ``draft_token_buffer``: [max_num_seqs, k] int64, d_1..d_{n_r} of the last step;
    - ``draft_probs_buffer``: [max_num_seqs, k, V] float32, q = softmax(draft_logits / T) of each
      draft (probabilistic drafting only; None when greedy).
    """

    runner: ModelRunner
    num_layers: int | None = None
    # Whether ``capture`` also captures the draft's forwards one position at a time, which a
    # batch with a grammar replays between its host-side masks (``_draft``); the proposers
    # whose ``_draft`` drafts from the runner's logits alone.
    captures_positions = False

    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        super().__init__(config, context)
        self.greedy = config.draft_sample_method == "greedy"
        self.uses_draft_probs = not self.greedy

    @property
    def draft_cost(self) -> float:
        """The bytes of the proposer's model's matmul weights over the target's
        (``Proposer.draft_cost``);
        0 where it drafts with the target's own runner (early exit: not modelled)."""
        target = getattr(self.context.target_model, "model", None)
        if target is None or self.runner.model is target:
            return 0.0
        return matmul_weight_bytes(self.runner.model) / max(1, matmul_weight_bytes(target))

    def _init_buffers(self, num_slots: int, vocab_size: int) -> None:
        k = self.num_speculative_tokens
        self.vocab_size = vocab_size
        # One more row where the runner has a scratch slot: a captured draft writes the rows of
        # its batch padding there.
        rows = num_slots + (self.runner.kv_cache.scratch_slot is not None)
        self.draft_token_buffer = torch.zeros(  # [max_num_seqs (+ 1), k] int64
            rows, k, dtype=torch.int64, device=self.device
        )
        self.draft_probs_buffer = None if self.greedy else torch.zeros(  # [max_num_seqs, k, V]
            rows, k, vocab_size, dtype=torch.float32, device=self.device
        )
        self._captured_buffers = None
        # Drafting ahead: whether the last draft replayed the graph for the whole batch, and the
        # drafts queued for the next step (requests, their committed lengths once known).
        self._replayed_all = False
        self._ahead: _AheadDraft | None = None

    # ----------------------------------------------------------------- captured drafting

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

    def _position_logits(self, slots: np.ndarray, ids, starts: np.ndarray) -> torch.Tensor:
        """Replay the position forward of ``ids`` [B, width] (host array or device tensor) at
        positions ``starts`` [B] .. in ``slots``; [B, V] logits of each request's last token."""
        width = ids.shape[1]
        cache = self.runner.kv_cache
        cache.prepare_write(slots, lambda: starts + width)
        self.runner.graphs.run(self._position_graph(width), {
            "ids": ids, "slots": slots[:, None], "starts": starts[:, None]})
        cache.set_lengths(slots, starts + width)
        return self.draft_logits_buffer[ops.to_device(slots, self.device)]

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
        self._ahead = _AheadDraft(list(requests))
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

    @property
    def num_cached_tokens(self) -> np.ndarray:
        """[num_slots] int64 host array: tokens each slot's cache holds (a live view)."""
        return self.runner.kv_cache.lengths_np

    def _num_drafts(self, requests: Sequence[ProposalRequest]) -> np.ndarray:
        """[B] int64 n_r: k cut to max_num_draft_tokens and to the positions the cache has."""
        k, max_len = self.num_speculative_tokens, self.runner.max_model_len
        return np.array(
            [max(0, min(k, int(r.max_num_draft_tokens), max_len - len(r.token_ids)))
             for r in requests],
            dtype=np.int64,
        )

    def propose(self, requests: Sequence[ProposalRequest]) -> DraftProposal:
        """Drafts for every request; see ``Proposer.propose`` and the module docstring."""
        num_drafts = self._num_drafts(requests)  # [B] n_r
        cu_num_draft_tokens = np.zeros(len(requests) + 1, dtype=np.int64)  # [B + 1]
        np.cumsum(num_drafts, out=cu_num_draft_tokens[1:])
        active = np.flatnonzero(num_drafts > 0)
        slots = np.array([requests[r].slot for r in active], dtype=np.int64)  # [B_a]
        if self._take_ahead(requests):
            self._replayed_all = True  # every request's cache holds its queued drafts
        elif active.size:
            self._draft(requests, active, slots, num_drafts[active])
        else:
            self._replayed_all = False
        # Gather the flattened layout from the per-slot buffers: request r's drafts are
        # buffer[slot_r, 0:n_r], in the order of ``requests`` (host-built indices, no sync).
        flat_slots = ops.to_device(np.repeat(slots, num_drafts[active]), self.device)
        flat_pos = ops.to_device(
            np.concatenate([np.arange(n) for n in num_drafts[active]] or [np.zeros(0, np.int64)]),
            self.device)
        draft_token_ids = self.draft_token_buffer[flat_slots, flat_pos]  # [num_draft_tokens]
        draft_probs = None
        if self.draft_probs_buffer is not None:
            with ops.few_rows_on_one_thread(self.device, flat_slots.numel() * self.vocab_size):
                draft_probs = self.draft_probs_buffer[flat_slots, flat_pos]  # [num_drafts, V]
        return DraftProposal(draft_token_ids, torch.from_numpy(cu_num_draft_tokens), draft_probs)

    def _draft(
        self,
        requests: Sequence[ProposalRequest],
        active: np.ndarray,  # [B_a] indices into requests with n_r > 0
        slots: np.ndarray,  # [B_a] their slots
        num_drafts: np.ndarray,  # [B_a] their n_r
    ) -> None:
        """Run the catch-up forward and n_r autoregressive steps; fill the per-slot buffers
        (replaying the captured draft where it applies)."""
        self._replayed_all = False
        if self._can_replay(requests, active, slots):
            self._catch_up(requests, active, slots)
            self._draft_replay(requests, active, slots)
            self._replayed_all = active.size == len(requests)
            return
        cache = self.runner.kv_cache
        contexts = [requests[r].token_ids for r in active]
        num_tokens = np.array([len(c) for c in contexts], dtype=np.int64)  # [B_a]
        # a grammar batch replays the captured forwards of one position (``_position_logits``),
        # which feed the last two committed tokens as the captured draft does
        by_position = self._replays_positions(requests, active)
        feeds = []
        for slot, context, length in zip(slots.tolist(), contexts, num_tokens.tolist()):
            if by_position:
                continue
            # Normally the cache holds at most num_tokens - 1 (on_commit's rule); a cache that
            # holds the last committed token too is moved back one so that its logits exist.
            num_cached = min(cache.length(slot), length - 1)
            cache.truncate(slot, num_cached)
            feeds.append(context_tail(context, num_cached))
        temperature = seeds = None
        if not self.greedy:
            temperature = torch.tensor(
                [float(requests[r].temperature) for r in active], dtype=torch.float32
            ).to(self.device)
            seeds = torch.tensor([int(requests[r].seed) for r in active], dtype=torch.int64)
            seeds = seeds.to(self.device)
        slots_t = torch.from_numpy(slots).to(self.device)
        rows = np.arange(active.size)  # rows of the B_a active requests still drafting
        # structured output: draft only what each request's grammar allows (grammar_walk)
        walks = GrammarWalks([self.draft_grammar(requests[r]) for r in active])
        try:
            if by_position:
                self._catch_up(requests, active, slots)
                last_two = np.stack([np.asarray(context_tail(c, n - 2), dtype=np.int64)
                                     for c, n in zip(contexts, num_tokens)])
                logits = self._position_logits(slots, last_two, num_tokens - 2)  # [B_a, V]
            else:
                logits = self.runner.forward(slots.tolist(), feeds, "last", self.num_layers)
            for i in range(int(num_drafts.max())):
                row_index = torch.from_numpy(rows).to(self.device)
                row_slots = slots_t if rows.size == active.size else slots_t[row_index]
                if walks:
                    logits = walks.apply(logits, rows)
                if self.greedy:
                    draft_ids = torch.argmax(logits, dim=-1)  # [rows] d_{i+1}
                else:
                    # d_{i+1} occupies absolute position num_tokens + i; q = softmax(logits / T).
                    positions = torch.from_numpy(num_tokens[rows] + i).to(self.device)
                    draft_ids, q = ops.sample_draft(
                        logits, temperature[row_index], seeds[row_index], positions
                    )
                    with ops.few_rows_on_one_thread(self.device, q.numel()):
                        self.draft_probs_buffer[row_slots, i] = q
                self.draft_token_buffer[row_slots, i] = draft_ids
                keep = num_drafts[rows] > i + 1  # requests that still need d_{i+2}
                if walks:
                    walks.advance(draft_ids, rows, ~keep)
                if not keep.any():
                    break
                # Feed d_{i+1} to the requests with more drafts to produce. ``ModelRunner.forward``
                # takes host token ids, so this is the one device-to-host read per draft position
                # (free on the CPU; on a GPU it waits for this position's sampling).
                feed_ids = draft_ids[torch.from_numpy(np.flatnonzero(keep)).to(self.device)]
                rows = rows[keep]
                if by_position:  # d_{i+1} at position num_tokens + i
                    logits = self._position_logits(slots[rows], feed_ids[:, None],
                                                   num_tokens[rows] + i)
                else:
                    logits = self.runner.forward(slots[rows].tolist(),
                                                 [[t] for t in feed_ids.tolist()], "last",
                                                 self.num_layers)
        finally:
            walks.close()  # (every walk has ended unless drafting failed)

    def on_commit(self, slots: Sequence[int], num_committed_tokens: Sequence[int]) -> None:
        """Roll each slot back to the committed tokens it has consumed:
        ``min(num_cached_tokens, num_committed_tokens - 1)``."""
        cache = self.runner.kv_cache
        for slot, num_committed in zip(slots, num_committed_tokens):
            cache.truncate(slot, max(0, min(cache.length(slot), int(num_committed) - 1)))
        self._note_commit(slots, num_committed_tokens)

    def free(self, slot: int) -> None:
        self.runner.kv_cache.free(slot)


@dataclass
class _AheadDraft:
    """Drafts queued by ``draft_ahead``: for these requests, in this order, each continuing
    with the committed length ``on_commit`` then reports (slot -> num_tokens)."""

    requests: list
    num_tokens: dict[int, int] | None = None


def check_vocab_sizes(
    draft_vocab_size: int,
    target_vocab_size: int | None,
    model_path: str,
    draft_tokenizer=None,
    target_tokenizer=None,
) -> None:
    """ValueError naming both sizes and the draft model when the vocabularies differ (the
    model's embedding rows, and the tokenizers' sizes when both are known)."""
    if target_vocab_size is not None and draft_vocab_size != target_vocab_size:
        raise ValueError(
            f"draft model {model_path!r} has vocab_size={draft_vocab_size}, but the target has "
            f"vocab_size={target_vocab_size}: a draft model must share the target's vocabulary"
        )
    if draft_tokenizer is not None and target_tokenizer is not None:
        num_draft, num_target = len(draft_tokenizer), len(target_tokenizer)
        if num_draft != num_target:
            raise ValueError(
                f"draft model {model_path!r} has a tokenizer of {num_draft} tokens, but the "
                f"target's tokenizer has {num_target}: a draft model must share the target's "
                "vocabulary"
            )
        draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
        if draft_vocab != target_vocab:
            differ = sorted(t for t in draft_vocab.keys() ^ target_vocab.keys())[:3] or sorted(
                t for t in draft_vocab if draft_vocab[t] != target_vocab[t])[:3]
            raise ValueError(
                f"draft model {model_path!r} has a tokenizer of the target's size whose tokens "
                f"differ (e.g. {differ!r}): a draft model must share the target's vocabulary")


@register_proposer("draft_model")
class DraftModelProposer(ModelProposer):
    """A second model, loaded from ``config.model`` (a local HF directory or a ``.gguf`` file)
    with ``context.dtype`` on ``context.device``, with its own KV cache of
    ``context.max_num_seqs`` slots x ``context.max_model_len`` positions over the same slot
    numbers as the target.

    Its vocabulary must equal ``context.vocab_size`` (or, when that is None, the vocabulary of
    ``context.target_model``'s config); when both tokenizers are known (the
    draft directory's, and ``context.tokenizer`` or ``context.target_model.tokenizer``) their
    sizes must agree as well.
    """

    captures_positions = True

    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        super().__init__(config, context)

        if config.model is None:
            raise ValueError(
                "speculative method 'draft_model' needs the draft model: set "
                "SpeculativeConfig.model to a local HF directory or .gguf file"
            )
        ctx = self.context
        self.loaded = load_model(config.model, ctx.dtype, ctx.device, tp=ctx.tp,
                                 load_format=ctx.load_format)
        target_tokenizer = ctx.tokenizer
        if target_tokenizer is None:  # a LoadedModel given as the target
            target_tokenizer = getattr(ctx.target_model, "tokenizer", None)
        target_vocab_size = ctx.vocab_size
        if target_vocab_size is None:  # the target's config (a runner, a model or a LoadedModel)
            target_vocab_size = getattr(getattr(ctx.target_model, "config", None), "vocab_size",
                                        None)
        check_vocab_sizes(
            self.loaded.config.vocab_size, target_vocab_size, str(config.model),
            self.loaded.tokenizer, target_tokenizer,
        )
        target_graphs = getattr(ctx.target_model, "graphs", None)
        self.runner = ModelRunner(
            self.loaded.model, ctx.max_num_seqs, ctx.max_model_len, ctx.device,
            max_step_tokens=max(config.num_speculative_tokens,
                                len(config.tree_parents or ())) + 1,
            enforce_eager=ctx.device.type == "cuda" and target_graphs is None,
            # drafts decide which tokens a sampled request emits: batch invariant like the target
            batch_invariant=getattr(ctx.target_model, "batch_invariant", True),
            block_tables=ctx.block_tables)
        if target_graphs is not None and self.runner.graphs is not None:
            self.runner.graphs.pool = target_graphs.pool  # one memory pool for every capture
        self._init_buffers(ctx.max_num_seqs, self.loaded.config.vocab_size)

"""Model-based drafting (docs/design.md §5): the base of the proposers that draft with a
``ModelRunner``.

``ModelProposer`` holds what every model-based proposer shares (``draft_model`` in
``verispec.proposers.draft_model``, ``early_exit`` in ``verispec.proposers.early_exit``): a
``ModelRunner`` whose per-slot KV cache holds the tokens the proposer has consumed, the catch-up
feed, the n_r batched autoregressive steps and the per-slot draft buffers (token trees:
``proposers.draft_tree``).

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

On CUDA a step's draft is one captured CUDA graph per batch bucket, and the next step's draft
can be queued on the device before the host reads the step's output tokens: the captured
drafting of ``verispec.proposers.model_graph``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verispec import ops
from verispec.config import SpeculativeConfig
from verispec.ops.staging import HostDrafts
from verispec.proposers.base import (
    DraftProposal,
    ProposalRequest,
    Proposer,
    ProposerContext,
    matmul_weight_bytes,
)
from verispec.proposers.draft_tree import DraftTreeDrafting, context_tail
from verispec.proposers.grammar_walk import GrammarWalks
from verispec.proposers.model_graph import AheadDraft, ModelGraphDrafting
from verispec.runtime.flat_layout import ragged_arange
from verispec.runtime.model_runner import ModelRunner


class ModelProposer(DraftTreeDrafting, ModelGraphDrafting, Proposer):
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
        self._ahead: AheadDraft | None = None

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
        flat_pos = ops.to_device(ragged_arange(num_drafts[active]), self.device)
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
        temperature = seeds = base = None
        if not self.greedy:
            temperature = ops.to_device([float(requests[r].temperature) for r in active],
                                        self.device, torch.float32)
            seeds = ops.to_device([int(requests[r].seed) for r in active], self.device,
                                  torch.int64)
            base = ops.to_device(num_tokens, self.device)  # d_{i+1}'s position: base + i
        slots_t = ops.to_device(slots, self.device)
        rows = np.arange(active.size)  # rows of the B_a active requests still drafting
        if by_position:
            self._catch_up(requests, active, slots)
            last_two = np.stack([np.asarray(context_tail(c, n - 2), dtype=np.int64)
                                 for c, n in zip(contexts, num_tokens)])
            logits = self._position_logits(slots, last_two, num_tokens - 2, slots_t)  # [B_a, V]
        else:
            logits = self.runner.forward(slots.tolist(), feeds, "last", self.num_layers)
        # structured output: draft only what each request's grammar allows (grammar_walk); the
        # first draft's masks are computed while the device runs the forward above
        walks = GrammarWalks([self.draft_grammar(requests[r]) for r in active],
                             greedy=self.greedy)
        try:
            for i in range(int(num_drafts.max())):
                # (every request still drafting: views, not gathers)
                row_index = (slice(None) if rows.size == active.size
                             else ops.to_device(rows, self.device))
                row_slots = slots_t[row_index]
                read = None  # d_{i+1} on the host, where the walks read it already
                if walks and self.greedy:  # masks only where the grammar refuses an argmax
                    draft_ids, read = walks.argmax(logits, rows,
                                                   lambda x: torch.argmax(x, dim=-1))
                elif self.greedy:
                    draft_ids = torch.argmax(logits, dim=-1)  # [rows] d_{i+1}
                else:
                    if walks:
                        logits = walks.apply(logits, rows)
                    # d_{i+1} occupies absolute position num_tokens + i; q = softmax(logits / T).
                    draft_ids, q = ops.sample_draft(
                        logits, temperature[row_index], seeds[row_index], base[row_index] + i
                    )
                    with ops.few_rows_on_one_thread(self.device, q.numel()):
                        self.draft_probs_buffer[row_slots, i] = q
                self.draft_token_buffer[row_slots, i] = draft_ids
                keep = num_drafts[rows] > i + 1  # requests that still need d_{i+2}
                if not keep.any():
                    if walks:
                        walks.advance(draft_ids, rows, ~keep)
                    break
                # Feed d_{i+1} to the requests with more drafts to produce. ``ModelRunner.forward``
                # takes host token ids, so this is the one device-to-host read per draft position
                # (free on the CPU; on a GPU it waits for this position's sampling).
                kept = (slice(None) if keep.all()
                        else ops.to_device(np.flatnonzero(keep), self.device))
                feed_ids = draft_ids[kept]
                walked, rows = rows, rows[keep]
                host_ids = HostDrafts(draft_ids) if walks and read is None else None
                if by_position:  # d_{i+1} at position num_tokens + i
                    logits = self._position_logits(slots[rows], feed_ids[:, None],
                                                   num_tokens[rows] + i, row_slots[kept])
                else:
                    logits = self.runner.forward(slots[rows].tolist(),
                                                 [[t] for t in feed_ids.tolist()], "last",
                                                 self.num_layers)
                if walks:
                    # the masks of d_{i+2} are built while the device runs the forward above
                    # (the replayed forward takes d_{i+1} on the device; its host copy was
                    # queued before it)
                    walks.advance(read if read is not None else host_ids.tolist(), walked,
                                  ~keep)
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

"""Captured drafting of an EAGLE head (docs/design.md §5): the CUDA graphs and drafting ahead of
``verispec.proposers.eagle.EagleProposer`` (its eager drafting, the head's forward and the
pending pairs are there, with the terms N and pending pair).

On CUDA (the flat layout; ``capture``) a step's draft is one CUDA graph per batch bucket:

    forward 0:  W = k + 1 pairs per request at positions num_cached .. num_cached + W - 1, of
                which the first ``counts[b]`` are its pending pairs (a + 1 after a step that
                accepted a drafts, 1 after a decode step); the padding pairs write cache rows
                past N - 2, which are dead: a draft forward rewrites any it reads
                -> d_1 from row counts[b] - 1
    forward i:  (g, d_i) at position N - 2 + i -> d_{i+1}, for i = 1 .. k - 1

drafting k tokens for every request (as the draft model's graph: a request planned for fewer
ignores the rest). A request with more than W pending pairs (its first step after the prompt,
or after steps without drafts) first feeds the others in one eager forward without logits.

Drafting ahead (``draft_ahead``): after a verify replayed through the target's graph of W tokens
per request, request b's pending pairs are its verified positions, whose hidden states are rows
``b W .. b W + a`` of that graph's output and whose next tokens are the step's output tokens
``out[b, 0 .. a]``. So the next step's draft is queued on the device right behind the rejection
sampler, before the host reads the tokens, and the device drafts while the host commits. The
pending rows are still taken by ``on_commit``; ``propose`` drops them when it uses the queued
drafts (the queued forward 0 fed the same pairs into the same cache rows), and otherwise drafts
as usual from them, rewriting those rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verispec import ops
from verispec.ops.rejection import PLACEHOLDER_TOKEN_ID
from verispec.proposers.base import ProposalRequest
from verispec.proposers.model_graph import AheadDraft
from verispec.runtime.cuda_graphs import StepInput


class EagleGraphDrafting:
    """The captured draft and drafting ahead of ``EagleProposer`` (a mixin over its head, its
    runner, its pending pairs and ``ModelGraphDrafting``, whose captured draft it replaces)."""

    def _draft_inputs(self) -> dict:
        """The captured draft's own static inputs (``capture``; the module docstring): W pairs
        per request, token ids and target hidden states, and how many of them are real."""

        eagle = self.head.eagle
        width = len(eagle.aux_layer_ids) * eagle.target_hidden_size  # a target row's features
        return {"ids": StepInput(self.width, torch.int64),
                "hidden": StepInput(self.width * width, self.runner.dtype),
                "counts": StepInput(1, torch.int64, 1)}

    def _draft_step(self, x: dict[str, torch.Tensor]) -> None:
        """The captured draft: ``x["ids"]`` [B, W] tokens and ``x["hidden"]`` [B, W * D] target
        hidden states of positions ``starts ..``, the first ``counts`` real; writes d_1..d_k
        (and q) into the slot rows."""
        runner, head, W = self.runner, self.head, self.width
        cache = runner.kv_cache
        slots, starts = x["slots"].view(-1), x["starts"].view(-1)
        counts = x["counts"].view(-1)
        B = slots.shape[0]
        normed, out = head.forward_flat(
            x["ids"].view(-1), x["hidden"].view(B * W, -1), True,
            runner.fixed_batch(slots, starts, W), cache.k_layers, cache.v_layers)
        last = torch.arange(0, B * W, W, device=self.device) + counts - 1
        logits, hidden = head.compute_logits(normed[last], runner.ops), out[last]
        fed = starts + counts - 1  # position of the last pending pair: N - 2
        temperature = seeds = None
        if not self.greedy:
            temperature, seeds = x["temperature"].view(-1), x["seeds"].view(-1)
        for i in range(self.num_speculative_tokens):
            draft_ids, q = self._choose(logits, temperature, seeds, fed + 2 + i)
            if q is not None:
                self._store_q(slots, i, q)
            self.draft_token_buffer[slots, i] = draft_ids  # d_{i+1}, at position N + i
            if i + 1 < self.num_speculative_tokens:  # (g, d_{i+1}) at position N - 1 + i
                normed, hidden = head.forward_flat(
                    draft_ids, hidden, False, runner.fixed_batch(slots, fed + 1 + i, 1),
                    cache.k_layers, cache.v_layers)
                logits = head.compute_logits(normed, runner.ops)

    def _draft_replay(self, requests, active: np.ndarray, slots: np.ndarray,
                      num_tokens: np.ndarray, feeds: list[np.ndarray],
                      pending: list[torch.Tensor]) -> None:
        """The captured draft for ``requests[active]``: ``feeds[b]`` the tokens and
        ``pending[b]`` the target hidden states of its pending pairs."""
        W, cache = self.width, self.runner.kv_cache
        counts = np.array([len(f) for f in feeds], dtype=np.int64)
        lag = np.flatnonzero(counts > W)
        if lag.size:  # all but the last W pairs in one eager forward, no logits
            self._head_forward(slots[lag].tolist(), [feeds[b][: counts[b] - W] for b in lag],
                               torch.cat([pending[b][: counts[b] - W] for b in lag]), True,
                               logits=False)
            for b in lag:
                feeds[b], pending[b] = feeds[b][counts[b] - W:], pending[b][counts[b] - W:]
            counts = np.minimum(counts, W)
        B = active.size
        ids = np.zeros((B, W), dtype=np.int64)
        for b, f in enumerate(feeds):
            ids[b, : len(f)] = f
        rows = torch.cat(pending)
        if (counts == W).all():
            hidden = rows.view(B, -1)
        else:
            valid = (np.arange(W)[None, :] < counts[:, None]).reshape(-1)
            hidden = rows.new_zeros((B * W, rows.shape[-1]))
            hidden[ops.to_device(np.flatnonzero(valid), self.device)] = rows
            hidden = hidden.view(B, -1)
        self._replay(requests, active, slots, ids, hidden, cache.lengths_np[slots], counts)
        # only the pairs fed with target hidden states stay (``verispec.proposers.eagle``)
        cache.set_lengths(slots, num_tokens - 1)

    def _replay(self, requests, active: np.ndarray, slots: np.ndarray, ids, hidden: torch.Tensor,
                starts: np.ndarray, counts) -> None:
        """Replay the captured draft for ``requests[active]`` in ``slots``: ``ids`` [B_a, W]
        and ``hidden`` [B_a, W * D] the pairs from positions ``starts`` [B_a], the first
        ``counts`` [B_a] real (host arrays or device tensors)."""
        self._check_captured_buffers()
        # the step writes W pairs and k - 1 drafts from ``starts``
        self.runner.kv_cache.prepare_write(slots, lambda: np.asarray(
            starts.cpu() if isinstance(starts, torch.Tensor) else starts).reshape(-1)
            + self.width + self.num_speculative_tokens)
        inputs = {"ids": ids, "hidden": hidden, "slots": slots[:, None],
                  "starts": starts.reshape(-1, 1), "counts": counts.reshape(-1, 1)}
        if not self.greedy:
            inputs["temperature"] = np.array([[float(requests[r].temperature)] for r in active],
                                             dtype=np.float32)
            inputs["seeds"] = np.array([[int(requests[r].seed)] for r in active],
                                       dtype=np.int64)
        self.runner.graphs.run(self.graph_name, inputs)

    def draft_ahead(self, requests: Sequence[ProposalRequest],
                    output_token_ids: torch.Tensor) -> bool:
        """Queue the next step's captured draft from this step's output tokens and the verify
        graph's hidden states, on the device (``Proposer.draft_ahead``). After a verify of
        these requests through the graph of k + 1 tokens each, request b's pending pairs are
        exactly its verified positions: the hidden states of rows ``b (k + 1) ..`` of the
        graph's output with the output tokens ``out[b, 0 .. a]`` as the tokens after them
        (a accepted drafts, then the bonus or recovered token). Needs every head cache at the
        request's committed length - 1 with nothing pending (it drafted this step)."""
        self._ahead = None
        graphs, captured, W = self.runner.graphs, self.target.captured_hidden, self.width
        B = len(requests)
        if (captured is None or graphs is None or not graphs.has(self.graph_name)
                or not graphs.fits(self.graph_name, B)
                or any(self.draft_grammar(r) is not None for r in requests)):
            return False
        slots = np.array([r.slot for r in requests], dtype=np.int64)
        num_tokens = np.array([len(r.token_ids) for r in requests], dtype=np.int64)
        if (captured.slots != slots.tolist() or captured.rows.shape[0] < B * W
                or not np.array_equal(captured.row_start, np.arange(B) * W)
                or not np.array_equal(captured.starts, num_tokens - 1)
                or (self.runner.kv_cache.lengths_np[slots] != num_tokens - 1).any()
                or self.num_pending[slots].any()):
            return False
        out = output_token_ids.to(torch.int64)  # [B, <= k + 1], -1 padded
        if out.shape[1] < W:
            out = torch.nn.functional.pad(out, (0, W - out.shape[1]), value=PLACEHOLDER_TOKEN_ID)
        counts = (out != PLACEHOLDER_TOKEN_ID).sum(1)  # a + 1 >= 1
        self._replay(requests, np.arange(B), slots, out.clamp_min(0),
                     captured.rows[: B * W].view(B, -1), num_tokens - 1, counts)
        self._ahead = AheadDraft(list(requests))
        return True

    def _take_ahead(self, requests: Sequence[ProposalRequest]) -> bool:
        """Whether the queued drafts are this step's: then the queued draft has fed every
        pending pair (its cache rows are those pairs' rows), so the pending rows are dropped."""
        if not self._ahead_matches(requests):
            return False
        slots = [r.slot for r in requests]
        for slot in slots:
            self._pending[slot] = []
            self.num_pending[slot] = 0
        self.runner.kv_cache.set_lengths(slots, [len(r.token_ids) - 1 for r in requests])
        return True

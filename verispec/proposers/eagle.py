"""EAGLE proposers (docs/design.md §5): a one-layer head fed the target's own hidden states drafts k
tokens. ``method="eagle"`` loads an EAGLE-1 head, ``"eagle3"`` an EAGLE-3 head
(``verispec.models.eagle``); ``SpeculativeConfig.model`` is the head's directory.

The target's ``ModelRunner`` keeps the hidden states the head reads (``capture_layers``) of every
token its forwards feed: the prompt at prefill, ``[last committed token, d_1 .. d_n]`` at verify.
Head position p pairs target position p's hidden state with the token at p + 1, so once the
engine has committed N tokens the pairs of positions ``0 .. N - 2`` are known (the last token's
own hidden state comes with the next verify). Per slot the proposer keeps

- the head's KV cache (a ``ModelRunner`` over the head): ``num_cached`` positions, every one
  fed with the *target's* hidden state;
- the pending rows: target hidden states of positions ``num_cached .. N - 2`` not yet fed
  (``on_commit`` takes them from the target runner's last forward: the prompt after prefill,
  the ``a + 1`` verified rows after a step that accepted ``a`` drafts, ``k + 1`` when all were).

One step, for the requests with n_r > 0 (as a draft model: one forward per draft position):

    forward 0:  the pending pairs (target hidden, token) at positions num_cached .. N - 2
                -> d_1 from the last row; its output hidden g feeds the next step
    forward i:  (g, d_i) at position N - 2 + i -> d_{i+1}, for i = 1 .. n_r - 1

then every slot's cache is moved back to ``N - 1``: rows fed with the head's own hidden states
are never kept, whatever the verification accepts, and the verified rows replace them at the
next step. So the first step after prefill (pending = the prompt) and the step after all drafts
were accepted (pending = the k + 1 verified rows) need no special case.

Drafting: ``draft_sample_method="greedy"`` takes the argmax (one-hot rule, no probabilities);
``"probabilistic"`` samples over the head's draft vocabulary with ``ops.sample_draft`` on the
draft stream at each draft's absolute position (the race's vocabulary index is the draft id),
maps the draft to its target id, and keeps q scattered onto the target vocabulary (zero outside
the head's map) in a float32 ``[max_num_seqs, k, V]`` buffer owned by the proposer.

A request with structured output drafts under its grammar as a draft model does
(``verispec.proposers.grammar_walk``): the head's logits at draft position i are masked by its
matcher walked along d_1..d_i (a draft id allowed when its target id is) before d_{i+1} is
drawn, so q is the masked distribution the draft was sampled from; such a batch drafts eagerly
and is never drafted ahead (the captured draft masks nothing).

Buffers are per slot and allocated once (the captured GPU draft of a later step writes them);
the pending rows are a list per slot, copies taken from the target's forward by ``on_commit``
(one gather per step; a replayed target graph rewrites its output at the next replay).

On CUDA (the flat layout) a step's draft is one captured CUDA graph per batch bucket, and after a
verify replayed through the target's graph the next step's draft is queued on the device before
the host reads the step's output tokens: the captured drafting of
``verispec.proposers.eagle_graph``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verispec import ops
from verispec.config import SpeculativeConfig
from verispec.models.eagle_checkpoint import load_eagle_head
from verispec.ops.sampling import first_argmax
from verispec.proposers.base import ProposalRequest, ProposerContext, register_proposer
from verispec.proposers.eagle_graph import EagleGraphDrafting
from verispec.proposers.eagle_tree import EagleTreeDrafting
from verispec.proposers.grammar_walk import GrammarWalks
from verispec.proposers.model_proposer import ModelProposer
from verispec.runtime.flat_layout import ragged_arange
from verispec.runtime.model_runner import ModelRunner

# A request that does not draft (the planner turned drafting off, or no room) still feeds its
# pending pairs to the head once it has this many: its head KV then stays within a block or so
# of the target's, so the prefix cache can publish its blocks as complete (an EAGLE hit needs
# the head's rows). Every 16 idle steps, one eager forward of the head without logits.
CATCH_UP_PENDING = 16


@register_proposer("eagle")
class EagleProposer(EagleTreeDrafting, EagleGraphDrafting, ModelProposer):
    """An EAGLE head from ``config.model`` drafting from ``context.target_model``, the
    target's ``ModelRunner`` (whose hidden states it reads); token trees on the CPU path
    (``verispec.proposers.eagle_tree``)."""

    shifted_inputs = True  # head position p: the target's hidden state at p, the token at p + 1

    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        super().__init__(config, context)

        if config.model is None:
            raise ValueError(
                f"speculative method {self.name!r} needs the head: set SpeculativeConfig.model "
                "(--draft-model) to the EAGLE head's directory")
        ctx = self.context
        target = ctx.target_model
        if not isinstance(target, ModelRunner):
            raise ValueError(
                f"speculative method {self.name!r} reads the target's hidden states: "
                "ProposerContext.target_model must be the target's ModelRunner, got "
                f"{type(target).__name__}")
        self.target = target
        self.head = load_eagle_head(config.model, self.name, target.model, ctx.dtype, ctx.device,
                                    tp=ctx.tp)
        if ctx.vocab_size is not None and ctx.vocab_size != self.head.eagle.vocab_size:
            raise ValueError(
                f"EAGLE head {config.model!r} has vocab_size={self.head.eagle.vocab_size}, but "
                f"the target has vocab_size={ctx.vocab_size}")
        layers = self.head.eagle.aux_layer_ids
        if target.capture_layers and target.capture_layers != layers:
            raise ValueError(
                f"the target runner already keeps the hidden states of layers "
                f"{target.capture_layers}; this head reads {layers}")
        target.capture_layers = layers
        k = config.num_speculative_tokens
        self.width = k + 1  # pairs fed by the captured draft's first forward
        # The head's runner follows the target's layout (flat on CUDA) and graphs.
        self.runner = ModelRunner(
            self.head, ctx.max_num_seqs, ctx.max_model_len, ctx.device,
            max_step_tokens=self.width, flat_layout=target.flat,
            enforce_eager=target.graphs is None,
            batch_invariant=getattr(target, "batch_invariant", True),
            block_tables=ctx.block_tables)
        if target.graphs is not None and self.runner.graphs is not None:
            self.runner.graphs.pool = target.graphs.pool  # one memory pool for every capture
        self.draft_to_target = self.head.draft_to_target()  # [draft_vocab_size] int64 or None
        # its host copy: the grammar walks' masks are host bitmasks over the target's ids
        self.draft_to_target_np = (None if self.draft_to_target is None
                                   else self.draft_to_target.cpu().numpy())
        self._init_buffers(ctx.max_num_seqs, self.head.eagle.vocab_size)
        # Target hidden states not yet fed to the head, per slot: positions
        # num_cached .. num_cached + num_pending - 1, as runs (rows, lo, hi) of rows[lo:hi]
        # ([n, D], D = the fc's input features), sliced only when fed (``_pending_rows``: a
        # step drafted ahead drops them unread).
        self._pending: list[list[tuple[torch.Tensor, int, int]]] = [
            [] for _ in range(ctx.max_num_seqs)]
        self.num_pending = np.zeros(ctx.max_num_seqs, dtype=np.int64)

    # ----------------------------------------------------------------- the head's forward

    @torch.inference_mode()
    def _head_forward(self, slots: list[int], token_ids: list, hidden: torch.Tensor,
                      from_target: bool, logits: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Feed slot ``slots[b]`` the tokens ``token_ids[b]`` with their hidden states
        (``hidden`` [sum(len(t)), D], request-major; the target's when ``from_target``, else
        the head's own outputs), eagerly. Returns the last fed position's (logits [B, V_draft]
        float32, output hidden [B, H]); None without ``logits``."""
        runner = self.runner
        cache = runner.kv_cache
        counts = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(token_ids))
        starts = cache.lengths_np[slots]
        cache.check_append_many(slots, counts)
        if runner.flat:
            ids = ops.to_device(np.concatenate(token_ids).astype(np.int64), self.device)
            normed, out = self.head.forward_flat(
                ids, hidden, from_target, runner.flat_batch(slots, counts, starts),
                cache.k_layers, cache.v_layers)
            last = ops.to_device(np.cumsum(counts) - 1, self.device)
            normed, out = normed[last], out[last]
        else:
            B, width = len(slots), int(counts.max())
            ids = np.zeros((B, width), dtype=np.int64)
            for b, t in enumerate(token_ids):
                ids[b, : len(t)] = t
            meta, _, valid_index = runner._metadata(slots, counts, starts, width)
            if valid_index is None:
                padded = hidden.reshape(B, width, -1)
            else:
                padded = hidden.new_zeros((B * width, hidden.shape[-1]))
                padded[valid_index] = hidden
                padded = padded.view(B, width, -1)
            normed, out = self.head(ops.to_device(ids, self.device), padded, from_target,
                                    meta, cache.k_layers, cache.v_layers)
            if (counts == width).all():  # no padding (a draft step): the last column
                normed, out = normed[:, -1], out[:, -1]
            else:
                rows = torch.arange(B, device=self.device)
                last = ops.to_device(counts - 1, self.device)
                normed, out = normed[rows, last], out[rows, last]
        cache.advance(slots, counts.tolist())
        if not logits:
            return None
        return self.head.compute_logits(normed, runner.ops if runner.flat else None), out

    def _choose(self, logits: torch.Tensor, temperature, seeds, positions):
        """Drafts from the head's logits ([R, V_draft]): target ids [R] and q [R, V_draft] (for
        ``_store_q``) or None."""
        if self.greedy:
            ids = self.runner.ops.argmax(logits) if self.runner.flat else first_argmax(logits)
            return (ids if self.draft_to_target is None else self.draft_to_target[ids]), None
        # sampled over the draft vocabulary (a sample of q, which is zero outside the head's
        # map): a race over the draft vocabulary instead of the target's (the bundled model's
        # head: 8192 tokens, not 49 152)
        ids, q = ops.sample_draft(logits, temperature, seeds, positions)
        return (ids if self.draft_to_target is None else self.draft_to_target[ids]), q

    def _store_q(self, row_slots: torch.Tensor, i: int, q: torch.Tensor) -> None:
        """q of draft i ([R, V_draft], from ``_choose``) into the slots' rows of the buffer on
        the target vocabulary, zero outside the head's map, for the full rule."""
        if self.draft_to_target is None:
            self.draft_probs_buffer[row_slots, i] = q
            return
        rows = self.draft_probs_buffer[:, i]  # [max_num_seqs, V]
        rows.index_fill_(0, row_slots, 0.0)  # (a scalar fill: no host tensor, capturable)
        rows[row_slots[:, None], self.draft_to_target] = q

    # ----------------------------------------------------------------- drafting

    def _draft(
        self,
        requests: Sequence[ProposalRequest],
        active: np.ndarray,  # [B_a] indices into requests with n_r > 0
        slots: np.ndarray,  # [B_a] their slots
        num_drafts: np.ndarray,  # [B_a] their n_r
    ) -> None:
        """Forward 0 over the pending pairs, n_r - 1 draft forwards, then every slot back to
        the pairs fed with target hidden states (the module docstring)."""
        cache = self.runner.kv_cache
        num_tokens, feeds, pending = self._take_pending(requests, active, slots)
        grammars = [self.draft_grammar(requests[r]) for r in active]
        graphs = self.runner.graphs
        # the captured draft masks nothing: a batch with a grammar drafts eagerly under it
        if (graphs is not None and graphs.has(self.graph_name)
                and graphs.fits(self.graph_name, active.size)
                and all(g is None for g in grammars)):
            self._draft_replay(requests, active, slots, num_tokens, feeds, pending)
            return
        slot_list = slots.tolist()
        logits, out = self._head_forward(slot_list, feeds, torch.cat(pending), True)
        temperature = seeds = None
        if not self.greedy:
            temperature = ops.to_device([float(requests[r].temperature) for r in active],
                                        self.device, torch.float32)
            seeds = ops.to_device([int(requests[r].seed) for r in active], self.device,
                                  torch.int64)
        slots_t = ops.to_device(slots, self.device)
        rows = np.arange(active.size)  # the requests still drafting
        # structured output: draft only what each request's grammar allows (grammar_walk)
        walks = GrammarWalks(grammars, self.draft_to_target_np, greedy=self.greedy)
        try:
            for i in range(int(num_drafts.max())):
                # (every request still drafting: views, not gathers)
                row_index = (slice(None) if rows.size == active.size
                             else ops.to_device(rows, self.device))
                positions = ops.to_device(num_tokens[rows] + i, self.device)
                row_slots = slots_t[row_index]
                read = None  # d_{i+1} on the host, where a greedy walk read it already
                if walks and not self.greedy:  # q = softmax(masked logits / T): d_{i+1}'s
                    logits = walks.apply(logits, rows)
                # (the draw and q's store touch a few rows: one thread, no workers to wake)
                with ops.few_rows_on_one_thread(self.device, rows.size * self.vocab_size):
                    if walks and self.greedy:  # masks only where the grammar refuses an argmax
                        draft_ids, read = walks.argmax(
                            logits, rows, lambda x: self._choose(x, None, None, None)[0])
                        q = None
                    else:
                        draft_ids, q = self._choose(
                            logits, None if temperature is None else temperature[row_index],
                            None if seeds is None else seeds[row_index], positions)
                    self.draft_token_buffer[row_slots, i] = draft_ids  # d_{i+1}
                    if q is not None:
                        self._store_q(row_slots, i, q)
                keep = num_drafts[rows] > i + 1
                if walks and read is None and keep.any():
                    read = draft_ids.tolist()  # the walks' read and the head's next input
                if walks:
                    walks.advance(draft_ids if read is None else read, rows, ~keep)
                if not keep.any():
                    break
                kept = (slice(None) if keep.all()
                        else ops.to_device(np.flatnonzero(keep), self.device))
                # The head's input ids are host lists: one device-to-host read per position
                # (the walks' read already, where there are walks).
                feed = (draft_ids[kept].tolist() if read is None
                        else [read[j] for j in np.flatnonzero(keep).tolist()])
                rows = rows[keep]
                logits, out = self._head_forward(
                    slots[rows].tolist(), [[t] for t in feed], out[kept], False)
        finally:
            walks.close()  # (every walk has ended unless drafting failed)
            for slot, n in zip(slot_list, num_tokens.tolist()):
                cache.truncate(slot, n - 1)  # only rows fed with target hidden states stay

    def _take_pending(self, requests, active: np.ndarray, slots: np.ndarray
                      ) -> tuple[np.ndarray, list[np.ndarray], list[torch.Tensor]]:
        """Each active request's committed length N, and its pending pairs (tokens, target
        hidden states [n, D]) for forward 0, taken out of the pending list."""
        cache = self.runner.kv_cache
        num_tokens = np.array([len(requests[r].token_ids) for r in active], dtype=np.int64)
        feeds, pending = [], []
        for r, slot, n in zip(active.tolist(), slots.tolist(), num_tokens.tolist()):
            num_cached = cache.length(slot)
            if num_cached + self.num_pending[slot] != n - 1 or self.num_pending[slot] == 0:
                raise RuntimeError(
                    f"EAGLE proposer: slot {slot} has {num_cached} positions cached and "
                    f"{self.num_pending[slot]} target hidden states pending, but its request "
                    f"holds {n} tokens (on_commit must follow every step)")
            feeds.append(np.asarray(requests[r].token_ids[num_cached + 1 : n], dtype=np.int64))
            pending.append(self._pending_rows(slot))
            self._pending[slot] = []
            self.num_pending[slot] = 0
        return num_tokens, feeds, pending

    def _pending_rows(self, slot: int) -> torch.Tensor:
        """The pending rows of ``slot`` as one [num_pending, D] tensor."""
        parts = [rows[lo:hi] for rows, lo, hi in self._pending[slot]]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def propose(self, requests: Sequence[ProposalRequest]):
        self._catch_up_idle(requests)
        return super().propose(requests)

    def _catch_up_idle(self, requests: Sequence[ProposalRequest]) -> None:
        """Feed the head the pending pairs of each request that drafts nothing this step and
        has at least ``CATCH_UP_PENDING`` of them, but the last (a later forward 0 needs one
        pair to draft from). Rows fed with the target's hidden states, the same bits as in a
        forward 0 (the head's forward is batch invariant)."""
        threshold = max(CATCH_UP_PENDING, self.width + 1)  # never a request that just drafted
        if not (self.num_pending >= threshold).any():
            return
        num_drafts = self._num_drafts(requests)
        cache = self.runner.kv_cache
        slots, feeds, hidden = [], [], []
        for r, n in zip(requests, num_drafts.tolist()):
            slot = r.slot
            if n > 0 or self.num_pending[slot] < threshold:
                continue
            rows = self._pending_rows(slot)
            num_cached = cache.length(slot)
            fed = rows.shape[0] - 1
            slots.append(slot)
            feeds.append(np.asarray(r.token_ids[num_cached + 1:num_cached + 1 + fed],
                                    dtype=np.int64))
            hidden.append(rows[:fed])
            self._pending[slot] = [(rows, fed, rows.shape[0])]
            self.num_pending[slot] = 1
        if slots:
            self._head_forward(slots, feeds, torch.cat(hidden), True, logits=False)

    def on_commit(self, slots: Sequence[int], num_committed_tokens: Sequence[int]) -> None:
        """Take the target hidden states of the newly committed pairs from the target runner's
        last forward (slot s with N committed tokens needs positions up to N - 2), in one
        gather: copies that the target's next forward cannot overwrite. Array operations over
        the batch (a Python loop per request was ~0.6 ms of a batch-64 step's host work)."""
        slots_np = np.asarray(slots, dtype=np.int64)
        want = np.asarray(num_committed_tokens, dtype=np.int64) - 1
        have = self.runner.kv_cache.lengths_np[slots_np] + self.num_pending[slots_np]
        needs = want > have  # positions have .. want - 1 lack a row
        self._note_commit(slots, num_committed_tokens)
        if not needs.any():
            return
        slots_np, want, have = slots_np[needs], want[needs], have[needs]
        captured = self.target.captured_hidden
        bad = np.ones(slots_np.shape, dtype=bool)
        if captured is not None:
            b = _rows_in(captured.slots, slots_np)
            starts = captured.starts[b]
            bad = (b < 0) | (starts > have) | (want > starts + captured.counts[b])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise RuntimeError(
                f"EAGLE proposer: the target's last forward lacks the hidden states of "
                f"positions {have[i]} .. {want[i] - 1} of slot {slots_np[i]}")
        firsts = captured.row_start[b] + have - starts
        sizes = want - have
        ends = np.cumsum(sizes)
        if (firsts[1:] == (firsts + sizes)[:-1]).all():  # one run of rows (eager forwards)
            rows = captured.rows[firsts[0]:firsts[0] + ends[-1]].clone()
        else:
            index_rows = np.repeat(firsts, sizes) + ragged_arange(sizes)
            rows = captured.rows[ops.to_device(index_rows, self.device)]
        self.num_pending[slots_np] += sizes
        pending = self._pending
        for slot, lo, hi in zip(slots_np.tolist(), (ends - sizes).tolist(), ends.tolist()):
            pending[slot].append((rows, lo, hi))

    def free(self, slot: int) -> None:
        self.runner.kv_cache.free(slot)
        self._pending[slot] = []
        self.num_pending[slot] = 0


def _rows_in(captured_slots: list[int], slots: np.ndarray) -> np.ndarray:
    """[len(slots)] each slot's row in a forward over ``captured_slots`` (-1: not in it)."""
    where = np.full(max(max(captured_slots, default=-1), int(slots.max(initial=-1))) + 1, -1,
                    dtype=np.int64)
    where[captured_slots] = np.arange(len(captured_slots))
    return where[slots]


@register_proposer("eagle3")
class Eagle3Proposer(EagleProposer):
    """An EAGLE-3 head (``verispec.models.eagle``); everything else as ``EagleProposer``."""

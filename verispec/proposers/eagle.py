"""EAGLE proposers (REFERENCE §5): a one-layer head fed the target's own hidden states drafts k
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
``"probabilistic"`` scatters the draft-vocabulary logits onto the target vocabulary (``-inf``
elsewhere, so q is zero outside the head's map), samples with ``ops.sample_draft`` on the draft
stream at each draft's absolute position, and keeps q in a float32 ``[max_num_seqs, k, V]``
buffer owned by the proposer.

Buffers are per slot and allocated once (the captured GPU draft of a later step writes them);
the pending rows are a list per slot (the prompt's rows are one tensor). On CUDA the head runs
eagerly and the target runner keeps its hidden states on the eager path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verispec import ops
from verispec.config import SpeculativeConfig
from verispec.proposers.base import ProposalRequest, ProposerContext, register_proposer
from verispec.proposers.draft_model import ModelProposer


@register_proposer("eagle")
class EagleProposer(ModelProposer):
    """An EAGLE head from ``config.model`` drafting from ``context.target_model``, the
    target's ``ModelRunner`` (whose hidden states it reads)."""

    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        super().__init__(config, context)
        # Imported here: the engine imports the proposers package, not the other way round.
        from verispec.engine.model_runner import ModelRunner
        from verispec.models.eagle import load_eagle_head

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
        self.head = load_eagle_head(config.model, self.name, target.model, ctx.dtype, ctx.device)
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
        self.runner = ModelRunner(
            self.head, ctx.max_num_seqs, ctx.max_model_len, ctx.device, flat_layout=False,
            batch_invariant=getattr(target, "batch_invariant", True))
        self.draft_to_target = self.head.draft_to_target()  # [draft_vocab_size] int64 or None
        self._init_buffers(ctx.max_num_seqs, self.head.eagle.vocab_size)
        # Target hidden states not yet fed to the head, per slot: positions
        # num_cached .. num_cached + num_pending - 1, each [n, D] (D = the fc's input features).
        self._pending: list[list[torch.Tensor]] = [[] for _ in range(ctx.max_num_seqs)]
        self.num_pending = np.zeros(ctx.max_num_seqs, dtype=np.int64)

    # ----------------------------------------------------------------- the head's forward

    @torch.inference_mode()
    def _head_forward(self, slots: list[int], token_ids: list, hidden: torch.Tensor,
                      from_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed slot ``slots[b]`` the tokens ``token_ids[b]`` with their hidden states
        (``hidden`` [sum(len(t)), D], request-major; the target's when ``from_target``, else
        the head's own outputs). Returns the last fed position's (logits [B, V_draft] float32,
        output hidden [B, H])."""
        runner = self.runner
        cache = runner.kv_cache
        counts = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(token_ids))
        starts = cache.lengths_np[slots]
        for slot, n in zip(slots, counts):
            cache.check_append(slot, int(n))
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
        normed, out = self.head(torch.from_numpy(ids).to(self.device), padded, from_target,
                                meta, runner.kv_cache.k_layers, runner.kv_cache.v_layers)
        cache.advance(slots, counts.tolist())
        rows = torch.arange(B, device=self.device)
        last = torch.from_numpy(counts - 1).to(self.device)
        return self.head.compute_logits(normed[rows, last]), out[rows, last]

    def _choose(self, logits: torch.Tensor, temperature, seeds, positions):
        """Drafts from the head's logits ([R, V_draft]): target ids [R] and q [R, V] or None."""
        if self.greedy:
            ids = torch.argmax(logits, dim=-1)
            return (ids if self.draft_to_target is None else self.draft_to_target[ids]), None
        if self.draft_to_target is not None:
            # q over the target vocabulary: the draft vocabulary's logits at their target ids,
            # -inf (q = 0) everywhere else, before the full rule sees it.
            logits = logits.new_full((logits.shape[0], self.vocab_size), float("-inf")
                                     ).index_copy_(1, self.draft_to_target, logits)
        return ops.sample_draft(logits, temperature, seeds, positions)

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
        num_tokens = np.array([len(requests[r].token_ids) for r in active], dtype=np.int64)
        feeds, hidden = [], []
        for r, slot, n in zip(active.tolist(), slots.tolist(), num_tokens.tolist()):
            num_cached = cache.length(slot)
            if num_cached + self.num_pending[slot] != n - 1 or self.num_pending[slot] == 0:
                raise RuntimeError(
                    f"EAGLE proposer: slot {slot} has {num_cached} positions cached and "
                    f"{self.num_pending[slot]} target hidden states pending, but its request "
                    f"holds {n} tokens (on_commit must follow every step)")
            feeds.append(np.asarray(requests[r].token_ids[num_cached + 1 : n], dtype=np.int64))
            hidden.extend(self._pending[slot])
            self._pending[slot] = []
            self.num_pending[slot] = 0
        slot_list = slots.tolist()
        logits, out = self._head_forward(slot_list, feeds, torch.cat(hidden), True)
        temperature = seeds = None
        if not self.greedy:
            temperature = torch.tensor([float(requests[r].temperature) for r in active],
                                       dtype=torch.float32).to(self.device)
            seeds = torch.tensor([int(requests[r].seed) for r in active]).to(self.device)
        slots_t = torch.from_numpy(slots).to(self.device)
        rows = np.arange(active.size)  # the requests still drafting
        try:
            for i in range(int(num_drafts.max())):
                row_index = torch.from_numpy(rows).to(self.device)
                positions = torch.from_numpy(num_tokens[rows] + i).to(self.device)
                draft_ids, q = self._choose(
                    logits, None if temperature is None else temperature[row_index],
                    None if seeds is None else seeds[row_index], positions)
                row_slots = slots_t[row_index]
                self.draft_token_buffer[row_slots, i] = draft_ids  # d_{i+1}
                if q is not None:
                    self.draft_probs_buffer[row_slots, i] = q
                keep = num_drafts[rows] > i + 1
                if not keep.any():
                    break
                kept = torch.from_numpy(np.flatnonzero(keep)).to(self.device)
                rows = rows[keep]
                # The head's input ids are host lists: one device-to-host read per position.
                logits, out = self._head_forward(
                    slots[rows].tolist(), [[t] for t in draft_ids[kept].tolist()], out[kept],
                    False)
        finally:
            for slot, n in zip(slot_list, num_tokens.tolist()):
                cache.truncate(slot, n - 1)  # only rows fed with target hidden states stay

    def on_commit(self, slots: Sequence[int], num_committed_tokens: Sequence[int]) -> None:
        """Take the target hidden states of the newly committed pairs from the target runner's
        last forward: slot s with N committed tokens needs positions up to N - 2."""
        captured = self.target.captured_hidden
        index = {} if captured is None else {s: b for b, s in enumerate(captured.slots)}
        cache = self.runner.kv_cache
        for slot, num_committed in zip(slots, num_committed_tokens):
            have = cache.length(slot) + int(self.num_pending[slot])  # positions with a row
            want = int(num_committed) - 1
            if want <= have:
                continue
            b = index.get(slot)
            if b is None or not (captured.starts[b] <= have
                                 and want <= captured.starts[b] + captured.counts[b]):
                raise RuntimeError(
                    f"EAGLE proposer: the target's last forward lacks the hidden states of "
                    f"positions {have} .. {want - 1} of slot {slot}")
            first = int(captured.counts[:b].sum() + have - captured.starts[b])
            self._pending[slot].append(captured.rows[first : first + want - have])
            self.num_pending[slot] += want - have

    def free(self, slot: int) -> None:
        self.runner.kv_cache.free(slot)
        self._pending[slot] = []
        self.num_pending[slot] = 0


@register_proposer("eagle3")
class Eagle3Proposer(EagleProposer):
    """An EAGLE-3 head (``verispec.models.eagle``); everything else as ``EagleProposer``."""

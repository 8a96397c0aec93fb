"""Early-exit proposer (self-speculation, docs/design.md §5): the target's own first N layers, its
final norm and its LM head draft the tokens. No second model is held in memory.

The draft logits of a token are ``lm_head(norm(h_N))`` where ``h_N`` is the hidden state after
layer N (``ModelRunner.forward(..., num_layers=N)``). The K/V that layer i < N writes for a token
depends only on layers 0..i-1, so it is the same whether the forward runs N layers or all of
them. That allows two ways to hold the drafting cache, chosen by what
``ProposerContext.target_model`` is:

- **the target's ``ModelRunner``** (what the engine passes; no extra memory): the proposer drafts
  in the target's own slot rows. It catches up from the target's length (the engine keeps it at
  ``num_committed_tokens - 1``, so usually one token), drafts n_r tokens through layers < N, then
  moves every slot back to the length it found (at most ``num_tokens``). Rows it wrote past that
  are dead; the verify forward rewrites them for every layer. ``on_commit`` and ``free`` have
  nothing to do: the engine rolls the target cache back.
- **the target model** (``LlamaForCausalLM`` or a ``LoadedModel``): the proposer keeps its own KV
  cache of N layers x ``max_num_seqs`` slots x ``max_model_len`` (N / num_hidden_layers of the
  target's cache) and follows the ``num_cached_tokens`` rule of ``draft_model`` exactly.

Either way a step costs ``max_r n_r`` forwards of N layers for the whole batch.

``num_draft_layers`` may equal the number of layers: the drafts are then the target's own greedy
continuation and every greedy draft is accepted, which tests the fully accepted path of a
speculative step without a second model; it is not a speed-up.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verispec.config import SpeculativeConfig
from verispec.models.loader import LoadedModel
from verispec.proposers.base import (
    ProposalRequest,
    ProposerContext,
    register_proposer,
)
from verispec.proposers.model_proposer import ModelProposer
from verispec.runtime.model_runner import ModelRunner
from verispec.runtime.state_cache import make_cache


@register_proposer("early_exit")
class EarlyExitProposer(ModelProposer):
    """Drafts with ``context.target_model``'s first ``config.num_draft_layers`` layers.

    ``shares_target_cache`` is True when ``context.target_model`` is the target's
    ``ModelRunner`` (drafting in its rows), False when it is the model (an own N-layer cache).
    """

    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        super().__init__(config, context)

        ctx = self.context
        target = ctx.target_model
        if isinstance(target, LoadedModel):
            target = target.model
        if not isinstance(target, (ModelRunner, torch.nn.Module)):
            raise ValueError(
                "speculative method 'early_exit' drafts with the target's first layers: "
                "ProposerContext.target_model must be the target's ModelRunner or model, got "
                f"{type(target).__name__}"
            )
        self.shares_target_cache = isinstance(target, ModelRunner)
        model = target.model if self.shares_target_cache else target
        num_hidden_layers = model.config.num_hidden_layers
        num_layers = config.num_draft_layers
        if num_layers is None or not 1 <= num_layers <= num_hidden_layers:
            raise ValueError(
                "speculative method 'early_exit' needs num_draft_layers (--draft-layers) in "
                f"[1, {num_hidden_layers}] (the target has num_hidden_layers="
                f"{num_hidden_layers}), got num_draft_layers={num_layers!r}"
            )
        self.num_layers = num_layers
        if self.shares_target_cache:
            self.runner = target
        else:
            # A runner over the target model whose cache has only the N drafting layers
            # (model.forward pairs layer i with cache layer i). Built with 0 slots, then given
            # the N-layer cache (in the dtype the runner chose for its cache), so the
            # full-depth cache is never allocated.
            self.runner = ModelRunner(model, 0, ctx.max_model_len, ctx.device)
            self.runner.kv_cache = make_cache(
                model.config, ctx.max_num_seqs, ctx.max_model_len, self.runner.kv_cache.k.dtype,
                ctx.device, num_layers=num_layers, extra_rows=self.runner.kv_cache.extra_rows,
                max_step_tokens=config.num_speculative_tokens + 1,  # a hybrid's state ring
                block_tables=ctx.block_tables,
            )
        self._init_buffers(self.runner.kv_cache.num_slots, model.config.vocab_size)

    def _draft(
        self,
        requests: Sequence[ProposalRequest],
        active: np.ndarray,  # [B_a] indices into requests with n_r > 0
        slots: np.ndarray,  # [B_a] their slots
        num_drafts: np.ndarray,  # [B_a] their n_r
    ) -> None:
        """Draft as ``ModelProposer._draft``; with a shared cache, restore each slot's length."""
        if not self.shares_target_cache:
            return super()._draft(requests, active, slots, num_drafts)
        cache = self.runner.kv_cache
        # What the target's rows held; only rows below num_tokens can stay live (from
        # num_tokens on, layers < N now hold drafts).
        num_tokens = [len(requests[r].token_ids) for r in active]
        restore = np.minimum(cache.lengths_np[slots], num_tokens)
        try:
            super()._draft(requests, active, slots, num_drafts)
        finally:
            for slot, length in zip(slots.tolist(), restore.tolist()):
                cache.truncate(slot, min(length, cache.length(slot)))

    def on_commit(self, slots: Sequence[int], num_committed_tokens: Sequence[int]) -> None:
        if not self.shares_target_cache:
            super().on_commit(slots, num_committed_tokens)

    def free(self, slot: int) -> None:
        if not self.shares_target_cache:
            super().free(slot)

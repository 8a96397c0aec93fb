"""The rejection sampler: a SpeculativeConfig bound to the rejection_sample op."""

from __future__ import annotations

import torch

from verispec import ops
from verispec.config import SpeculativeConfig
from verispec.sample.sampler import SamplingTensors


class RejectionSampler:
    """Keeps exactly the draft tokens that preserve the target distribution (docs/design.md §3).

    In synthetic mode the conditional rates are made once, as a tensor on ``device``.
    """

    def __init__(self, config: SpeculativeConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.max_num_draft_tokens = config.num_speculative_tokens
        rates = config.conditional_rates
        self.synthetic_conditional_rates = (
            None if rates is None else torch.tensor(rates, dtype=torch.float32, device=device)
        )  # [k] float32

    def __call__(
        self,
        target_logits: torch.Tensor,  # [num_draft_tokens + B, V]
        draft_token_ids: torch.Tensor,  # [num_draft_tokens] int
        cu_num_draft_tokens: torch.Tensor,  # [B + 1] int, leading 0
        draft_probs: torch.Tensor | None,  # [num_draft_tokens, V] float32, or None (one-hot rule)
        sampling: SamplingTensors,
        positions: torch.Tensor,  # [B] int64, position of each request's first draft token
    ) -> torch.Tensor:
        """Returns token_ids [B, k + 1] int32, -1 padded (``ops.rejection.rejection_sample``)."""
        return ops.rejection_sample(
            target_logits,
            draft_token_ids,
            cu_num_draft_tokens,
            draft_probs,
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            sampling.min_p,
            sampling.seeds,
            positions,
            self.max_num_draft_tokens,
            self.synthetic_conditional_rates,
            sampling.all_greedy,
            # the proposers' drafts are in range by construction; the check reads them on the
            # host, a sync in the middle of the step
            check_draft_ids=False,
        )

    @staticmethod
    def num_output_tokens(token_ids: torch.Tensor) -> torch.Tensor:
        """[B] int64: accepted + 1 per request."""
        return ops.num_output_tokens(token_ids)

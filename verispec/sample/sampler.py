"""Per-request sampling parameters as batch tensors, and the sampler that uses them."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verispec import ops
from verispec.sampling_params import SamplingParams


def draw_seed() -> int:
    """A fresh int64 seed for a request that gave none (drawn once, at admission)."""
    return random.SystemRandom().randrange(-(2**63), 2**63)


@dataclass(frozen=True)
class SamplingTensors:
    """Sampling parameters of a batch, one row per request.

    Masks that no request uses are None, so the ops skip them; ``all_greedy`` is known on the host
    and lets the ops skip the noise entirely.
    """

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor | None  # [B] int32, 0 = off
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off
    min_p: torch.Tensor | None  # [B] float32, 0.0 = off
    seeds: torch.Tensor  # [B] int64
    all_greedy: bool

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Build from one SamplingParams and one resolved seed per request."""
        if len(params) != len(seeds):
            raise ValueError(f"need one seed per request: {len(params)} params, {len(seeds)} seeds")

        def column(values, dtype):
            return ops.to_device(values, device, dtype)

        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column([max(p.top_k, 0) for p in params], torch.int32)
            if any(p.uses_top_k for p in params) else None,
            top_p=column([p.top_p for p in params], torch.float32)
            if any(p.uses_top_p for p in params) else None,
            min_p=column([p.min_p for p in params], torch.float32)
            if any(p.uses_min_p for p in params) else None,
            seeds=column(list(seeds), torch.int64),
            all_greedy=all(p.greedy for p in params),
        )

    def select(self, index: torch.Tensor) -> SamplingTensors:
        """The rows ``index`` (e.g. the running requests of a step)."""

        def pick(t):
            return None if t is None else t[index]

        return SamplingTensors(
            temperature=self.temperature[index],
            top_k=pick(self.top_k),
            top_p=pick(self.top_p),
            min_p=pick(self.min_p),
            seeds=self.seeds[index],
            all_greedy=self.all_greedy,
        )


class Sampler:
    """Samples the next token of each request (no speculation, or the bonus-only path)."""

    def __call__(
        self,
        logits: torch.Tensor,  # [B, V]
        sampling: SamplingTensors,
        positions: torch.Tensor,  # [B] int64, the position each sampled token will occupy
    ) -> torch.Tensor:
        """Returns [B] int64 token ids."""
        return ops.sample(
            logits,
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            sampling.min_p,
            sampling.seeds,
            positions,
            ops.SAMPLE_STREAM,
            sampling.all_greedy,
        )

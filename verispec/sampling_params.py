"""Per-request sampling settings, named and defaulted as vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    ``temperature`` 0 means greedy (argmax). ``top_k`` 0 or -1 disables top-k, ``top_p`` 1.0 and
    ``min_p`` 0.0 disable theirs. The processed distribution is logits / temperature, then top-k,
    top-p and min-p masks, renormalised (docs/design.md §3). ``seed`` None draws one at admission.
    ``stop`` strings and ``stop_token_ids`` end the request; the EOS token does too unless
    ``ignore_eos``. ``max_tokens`` counts generated tokens. ``logprobs`` None returns no log
    probabilities; an integer N returns, for every output token, its log probability under the
    processed distribution and those of the N most likely tokens (vLLM's meaning; 0 = the
    token's alone).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: Sequence[str] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or math.isnan(self.temperature) or (
            self.temperature < 0 or math.isinf(self.temperature)
        ):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1) or (
                self.top_k >= 2**31):  # sampled as int32; any k >= the vocabulary is off
            raise ValueError(f"top_k must be an integer in [0, 2**31) (0 or -1 = off), got "
                             f"{self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens < 2**63:
            raise ValueError(f"max_tokens must be an integer in [1, 2**63), got "
                             f"{self.max_tokens!r}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(
                _is_int(t) and 0 <= t < 2**63 for t in ids):
            raise ValueError(
                "stop_token_ids must be a list of non-negative 64-bit integers, "
                f"got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0.0

"""Speculative decoding metrics with vLLM's definitions (docs/design.md §8), so dashboards carry
over.

Per step and request with n_r > 0: drafts += 1, draft_tokens += n_r, accepted += a,
accepted_per_pos[0 .. a-1] += 1. Requests that proposed nothing are not counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

logger = logging.getLogger("verispec.metrics")


@dataclass
class SpecDecodingStats:
    """Counters over any span of steps and requests."""

    num_spec_tokens: int  # k: length of the per-position counters
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification in one step."""
        if num_draft_tokens <= 0:
            return
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(
                f"num_accepted_tokens must be in [0, {num_draft_tokens}], got {num_accepted_tokens}"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def observe_step(
        self, num_draft_tokens: Sequence[int], num_accepted_tokens: Sequence[int]
    ) -> None:
        """A whole batch: per-request draft counts and accepted counts (host lists)."""
        for n, a in zip(num_draft_tokens, num_accepted_tokens, strict=True):
            self.observe(int(n), int(a))

    def merge(self, other: SpecDecodingStats) -> None:
        if other.num_spec_tokens != self.num_spec_tokens:
            raise ValueError(
                f"cannot merge stats for k={other.num_spec_tokens} into k={self.num_spec_tokens}"
            )
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[i] += n

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (counts the bonus or recovered token); 1.0 with no drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """accepted_per_pos[i] / drafts: the unconditional rate a_{i+1}."""
        if not self.num_drafts:
            return [0.0] * self.num_spec_tokens
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos]

    @property
    def draft_acceptance_rate(self) -> float:
        """accepted / draft_tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def log_line(self, elapsed_s: float) -> str:
        """The vLLM-format line; throughputs are over ``elapsed_s`` seconds."""
        elapsed_s = max(elapsed_s, 1e-9)
        per_pos = ", ".join(f"{r:.3f}" for r in self.acceptance_rate_per_pos)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {self.num_accepted_tokens / elapsed_s:.2f} tokens/s, "
            f"Drafted throughput: {self.num_draft_tokens / elapsed_s:.2f} tokens/s, "
            f"Accepted: {self.num_accepted_tokens} tokens, "
            f"Drafted: {self.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {100 * self.draft_acceptance_rate:.1f}%"
        )

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
            "draft_acceptance_rate": self.draft_acceptance_rate,
        }


class SpecDecodingLogger:
    """Aggregates stats over an interval and logs the vLLM line every ``interval_s`` seconds."""

    def __init__(self, num_spec_tokens: int, interval_s: float = 5.0) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.interval_s = interval_s
        self.total = SpecDecodingStats(num_spec_tokens)
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.interval = SpecDecodingStats(self.num_spec_tokens)
        self.interval_start = now

    def observe(self, stats: SpecDecodingStats) -> None:
        self.interval.merge(stats)
        self.total.merge(stats)

    def maybe_log(self, now: float | None = None) -> str | None:
        """Log and return the line if the interval has passed and drafts were seen."""
        now = time.monotonic() if now is None else now
        if now - self.interval_start < self.interval_s or not self.interval.num_drafts:
            return None
        line = self.interval.log_line(now - self.interval_start)
        logger.info(line)
        self._reset(now)
        return line

"""The hidden states a forward keeps for an EAGLE head (the runner's ``capture_layers``): which
layers' residual streams the model returns beside its output, and ``CapturedHidden``, the rows of
every token the runner's last forward fed (``verispec.runtime.model_runner``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CapturedHidden:
    """Hidden states of every token fed by the runner's last forward (``capture_layers``):
    slot ``slots[b]`` fed ``counts[b]`` tokens at positions ``starts[b] ..``, whose rows are
    ``rows[row_start[b] : row_start[b] + counts[b]]``. After a replayed graph ``rows`` is the
    graph's output buffer (padded layout), which its next replay overwrites: copy what you keep."""

    slots: list[int]
    starts: np.ndarray  # [B] int64 position of each request's first fed token
    counts: np.ndarray  # [B] int64
    row_start: np.ndarray  # [B] int64
    rows: torch.Tensor  # [>= sum(counts), len(capture_layers) * hidden] model dtype


class HiddenCapture:
    """The ``ModelRunner`` methods that keep the hidden states ``capture_layers`` names (they
    read its ``config`` and ``capture_layers`` and set its ``captured_hidden``)."""

    def _capture_kwargs(self) -> dict:
        """The model's ``capture_layers`` argument: the listed layers below the final norm."""
        inner = tuple(i for i in self.capture_layers if i < self.config.num_hidden_layers)
        return {"capture_layers": inner} if inner else {}

    def _split_captured(self, output) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A forward's output -> (final-norm hidden states, the hidden states
        ``capture_layers`` names side by side [..., D], or None without them)."""
        hidden, captured = output if isinstance(output, tuple) else (output, [])
        if not self.capture_layers:
            return hidden, None
        captured = iter(captured)
        parts = [hidden if i >= self.config.num_hidden_layers else next(captured)
                 for i in self.capture_layers]
        return hidden, torch.cat(parts, dim=-1).reshape(-1, sum(p.shape[-1] for p in parts))

    def _capture(self, slots: list[int], starts: np.ndarray, counts: np.ndarray,
                 valid_index: torch.Tensor | None, output) -> torch.Tensor:
        """Keep the hidden states ``capture_layers`` names in ``captured_hidden`` (the rows of
        the valid tokens); returns the final-norm hidden states."""
        hidden, rows = self._split_captured(output)
        if rows is None:
            return hidden
        if valid_index is not None:
            rows = rows[valid_index]
        counts = np.asarray(counts).copy()
        self.captured_hidden = CapturedHidden(list(slots), np.asarray(starts).copy(), counts,
                                              np.cumsum(counts) - counts, rows)
        return hidden

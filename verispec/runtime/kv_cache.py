"""Preallocated per-slot KV cache (REFERENCE §6).

Each request owns one slot for its lifetime. A slot holds ``max_model_len`` rows per layer; its
*committed length* says how many are live. Entries past it are dead: appending writes rows
``[length, length + n)``, and rolling back (rejected draft tokens) only moves the length back.
Nothing is reallocated while generating.
"""

from __future__ import annotations

import numpy as np
import torch

from verispec.models.config import ModelConfig


class KVCache:
    """K and V tensors ``[num_layers, num_slots, max_model_len, num_kv_heads, head_dim]``.

    Token-major rows make the append of a step one ``index_put_`` per layer; the attention reads
    ``[slots, :kv_len]`` views. Zero-initialised, so never-written rows are finite (masked keys
    with NaN values would still poison SDPA's weighted sum).

    For fixed-shape (CUDA-graph) steps, ``extra_rows`` rows past ``max_model_len`` take the
    writes of padding tokens after a request's last real one, and one more slot,
    ``scratch_slot`` (= ``num_slots``), takes the rows that pad a batch up to its graph's size;
    neither is ever live.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_layers: int | None = None,
        extra_rows: int = 0,
    ) -> None:
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.num_layers = config.num_hidden_layers if num_layers is None else num_layers
        self.extra_rows = extra_rows
        self.scratch_slot = num_slots if extra_rows else None
        shape = (self.num_layers, num_slots + (1 if extra_rows else 0), max_model_len + extra_rows,
                 config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Per-layer views, indexed once here rather than on every step.
        self.k_layers = list(self.k.unbind(0))
        self.v_layers = list(self.v.unbind(0))
        self.lengths_np = np.zeros(num_slots, dtype=np.int64)  # committed length per slot (host)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def length(self, slot: int) -> int:
        return int(self.lengths_np[slot])

    def check_append(self, slot: int, num_tokens: int) -> None:
        if self.lengths_np[slot] + num_tokens > self.max_model_len:
            raise ValueError(
                f"slot {slot} holds {self.lengths_np[slot]} tokens; appending {num_tokens} "
                f"exceeds max_model_len={self.max_model_len}"
            )

    def advance(self, slots: list[int], num_tokens: list[int]) -> None:
        """Mark ``num_tokens[i]`` rows appended to ``slots[i]`` (the forward wrote them)."""
        for slot, n in zip(slots, num_tokens):
            self.lengths_np[slot] += n

    def truncate(self, slot: int, length: int) -> None:
        """Roll slot back to ``length`` committed tokens (0 <= length <= current length)."""
        if not 0 <= length <= self.lengths_np[slot]:
            raise ValueError(
                f"cannot truncate slot {slot} to {length}: it holds {self.lengths_np[slot]} tokens"
            )
        self.lengths_np[slot] = length

    def free(self, slot: int) -> None:
        self.lengths_np[slot] = 0

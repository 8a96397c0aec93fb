"""The cache of a hybrid (Mamba2 + attention) model: paged attention KV plus recurrent state per
slot, rolled back by moving the slot's length (docs/design.md §6).

``HybridCache`` is a ``KVCache`` (same block tables and lengths, ``advance`` / ``truncate`` /
``free``, the same per-layer ``k_layers`` / ``v_layers`` the model's forward takes) whose paged
K/V cover the attention layers only (a request's recurrent state does not grow with its length,
so it stays one entry per slot, not per block); a Mamba2 layer's entry in ``k_layers`` and
``v_layers`` is its ``MambaLayerState``: conv and SSM state for each slot at its last
``ring_size`` lengths, the state after L tokens at ring index ``L % ring_size``
(``verispec.models.granite_hybrid``).

``ring_size = max_step_tokens + 1``: a verify step of k + 1 tokens from length b writes the states
of lengths b + 1 .. b + k + 1, and b itself stays (an early-exit draft, which writes b + 1 .. b + k
through its first layers, returns to b). After the step the engine commits
``num_output_tokens = (token_ids != -1).sum()`` tokens and truncates to
``b + num_output_tokens``: the state at index ``num_output_tokens - 1`` of the step's positions
is the one the next step reads. No copy, no recomputation; the truncation is the rollback.

Each slot tracks the oldest length whose state it still holds (``state_start_np``): a forward
that keeps the state after every new token (the recurrent form) keeps the last ``ring_size``
lengths; a long prefill (the chunked scan, then its last token in the recurrent form) its last
two. Truncating below it is a ValueError rather than a silent continuation from a wrong state.

On the GPU path (``extra_rows`` > 0) the states are the static buffers a captured step reads and
writes in place, with a scratch slot for the padding rows of a bucket; the bookkeeping above is
the same (``verispec.models.mamba2_flat``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from verispec.models.config import HybridModelConfig, ModelConfig
from verispec.models.mamba2 import MambaLayerState, stores_every_position
from verispec.runtime.kv_cache import DEFAULT_BLOCK_SIZE, BlockTables, KVCache

logger = logging.getLogger("verispec")


def is_hybrid(config: ModelConfig) -> bool:
    return isinstance(config, HybridModelConfig)


def make_cache(config: ModelConfig, num_slots: int, max_model_len: int, dtype: torch.dtype,
               device: torch.device | str = "cpu", num_layers: int | None = None,
               extra_rows: int = 0, max_step_tokens: int = 1,
               block_tables: BlockTables | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
               num_blocks: int | None = None) -> KVCache:
    """The cache for ``config``'s model: a ``HybridCache`` for a hybrid (``max_step_tokens``
    sizes its state ring), else a ``KVCache``; ``extra_rows`` > 0 adds the padding rows and the
    scratch slot of fixed-shape (GPU) steps; ``block_tables`` shares another cache's blocks
    (``kv_cache.KVCache``)."""
    if is_hybrid(config):
        return HybridCache(config, num_slots, max_model_len, dtype, device, num_layers,
                           max_step_tokens, extra_rows, block_tables, block_size, num_blocks)
    return KVCache(config, num_slots, max_model_len, dtype, device, num_layers, extra_rows,
                   block_tables, block_size, num_blocks)


class HybridCache(KVCache):
    """K/V ``[num_attention_layers, num_blocks, block_size, kv_heads, head_dim]`` and one
    ``MambaLayerState`` per Mamba2 layer (of the first ``num_layers`` layers).

    With ``extra_rows`` (the GPU path) the K/V have ``extra_rows`` more rows per slot and, as
    the states, one more slot, ``scratch_slot``: the padding of a fixed-shape step writes there
    (``KVCache``, ``verispec.models.mamba2_flat``)."""

    def __init__(
        self,
        config: HybridModelConfig,
        num_slots: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_layers: int | None = None,
        max_step_tokens: int = 1,
        extra_rows: int = 0,
        block_tables: BlockTables | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
    ) -> None:
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {max_step_tokens!r}")
        self.num_layers = config.num_hidden_layers if num_layers is None else num_layers
        self.ring_size = max_step_tokens + 1
        self.layer_types = config.layer_types[: self.num_layers]
        self.states: list[MambaLayerState] = [
            MambaLayerState.allocate(config, num_slots, self.ring_size, device,
                                     scratch_slot=bool(extra_rows))
            for layer_type in self.layer_types if layer_type != "attention"]
        self._init_pages(config, self.layer_types.count("attention"), num_slots, max_model_len,
                         dtype, device, extra_rows, block_tables, block_size, num_blocks)
        self.state_start_np = np.zeros(num_slots, dtype=np.int64)  # oldest length with a state
        if num_slots:
            logger.info(
                "recurrent state: %d Mamba2 layers x %d slots%s x %d positions "
                "(max_step_tokens + 1) = %d bytes (%.1f MiB; %d bytes per slot and position); "
                "attention KV cache %d bytes", len(self.states), num_slots,
                "" if self.scratch_slot is None else " (+ 1 scratch)", self.ring_size,
                self.state_nbytes, self.state_nbytes / 2**20, self.position_nbytes,
                super().nbytes)

    def _build_layers(self) -> None:
        k_attention, v_attention = iter(self.k.unbind(0)), iter(self.v.unbind(0))
        states = iter(self.states)
        self.k_layers, self.v_layers = [], []
        for layer_type in self.layer_types:
            if layer_type == "attention":
                self.k_layers.append(next(k_attention))
                self.v_layers.append(next(v_attention))
            else:
                state = next(states)
                self.k_layers.append(state)
                self.v_layers.append(state)

    @property
    def state_nbytes(self) -> int:
        """Bytes of the per-position recurrent states (every slot, every ring position)."""
        return sum(s.nbytes for s in self.states)

    @property
    def position_nbytes(self) -> int:
        """Bytes of one slot's recurrent states at one position (every Mamba2 layer)."""
        return sum(s.nbytes // (s.conv.shape[0] * s.ring_size) for s in self.states)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.state_nbytes

    def advance(self, slots: list[int], num_tokens: list[int]) -> None:
        for slot, n in zip(slots, num_tokens):
            end = self.lengths_np[slot] + n
            if stores_every_position(n):
                oldest = max(self.state_start_np[slot], end - self.ring_size + 1)
            else:  # the chunked scan, then the recurrent form for the last token
                oldest = end - 1
            self.state_start_np[slot] = oldest
            self.lengths_np[slot] = end

    def truncate(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to ``length`` tokens: its recurrent state is the one kept after
        ``length`` tokens (a ValueError when that state is no longer held)."""
        oldest = int(self.state_start_np[slot])
        if 0 < length < oldest and length <= self.lengths_np[slot]:
            raise ValueError(
                f"cannot truncate slot {slot} to {length}: its recurrent state is kept for "
                f"lengths {oldest}..{self.lengths_np[slot]} only (ring of {self.ring_size} "
                "positions = max_step_tokens + 1)")
        super().truncate(slot, length)
        if length == 0:
            self.state_start_np[slot] = 0

    def free(self, slot: int) -> None:
        super().free(slot)
        self.state_start_np[slot] = 0

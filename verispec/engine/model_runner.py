"""The model runner: one forward of a model over a batch of slots, each appending its own number
of new tokens to its KV cache slot.

This is the one entry point every kind of step uses:

- prefill: ``forward(slots, [prompt_ids ...])`` -> logits of each prompt's last token;
- decode: ``forward(slots, [[last_token] ...])``;
- speculative verify: ``forward(slots, [[last_token, d_1, .., d_n_r] ...], logits="all")`` ->
  the ``sum(n_r + 1)`` rows in the flattened layout of REFERENCE §2, then ``kv_cache.truncate``
  each slot to its committed length;
- early-exit drafting: ``forward(..., num_layers=N)`` runs the first N layers + norm + LM head
  (it writes only those layers' cache rows, which the verify forward later rewrites);
- a draft model: a second ``ModelRunner`` with its own KV cache over the same slot numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from verispec.engine.kv_cache import KVCache
from verispec.models import cpu_kernels
from verispec.models.llama import AttentionMetadata
from verispec.models.rope import rope_tables

LOGITS_MODES = ("last", "all", "none")
# bfloat16 CPU matmuls of this many rows or more run in float32 (prefill; see models.llama.linear).
# Decode and verify steps keep a bfloat16 matmul: widening the LM head every step costs more than
# it saves there. With the compiled bfloat16 kernel (models.cpu_kernels) the crossover is later:
# on a 2-core AMD EPYC over the bundled model's matrices, 16 rows 76 ms against 159 widened,
# 32 rows 165 against 190.
CPU_UPCAST_ROWS = 16
CPU_UPCAST_ROWS_WITH_KERNEL = 32


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int,
        max_model_len: int,
        device: torch.device | str = "cpu",
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.config = model.config
        self.device = torch.device(device)
        self.dtype = model.embed_weight.dtype
        self.max_model_len = max_model_len
        if kv_cache_dtype is None:
            # On CPU, SDPA over a bfloat16 cache is several times slower than over float32.
            kv_cache_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        if self.device.type == "cpu":
            # float32 products as one weight block per thread; bfloat16 ones of many rows
            # (prefill) widened to float32 (models.llama.linear says why).
            upcast_rows = 0
            if self.dtype != torch.float32:
                upcast_rows = (CPU_UPCAST_ROWS_WITH_KERNEL if cpu_kernels.available()
                               else CPU_UPCAST_ROWS)
            model.set_cpu_matmuls(torch.get_num_threads(), upcast_rows=upcast_rows)
        self.kv_cache = KVCache(self.config, num_slots, max_model_len, kv_cache_dtype,
                                self.device)
        # Angles in float32, then rounded to the model dtype once (as HF does per forward).
        cos, sin = rope_tables(self.config, max_model_len)
        self.cos = cos.to(self.device, self.dtype)  # [max_model_len, head_dim]
        self.sin = sin.to(self.device, self.dtype)
        self._key_positions = torch.arange(max_model_len, device=self.device)

    def _metadata(
        self, slots: list[int], counts: np.ndarray, starts: np.ndarray, width: int
    ) -> tuple[AttentionMetadata, np.ndarray, np.ndarray | None]:
        """AttentionMetadata for a padded [B, width] batch; also the [B, width] positions and the
        flat indices of valid tokens (None when there is no padding)."""
        B = len(slots)
        positions = starts[:, None] + np.arange(width)[None, :]  # [B, width]
        valid = np.arange(width)[None, :] < counts[:, None]
        valid_index = None if valid.all() else np.flatnonzero(valid)
        slots_np = np.repeat(np.asarray(slots, dtype=np.int64), width)
        write_positions = positions.reshape(-1)
        if valid_index is not None:
            slots_np, write_positions = slots_np[valid_index], write_positions[valid_index]
        kv_len = int((starts + counts).max())

        rope_positions = torch.from_numpy(np.minimum(positions, self.max_model_len - 1))
        rope_positions = rope_positions.to(self.device)
        attn_mask, is_causal = None, False
        window = self.config.sliding_window
        windowed = window is not None and kv_len > window
        if B == 1 and width == 1 and not windowed:
            pass  # one query that sees every live row
        elif B == 1 and starts[0] == 0 and not windowed:
            is_causal = True  # prefill from an empty slot: width == kv_len
        elif width == 1 and (starts == starts[0]).all() and not windowed:
            pass  # decode of equal-length requests: every row sees every live row
        else:
            keys = self._key_positions[:kv_len]
            query_pos = torch.from_numpy(positions).to(self.device)[:, :, None]  # [B, width, 1]
            # Causal over absolute positions: the query at position p sees keys 0..p (padding
            # queries see rows past their request's length; their outputs are discarded).
            attn_mask = keys <= query_pos
            if window is not None:
                attn_mask &= query_pos - keys < window
            attn_mask = attn_mask[:, None]  # [B, 1, width, kv_len]
        first = slots[0]
        contiguous = slots == list(range(first, first + B))
        meta = AttentionMetadata(
            cos=self.cos[rope_positions].unsqueeze(2),
            sin=self.sin[rope_positions].unsqueeze(2),
            write_slots=torch.from_numpy(slots_np).to(self.device),
            write_positions=torch.from_numpy(write_positions).to(self.device),
            valid_index=None if valid_index is None
            else torch.from_numpy(valid_index).to(self.device),
            read_slots=slice(first, first + B) if contiguous
            else torch.tensor(slots, device=self.device),
            kv_len=kv_len,
            attn_mask=attn_mask,
            is_causal=is_causal,
            slot_ids=torch.tensor(slots, dtype=torch.int64) if self.device.type == "cpu"
            else None,
        )
        return meta, positions, valid_index

    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        token_ids: list[list[int]],
        logits: str = "last",
        num_layers: int | None = None,
    ) -> torch.Tensor | None:
        """Append ``token_ids[i]`` to slot ``slots[i]`` and run the model over them.

        Parameters
        ----------
        slots : B distinct cache slots
        token_ids : B non-empty lists of new token ids (different lengths allowed)
        logits : ``"last"`` -> [B, vocab] float32 for each request's last new token;
            ``"all"`` -> [sum(len(t)), vocab] float32, request-major (REFERENCE §2 layout);
            ``"none"`` -> None (fill the cache only)
        num_layers : run only the first N layers (early exit); default all

        Each slot's committed length grows by ``len(token_ids[i])``; roll back with
        ``self.kv_cache.truncate``.
        """
        if logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")
        cache = self.kv_cache
        counts = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(token_ids))
        starts = cache.lengths_np[slots]
        for slot, n in zip(slots, counts):
            cache.check_append(slot, int(n))
        width = int(counts.max())
        if (counts == width).all():
            ids_np = np.asarray(token_ids, dtype=np.int64)
        else:
            ids_np = np.zeros((len(slots), width), dtype=np.int64)
            for row, t in enumerate(token_ids):
                ids_np[row, : len(t)] = t
        meta, _, valid_index = self._metadata(slots, counts, starts, width)
        input_ids = torch.from_numpy(ids_np).to(self.device)
        hidden = self.model(input_ids, meta, cache.k_layers, cache.v_layers, num_layers)
        cache.advance(slots, counts.tolist())
        if logits == "none":
            return None
        if logits == "last":
            if valid_index is None:
                rows = hidden[:, -1]
            else:
                rows = hidden[torch.arange(len(slots)), torch.from_numpy(counts - 1)]
        else:
            rows = hidden.reshape(-1, hidden.shape[-1])
            if valid_index is not None:
                rows = rows[meta.valid_index]
        return self.model.compute_logits(rows)

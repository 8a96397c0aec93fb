"""The CPU path's padded layout (``verispec.runtime.model_runner``): a step's requests as one
``[B, width]`` batch (``LlamaForCausalLM.forward`` over ``AttentionMetadata``), each request's
tokens padded to the widest; requests whose token counts differ widely run as several such
forwards (``padding_groups``).
"""

from __future__ import annotations

import numpy as np
import torch

from verispec.models.layout import AttentionMetadata
from verispec.ops.tree_feed import TreeFeed
from verispec.runtime.hidden_capture import CapturedHidden

# A padded CPU batch may hold at most this many times its real tokens, plus a few: past it the
# requests run as several forwards (``padding_groups``). The few spare a forward's fixed cost
# where the padding is small in tokens (decode rows beside verify rows).
MAX_PADDING_RATIO = 1.25
SPARE_PADDING_TOKENS = 32


def _fits(num_rows: int, width: int, num_tokens: int) -> bool:
    return num_rows * width <= MAX_PADDING_RATIO * num_tokens + SPARE_PADDING_TOKENS


def padding_groups(counts: np.ndarray) -> list[np.ndarray]:
    """The requests of a padded step (``counts`` [B] new tokens each) in groups whose padded
    size ``len(group) * max(count)`` stays within ``MAX_PADDING_RATIO`` of their tokens (plus
    ``SPARE_PADDING_TOKENS``): decodes together, a prefill chunk apart. One group when the whole
    step already does."""
    if counts.size < 2 or _fits(counts.size, int(counts.max()), int(counts.sum())):
        return [np.arange(counts.size)]
    groups, current, total = [], [], 0
    for b in np.argsort(counts, kind="stable").tolist():  # ascending: the widest row last
        n = int(counts[b])
        if current and not _fits(len(current) + 1, n, total + n):
            groups.append(np.array(current))
            current, total = [], 0
        current.append(b)
        total += n
    groups.append(np.array(current))
    return groups


class PaddedLayout:
    """The ``ModelRunner`` methods of the padded layout (they read its ``config``, ``device``,
    ``max_model_len``, ``kv_cache``, ``cos`` / ``sin`` and ``_key_positions``, and call its
    ``forward``)."""

    def _metadata(
        self, slots: list[int], counts: np.ndarray, starts: np.ndarray, width: int,
        tree: TreeFeed | None = None,
    ) -> tuple[AttentionMetadata, np.ndarray, np.ndarray | None]:
        """AttentionMetadata for a padded [B, width] batch; also the [B, width] cache rows and
        the flat indices of valid tokens (None when there is no padding). With ``tree`` the
        tokens are tree slots: positions by depth, the tree's attention mask."""
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
        if tree is not None:  # tree slots: positions by depth, the context and the ancestors
            tree.check_rows(starts)
            tree_positions, attn_mask = tree.attention(width, kv_len, window)
            rope_positions = tree_positions.clamp_max(self.max_model_len - 1).to(self.device)
            attn_mask = attn_mask.to(self.device)
        elif B == 1 and width == 1 and not windowed:
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
        tables = self.kv_cache.block_tables
        num_blocks = -(-kv_len // tables.block_size)
        meta = AttentionMetadata(
            # (a row gather: indexing by a [B, width] tensor opens a parallel region, ~95 against
            # ~10 us at batch 64 x 4 on an idle 2-core CPU, milliseconds on a busy one)
            cos=torch.nn.functional.embedding(rope_positions, self.cos).unsqueeze(2),
            sin=torch.nn.functional.embedding(rope_positions, self.sin).unsqueeze(2),
            write_slots=torch.from_numpy(slots_np).to(self.device),
            write_positions=torch.from_numpy(write_positions).to(self.device),
            slot_mapping=torch.from_numpy(tables.slot_mapping(slots_np, write_positions)).to(
                self.device),
            valid_index=None if valid_index is None
            else torch.from_numpy(valid_index).to(self.device),
            block_tables=torch.from_numpy(np.ascontiguousarray(
                tables.table_np[slots, :num_blocks])).to(self.device),
            kv_len=kv_len,
            attn_mask=attn_mask,
            is_causal=is_causal,
        )
        return meta, positions, valid_index

    def _forward_grouped(self, slots: list[int], token_ids: list[list[int]], counts: np.ndarray,
                         groups: list[np.ndarray], logits: str,
                         num_layers: int | None) -> torch.Tensor | None:
        """``forward`` of requests whose new-token counts differ widely (decodes beside a
        prefill chunk) as one padded forward per group of similar counts (``padding_groups``),
        so the padded batch does not multiply the work. Batch invariance makes the logits, the
        cache and the captured hidden states those of one forward."""
        starts = self.kv_cache.lengths_np[slots].copy()
        outputs: list[torch.Tensor | None] = [None] * len(slots)
        captured: list[torch.Tensor | None] = [None] * len(slots)
        for group in groups:
            out = self.forward([slots[b] for b in group], [token_ids[b] for b in group],
                               logits, num_layers)
            kept = self.captured_hidden
            row = 0
            for i, b in enumerate(group.tolist()):
                n = int(counts[b])
                if out is not None:
                    outputs[b] = out[i:i + 1] if logits == "last" else out[row:row + n]
                if self.capture_layers and kept is not None:
                    start = int(kept.row_start[i])
                    captured[b] = kept.rows[start:start + n]
                row += n
        if self.capture_layers:
            self.captured_hidden = CapturedHidden(list(slots), starts, counts.copy(),
                                                  np.cumsum(counts) - counts,
                                                  torch.cat(captured))
        if logits == "none":
            return None
        return torch.cat(outputs)

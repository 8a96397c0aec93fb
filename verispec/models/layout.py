"""The two layouts of a step's new tokens that the models read, built once per step by the model
runner (``runtime/padded_layout.py``, ``runtime/flat_layout.py``) and shared by every layer.

Both serve a batch of requests that each append a different number of new tokens (prefill,
decode, or the n_r + 1 positions of a speculative verify step) in one forward:

- ``AttentionMetadata``, the padded CPU layout: inputs are padded to ``[B, S]`` (S = the largest
  number of new tokens of the step); each layer writes the K/V of the valid tokens into the
  cache at their cache slots, then attends over the cache rows of the batch up to ``kv_len``
  with a mask built once per step, so no Python runs per request inside a layer.
- ``FlatBatch``, the flat GPU layout: the new tokens of the batch concatenated, one kernel per
  small op (``verispec.ops.model_ops``).

The models (Llama, the Granite hybrid with its Mamba2 layers, EAGLE heads) have a forward for
each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.ops.model_ops import ModelOps


@dataclass
class FlatBatch:
    """What the layers of a GPU step share (the flat token layout of ``verispec.ops.model_ops``):
    T new tokens of B requests, request b owning ``[query_start[b], query_start[b + 1])``."""

    positions: torch.Tensor  # [T] int64: each token's position in its request
    slot_mapping: torch.Tensor  # [T] int64: each token's cache slot (block * block_size + row)
    slot_ids: torch.Tensor  # [B] int64: each request's slot (its row of block_tables)
    context_lens: torch.Tensor  # [B] int64: positions of each request after the step
    query_start: torch.Tensor  # [B + 1] int64, leading 0
    max_queries: int  # >= every request's number of new tokens
    cos: torch.Tensor  # [L, head_dim] model dtype (models.rope tables)
    sin: torch.Tensor  # [L, head_dim] model dtype, signed
    ops: ModelOps
    block_tables: torch.Tensor  # [num_slots + 1, max_blocks] int32: every slot's blocks
    # [T, P] int32 or None: the tokens are slots of token trees, positions[t] = root row +
    # depth, and row t the slots of token t's path (``ops.model_ops.cache_attention``)
    tree_paths: torch.Tensor | None = None
    # what the ops derive from this layout once for all layers (model_ops.rope_cache_attention)
    derived: dict = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    """Everything the layers of one forward share; built once per step by the model runner."""

    cos: torch.Tensor  # [B, S, 1, head_dim] model dtype
    sin: torch.Tensor  # [B, S, 1, head_dim] model dtype, signed (see rope.apply_rope)
    write_slots: torch.Tensor  # [N] int64: request slot of each valid new token
    write_positions: torch.Tensor  # [N] int64: its position in the request
    slot_mapping: torch.Tensor  # [N] int64: its cache slot (block * block_size + row)
    valid_index: torch.Tensor | None  # [N] int64 into the flattened [B * S] tokens; None = all
    block_tables: torch.Tensor  # [B, >= ceil(kv_len / block_size)] int32: the batch rows' blocks
    kv_len: int  # attend over positions [0, kv_len)
    attn_mask: torch.Tensor | None  # [B, 1, S, kv_len] bool, True = attend; None = see is_causal
    is_causal: bool = False  # with attn_mask None: causal (prefill from an empty cache) or all

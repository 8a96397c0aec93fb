"""The model's Triton ops, read from one module: the attention over the paged KV cache
(``verispec.ops.triton_attention``) and the ops that compute each token's row on its own
(RMSNorm, SiLU-and-multiply, argmax, the matmul: ``verispec.ops.triton_rowwise``).
``verispec.ops.model_ops`` has the contract and the torch twins. Every kernel computes a row with
the same instructions whatever the number of rows, so a token's result does not depend on its
batch (docs/design.md §12).
"""

from __future__ import annotations

from verispec.ops.triton_attention import (
    ATTENTION_BLOCK_KV,
    ATTENTION_BLOCK_Q,
    FUSED_WRITE_MAX_QUERIES,
    MAX_PARTITIONS,
    PARTITION_KEYS,
    PREFILL_BLOCK_Q,
    rope_cache_attention,
)
from verispec.ops.triton_rowwise import (
    ARGMAX_CHUNK,
    LINEAR_FEW_ROWS,
    LINEAR_MANY_ROWS,
    LINEAR_MIN_PROGRAMS,
    LINEAR_TILES,
    LINEAR_TMA_MIN_ROWS,
    LinearConfig,
    argmax,
    linear,
    linear_config,
    linear_silu_mul,
    rms_norm,
    rms_norm_row,
    silu_mul,
)

__all__ = [
    "ARGMAX_CHUNK", "ATTENTION_BLOCK_KV", "ATTENTION_BLOCK_Q", "FUSED_WRITE_MAX_QUERIES",
    "MAX_PARTITIONS", "PARTITION_KEYS",
    "LINEAR_FEW_ROWS", "LINEAR_MANY_ROWS", "LINEAR_MIN_PROGRAMS", "LINEAR_TILES",
    "LINEAR_TMA_MIN_ROWS", "PREFILL_BLOCK_Q", "LinearConfig", "argmax", "linear", "linear_config",
    "linear_silu_mul", "rms_norm", "rms_norm_row", "rope_cache_attention", "silu_mul",
]

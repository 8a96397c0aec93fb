"""The building blocks of the Llama-family decoder (``models.llama``), shared by the models built
on it (the Granite hybrid, Mamba2, EAGLE heads): RMSNorm, grouped-query attention over a paged
KV cache (RoPE, the cache write, then SDPA, the compiled CPU kernel or the batch-invariant path),
SwiGLU MLP, each on both step layouts (``models.layout``); and ``set_cpu_matmuls``, which sets
how their CPU matmuls run.

Projections are fused (q|k|v in one matrix, gate|up in another) to halve the matmul launches;
the loader splits HF checkpoints' separate matrices into them.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.config import ModelConfig
from verispec.models.layout import AttentionMetadata, FlatBatch
from verispec.models.parallel import SINGLE, TensorParallel
from verispec.models.rope import apply_rope
from verispec.ops.cpu_linear import linear
from verispec.ops.model_ops import ModelOps

# Steps of at most this many new tokens per request (decode, verify, short prefills) attend
# through the compiled CPU kernel (``kernels.cache_attention``) where the model has the kernels
# (torch's SDPA call is mostly fixed overhead at so few queries); longer ones through SDPA.
CPU_KERNEL_MAX_QUERIES = 16


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), statistics in float32, as HF Llama.

    Computed as a layer norm of ``[x, -x]``: that vector has mean exactly 0 and variance
    ``mean(x^2)``, so its first half is x / sqrt(mean(x^2) + eps). ``F.layer_norm`` is one fused
    CPU kernel (statistics in float32, output rounded once to x's dtype, then scaled by w as HF
    does), where ``F.rms_norm`` runs as half a dozen separate ops on CPU. Given the compiled
    CPU kernels (``set_cpu_matmuls``), ``kernels.rms_norm`` instead (one call, no parallel
    region for the few rows of a decode or verify step).
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps
        self.kernels: ModuleType | None = None  # see set_cpu_matmuls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.kernels is not None and x.device.type == "cpu" and x.dtype == self.weight.dtype
                and x.dtype in (torch.bfloat16, torch.float32) and not torch.is_grad_enabled()):
            return self.kernels.rms_norm(x, self.weight, self.eps)
        n = x.shape[-1]
        normed = F.layer_norm(torch.cat((x, x.neg()), dim=-1), (2 * n,), eps=self.eps)
        return normed[..., :n] * self.weight


def gather_positions(cache: torch.Tensor, block_tables: torch.Tensor, kv_len: int
                     ) -> torch.Tensor:
    """Positions ``[0, kv_len)`` of each request of a paged cache ``[num_blocks, block_size,
    kv_heads, head_dim]`` through its block table [B, *]: [B, kv_len, kv_heads, head_dim]."""
    num_blocks = -(-kv_len // cache.shape[1])
    blocks = block_tables[:, :num_blocks].long()
    return cache[blocks].flatten(1, 2)[:, :kv_len]


def invariant_attention(
    q: torch.Tensor,  # [B, S, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of each new token over exactly the cache rows it sees, one token per SDPA call:
    the call's shape depends on the token's own rows alone, so its result does not depend on the
    batch or on the other tokens of the step (docs/design.md §12). The CPU path where the compiled
    attention kernel does not run; slower (one call per token), never different between batches.
    Returns [B, S, heads, head_dim] in the cache dtype (zeros for a token that sees no row)."""
    B, S, num_heads, head_dim = q.shape
    out = q.new_zeros((B, S, num_heads, head_dim), dtype=k_cache.dtype)
    block_size = k_cache.shape[1]
    k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    for b in range(B):
        for s in range(S):
            if meta.attn_mask is not None:
                rows = meta.attn_mask[b, 0, s].nonzero().view(-1)
            else:
                last = meta.kv_len - S + s if meta.is_causal else meta.kv_len - 1
                rows = torch.arange(last + 1)
            if rows.numel() == 0:
                continue
            rows = (meta.block_tables[b].long()[rows // block_size] * block_size
                    + rows % block_size)
            keys = k_rows[rows].transpose(0, 1)  # [kv_heads, n, head_dim]
            values = v_rows[rows].transpose(0, 1)
            out[b, s] = F.scaled_dot_product_attention(
                q[b, s, :, None].to(k_cache.dtype), keys, values, scale=scale,
                enable_gqa=num_heads != keys.shape[0])[:, 0]
    return out


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the loader (which checks none is missed).
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Attention(nn.Module):
    """Grouped-query attention over the paged cache. Under tensor parallelism ``config`` is the
    rank's slice (``TensorParallel.shard_config``: its heads) and the output projection's
    partial sums are all-reduced here."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        c = config
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads, c.num_key_value_heads, c.head_dim
        )
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.qkv_weight = _param(c.q_size + 2 * c.kv_size, c.hidden_size, dtype=dtype)
        self.qkv_bias = _param(c.q_size + 2 * c.kv_size, dtype=dtype) if c.qkv_bias else None
        self.o_weight = _param(c.hidden_size, c.q_size, dtype=dtype)
        self.o_bias = _param(c.hidden_size, dtype=dtype) if c.o_bias else None
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.scale = c.head_dim**-0.5
        self.window = c.sliding_window
        # see set_cpu_matmuls
        self.matmul_splits, self.upcast_rows, self.batch_invariant = 1, 0, False
        self.kernels: ModuleType | None = None

    def forward(
        self,
        x: torch.Tensor,  # [B, S, hidden]
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:
        B, S, _ = x.shape
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.matmul_splits,
                     self.upcast_rows, self.batch_invariant, self.kernels)
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[..., self.q_size + self.kv_size :].view(B, S, hkv, d)
        if self.q_norm is None:
            # q and k are adjacent in the fused output: rotate both with one set of ops.
            qk = apply_rope(qkv[..., : self.q_size + self.kv_size].view(B, S, hq + hkv, d),
                            meta.cos, meta.sin)
            q, k = qk[:, :, :hq], qk[:, :, hq:]
        else:  # Qwen3: RMSNorm over each head of q and k, then RoPE
            q = self.q_norm(qkv[..., : self.q_size].view(B, S, hq, d))
            k = self.k_norm(qkv[..., self.q_size : self.q_size + self.kv_size].view(B, S, hkv, d))
            q, k = apply_rope(q, meta.cos, meta.sin), apply_rope(k, meta.cos, meta.sin)

        # The cache may be wider than the model dtype (float32 for a bfloat16 model on CPU, where
        # SDPA is several times faster in float32); attention then runs in the cache dtype.
        # One copy each: the dtype cast (when it happens) also makes the rows contiguous.
        new_k = k.to(k_cache.dtype).reshape(B * S, hkv, d)
        new_v = v.to(v_cache.dtype).reshape(B * S, hkv, d)
        if meta.valid_index is not None:  # drop padding tokens: they must not touch the cache
            new_k = new_k.index_select(0, meta.valid_index)
            new_v = new_v.index_select(0, meta.valid_index)
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, new_k)
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, new_v)

        invariant = self.batch_invariant and k_cache.device.type == "cpu"
        if ((S <= CPU_KERNEL_MAX_QUERIES or invariant) and self.kernels is not None
                and k_cache.dtype == torch.float32 and k_cache.device.type == "cpu"
                and k_cache.is_contiguous() and v_cache.is_contiguous()):
            # One (token, head) at a time over its visible rows in order: batch invariant.
            out = self.kernels.cache_attention(q, k_cache, v_cache, meta.block_tables,
                                               meta.kv_len, meta.attn_mask, meta.is_causal,
                                               self.scale)
        elif invariant:
            out = invariant_attention(q, k_cache, v_cache, meta, self.scale)
        else:
            out = None
        if out is not None:
            return self.tp.all_reduce(linear(
                out.to(x.dtype).reshape(B, S, self.q_size), self.o_weight, self.o_bias,
                self.matmul_splits, self.upcast_rows, self.batch_invariant, self.kernels))
        keys = gather_positions(k_cache, meta.block_tables, meta.kv_len)  # [B, kv_len, hkv, d]
        values = gather_positions(v_cache, meta.block_tables, meta.kv_len)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2).to(k_cache.dtype),  # [B, hq, S, d]
            keys.transpose(1, 2),  # [B, hkv, kv_len, d]
            values.transpose(1, 2),
            attn_mask=meta.attn_mask,
            is_causal=meta.is_causal,
            scale=self.scale,
            enable_gqa=hq != hkv,
        ).to(x.dtype)  # [B, hq, S, d]
        return self.tp.all_reduce(linear(
            out.transpose(1, 2).reshape(B, S, self.q_size), self.o_weight, self.o_bias,
            self.matmul_splits, self.upcast_rows, self.batch_invariant, self.kernels))


    def forward_flat(self, h: torch.Tensor, batch: FlatBatch, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] on the flat layout: the qkv projection; RoPE, the cache
        write and attention over the cache in one op; the output projection (under tensor
        parallelism its partial sums, all-reduced unless ``reduce`` is False)."""
        ops = batch.ops
        qkv = ops.linear(h, self.qkv_weight, self.qkv_bias)
        out = ops.rope_cache_attention(
            qkv, batch.positions, batch.cos, batch.sin, k_cache, v_cache, batch.slot_mapping,
            batch.block_tables, batch.slot_ids, batch.context_lens, batch.query_start,
            batch.max_queries,
            self.num_heads, self.num_kv_heads, self.scale, self.window,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            0.0 if self.q_norm is None else self.q_norm.eps,
            tree_paths=batch.tree_paths, derived=batch.derived,
        )
        out = ops.linear(out.view(h.shape[0], self.q_size), self.o_weight, self.o_bias)
        return self.tp.all_reduce(out) if reduce else out


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one matmul. Under tensor
    parallelism ``config`` holds the rank's FFN width and down's partial sums are all-reduced."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        c = config
        self.tp = tp
        self.intermediate_size = c.intermediate_size
        self.gate_up_weight = _param(2 * c.intermediate_size, c.hidden_size, dtype=dtype)
        self.gate_up_bias = _param(2 * c.intermediate_size, dtype=dtype) if c.mlp_bias else None
        self.down_weight = _param(c.hidden_size, c.intermediate_size, dtype=dtype)
        self.down_bias = _param(c.hidden_size, dtype=dtype) if c.mlp_bias else None
        self.matmul_splits, self.upcast_rows, self.batch_invariant = 1, 0, False
        self.kernels: ModuleType | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, self.matmul_splits,
                         self.upcast_rows, self.batch_invariant, self.kernels)
        if (self.kernels is not None and gate_up.dtype == torch.float32
                and gate_up.device.type == "cpu"):
            # the compiled decoder's activation (ops.cpu_decoder), so both give the same bits
            act = self.kernels.silu_mul(gate_up, self.intermediate_size)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        return self.tp.all_reduce(linear(act, self.down_weight, self.down_bias,
                                         self.matmul_splits, self.upcast_rows,
                                         self.batch_invariant, self.kernels))


    def forward_flat(self, h: torch.Tensor, ops: ModelOps, reduce: bool = True) -> torch.Tensor:
        act = ops.linear_silu_mul(h, self.gate_up_weight, self.gate_up_bias)
        out = ops.linear(act, self.down_weight, self.down_bias)
        return self.tp.all_reduce(out) if reduce else out


def input_norm_flat(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                    ops: ModelOps) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat-layout layer's input norm with the residual add fused: (normed, residual stream).
    At layer 0 (``residual`` None) x is the embedding and becomes the stream; after it the
    norm adds x into ``residual`` in place."""
    if residual is None:
        return ops.rms_norm(x, norm.weight, norm.eps), x
    return ops.rms_norm(x, norm.weight, norm.eps, residual), residual


def set_cpu_matmuls(model: nn.Module, splits: int, upcast_rows: int = 0,
                    batch_invariant: bool = False, kernels: ModuleType | None = None) -> None:
    """Compute every weight matmul of ``model`` as ``splits`` row blocks in one bmm, and in
    float32 from ``upcast_rows`` rows on (0: never); or, with ``batch_invariant``, every matmul
    and attention row the same way whatever the number of rows (``ops.cpu_linear``,
    ``invariant_attention``); with the compiled CPU kernels ``kernels`` (``Backend.cpu``: the
    runner's) or torch's ops alone (None); see ``ops.cpu_linear.linear``."""
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.matmul_splits = splits
            module.upcast_rows = upcast_rows
            module.batch_invariant = batch_invariant
        if hasattr(module, "kernels"):
            module.kernels = kernels

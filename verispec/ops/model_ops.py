"""The model's small ops on the flat token layout of a GPU step, torch twin (reference, CPU) and
Triton (``verispec.ops.triton_model``) with one signature each.

A step holds T new tokens of B requests, flattened request-major: request b owns tokens
``[query_start[b], query_start[b + 1])``, which occupy positions ``context_lens[b] - n_b ..
context_lens[b] - 1`` of its request (n_b = its number of new tokens). The KV cache is paged
(``verispec.runtime.kv_cache``): per layer a pool ``[num_blocks, block_size, Hkv, D]``; position
t of the request in slot s lives in block ``block_tables[s, t // block_size]`` at row
``t % block_size``, and a token's *cache slot* (``slot_mapping``) is ``block * block_size +
row``. Every op computes each row the same way whatever else is in the batch and however many
tokens the step holds (docs/design.md §12): a row's result depends on that row (and, for attention,
on its own cache rows) only.

- ``rms_norm(x, weight, eps, residual=None)``: with ``residual``, first ``residual += x`` in place
  (the decoder's residual add), then the norm of the sum;
- ``rope_cache_write``: RoPE on q and k of the fused qkv projection (after Qwen3's per-head norm
  where the model has one), k and v written into the KV cache at each token's cache slot;
  returns the rotated q;
- ``cache_attention``: causal attention of each new token over its request's positions
  ``[0, position]`` (a sliding window where the model has one) read through its block table,
  grouped-query;
- ``rope_cache_attention``: the two above in one op (one kernel on the GPU);
- with ``tree_paths`` both attend over token trees instead (docs/design.md §16): the new tokens
  are slots of their request's tree, written at the rows the cache appends next, each at
  position root row + its depth. A token's path (the slots from the root to itself, one per
  depth) names its keys: the context (rows below the root) and then its path's rows, read in
  that order as the positions ``[0, position]`` of the chain holding its path. So a tree token
  gets the bits of that chain's token (docs/design.md §12), which a mask over the tree's rows
  would not give: the kernel's reduction order over keys follows their order;
- ``silu_mul``: ``silu(gate) * up`` of the fused gate|up projection;
- ``linear``: ``x @ weight.T + bias``, on the GPU a kernel whose reduction order over the input
  features is fixed by the weight's shape alone (never by the number of rows);
- ``linear_silu_mul``: ``silu_mul(linear(x, weight, bias))`` of the fused gate|up weight;
- ``argmax``: the first maximum of each row of logits (greedy drafting);
- ``ssm_state_update``: a hybrid model's Mamba2 state update over a step's few new tokens per
  request, the states after each token into the slot's state ring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from verispec.ops.sampling import first_argmax


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H], updated in place: residual += x
) -> torch.Tensor:
    """``weight * y`` with ``y = s / sqrt(mean(s^2) + eps)`` rounded to the input dtype, where
    ``s = x`` or, with ``residual``, ``s = residual + x`` (stored into ``residual``). Statistics in
    float32, as HF Llama. Returns [T, H] in x's dtype."""
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, S, H, D] by the angles of its positions; cos, signed_sin [B, S, 1, D] in
    x's dtype.

    HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``, written as
    ``x * cos + [x2, x1] * [-sin, sin]``: the same products (negation is exact), one op fewer.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def rope_cache_write(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [L, D] model dtype
    sin: torch.Tensor,  # [L, D] model dtype, signed ([-sin, sin], see models.rope)
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64: cache slot of each token (block * block_size + row)
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,  # [D] Qwen3 per-head norm of q
    k_norm: torch.Tensor | None = None,  # [D]
    eps: float = 1e-6,
) -> torch.Tensor:
    """Rotate q and k of each token by its position, write k and v into the cache at cache slot
    ``slot_mapping[t]``. Returns q [T, Hq, D] (rotated) in qkv's dtype."""
    T = qkv.shape[0]
    D = cos.shape[-1]
    q_size, kv_size = num_heads * D, num_kv_heads * D
    q = qkv[:, :q_size].view(T, num_heads, D)
    k = qkv[:, q_size:q_size + kv_size].view(T, num_kv_heads, D)
    v = qkv[:, q_size + kv_size:].view(T, num_kv_heads, D)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    # [T, 1, D] (a row gather; indexing by a tensor costs a parallel region on a CPU)
    c, s = cos.index_select(0, positions)[:, None], sin.index_select(0, positions)[:, None]
    q = apply_rope(q[None], c[None], s[None])[0]
    k = apply_rope(k[None], c[None], s[None])[0]
    k_cache.view(-1, num_kv_heads, D)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, D)[slot_mapping] = v.to(v_cache.dtype)
    return q.contiguous()


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_pos: torch.Tensor,
            scale: float, window: int | None) -> torch.Tensor:
    """q [n, Hq, D] at positions ``query_pos`` [n] over ``keys``, ``values`` [L, Hkv, D] at
    positions 0 .. L - 1: each query sees the keys at or before its position (within the
    window). Returns [n, Hq, D] in q's dtype."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, 1)
    values = values.float().repeat_interleave(group, 1)
    key_pos = torch.arange(keys.shape[0], device=q.device)[None, :]
    query_pos = query_pos[:, None]  # [n, 1]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= query_pos - key_pos < window
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)


def cache_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [num_slots + 1, max_blocks] int32
    slot_ids: torch.Tensor,  # [B] int64: each request's row of block_tables
    context_lens: torch.Tensor,  # [B] int64: positions of each request after this step
    query_start: torch.Tensor,  # [B + 1] int64, leading 0
    max_queries: int,  # >= every n_b (the kernel's grid; unused by the twin)
    scale: float,
    window: int | None = None,  # sliding window: a query at p sees keys p - window < key <= p
    positions: torch.Tensor | None = None,  # [T] int64, with tree_paths: root row + depth
    tree_paths: torch.Tensor | None = None,  # [T, P] int: slots root .. token, -1 padded
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its positions, read through its block
    table; with ``tree_paths``, of each tree token over its context and its path (module
    docstring). Returns [T, Hq, D] in q's dtype (softmax in float32)."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start.tolist()
    for b, (slot, ctx) in enumerate(zip(slot_ids.tolist(), context_lens.tolist())):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        blocks = block_tables[slot, : -(-ctx // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:ctx]
        values = v_cache[blocks].flatten(0, 1)[:ctx]
        if tree_paths is None:
            query_pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
            out[lo:hi] = _attend(q[lo:hi], keys, values, query_pos, scale, window)
            continue
        for t in range(lo, hi):  # one query at a time: its keys are its own
            path = tree_paths[t].long()
            path = path[path >= 0]  # slots of depths 0 .. depth
            root = int(positions[t]) - (path.shape[0] - 1)
            rows = torch.cat([torch.arange(root, device=q.device), root + path])
            out[t:t + 1] = _attend(q[t:t + 1], keys[rows], values[rows], positions[t:t + 1],
                                   scale, window)
    return out


def rope_cache_attention(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [L, D]
    sin: torch.Tensor,  # [L, D] signed
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64: cache slot of each token
    block_tables: torch.Tensor,  # [num_slots + 1, max_blocks] int32
    slot_ids: torch.Tensor,  # [B] int64
    context_lens: torch.Tensor,  # [B] int64
    query_start: torch.Tensor,  # [B + 1] int64, leading 0
    max_queries: int,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    window: int | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    tree_paths: torch.Tensor | None = None,  # [T, P] int: token trees (cache_attention)
    derived: dict | None = None,
) -> torch.Tensor:
    """``rope_cache_write`` then ``cache_attention`` (one kernel on the GPU, which derives
    ``slot_mapping``, and ``positions`` without ``tree_paths``, from the request layout and the
    block tables). ``derived``: a dict the layers of one step share, where a backend keeps what
    it computes from the layout once a step (``FlatBatch.derived``; unused here). Returns
    [T, Hq, D]."""
    q = rope_cache_write(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                         num_kv_heads, q_norm, k_norm, eps)
    return cache_attention(q, k_cache, v_cache, block_tables, slot_ids, context_lens, query_start,
                           max_queries, scale, window, positions, tree_paths)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: ``silu(gate) * up`` (each rounded to the input dtype, as torch)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T, K] @ [N, K].T (+ [N]) -> [T, N], rounded to x's dtype, then in ``out_dtype`` if given
    (the LM head's float32 logits)."""
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] int64: the first index of each row's maximum (NaN counts as the
    maximum), as ``torch.argmax`` (``sampling.first_argmax``: faster on the CPU)."""
    return first_argmax(logits)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """[T, K] x [2I, K] (gate rows, then up rows) -> [T, I]: ``silu_mul(linear(x, weight,
    bias))``, the SwiGLU projection and activation (one kernel on the GPU)."""
    return silu_mul(linear(x, weight, bias))


def ssm_state_update(
    ssm_ring: torch.Tensor,  # [num_slots, ring_size, heads, head_dim, d_state] float32, updated
    slots: torch.Tensor,  # [G] int64
    starts: torch.Tensor,  # [G] int64: each request's length before the step
    counts: torch.Tensor,  # [G] int64 >= 1: its new tokens (S = counts.max())
    x: torch.Tensor,  # [S, G, heads, head_dim] float32, token-major
    dtB: torch.Tensor,  # [S, G, heads, d_state] float32: dt * B (groups expanded to heads)
    decay: torch.Tensor,  # [S, G, heads] float32: exp(dt * A)
    C: torch.Tensor,  # [S, G, heads, d_state] float32
) -> torch.Tensor:
    """The multi-token SSM state update of a hybrid model's decode or verify step
    (``verispec.models.mamba2``), on CPU tensors (the torch twin; the Triton kernel
    ``verispec.ops.triton_ssm.ssm_state_update`` has the same signature).

    For each request g, from the state after ``starts[g]`` tokens (ring entry
    ``starts[g] % ring_size``, zeros when ``starts[g] == 0``), token s < counts[g]::

        h = h * decay[s, g] + x[s, g] (outer) dtB[s, g]     stored at ring entry starts + s + 1
        y[s, g] = C[s, g] . h                                (over d_state)

    Returns y [S, G, heads, head_dim] float32 (zeros for the padding tokens s >= counts[g]).
    Per (request, head) the products have a fixed shape, so a request's bits do not depend on
    G; one request writes each new state straight into its ring entry, several into one of two
    scratch states (the state before the token is in the other) scattered into the ring. ``y``
    as a row vector times the transposed state: much faster here than ``h @ C``.
    """
    S, G, H, P = x.shape
    N = dtB.shape[-1]
    ring_size = ssm_ring.shape[1]
    slots_np, starts_np, counts_np = slots.numpy(), starts.numpy(), counts.numpy()
    # Token s's operands and output as [G * H, ...] blocks, viewed once.
    xs = x.view(S, G * H, P, 1).unbind(0)
    dtBs = dtB.view(S, G * H, 1, N).unbind(0)
    decays = decay.view(S, G * H, 1, 1).unbind(0)
    Cs = C.view(S, G * H, 1, N).unbind(0)
    ys = torch.empty(S, G * H, 1, P, dtype=torch.float32, device=x.device)
    y_rows = ys.unbind(0)
    if G == 1:  # each new state straight into its ring entry
        entries = ssm_ring[int(slots_np[0])].view(ring_size, H, P, N).unbind(0)
        start, count = int(starts_np[0]), int(counts_np[0])
        ssm = entries[start % ring_size] if start > 0 else x.new_zeros(H, P, N)
        if count < S:  # padding tokens (a fixed-shape step) leave the state alone
            ys[count:] = 0.0
        for s in range(count):
            new_ssm = entries[(start + s + 1) % ring_size]
            torch.mul(ssm, decays[s], out=new_ssm)
            new_ssm.baddbmm_(xs[s], dtBs[s])
            torch.bmm(Cs[s], new_ssm.transpose(1, 2), out=y_rows[s])
            ssm = new_ssm
        return ys.view(S, G, H, P)
    ssm = ssm_ring[slots, starts % ring_size]
    ssm[starts == 0] = 0.0
    ssm = ssm.view(G * H, P, N)
    buffers = torch.empty(2, G * H, P, N, dtype=torch.float32, device=x.device).unbind(0)
    for s in range(S):
        new_ssm = buffers[s % 2]  # the state before token s is in the other one
        torch.mul(ssm, decays[s], out=new_ssm)
        new_ssm.baddbmm_(xs[s], dtBs[s])
        torch.bmm(Cs[s], new_ssm.transpose(1, 2), out=y_rows[s])
        per_request = new_ssm.view(G, H, P, N)
        active = counts_np > s
        if active.all():
            live = slots
            lengths = (starts + s + 1) % ring_size
        else:  # padding tokens leave the state alone and output zeros
            idle = torch.from_numpy(np.flatnonzero(~active))
            per_request[idle] = ssm.view(G, H, P, N)[idle]
            y_rows[s].view(G, H, P)[idle] = 0.0
            rows = np.flatnonzero(active)
            live = slots[torch.from_numpy(rows)]
            lengths = torch.from_numpy((starts_np[rows] + s + 1) % ring_size)
            per_request = per_request[torch.from_numpy(rows)]
        ssm_ring.index_put_((live, lengths), per_request)
        ssm = new_ssm
    return ys.view(S, G, H, P)


@dataclass(frozen=True)
class ModelOps:
    """The model ops of one backend (all with the twins' signatures)."""

    name: str
    rms_norm: Callable[..., torch.Tensor]
    rope_cache_attention: Callable[..., torch.Tensor]
    linear: Callable[..., torch.Tensor]
    linear_silu_mul: Callable[..., torch.Tensor]
    argmax: Callable[..., torch.Tensor]
    ssm_state_update: Callable[..., torch.Tensor]


TORCH_MODEL_OPS = ModelOps("torch", rms_norm, rope_cache_attention, linear, linear_silu_mul,
                           argmax, ssm_state_update)


@functools.cache
def triton_model_ops(batch_invariant: bool = True) -> ModelOps:
    """The Triton model ops; ``batch_invariant=False`` keeps torch's (cuBLAS) matmul, whose
    algorithm depends on the number of rows (faster at some sizes, not batch invariant)."""
    # imports triton (the optional gpu extra): CUDA only
    from verispec.ops import triton_model, triton_ssm

    if batch_invariant:
        return ModelOps(
            "triton", triton_model.rms_norm, triton_model.rope_cache_attention,
            triton_model.linear, triton_model.linear_silu_mul,
            triton_model.argmax, triton_ssm.ssm_state_update)

    def cublas_linear_silu_mul(x, weight, bias=None):
        return triton_model.silu_mul(linear(x, weight, bias))

    return ModelOps(
        "triton", triton_model.rms_norm, triton_model.rope_cache_attention,
        linear, cublas_linear_silu_mul, triton_model.argmax, triton_ssm.ssm_state_update)

"""Compiled CPU kernels: bfloat16 and float32 linear layers and attention over the KV cache,
each computing a row the same way whatever the number of rows (the CPU path's batch invariance,
docs/design.md §12: MKL and oneDNN choose their kernels, and so a row's summation order, by the
number of rows), and a fast bfloat16 matmul for CPUs whose torch has none.

On an x86-64 CPU with AVX2 but without AVX-512 (oneDNN's bfloat16 path then refuses to run,
``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False), torch's bfloat16 ``F.linear`` falls
back to a generic kernel that is compute-bound: it widens every weight for every input row, and
a few rows take several times as long as streaming the weights once (docs/benchmarks.md).
``bf16_linear.c`` widens the weights in registers and accumulates in
float32 with FMA, reading each weight row once for up to four input rows, so the product is
memory-bound again up to a verify step's few rows.
No maintained library offers this for bfloat16 on such CPUs, hence the few dozen lines of C.

Where the CPU has bfloat16 instructions, ``bf16_linear_avx512.c`` does the same with AVX-512
BF16 or AMX (``bf16_isas()``; runtime dispatch by CPU and weight shape, never by row count).
With AMX a verify step's few rows cost about one (docs/benchmarks.md compares the three
kernels). torch's own bfloat16
matmul (oneDNN, also AMX) picks its kernel by the number of rows, so it cannot give one row's
bits in every batch.

Decode attention: torch's SDPA over one query per request is nearly all fixed overhead, plus
casts of q and the output around it (the cache is float32);
``attention.c`` reads keys and values where they lie in the cache, for bfloat16 or float32
q (``cache_attention``).

RMS norm (``rms_norm.c``): torch's fused CPU layer norm opens a parallel region for every call
of more than one row; the kernel normalises a step's few rows on the calling thread.

A grammar's token masks (``elementwise.c``): torch's masked fill of a 49 k-token row took
~100-190 us on the 2-core machine, the kernel skips a word of 32 allowed tokens with one test.

Sampling (``sampling.c``): the counter-based generator's ten rounds and the uniforms made of
their words for the sampling noise (``verispec.ops.philox``), in a loop instead of ~90 numpy and
torch array operations a draw; the exponential race (``verispec.ops.sampling.race``) and the
rejection sampler after p (``verispec.ops.rejection``) in one call each instead of ~25 and ~45
small torch ops, each of which pays its cache misses again after every forward of a running
engine (docs/benchmarks.md).

The C files are built on first use and loaded by ``verispec.ops.cpu_build``. Which ops run
them is ``ops.backend``'s choice (``Backend.cpu``; off with ``VERISPEC_CPU_KERNELS=0``); where
they cannot be built ``available()`` is False and the callers use torch's ops (batch invariant
by running them one row at a time: ``ops.cpu_linear.invariant_linear``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from verispec.ops.cpu_build import load as _library


@functools.cache
def torch_has_fast_bf16() -> bool:
    """torch's own bfloat16 CPU matmul is fast here (oneDNN with AVX-512 bfloat16 or
    AVX-NE-CONVERT instructions); without it torch widens every weight for every row."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


BF16_ISAS = ("avx2", "avx512_bf16", "amx")  # the bfloat16 matmul kernels, slowest first


@functools.cache
def bf16_isas() -> tuple[str, ...]:
    """The bfloat16 matmul kernels this CPU runs (``BF16_ISAS`` order; empty where the kernels
    are not built). The last one is ``bf16_linear``'s choice."""
    library = _library()
    if library is None:
        return ()
    level = library.bf16_isa() if hasattr(library, "bf16_isa") else 0
    return BF16_ISAS[: level + 1]


def available() -> bool:
    """True where ``bf16_linear`` can run: the kernel is built and loaded."""
    return _library() is not None


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                isa: str | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bfloat16 CPU tensors through the compiled kernel
    (float32 accumulation, one rounding to bfloat16); only where ``available()``. ``weight``
    [out, in] and ``bias`` must be contiguous (model parameters are); any x of [..., in].

    The kernel is the fastest this CPU runs (``bf16_isas()``; ``isa`` picks another, for
    tests): AMX where the weight's shape suits it (in_features % 32, out_features % 16),
    else AVX-512 BF16, else AVX2. The choice depends on the CPU and the weight's shape only, never
    on the number of rows (batch invariance)."""
    out_features, in_features = weight.shape
    isas = bf16_isas()
    isa = isas[-1] if isa is None else isa
    if isa not in isas:
        raise ValueError(f"bf16_linear: isa={isa!r} does not run here (this CPU: {isas})")
    if isa == "amx" and (in_features % 32 or out_features % 16):
        isa = "avx512_bf16"
    kernel = {"avx2": "bf16_linear", "avx512_bf16": "bf16_linear_avx512",
              "amx": "bf16_linear_amx"}[isa]
    if not x.is_contiguous():
        x = x.contiguous()
    y = x.new_empty((*x.shape[:-1], out_features))
    if y.numel() == 0:
        return y
    status = getattr(_library(), kernel)(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        y.data_ptr(), x.numel() // in_features, out_features, in_features,
        torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"bf16_linear: no scratch memory for a {tuple(x.shape)} input")
    return y


@functools.cache
def quant_available() -> bool:
    """True where ``quant_linear`` runs: the kernels are built and the CPU has AVX-512."""
    library = _library()
    return library is not None and hasattr(library, "quant_linear") and library.quant_isa() == 1


def library() -> ctypes.CDLL | None:
    """The loaded kernels (None where they are not built), for modules that declare their own
    C functions' signatures (``ops.cpu_decoder``)."""
    return _library()


def quant_linear(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None, out_features: int, bits: int,
                 group: int) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in float32 for weights in ``verispec.ops.quant``'s layouts (see
    ``ops/quant_linear.c``): x [M, K] float32 contiguous, qs and scales contiguous,
    ``out_features`` a multiple of 64; only where ``quant_available()``. Returns [M, N]."""
    rows, in_features = x.shape
    y = torch.empty((rows, out_features))
    if rows:
        _library().quant_linear(
            x.data_ptr(), qs.data_ptr(), scales.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), rows, out_features,
            in_features, bits, group, torch.get_num_threads(), scales.dtype == torch.float16)
    return y


def f32_linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 CPU tensors of a few rows through the compiled
    kernel (each weight row read once for up to four input rows); only where ``available()``.
    ``weight`` and ``bias`` contiguous, any x of [..., in]."""
    out_features, in_features = weight.shape
    if not x.is_contiguous():
        x = x.contiguous()
    y = x.new_empty((*x.shape[:-1], out_features))
    _library().f32_linear(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        y.data_ptr(), x.numel() // in_features, out_features, in_features,
        torch.get_num_threads())
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dimension as HF Llama computes it
    (float32 statistics; bfloat16 rounded before and after the product with ``weight``), for
    bfloat16 or float32 CPU ``x`` and a contiguous ``weight`` of x's dtype; only where
    ``available()``. A few rows run on the calling thread (no parallel region to wait for)."""
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    if y.numel():
        _library().rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(),
                            x.dtype == torch.bfloat16, x.numel() // n, n, eps,
                            torch.get_num_threads())
    return y


def silu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    """``F.silu(gate) * up`` of float32 CPU ``gate_up`` [..., >= 2 n] (gate in [0, n), up in
    [n, 2 n); the last dimension contiguous, rows evenly strided), with the C library's exp: the
    compiled decoder's activation (``ops/elementwise.c``), so the per-op path gives its bits.
    Returns [..., n] float32. Only where ``available()``."""
    rows = gate_up.reshape(-1, gate_up.shape[-1]) if gate_up.dim() != 2 else gate_up
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < 2 * n):
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n))
    if out.numel():
        _library().silu_mul(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], n,
                            torch.get_num_threads())
    return out.view(*gate_up.shape[:-1], n)


def token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                  token_ids: torch.Tensor | None = None) -> None:
    """``verispec.ops.options.apply_token_bitmask`` on float32 CPU ``logits`` whose last
    dimension is contiguous, in place (``ops/elementwise.c``). Only where ``available()``."""
    rows = rows.to(torch.int64).contiguous()
    bitmask = bitmask.to(torch.int32).contiguous()
    if token_ids is not None:
        token_ids = token_ids.to(torch.int64).contiguous()
    _library().token_bitmask(logits.data_ptr(), logits.stride(0), rows.data_ptr(),
                             bitmask.data_ptr(), bitmask.shape[1], rows.shape[0],
                             logits.shape[1], None if token_ids is None else token_ids.data_ptr())


def philox_uniform(seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor,
                   word: torch.Tensor | None = None) -> torch.Tensor:
    """``verispec.ops.philox``'s uniforms (float32 in (0, 1)) of counters ``(c0, c1, 0, 0)``
    under key ``seed`` (broadcastable int64 CPU tensors, shape S): with ``word`` (int64, 0..3,
    broadcastable) that word's, shape S; without, all four, shape [*S[:-1], 4 * S[-1]] (counter
    i's word w at 4 i + w, the vocabulary layout). Only where ``available()``."""
    tensors = (seed, c0, c1) if word is None else (seed, c0, c1, word)
    tensors = [t.contiguous() for t in torch.broadcast_tensors(*tensors)]
    shape = tensors[0].shape
    if word is None:
        out = torch.empty((*shape[:-1], 4 * shape[-1]) if shape else (4,), dtype=torch.float32)
    else:
        out = torch.empty(shape, dtype=torch.float32)
    if tensors[0].numel():
        _library().philox_uniform(tensors[0].data_ptr(), tensors[1].data_ptr(),
                                  tensors[2].data_ptr(),
                                  None if word is None else tensors[3].data_ptr(),
                                  tensors[0].numel(), out.data_ptr())
    return out


def race_rows(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
              streams: torch.Tensor, block: int, block_noise_index: int) -> torch.Tensor:
    """``verispec.ops.sampling.race`` of float32 CPU ``weights`` [R, V] (last dimension
    contiguous) with int64 ``seeds``, ``positions`` and ``streams`` [R]: [R] int64 token ids.
    Only where ``available()``."""
    num_rows, vocab_size = weights.shape
    if vocab_size > 1 and weights.stride(1) != 1:
        weights = weights.contiguous()
    seeds, positions, streams = (t.to(torch.int64).contiguous()
                                 for t in (seeds, positions, streams))
    out = torch.empty(num_rows, dtype=torch.int64)
    if num_rows and vocab_size:
        _library().race_rows(weights.data_ptr(), num_rows, vocab_size, weights.stride(0),
                             seeds.data_ptr(), positions.data_ptr(), streams.data_ptr(), block,
                             block_noise_index, out.data_ptr(), torch.get_num_threads())
    return out


def _rows(t: torch.Tensor | None) -> tuple[int | None, int]:
    """(data pointer, row stride) of a [R, V] tensor with a contiguous last dimension; (None, 0)
    for None."""
    return (None, 0) if t is None else (t.data_ptr(), t.stride(0))


def rejection_rows(probs: torch.Tensor | None, draft_probs: torch.Tensor | None,
                   argmax_rows: torch.Tensor | None, draft_ids: torch.Tensor,
                   cu_num_draft_tokens: torch.Tensor, vocab_size: int,
                   temperature: torch.Tensor, all_greedy: bool, seeds: torch.Tensor,
                   positions: torch.Tensor, streams: tuple[int, int, int], width: int,
                   block: int, block_noise_index: int) -> torch.Tensor | None:
    """``verispec.ops.rejection.rejection_sample`` from the processed probabilities on (CPU
    tensors): ``probs`` [N + B, V] float32 (None when every request is greedy), ``draft_probs``
    [N, V] float32 or None (the one-hot rule), ``argmax_rows`` [N + B] int64 (None when no
    request is greedy); ``streams``: the acceptance, residual and sample streams. Returns
    token_ids [B, width] int32, or None where a draft id lies outside [-1, V). Only where
    ``available()``."""
    probs, draft_probs = (None if t is None or t.numel() == 0 else
                          t if t.stride(-1) == 1 else t.contiguous() for t in (probs, draft_probs))
    draft_ids, cu, seeds, positions = (t.to(torch.int64).contiguous() for t in (
        draft_ids, cu_num_draft_tokens, seeds, positions))
    argmax_rows = None if argmax_rows is None else argmax_rows.to(torch.int64).contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    batch_size = cu.shape[0] - 1
    out = torch.empty((batch_size, width), dtype=torch.int32)
    scratch = torch.empty((batch_size, vocab_size) if probs is not None else (0,),
                          dtype=torch.float32)
    status = _library().rejection_rows(
        *_rows(probs), *_rows(draft_probs),
        None if argmax_rows is None else argmax_rows.data_ptr(), draft_ids.data_ptr(),
        cu.data_ptr(), batch_size, vocab_size, temperature.data_ptr(), all_greedy,
        seeds.data_ptr(), positions.data_ptr(), (ctypes.c_int64 * 3)(*streams), width, block,
        block_noise_index, scratch.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return None if status else out


def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, kv_len: int, attn_mask: torch.Tensor | None,
                    is_causal: bool, scale: float) -> torch.Tensor:
    """Attention of ``q`` [B, S, heads, d] (bfloat16 or float32, each token's heads contiguous,
    tokens evenly strided as in a view of a [B, S, *, d] tensor) over positions ``[0, kv_len)``
    of paged float32 caches [num_blocks, block_size, kv_heads, d], request b's through
    ``block_tables[b]`` (int32, rows contiguous): every position, or ``attn_mask`` [B, 1, S,
    kv_len] bool (True = attend), or causal with the S tokens last.
    Returns [B, S, heads, d] in q's dtype; a token that sees no row gets zeros. Only where
    ``available()``."""
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if q.stride(3) != 1 or q.stride(2) != head_dim or q.stride(0) != seq * q.stride(1):
        q = q.contiguous()
    out = q.new_empty((batch, seq, num_heads, head_dim))
    mask = None if attn_mask is None else attn_mask.contiguous()
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("cache_attention: block_tables must be int32 with contiguous rows")
    if block_tables.shape[0] != batch:
        raise ValueError(f"cache_attention: {block_tables.shape[0]} block-table rows for a batch "
                         f"of {batch}")
    status = _library().cache_attention(
        q.data_ptr(), q.stride(1), out.data_ptr(), q.dtype == torch.bfloat16,
        k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        k_cache.shape[1], batch, seq, num_heads, num_kv_heads, head_dim, kv_len,
        None if mask is None else mask.data_ptr(), is_causal, scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"cache_attention: no scratch memory for {kv_len} cache rows")
    return out

"""Triton backend: the GPU twins of ``sampling.py`` and ``rejection.py``, one signature each.

Imported only when the ``triton`` backend is chosen (``verispec.ops.backend``). A call looks up
a *plan* by what its inputs look like (shapes, strides, dtypes, devices, 16-byte alignment, the
flags, the current stream): on the first call of a kind the plan checks the inputs, sizes the
workspace and compiles the kernels; every later call of that kind allocates its output and
launches the compiled kernels directly, skipping Triton's per-call argument binding. Nothing
depends on values, so no call syncs with the device and each can be captured in a CUDA graph
(make a first call of each kind before capturing). For the same inputs and seeds the ops return
the same token ids as the torch twins; see those for the contracts.

Launches: ``_rows_kernel`` (``triton_kernels_rows``) then ``_finish_kernel``, after
``_mask_stats_kernel`` when a request has top-k, top-p or min-p (``triton_kernels_masks``); how a
plan launches a compiled kernel, and the device facts it reads, are ``triton_launch``.
"""

from __future__ import annotations

import torch
import triton

from verispec.ops import philox, sampling
from verispec.ops.rejection import check_draft_token_ids, check_inputs, check_rows
from verispec.ops.triton_kernels_finish import _finish_kernel
from verispec.ops.triton_kernels_masks import _mask_stats_kernel, _probs_kernel
from verispec.ops.triton_kernels_rows import _rows_kernel
from verispec.ops.triton_launch import _Launch, _pdl, _signature, _sm_count, _stream

_MAX_CHUNK = 4096  # tokens per statistics chunk: 16 KB of float32 logits
# tokens per program of the finishing race: of the chosen block (every token scored exactly;
# 8 programs per 4096-token block), or of a rejected row's whole residual (full rule)
_BLOCK_RACE_CHUNK = 512
_ROW_RACE_CHUNK = 2048
# batch size from which a statistics program reads two chunks of its row: below it one chunk
# decides a row sooner, above it two halve the programs (docs/benchmarks.md); with synthetic
# rates, where most programs skip, from 32
_GROUP_BATCH = 128
_GROUP_BATCH_SYNTHETIC = 32
# warps per program of the mask search (one program per row, a latency-bound loop of passes
# over the row): 32 where the rows fit one per SM, so each pass over a row is short; 8 beyond
# (docs/benchmarks.md)
_MASK_WARPS = 8
_MASK_WIDE_WARPS = 32
_MAX_PLANS = 4096


def _p2(n: int, least: int = 2) -> int:
    """The next power of two >= n (and >= least)."""
    return max(least, 1 << (max(int(n), 1) - 1).bit_length())


def _aligned(n: int) -> int:
    """``n`` 4-byte elements rounded up to 128 bytes: every scratch segment starts aligned, so
    the pointers a plan hands its kernels specialize the same way for every shape (else each
    new alignment pattern compiles the kernels again)."""
    return triton.cdiv(n, 32) * 32


def chunk_size(vocab_size: int) -> int:
    """Tokens per statistics chunk: 4096, or the whole row when smaller; never more than a
    block of the two-level race (``sampling.SAMPLING_BLOCK``), so that no chunk straddles two."""
    return min(_MAX_CHUNK, _p2(vocab_size, 16), sampling.SAMPLING_BLOCK)


def _as(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Per-request parameters in the kernels' dtype (a copy of B values at most)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


_PLANS: dict = {}
# Scratch by (device, stream): float32 and int32 scratch, and int32 counters that are zero
# between launches (each kernel resets what it used). Grown by doubling; a plan keeps the
# buffers it was made with (a captured graph may use them), so buffers outgrown stay alive as
# long as plans hold them.
_SCRATCH: dict = {}


def _scratch(device: torch.device, stream: int, num_f: int, num_i: int, num_sync: int):
    """(float32, int32, zeroed int32 counters) buffers of at least these sizes."""
    have = _SCRATCH.get((device, stream))
    sizes = (num_f, num_i, num_sync)
    if have is None or any(t.numel() < n for t, n in zip(have, sizes)):
        old = have or (None, None, None)
        have = tuple(
            t if t is not None and t.numel() >= n else
            torch.zeros(_p2(max(n, 2 * (0 if t is None else t.numel())), 1024),
                        dtype=dtype, device=device)
            for t, n, dtype in zip(old, sizes, (torch.float32, torch.int32, torch.int32)))
        _SCRATCH[(device, stream)] = have
    return have


def _mask_warps(num_programs: int, device: torch.device) -> int:
    """Warps per program of the mask search: wide where the programs fit one per SM (always
    under the interpreter, which has no SMs), else narrow."""
    if device.type != "cuda":
        return _MASK_WIDE_WARPS
    index = torch.cuda.current_device() if device.index is None else device.index
    return _MASK_WIDE_WARPS if num_programs <= _sm_count(index) else _MASK_WARPS


class _Plan:
    """The launches of one kind of call: mask search (if any mask), rows, finish.

    ``num_drafts is None``: sampling (one bonus row per request, no drafts)."""

    def __init__(self, logits: torch.Tensor, batch_size: int, rows_per_request: int,
                 num_draft_tokens: int | None, masks: tuple, has_draft_probs: bool,
                 synthetic: bool, all_greedy: bool, bonus_stream: int, draft_probs_stride: int,
                 out: torch.Tensor):
        vocab_size = logits.shape[1]
        # rows laid out in the scratch: every request's k + 1 (a call's row count, which varies
        # with the drafts, is not part of a plan; the kernels find rows from cu_num_draft_tokens)
        num_rows = batch_size * rows_per_request
        device = logits.device
        no_drafts = num_draft_tokens is None
        self.masked = not all_greedy and any(t is not None for t in masks)
        self.batch_size, self.out_shape, self.out_dtype = batch_size, out.shape, out.dtype
        self.device = device
        block = sampling.SAMPLING_BLOCK
        chunk = chunk_size(vocab_size)
        num_chunks = triton.cdiv(vocab_size, chunk)
        num_blocks = triton.cdiv(vocab_size, block)
        block_span = min(block, _p2(vocab_size))
        race_chunk = min(_ROW_RACE_CHUNK if has_draft_probs else _BLOCK_RACE_CHUNK, block_span)
        num_programs = (triton.cdiv(vocab_size, race_chunk) if has_draft_probs
                        else block_span // race_chunk)
        group = 2 if batch_size >= (_GROUP_BATCH_SYNTHETIC if synthetic else _GROUP_BATCH) else 1
        plane = num_rows * num_chunks
        f_sizes = [_aligned(n) for n in (3 * plane, 2 * num_rows, 2 * batch_size * num_programs,
                                          8 * num_rows)]
        i_sizes = [_aligned(n) for n in (plane, 2 * num_rows, batch_size * num_programs)]
        f32, i32, sync = _scratch(device, _stream(logits), sum(f_sizes), sum(i_sizes),
                                  num_rows + 2 * batch_size)
        self.part_f, row_f, race_f, self.row_stats = f32[:sum(f_sizes)].split(f_sizes)
        part_i, row_i, race_i = i32[:sum(i_sizes)].split(i_sizes)
        rows_p2 = _p2(rows_per_request)
        blocks = dict(BLOCK=block, NUM_BLOCKS=num_blocks, NB_P2=_p2(num_blocks))
        self.has = has = dict(zip(("HAS_TOP_K", "HAS_TOP_P", "HAS_MIN_P"),
                                  (self.masked and t is not None for t in masks)))
        pdl = _pdl(logits.get_device())
        flags = dict(NO_DRAFTS=no_drafts, ALL_GREEDY=all_greedy, SYNTHETIC=synthetic,
                     MASKED=self.masked, PDL=pdl, **has)
        self.mask_search = None
        if self.masked:
            warps = _mask_warps(batch_size * rows_per_request, device)
            self.mask_search = _Launch(
                _mask_stats_kernel, (batch_size, rows_per_request), warps,
                dict(TILE=min(1024 * warps, _p2(vocab_size)), NO_DRAFTS=no_drafts, **has),
                logits_stride=logits.stride(0), row_stats_ptr=self.row_stats,
                vocab_size=vocab_size)
        # warps: 8 for a 4096-token chunk below batch 8 (the latency of one program matters),
        # 4 from it on (more programs in flight)
        warps = max(1, min(8, chunk // 512)) // (1 if batch_size < 8 else 2)
        self.rows = _Launch(
            _rows_kernel, (batch_size * rows_per_request * triton.cdiv(num_chunks, group),),
            max(1, warps),
            dict(ROWS=rows_per_request, NUM_CHUNKS=num_chunks, CHUNK=chunk,
                 NC_P2=_p2(num_chunks), GROUP=group, ROWS_P2=rows_p2,
                 HAS_DRAFT_PROBS=has_draft_probs, **blocks, **flags),
            logits_stride=logits.stride(0), draft_probs_stride=draft_probs_stride,
            row_stats_ptr=self.row_stats, part_f_ptr=self.part_f, part_i_ptr=part_i,
            row_i_ptr=row_i, row_f_ptr=row_f, sync_ptr=sync, batch_size=batch_size,
            num_rows=num_rows, vocab_size=vocab_size, bonus_stream=bonus_stream)
        self.finish = _Launch(
            _finish_kernel, (batch_size, num_programs), 4,
            dict(NUM_PROGRAMS=num_programs, NP_P2=_p2(num_programs), RACE_CHUNK=race_chunk,
                 HAS_DRAFT_PROBS=has_draft_probs, BLOCK_SPAN=block_span, ROWS_P2=rows_p2,
                 WIDTH_P2=_p2(rows_per_request), **blocks, **flags), launch_pdl=pdl,
            logits_stride=logits.stride(0), draft_probs_stride=draft_probs_stride,
            row_stats_ptr=self.row_stats, row_i_ptr=row_i, row_f_ptr=row_f, race_f_ptr=race_f,
            race_i_ptr=race_i, sync_ptr=sync, token_ids_stride=out.stride(0) if out.dim() == 2
            else 1, batch_size=batch_size, num_rows=num_rows, vocab_size=vocab_size,
            width=out.shape[1] if out.dim() == 2 else 1, bonus_stream=bonus_stream)

    def __call__(self, stream: int, logits, draft_ids, cu, draft_probs, temperature, masks,
                 seeds, positions, rates) -> torch.Tensor:
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        temperature = _as(temperature, torch.float32)
        if self.mask_search is not None:
            top_k, top_p, min_p = masks
            self.mask_search(stream, logits, cu, temperature,
                             temperature if top_k is None else top_k,
                             temperature if top_p is None else _as(top_p, torch.float32),
                             temperature if min_p is None else _as(min_p, torch.float32))
        seeds, positions = _as(seeds, torch.int64), _as(positions, torch.int64)
        self.rows(stream, logits, draft_ids, cu, draft_probs, temperature, seeds, positions, rates)
        self.finish(stream, logits, draft_ids, cu, draft_probs, temperature, seeds, positions,
                    rates, out)
        return out


def _plan(key: tuple, make) -> _Plan:
    if len(_PLANS) >= _MAX_PLANS:  # a bound on the plans (each holds a few launch templates)
        _PLANS.clear()
    plan = _PLANS[key] = make()
    return plan


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_num_draft_tokens: int,
    synthetic_conditional_rates: torch.Tensor | None = None,
    all_greedy: bool = False,
    *,
    check_draft_ids: bool = True,
) -> torch.Tensor:
    """Verify the drafts of a batch; the contract is ``verispec.ops.rejection.rejection_sample``.

    Returns
    -------
    token_ids : [B, max_num_draft_tokens + 1] int32, -1 padded.
    """
    inputs = (target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature,
              top_k, top_p, min_p, seeds, positions, synthetic_conditional_rates)
    stream = _stream(target_logits)
    # one plan serves every draft count of a batch size (rows laid out for k + 1 a request)
    num_draft_tokens = draft_token_ids.shape[0]
    key = (max_num_draft_tokens, all_greedy, sampling.SAMPLING_BLOCK, stream,
           num_draft_tokens == 0, _signature(target_logits, True),
           _signature(draft_token_ids, True), _signature(cu_num_draft_tokens),
           _signature(draft_probs, True), *map(_signature, inputs[4:]))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(key, lambda: _verify_plan(*inputs, max_num_draft_tokens, all_greedy))
    batch_size = plan.batch_size
    if (target_logits.shape[0] != num_draft_tokens + batch_size
            or num_draft_tokens > batch_size * max_num_draft_tokens
            or (draft_probs is not None and draft_probs.shape[0] != num_draft_tokens)):
        check_rows(target_logits, draft_token_ids, draft_probs, batch_size,
                   max_num_draft_tokens, contiguous=True)
    if check_draft_ids:
        check_draft_token_ids(draft_token_ids, target_logits.shape[1])
    if batch_size == 0:
        return torch.empty(plan.out_shape, dtype=plan.out_dtype, device=target_logits.device)
    if num_draft_tokens == 0:  # keep a valid pointer; nothing is read from it
        draft_token_ids = cu_num_draft_tokens
    return plan(stream, target_logits, draft_token_ids, cu_num_draft_tokens,
                target_logits if draft_probs is None else draft_probs, temperature,
                (top_k, top_p, min_p), seeds, positions,
                temperature if synthetic_conditional_rates is None
                else _as(synthetic_conditional_rates, torch.float32))


def _verify_plan(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature,
                 top_k, top_p, min_p, seeds, positions, rates, max_num_draft_tokens: int,
                 all_greedy: bool) -> _Plan:
    """Check one kind of ``rejection_sample`` call and make its plan."""
    check_inputs(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature,
                 top_k, top_p, min_p, seeds, positions, max_num_draft_tokens, rates,
                 contiguous=True)
    device = target_logits.device
    batch_size = cu_num_draft_tokens.shape[0] - 1
    masks = (None, None, None) if all_greedy else (top_k, top_p, min_p)
    out = torch.empty((batch_size, max_num_draft_tokens + 1), dtype=torch.int32, device=device)
    return _Plan(target_logits, batch_size, max_num_draft_tokens + 1, draft_token_ids.shape[0],
                 masks, draft_probs is not None, rates is not None, all_greedy,
                 philox.SAMPLE_STREAM, 0 if draft_probs is None else draft_probs.stride(0), out)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: int = philox.SAMPLE_STREAM,
    all_greedy: bool = False,
) -> torch.Tensor:
    """Sample one token per row; the contract is ``verispec.ops.sampling.sample``.

    Returns
    -------
    [R] int64 token ids.
    """
    return _sample(logits, temperature, top_k, top_p, min_p, seeds, positions, int(stream),
                   all_greedy)[0]


def _sample(logits, temperature, top_k, top_p, min_p, seeds, positions, stream: int,
            all_greedy: bool) -> tuple[torch.Tensor, _Plan]:
    """``sample``'s token ids and its plan."""
    inputs = (logits, temperature, top_k, top_p, min_p, seeds, positions)
    cuda_stream = _stream(logits)
    key = ("sample", stream, all_greedy, sampling.SAMPLING_BLOCK, cuda_stream,
           *map(_signature, inputs))
    plan = _PLANS.get(key)
    if plan is None:
        num_rows = sampling.check_logits("logits", logits, contiguous=True)
        sampling.check_params(num_rows, logits.device, temperature, top_k, top_p, min_p, seeds,
                              positions, contiguous=True)
        masks = (None, None, None) if all_greedy else (top_k, top_p, min_p)
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        plan = _plan(key, lambda: _Plan(logits, num_rows, 1, None, masks, False, False,
                                        all_greedy, stream, 0, out))
    if plan.batch_size == 0:
        return torch.empty(plan.out_shape, dtype=plan.out_dtype, device=logits.device), plan
    return plan(cuda_stream, logits, temperature, temperature, logits, temperature,
                (top_k, top_p, min_p), seeds, positions, temperature), plan


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The processed distribution p of each row; the contract is
    ``verispec.ops.sampling.processed_probs``.

    Returns
    -------
    [R, V] float32.
    """
    zeros = torch.zeros(logits.shape[0] if logits.dim() == 2 else 0, dtype=torch.int64,
                        device=logits.device)  # seeds and positions of a sample left unused
    return _sample_with_probs(logits, temperature, top_k, top_p, min_p, zeros, zeros,
                              philox.SAMPLE_STREAM)[1]


def sample_draft(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft sampler; the contract is ``verispec.ops.sampling.sample_draft``.

    Returns
    -------
    (draft_token_ids [R] int64, draft_probs [R, V] float32 = q)
    """
    return _sample_with_probs(logits, temperature, None, None, None, seeds, positions,
                              philox.DRAFT_STREAM)


def _sample_with_probs(logits, temperature, top_k, top_p, min_p, seeds, positions,
                       stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample and p: the sampling launches' row statistics (the mask search's, or the
    softmax partials of the chunks) give p chunk by chunk."""
    ids, plan = _sample(logits, temperature, top_k, top_p, min_p, seeds, positions, stream,
                        False)
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if logits.shape[0] > 0:
        num_rows, vocab_size = logits.shape
        chunk = chunk_size(vocab_size)
        num_chunks = triton.cdiv(vocab_size, chunk)
        _probs_kernel[(num_rows, num_chunks)](
            logits, logits.stride(0), _as(temperature, torch.float32), plan.row_stats,
            plan.part_f, probs, probs.stride(0), num_rows, vocab_size, NUM_CHUNKS=num_chunks,
            NC_P2=_p2(num_chunks), CHUNK=chunk, MASKED=plan.masked,
            num_warps=max(1, min(8, chunk // 512)), **plan.has)
    return ids, probs


__all__ = ["chunk_size", "processed_probs", "rejection_sample", "sample", "sample_draft"]

"""Triton backend: the GPU twins of ``sampling.py`` and ``rejection.py``, one signature each.

Imported only when the ``triton`` backend is chosen (``verispec.ops.backend``). The wrappers check
shapes, dtypes and contiguity, allocate fixed-size outputs and workspaces (sizes depend on shapes
only: no host sync, capturable in a CUDA graph) and launch the kernels of
``triton_kernels`` / ``triton_kernels_masks``. For the same inputs and seeds they return the same
token ids as the torch twins; see those for the contracts. A first call per shape class compiles
the kernels: make it before capturing a CUDA graph.
"""

from __future__ import annotations

import functools
import inspect

import torch

from verispec.ops import philox, sampling
from verispec.ops.backend import Backend
from verispec.ops.triton_kernels import INTERPRET, _stats_kernel
from verispec.ops.triton_kernels_decide import _decide_kernel
from verispec.ops.triton_kernels_fused import _fused_kernel
from verispec.ops.triton_kernels_masks import _mask_stats_kernel, _probs_kernel
from verispec.ops.triton_kernels_race import _race_kernel
from verispec.ops.triton_kernels_rows import _rows_kernel

_LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_CHUNK = 4096  # tokens per program: 16 KB of float32 logits
# the one-program-per-row threshold search of the sampling masks: warps per program, and the
# tokens of each loop step (1024 per warp: 32 per thread). Its loop is latency-bound, so where
# the rows fit one program per SM a program of 32 warps keeps four times the bytes in flight
# (benchmarks/bench_masks.py, H100, V = 151 936, k = 4, B = 8 = 40 rows, the one-hot op, 8 ->
# 32 warps: top-k 50 516 -> 363 us, top-p 0.9 1316 -> 918, min-p 108 -> 88, all three 4233 ->
# 2350); at B = 64 (320 rows) the search alone was the same or slower in one sweep (top-p 2524
# -> 2862 us), as programs of 32 warps take a whole SM each
_MASK_WARPS = 8
_MASK_WIDE_WARPS = 32
_LAG = 8  # requests between a request's statistics and its race in the one-launch kernel
_SMALL_BATCH = 16  # below this batch size the one-launch kernel favours latency
# one-hot rule: the last requests of the grid, whose block races helpers split; H100, k = 4,
# B = 32: 16 of them 42.4 us at V = 128 256, 32 39.9 (46.6 and 46.0 at V = 151 936); the same
# within 0.3 us at B >= 64, while helpers for every request cost 3-4 % at B >= 128
_TAIL = 32
_HELPERS = 16  # helper programs per such race, each racing 1/16 of the block
# the row-ordered one-hot kernel (triton_kernels_rows): the rows at the end of its grid, whose
# _ROW_HELPERS helper programs each decide the row and race 1/_ROW_HELPERS of its block; and
# the most rows per request its state word holds. H100, k = 4, one-hot, two runs, V = 128 256
# / 151 936, against the same 96 tail rows decided by their last statistics program and raced
# by 16 helpers: B = 32 32.9-33.0 / 38.5-38.6 vs 33.2-33.3 / 38.3-38.4 us (16 inputs timed
# one by one: the same on each), B = 48 40.9-41.1 / 49.2 vs 41.7-41.8 / 48.7-48.9, B = 64
# 52.4-52.5 / 59.1-59.4 vs 53.6 / 59.9-60.1, B = 128 84.6-84.8 / 100.8-101.0 vs 85.6 /
# 101.0-101.5, B = 256 163.8-164.0 / 190.9-191.3 vs 164.4-166.5 / 191.7-192.7. 16 helpers that
# decide: B = 32 35.2 / 42.2 (each polls and decides, so 16 of them per row hold more slots for
# longer). 64 tail rows at B = 32: 32.7 / 37.1 median over 16 inputs, but 35.5-36.1 on three
# of them, where a rejection in the third pass is raced in one program late in the stream
_ROW_TAIL = 96
_ROW_HELPERS = 8
_MAX_ROWS = 16
# batch sizes from which the one-hot rule reads rows in order (H100, k = 4, 80 % acceptance,
# bench_rejection, V = 151 936 / 128 256: B = 16 27.8 / 24.3 us rows in order vs 29.6 / 26.4
# requests in order, B = 32 39.3 / 34.7 vs 45.7 / 39.8, B = 64 63.3 / 55.8 vs 78.7 / 67.5);
# with synthetic rates, which leave one row per request to read, from 8 (B = 1 13.0 vs 12.6
# us, B = 8 17.7 vs 22.5, B = 32 29.6 vs 45.2)
_ROW_ORDER_BATCH = 16
_ROW_ORDER_BATCH_SYNTHETIC = 8
# batch size from which each statistics program of the row-ordered kernel reads two chunks of
# its row (one count, one early-word check per 32 KB): H100, k = 4, one-hot, V = 151 936 /
# 128 256, one run: B = 64 59.8 / 54.1 us vs 63.7 / 53.6 with one chunk, B = 128 106.5 / 89.7 vs
# 124.5 / 97.9, B = 256 202.5 / 173.3 vs 242.0 / 194.3 (another run: B = 96 82.9 / 71.8 vs 93.2
# / 75.0); slower at B = 32 (41.2 / 37.3 vs 39.7 / 34.9) and 48, where a program's longer wait
# decides a row after more of the next row's programs have started. With synthetic rates (only
# the final row read: most programs skip) from B = 32: B = 32 24.9 / 26.3 us vs 27.5 / 26.5,
# B = 64 36.9 / 32.8 vs 43.8 / 38.1, B = 256 111.5 / 97.1 vs 143.7 / 120.9 (B = 16 23.0 / 22.2
# vs 19.4 / 17.7)
_ROW_GROUP_BATCH = 64
_ROW_GROUP_BATCH_SYNTHETIC = 32


def _p2(n: int, least: int = 16) -> int:
    """The next power of two >= n (and >= least)."""
    return max(least, 1 << (max(int(n), 1) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per program: 4096 (16 KB of float32 logits), or the whole row when smaller."""
    return min(_MAX_CHUNK, _p2(vocab_size))


def _blocks(vocab_size: int) -> dict:
    """The two-level race's block constexprs (``sampling.race``): tokens per block, blocks per
    row, and that count as a power of two."""
    block = sampling.SAMPLING_BLOCK
    num_blocks = _cdiv(vocab_size, block)
    return dict(BLOCK=block, NUM_BLOCKS=num_blocks, NB_P2=_p2(num_blocks, 2))


def _fit_chunk(chunk: int, vocab_size: int) -> int:
    """A chunk of a row with more than one block of the race never straddles two blocks: at most
    ``sampling.SAMPLING_BLOCK`` tokens (both are powers of two)."""
    return min(chunk, sampling.SAMPLING_BLOCK) if vocab_size > sampling.SAMPLING_BLOCK else chunk


def launch_plan(batch_size: int, vocab_size: int, has_draft_probs: bool,
                chunk: int | None = None, race_chunk: int | None = None,
                fused: bool | None = None) -> tuple[bool, int, int]:
    """What ``rejection_sample`` launches without masks: (one launch, tokens per statistics
    program, tokens per race program). One launch by default for the one-hot rule (its deciding
    program samples from one block of the final row), three for the full rule (measured faster
    at large batches). Chunks never straddle a block of the two-level race (``_fit_chunk``)."""
    if fused is None:
        fused = not has_draft_probs
    chunk = _fit_chunk(chunk or default_chunk_size(vocab_size), vocab_size)
    if fused and not has_draft_probs and race_chunk is None:
        # tokens per step of the deciding program's race over a block: the whole chunk while the
        # batch is small (a shorter chain), a quarter from _SMALL_BATCH on (fewer registers, so
        # more statistics programs in flight); H100, V = 151 936: B = 1 10.7 us in a CUDA graph
        # with 4096 (13.8 with 1024), B = 128 152 us with 1024 (161 with 4096)
        race_chunk = chunk if batch_size < _SMALL_BATCH else max(16, chunk // 4)
    return fused, chunk, _fit_chunk(_race_chunk(chunk, race_chunk), vocab_size)


def _race_chunk(chunk: int, race_chunk: int | None = None) -> int:
    """Tokens per program of the recovered-token race: half a statistics chunk (at least 16)
    unless given; the race costs more arithmetic per token, so it is spread over more programs."""
    return race_chunk or max(16, chunk // 2)


def _num_warps(chunk: int) -> int:
    return max(1, min(8, chunk // 512))


def _fused_num_warps(chunk: int, batch_size: int) -> int:
    """Half the warps of the three launches from batch 8 on: 32 tokens of a 4096-token chunk
    per thread keep more loads in flight (H100, one-hot rule, B = 256: 286 us with 4 warps, 316
    with 8); all of them below, where the deciding program's race is the critical path."""
    return _num_warps(chunk) if batch_size < 8 else max(1, _num_warps(chunk) // 2)


def _check_1d(name: str, t: torch.Tensor, size: int, dtypes: tuple, device) -> None:
    if t.dim() != 1 or t.shape[0] != size:
        raise ValueError(f"{name} must be 1-D of length {size}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_rows(name: str, t: torch.Tensor, rows: int, vocab_size: int, dtypes: tuple, device):
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] != vocab_size:
        raise ValueError(f"{name} must be [{rows}, {vocab_size}], got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if rows > 0 and vocab_size > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along the vocabulary (stride(1) == 1)")


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-request parameters in the kernels' dtype (a copy of B values at most)."""
    return t if t.dtype == dtype else t.to(dtype)


def _specialization(arg) -> tuple:
    """What Triton specializes a compiled kernel on, for one runtime argument."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool):
        return bool, arg
    if isinstance(arg, int):
        return int, arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31
    return type(arg),


# Compiled kernels by (kernel, constants, specialization): Triton's own cache, keyed so that a
# hit skips its per-call argument binding (tens of microseconds of host time per launch).
_COMPILED: dict = {}


def _launch(kernel, grid: tuple, args: tuple, num_warps: int, **constexprs) -> None:
    """``kernel[grid](*args, num_warps=num_warps, **constexprs)``, cheaper on the host."""
    if INTERPRET:
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return
    key = (kernel, num_warps, tuple(constexprs.items()), tuple(map(_specialization, args)))
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, num_warps=num_warps, **constexprs)
        _COMPILED[key] = (compiled, _arg_positions(kernel, constexprs))
        return
    compiled, positions = entry
    it = iter(args)
    full = [value if is_const else next(it) for is_const, value in positions]
    grid = tuple(grid) + (1,) * (3 - len(grid))
    compiled[grid](*full)


def _arg_positions(kernel, constexprs: dict) -> list:
    """For each parameter of ``kernel``, in order, what a compiled launch passes there: (True,
    value) for a constexpr, given or left at its default, else (False, None), the next of the
    runtime arguments."""
    params = inspect.signature(kernel.fn).parameters.values()
    return [(True, constexprs[p.name]) if p.name in constexprs
            else (True, p.default) if _is_constexpr(p) and p.default is not p.empty
            else (False, None) for p in params]


def _is_constexpr(param: inspect.Parameter) -> bool:
    """Whether a kernel parameter is annotated ``tl.constexpr`` (a string in modules with
    postponed annotations, as Triton reads it too)."""
    annotation = param.annotation
    return annotation is not param.empty and "constexpr" in (
        annotation if isinstance(annotation, str) else repr(annotation))


_INT = (torch.int32, torch.int64)
_FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class _Params:
    """Per-request sampling parameters, checked and in kernel dtypes; masks present or not."""

    def __init__(self, batch_size, device, temperature, top_k, top_p, min_p, seeds, positions,
                 all_greedy: bool):
        _check_1d("temperature", temperature, batch_size, _FLOAT, device)
        self.temperature = _as(temperature, torch.float32)  # [B] float32
        self.top_k = self.top_p = self.min_p = None
        if not all_greedy:
            if top_k is not None:
                _check_1d("top_k", top_k, batch_size, _INT, device)
                self.top_k = top_k  # [B] int
            if top_p is not None:
                _check_1d("top_p", top_p, batch_size, _FLOAT, device)
                self.top_p = _as(top_p, torch.float32)  # [B] float32
            if min_p is not None:
                _check_1d("min_p", min_p, batch_size, _FLOAT, device)
                self.min_p = _as(min_p, torch.float32)  # [B] float32
        if seeds is not None:
            _check_1d("seeds", seeds, batch_size, _INT, device)
            _check_1d("positions", positions, batch_size, _INT, device)
            seeds, positions = _as(seeds, torch.int64), _as(positions, torch.int64)
        self.seeds = seeds  # [B] int64
        self.positions = positions  # [B] int64
        self.masked = not all_greedy and any(
            t is not None for t in (self.top_k, self.top_p, self.min_p)
        )

    def mask_flags(self) -> dict:
        return dict(HAS_TOP_K=self.top_k is not None, HAS_TOP_P=self.top_p is not None,
                    HAS_MIN_P=self.min_p is not None)


class _Workspace:
    """Per-call scratch: two allocations, sized by shapes only (capturable in a CUDA graph);
    every segment starts on a 16-byte boundary."""

    def __init__(self, num_rows: int, batch_size: int, num_chunks: int, num_race_chunks: int,
                 masked: bool, device, residual_sums: bool = False,
                 race_slots: int | None = None, row_tokens: int = 0, draft_logits: int = 0):
        part = num_rows * num_chunks
        race = batch_size * num_race_chunks if race_slots is None else race_slots
        f_sizes = [(4 if residual_sums else 3) * part, 2 * race, num_rows * 8 if masked else 0,
                   8 * batch_size, draft_logits]
        i_sizes = [2 * part, race, batch_size, 2 * batch_size, row_tokens]
        f32 = torch.empty(sum(map(_pad4, f_sizes)), dtype=torch.float32, device=device)
        i32 = torch.empty(sum(map(_pad4, i_sizes)), dtype=torch.int32, device=device)
        self.num_chunks = num_chunks
        self.num_race_chunks = num_race_chunks
        # [3 or 4, num_rows, NUM_CHUNKS]: m_c, S_c, raw max (, S_c without the row's draft);
        # [2, B, NUM_RACE_CHUNKS];  [num_rows, 8];  [B, 8];  [num_rows] (row-ordered kernel:
        # each draft row's logit of its draft)
        self.part_f, self.race_f, self.row_stats, self.record_f, self.draft_logits = _segments(
            f32, f_sizes)
        if not masked:
            self.row_stats = f32  # unused
        # [2, num_rows, NUM_CHUNKS]: raw argmax, race winner;  [B, NUM_RACE_CHUNKS];  [B];  [B, 2]
        # [B, ROWS] (row-ordered kernel): each candidate row's token
        self.part_i, self.race_i, self.counter, self.record, self.row_tokens = _segments(
            i32, i_sizes)


# Counters of the one-launch one-hot kernel, by (device, stream): zero between launches (the
# kernel's last program of each request resets its counter), so no launch zeroes them first.
# Launches on one stream run in order; a CUDA graph keeps the buffer of the stream it was
# captured on (graphs replayed concurrently must be captured on different streams). Buffers
# outgrown are kept: a captured graph may still use them.
_COUNTERS: dict = {}
_OUTGROWN: list = []


def _self_resetting_counters(device: torch.device, size: int) -> torch.Tensor:
    """``size`` int32 counters, all zero, for a launch on the current stream of ``device``."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, torch.cuda.current_stream(device).cuda_stream) if not INTERPRET else device
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < size:
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = torch.zeros(_p2(size, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def _segments(buffer: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    padded = [_pad4(size) for size in sizes]
    return [part[:size] for part, size in zip(buffer.split(padded), sizes)]


def _mask_warps(num_programs: int, device: torch.device) -> int:
    """Warps per program of the mask search: the wide program where ``num_programs`` fit one
    per SM (always under the interpreter, which has no SMs), else the narrow one."""
    if device.type != "cuda":
        return _MASK_WIDE_WARPS
    index = torch.cuda.current_device() if device.index is None else device.index
    return _MASK_WIDE_WARPS if num_programs <= _sm_count(index) else _MASK_WARPS


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _row_statistics(logits, cu, params: _Params, batch_size: int, rows_per_request: int,
                    no_drafts: bool, chunk: int, bonus_stream: int, all_greedy: bool,
                    bonus_race: bool, race_chunk: int | None = None) -> _Workspace:
    """Launch the mask search (if any mask) and the chunk statistics."""
    num_rows, vocab_size = logits.shape
    ws = _Workspace(num_rows, batch_size, _cdiv(vocab_size, chunk),
                    _cdiv(vocab_size, _fit_chunk(_race_chunk(chunk, race_chunk), vocab_size)),
                    params.masked, logits.device)
    flags = params.mask_flags()
    dummy = params.temperature
    if params.masked:
        warps = _mask_warps(batch_size * rows_per_request, logits.device)
        _launch(
            _mask_stats_kernel, (batch_size, rows_per_request),
            (logits, logits.stride(0), cu, params.temperature,
             dummy if params.top_k is None else params.top_k,
             dummy if params.top_p is None else params.top_p,
             dummy if params.min_p is None else params.min_p,
             ws.row_stats, vocab_size),
            warps, TILE=min(1024 * warps, _p2(vocab_size)), NO_DRAFTS=no_drafts, **flags,
        )
    seeds = dummy if params.seeds is None else params.seeds
    positions = dummy if params.positions is None else params.positions
    _launch(
        _stats_kernel, (batch_size * rows_per_request, ws.num_chunks),
        (logits, logits.stride(0), cu, params.temperature, seeds, positions, ws.row_stats,
         ws.part_f, ws.part_i, ws.counter, num_rows, vocab_size, bonus_stream),
        _num_warps(chunk), ROWS=rows_per_request, NUM_CHUNKS=ws.num_chunks, CHUNK=chunk,
        NO_DRAFTS=no_drafts, ALL_GREEDY=all_greedy, BONUS_RACE=bonus_race, MASKED=params.masked,
        **flags,
    )
    return ws


def _verify(logits, draft_token_ids, cu, draft_probs, params: _Params, batch_size: int,
            max_num_draft_tokens: int, rates, all_greedy: bool, bonus_stream: int,
            token_ids: torch.Tensor, chunk: int | None,
            race_chunk: int | None = None) -> tuple[torch.Tensor, _Workspace]:
    """Shared launch of rejection sampling (and of sampling: no drafts, one bonus row each).
    Returns the output and the workspace (its row statistics serve ``_write_probs``)."""
    num_rows, vocab_size = logits.shape
    no_drafts = draft_token_ids is None
    chunk = _fit_chunk(chunk or default_chunk_size(vocab_size), vocab_size)
    ws = _row_statistics(logits, cu, params, batch_size, max_num_draft_tokens + 1, no_drafts,
                         chunk, bonus_stream, all_greedy, True, race_chunk)
    dummy = params.temperature
    draft_ids = dummy if no_drafts else draft_token_ids
    q = logits if draft_probs is None else draft_probs
    q_stride = 0 if draft_probs is None else draft_probs.stride(0)
    out_stride = token_ids.stride(0) if token_ids.dim() == 2 else 1
    width = token_ids.shape[1] if token_ids.dim() == 2 else 1
    flags = params.mask_flags()
    rows_p2 = _p2(max_num_draft_tokens + 1, 2)
    _launch(
        _decide_kernel, (batch_size,),
        (logits, logits.stride(0), draft_ids, cu, q, q_stride, params.temperature,
         params.seeds, params.positions, dummy if rates is None else rates, ws.row_stats,
         ws.part_f, ws.part_i, ws.record, ws.record_f, token_ids, out_stride, num_rows, width,
         bonus_stream),
        4, NUM_CHUNKS=ws.num_chunks, NC_P2=_p2(ws.num_chunks, 2), ROWS_P2=rows_p2,
        WIDTH_P2=rows_p2, CHUNK=chunk, **_blocks(vocab_size), NO_DRAFTS=no_drafts,
        ALL_GREEDY=all_greedy,
        HAS_DRAFT_PROBS=draft_probs is not None, SYNTHETIC=rates is not None,
        MASKED=params.masked, **flags,
    )
    if not (no_drafts or all_greedy):  # else no request has a recovered token to race
        race_chunk = _fit_chunk(_race_chunk(chunk, race_chunk), vocab_size)
        _launch(
            _race_kernel, (batch_size, ws.num_race_chunks),
            (logits, logits.stride(0), draft_ids, cu, q, q_stride, params.temperature,
             params.seeds, params.positions, ws.record, ws.record_f, ws.race_f, ws.race_i,
             ws.counter, token_ids, out_stride, batch_size, vocab_size, width),
            _num_warps(race_chunk), RACE_CHUNK=race_chunk, NUM_RACE_CHUNKS=ws.num_race_chunks,
            NRC_P2=_p2(ws.num_race_chunks, 2), WIDTH_P2=rows_p2, **_blocks(vocab_size),
            HAS_DRAFT_PROBS=draft_probs is not None, **flags,
        )
    return token_ids, ws


def _verify_fused(logits, draft_token_ids, cu, draft_probs, params: _Params, batch_size: int,
                  max_num_draft_tokens: int, rates, token_ids: torch.Tensor, chunk: int | None,
                  race_chunk: int | None, lag: int | None,
                  num_warps: int | None) -> torch.Tensor:
    """Rejection sampling in one launch (``triton_kernels_fused``): no masks, drafts present,
    not all greedy; chunk sizes as ``launch_plan``. The one-hot rule's counters need no
    zeroing launch (``_self_resetting_counters``); the full rule's are zeroed first."""
    num_rows, vocab_size = logits.shape
    one_hot = draft_probs is None
    _, chunk, race_chunk = launch_plan(batch_size, vocab_size, not one_hot, chunk, race_chunk,
                                       True)
    num_chunks = _cdiv(vocab_size, chunk)
    blocks = _blocks(vocab_size)
    block_span = min(num_chunks * chunk, blocks["BLOCK"])
    # the one-hot rule samples inside the deciding program (no race programs, no lag), but for
    # the last ``num_tail`` requests of the grid, whose block race ``helpers`` programs split
    num_race_chunks = 0 if one_hot else _cdiv(vocab_size, race_chunk)
    helper_tile = _p2(_cdiv(block_span, _HELPERS))
    helpers = _cdiv(block_span, helper_tile) if one_hot else 0
    num_tail = min(_TAIL, batch_size) if helpers else 0
    ws = _Workspace(num_rows, batch_size, num_chunks,
                    helpers + 4 if one_hot else num_race_chunks, False, logits.device,
                    residual_sums=one_hot)
    if one_hot:  # [3, B] counters, decisions, helper counters, each reset by its last user
        sync = _self_resetting_counters(logits.device, 3 * batch_size)
    else:  # [3, B]: counters, decisions, race counters
        sync = torch.zeros(3 * batch_size, dtype=torch.int32, device=logits.device)
    rows = max_num_draft_tokens + 1
    rows_p2 = _p2(rows, 2)
    lag = 0 if one_hot else max(0, min(_LAG if lag is None else lag, batch_size - 1))
    q = logits if one_hot else draft_probs
    q_stride = 0 if one_hot else draft_probs.stride(0)
    _launch(
        _fused_kernel,
        ((batch_size + lag) * (rows * num_chunks + num_race_chunks) + num_tail * helpers,),
        (logits, logits.stride(0), draft_token_ids, cu, q, q_stride, params.temperature,
         params.seeds, params.positions, params.temperature if rates is None else rates,
         ws.part_f, ws.part_i, ws.record, ws.record_f, ws.race_f, ws.race_i, sync, token_ids,
         token_ids.stride(0), batch_size, num_rows, vocab_size, token_ids.shape[1],
         philox.SAMPLE_STREAM, lag, num_tail),
        num_warps or _fused_num_warps(chunk, batch_size), ROWS=rows, NUM_CHUNKS=num_chunks,
        CHUNK=chunk,
        NC_P2=_p2(num_chunks, 2), ROWS_P2=rows_p2, WIDTH_P2=rows_p2, RACE_CHUNK=race_chunk,
        NUM_RACE_CHUNKS=num_race_chunks, NRC_P2=_p2(num_race_chunks, 2), **blocks,
        BLOCK_SPAN=block_span, RACE_SUB=min(chunk, race_chunk), HAS_DRAFT_PROBS=not one_hot,
        SYNTHETIC=rates is not None, HELPERS=helpers, HELPER_TILE=helper_tile,
        HELPERS_P2=_p2(helpers, 2),
    )
    return token_ids


def _verify_rows(logits, draft_token_ids, cu, params: _Params, batch_size: int,
                 max_num_draft_tokens: int, rates, token_ids: torch.Tensor, chunk: int | None,
                 race_chunk: int | None, num_warps: int | None,
                 chunks_per_program: int | None) -> torch.Tensor:
    """The one-hot rule in one launch, rows in order (``triton_kernels_rows``): no masks,
    drafts present, not all greedy, at most ``_MAX_ROWS`` rows per request; chunk sizes as
    ``launch_plan``. Its counters need no zeroing launch (``_self_resetting_counters``)."""
    num_rows, vocab_size = logits.shape
    _, chunk, race_chunk = launch_plan(batch_size, vocab_size, False, chunk, race_chunk, True)
    num_chunks = _cdiv(vocab_size, chunk)
    blocks = _blocks(vocab_size)
    block_span = min(num_chunks * chunk, blocks["BLOCK"])
    helper_tile = _p2(_cdiv(block_span, _ROW_HELPERS))
    helpers = _cdiv(block_span, helper_tile)
    rows = max_num_draft_tokens + 1
    num_tail = min(_ROW_TAIL, batch_size * rows)
    ws = _Workspace(num_rows, batch_size, num_chunks, 0, False, logits.device,
                    residual_sums=True, race_slots=num_tail * helpers,
                    row_tokens=batch_size * rows, draft_logits=num_rows)
    # row counters, request states, tail helper counters, early candidate words; each reset
    # by its last user
    sync = _self_resetting_counters(logits.device, num_rows + 2 * batch_size + num_tail)
    rows_p2 = _p2(rows, 2)
    group = chunks_per_program or (2 if batch_size >= (
        _ROW_GROUP_BATCH if rates is None else _ROW_GROUP_BATCH_SYNTHETIC) else 1)
    _launch(
        _rows_kernel, (batch_size * rows * _cdiv(num_chunks, group) + num_tail * helpers,),
        (logits, logits.stride(0), draft_token_ids, cu, params.temperature, params.seeds,
         params.positions, params.temperature if rates is None else rates, ws.part_f,
         ws.part_i, ws.race_f, ws.race_i, ws.row_tokens, ws.draft_logits, sync, token_ids,
         token_ids.stride(0), batch_size, num_rows, vocab_size, token_ids.shape[1],
         philox.SAMPLE_STREAM, num_tail),
        num_warps or _fused_num_warps(chunk, batch_size), ROWS=rows, NUM_CHUNKS=num_chunks,
        CHUNK=chunk, NC_P2=_p2(num_chunks, 2), ROWS_P2=rows_p2, WIDTH_P2=rows_p2, **blocks,
        BLOCK_SPAN=block_span, RACE_SUB=min(chunk, race_chunk), SYNTHETIC=rates is not None,
        HELPERS=helpers, HELPER_TILE=helper_tile, HELPERS_P2=_p2(helpers, 2), GROUP=group,
    )
    return token_ids


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
    chunk_size: int | None = None,
    race_chunk_size: int | None = None,
    fused: bool | None = None,
    lag: int | None = None,
    num_warps: int | None = None,
    row_order: bool | None = None,
    chunks_per_program: int | None = None,
) -> torch.Tensor:
    """Verify the drafts of a batch; the contract is ``verispec.ops.rejection.rejection_sample``.

    ``chunk_size`` (tokens per program of the row statistics) and ``race_chunk_size`` (of the
    final-row race), powers of two >= 16, are tuning knobs for tests and benchmarks; the
    defaults suit the vocabulary size. ``fused`` picks the one-launch kernel (``None``: where it
    applies and is the faster, see ``launch_plan``), ``lag`` its distance between a
    request's statistics and its race, in requests, and ``num_warps`` its warps per program.
    ``row_order`` picks, for the one-hot rule in one launch, the kernel that reads rows in order
    and skips those after a known rejection (``triton_kernels_rows``; the default where it
    applies) over the one that reads whole requests in order (``triton_kernels_fused``), and
    ``chunks_per_program`` how many chunks of a row each of its statistics programs reads
    (``None``: 2 from batch ``_ROW_GROUP_BATCH`` on, synthetic rates from
    ``_ROW_GROUP_BATCH_SYNTHETIC``, else 1). A knob given where the plan cannot honour it (the
    one-launch knobs where masks or ``all_greedy`` take three launches, ``lag`` with rows in
    order, ``chunks_per_program`` without) raises ``ValueError`` rather than being dropped.

    Returns
    -------
    token_ids : [B, max_num_draft_tokens + 1] int32, -1 padded.
    """
    if chunks_per_program is not None and (
            isinstance(chunks_per_program, bool) or not isinstance(chunks_per_program, int)
            or chunks_per_program < 1):
        raise ValueError(
            f"chunks_per_program must be an int >= 1 or None, got {chunks_per_program!r}")
    device = target_logits.device
    batch_size = cu_num_draft_tokens.shape[0] - 1
    num_draft_tokens = draft_token_ids.shape[0]
    vocab_size = target_logits.shape[1] if target_logits.dim() == 2 else -1
    _check_rows("target_logits", target_logits, num_draft_tokens + batch_size, vocab_size,
                _LOGITS_DTYPES, device)
    _check_1d("draft_token_ids", draft_token_ids, num_draft_tokens, _INT, device)
    _check_1d("cu_num_draft_tokens", cu_num_draft_tokens, batch_size + 1, _INT, device)
    if draft_probs is not None:
        _check_rows("draft_probs", draft_probs, num_draft_tokens, vocab_size, (torch.float32,),
                    device)
    rates = None
    if synthetic_conditional_rates is not None:
        rates = _as(synthetic_conditional_rates, torch.float32)  # [>= k] float32
        if rates.dim() != 1 or rates.shape[0] < max_num_draft_tokens or rates.device != device:
            raise ValueError(
                f"synthetic_conditional_rates must be 1-D with >= {max_num_draft_tokens} "
                f"entries on {device}, got {tuple(rates.shape)} on {rates.device}")
        rates = rates.contiguous()
    params = _Params(batch_size, device, temperature, top_k, top_p, min_p, seeds, positions,
                     all_greedy)
    width = max_num_draft_tokens + 1
    token_ids = torch.empty((batch_size, width), dtype=torch.int32, device=device)
    if batch_size == 0:
        return token_ids
    if num_draft_tokens == 0:  # keep a valid pointer; nothing is read from it
        draft_token_ids = cu_num_draft_tokens
    one_launch = launch_plan(batch_size, target_logits.shape[1], draft_probs is not None,
                             fused=fused)[0] and not (all_greedy or params.masked)
    _check_knobs(fused, one_launch, all_greedy, params.masked, lag=lag, num_warps=num_warps,
                 row_order=row_order, chunks_per_program=chunks_per_program)
    if one_launch:
        row_order_fits = draft_probs is None and max_num_draft_tokens < _MAX_ROWS
        if row_order and not row_order_fits:
            raise ValueError(
                f"row_order=True needs the one-hot rule (draft_probs None) and at most "
                f"{_MAX_ROWS - 1} drafts per request, got draft_probs "
                f"{'given' if draft_probs is not None else 'None'} and max_num_draft_tokens "
                f"{max_num_draft_tokens}")
        if row_order is None:
            row_order = row_order_fits and batch_size >= (
                _ROW_ORDER_BATCH if rates is None else _ROW_ORDER_BATCH_SYNTHETIC)
        if row_order:
            if lag is not None:
                raise ValueError(f"lag={lag!r} applies to the request-ordered kernel only, "
                                 "not to rows in order (row_order=False picks it)")
            return _verify_rows(target_logits, draft_token_ids, cu_num_draft_tokens, params,
                                batch_size, max_num_draft_tokens, rates, token_ids, chunk_size,
                                race_chunk_size, num_warps, chunks_per_program)
        if chunks_per_program is not None:
            raise ValueError(
                f"chunks_per_program={chunks_per_program!r} applies to rows in order only (the "
                "one-hot rule, row_order=True or the default from batch "
                f"{_ROW_ORDER_BATCH}), not to the request-ordered kernel")
        return _verify_fused(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs,
                             params, batch_size, max_num_draft_tokens, rates, token_ids,
                             chunk_size, race_chunk_size, lag, num_warps)
    return _verify(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, params,
                   batch_size, max_num_draft_tokens, rates, all_greedy, philox.SAMPLE_STREAM,
                   token_ids, chunk_size, race_chunk_size)[0]


def _check_knobs(fused, one_launch: bool, all_greedy: bool, masked: bool, **knobs) -> None:
    """A tuning knob of the one-launch kernels given where three launches run: an error that
    says why, not a silently dropped value (row_order=False is always honoured)."""
    if one_launch:
        return
    if all_greedy or masked:
        why = ("sampling masks (top_k, top_p, min_p) run the three launches" if masked
               else "all_greedy runs the three launches")
    else:
        why = "the three launches run (fused=False, or the full rule's default)"
    if fused:
        raise ValueError(f"fused={fused!r} cannot apply: {why}")
    for name, value in knobs.items():
        if value is not None and not (name == "row_order" and value is False):
            raise ValueError(f"{name}={value!r} applies to the one-launch kernels only: {why}")


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
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Sample one token per row; the contract is ``verispec.ops.sampling.sample``.

    Returns
    -------
    [R] int64 token ids.
    """
    num_rows, vocab_size = logits.shape
    _check_rows("logits", logits, num_rows, vocab_size, _LOGITS_DTYPES, logits.device)
    params = _Params(num_rows, logits.device, temperature, top_k, top_p, min_p, seeds,
                     positions, all_greedy)
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return token_ids
    return _verify(logits, None, params.temperature, None, params, num_rows, 0, None,
                   all_greedy, int(stream), token_ids, chunk_size)[0]


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The processed distribution p of each row; the contract is
    ``verispec.ops.sampling.processed_probs``.

    Returns
    -------
    [R, V] float32.
    """
    num_rows, vocab_size = logits.shape
    _check_rows("logits", logits, num_rows, vocab_size, _LOGITS_DTYPES, logits.device)
    params = _Params(num_rows, logits.device, temperature, top_k, top_p, min_p, None, None,
                     False)
    probs = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return probs
    _write_probs(logits, params, probs, chunk_size)
    return probs


def _write_probs(logits, params: _Params, probs, chunk_size, workspace=None) -> None:
    num_rows, vocab_size = logits.shape
    chunk = chunk_size or default_chunk_size(vocab_size)
    if workspace is None:
        workspace = _row_statistics(logits, params.temperature, params, num_rows, 1, True, chunk,
                                    0, False, False)
    ws = workspace
    _launch(
        _probs_kernel, (num_rows, ws.num_chunks),
        (logits, logits.stride(0), params.temperature, ws.row_stats, ws.part_f, probs,
         probs.stride(0), num_rows, vocab_size),
        _num_warps(chunk), NUM_CHUNKS=ws.num_chunks, NC_P2=_p2(ws.num_chunks, 2), CHUNK=chunk,
        MASKED=params.masked, **params.mask_flags(),
    )

def sample_draft(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft sampler; the contract is ``verispec.ops.sampling.sample_draft``.

    Returns
    -------
    (draft_token_ids [R] int64, draft_probs [R, V] float32 = q)
    """
    num_rows, vocab_size = logits.shape
    _check_rows("logits", logits, num_rows, vocab_size, _LOGITS_DTYPES, logits.device)
    params = _Params(num_rows, logits.device, temperature, None, None, None, seeds, positions,
                     False)
    ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    probs = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return ids, probs
    # one pass of row statistics serves the race (draft stream) and the written q
    ids, ws = _verify(logits, None, params.temperature, None, params, num_rows, 0, None, False,
                      philox.DRAFT_STREAM, ids, chunk_size)
    _write_probs(logits, params, probs, chunk_size, ws)
    return ids, probs


BACKEND = Backend(
    name="triton",
    processed_probs=processed_probs,
    sample=sample,
    sample_draft=sample_draft,
    rejection_sample=rejection_sample,
)

__all__ = ["BACKEND", "default_chunk_size", "launch_plan", "processed_probs", "rejection_sample",
           "sample", "sample_draft"]

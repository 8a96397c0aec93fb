"""Tensor parallelism of a Llama-family decoder (Megatron-style; docs/design.md §14).

Each of ``size`` ranks holds:

- a slice of the attention heads: q heads ``[rank * H / size, (rank + 1) * H / size)`` and the
  KV heads they read (split the same way, or one replicated KV head per rank when there are
  fewer KV heads than ranks), so QKV is column-parallel and each rank's KV cache holds its own
  heads only;
- a slice of the FFN: gate|up column-parallel, down row-parallel;
- a slice of the vocabulary: rows ``[rank * S, (rank + 1) * S)`` of the embedding and the LM
  head, ``S = ceil(vocab_size / size)`` (rows past the vocabulary are zero).

The output and down projections then hold partial sums: one all-reduce each adds them. The
embedding is a masked lookup of the rank's rows plus an all-reduce (one rank adds the row, the
others zeros: exact). The LM head's logits are gathered, so every rank holds the same
``[rows, vocab_size]`` float32 logits and samples the same tokens from the same Philox
streams: no rank waits on another's host (docs/design.md §14 says why).

With two ranks an all-reduce adds two partials, ``a + b == b + a``: a row's bits do not depend
on the batch, as on one device. TP = 2 and TP = 1 differ by rounding (each partial is rounded to
the model dtype before the sum).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _symmetric_memory as symm_mem

from verispec.models.config import ModelConfig

logger = logging.getLogger("verispec")


class PeerAllReduce:
    """All-reduce of small tensors over NVLink peer-to-peer loads (PyTorch's symmetric memory,
    one-shot: each rank reads every peer's buffer and adds them in rank order, so every rank
    gets the same bits). A decode step's all-reduces are a few KiB to a few hundred KiB, where
    NCCL's latency dominates; larger ones (prefill) go to NCCL. Never multicast (see
    ``runtime.workers.SAFE_ENV``)."""

    MAX_BYTES = 1 << 20

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.group_name = group.group_name
        self.dtype = dtype
        self.buffer = symm_mem.empty(self.MAX_BYTES // dtype.itemsize, dtype=dtype,
                                     device=device)
        symm_mem.rendezvous(self.buffer, group)
        self._op = torch.ops.symm_mem.one_shot_all_reduce_out

    @classmethod
    def create(cls, group: Any, device: torch.device, dtype: torch.dtype
               ) -> PeerAllReduce | None:
        """One for ``group`` on ``device``, or None where symmetric memory is unavailable
        (then every all-reduce is NCCL's)."""
        try:
            comm = cls(group, device, dtype)
            probe = torch.ones(8, dtype=dtype, device=device)
            comm(probe)
            torch.cuda.synchronize(device)
            return comm
        except Exception:  # noqa: BLE001 - no peer access, an older torch: NCCL only
            return None

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() * x.element_size() <= self.MAX_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (contiguous) replaced by the sum over ranks; returns x."""
        staged = self.buffer[: x.numel()]
        staged.copy_(x.view(-1))
        self._op(staged, "sum", self.group_name, x.view(-1))
        return x


class PeerReduceNorm:
    """The all-reduce of a row-parallel projection fused with the residual add and RMSNorm that
    follow it (``ops.triton_peer``): one kernel and one cross-GPU barrier where NCCL or
    ``PeerAllReduce`` plus the norm take three kernels. For partial sums of up to
    ``HALF_BYTES`` (a decode or verify step); larger ones take the unfused path, which gives
    the same bits at two ranks (two partials, one rounding either way)."""

    HALF_BYTES = 2 << 20

    def __init__(self, group: Any, device: torch.device) -> None:
        from verispec.ops import triton_peer  # imports triton: only on CUDA

        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.flags_offset = 2 * self.HALF_BYTES
        size = self.flags_offset + self.world * triton_peer.PROGRAMS * 4
        self.buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group)
        shift = self.buffer.data_ptr() - handle.buffer_ptrs[self.rank]
        self.bases = torch.tensor([p + shift for p in handle.buffer_ptrs], dtype=torch.int64,
                                  device=device)
        self.counters = torch.zeros(triton_peer.PROGRAMS + 1, dtype=torch.int32,
                                    device=device)
        self.buffer.zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group)
        self._op = triton_peer.peer_reduce_rms_norm

    @classmethod
    def create(cls, group: Any, device: torch.device, dtype: torch.dtype
               ) -> PeerReduceNorm | None:
        """One for ``group``, checked on a probe (every rank's rows summed), or None where
        peer-to-peer symmetric memory or the kernel is unavailable."""
        try:
            fused = cls(group, device)
            rank, world = fused.rank, fused.world
            hidden = 256
            x = torch.full((3, hidden), float(rank + 1), dtype=dtype, device=device)
            residual = torch.zeros_like(x)
            weight = torch.ones(hidden, dtype=dtype, device=device)
            for _ in range(3):  # both halves of the buffer
                residual.zero_()
                fused(x, weight, 1e-6, residual)
            torch.cuda.synchronize(device)
            expected = world * (world + 1) / 2
            if not (bool((residual == expected).all()) and int(fused.counters[-1]) == 0):
                return None
            return fused
        except Exception:  # noqa: BLE001 - no peer access, no Triton: the unfused path
            return None

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.numel() * x.element_size() <= self.HALF_BYTES

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor) -> torch.Tensor:
        return self._op(x, residual, weight, eps, self.bases, self.counters, self.rank,
                        self.world, self.HALF_BYTES, self.flags_offset)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (``size`` 1: no parallelism)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None = the default group
    peer: PeerAllReduce | None = None  # small all-reduces over peer-to-peer loads (CUDA)
    fused: PeerReduceNorm | None = None  # small all-reduces fused with the next norm (CUDA)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    # ----------------------------------------------------------------- shapes

    def check(self, config: ModelConfig) -> None:
        """ValueError naming the field when ``config`` cannot be split ``size`` ways."""
        if not self.enabled:
            return
        for name in ("num_attention_heads", "intermediate_size"):
            value = getattr(config, name)
            if value % self.size:
                raise ValueError(f"tensor_parallel_size={self.size} must divide the model's "
                                 f"{name}={value}")
        kv = config.num_key_value_heads
        if kv % self.size and self.size % kv:
            raise ValueError(f"tensor_parallel_size={self.size} must divide the model's "
                             f"num_key_value_heads={kv}, or be a multiple of it")

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's slice: its heads and FFN width (vocabulary as a whole)."""
        if not self.enabled:
            return config
        self.check(config)
        return dataclasses.replace(
            config,
            num_attention_heads=config.num_attention_heads // self.size,
            num_key_value_heads=max(1, config.num_key_value_heads // self.size),
            intermediate_size=config.intermediate_size // self.size,
        )

    def kv_head_start(self, config: ModelConfig) -> int:
        """The first (global) KV head of this rank."""
        kv = config.num_key_value_heads
        if kv >= self.size:
            return self.rank * (kv // self.size)
        return self.rank // (self.size // kv)  # replicated: size / kv ranks share a head

    def vocab_shard_size(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """This rank's vocabulary rows ``[start, end)`` (end may pass the vocabulary: zeros)."""
        shard = self.vocab_shard_size(vocab_size)
        return self.rank * shard, (self.rank + 1) * shard

    # ----------------------------------------------------------------- collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's ``x``, in place; returns x. gloo has no bfloat16 sum: there the
        two partials are added in float32 and rounded once."""
        if not self.enabled:
            return x
        if self.peer is not None and self.peer.fits(x) and x.is_contiguous():
            return self.peer(x)
        if x.device.type == "cpu" and x.dtype not in (torch.float32, torch.float64):
            wide = x.float()
            dist.all_reduce(wide, group=self.group)
            return x.copy_(wide)
        dist.all_reduce(x, group=self.group)
        return x

    def defers_reduction(self, x: torch.Tensor) -> bool:
        """Whether a row-parallel projection's partial sums ``x`` [T, hidden] go unreduced to
        ``reduce_rms_norm`` (the fused kernel takes them), rather than through ``all_reduce``.
        The same answer for every projection of a forward."""
        return self.fused is not None and self.fused.fits(x)

    def reduce_rms_norm(self, partial: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor) -> torch.Tensor:
        """``ops.rms_norm(all_reduce(partial), weight, eps, residual)`` in one kernel (see
        ``defers_reduction``); residual updated in place."""
        return self.fused(partial, weight, eps, residual)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[..., shard] -> [..., vocab_size]: every rank's vocabulary slice, in rank order."""
        if not self.enabled:
            return logits
        shape = logits.shape
        flat = logits.reshape(-1, shape[-1]).contiguous()
        out = flat.new_empty((self.size * flat.shape[0], flat.shape[1]))
        _all_gather(out, flat, group=self.group)
        full = out.view(self.size, *flat.shape).permute(1, 0, 2).reshape(flat.shape[0], -1)
        full = full[:, :vocab_size]
        return full.reshape(*shape[:-1], vocab_size)

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor,
                  vocab_size: int) -> torch.Tensor:
        """Vocabulary-parallel lookup: [...] int64 ids -> [..., hidden] in the weight's dtype.
        Each rank looks up the ids in its rows (zeros elsewhere) and the all-reduce adds them."""
        if not self.enabled:
            return F.embedding(ids, weight)
        start = self.rank * weight.shape[0]
        local = ids - start
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.all_reduce(out)

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (start-up decisions that must agree)."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's ``value``."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = TensorParallel()
# torch >= 2.12 renamed the concatenating all-gather
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# How a CUDA engine's small all-reduces run: "fused" (default) peer-to-peer, fused with the
# norm after them where they fit, else as "peer"; "peer": peer-to-peer all-reduces, the norm
# apart; "nccl": NCCL only. A measurement switch (benchmarks/bench_tensor_parallel.py).
ALL_REDUCE_ENV = "VERISPEC_TP_ALL_REDUCE"
ALL_REDUCE_MODES = ("fused", "peer", "nccl")


def with_peer_all_reduce(tp: TensorParallel, device: torch.device,
                         dtype: torch.dtype) -> TensorParallel:
    """``tp`` with NVLink peer-to-peer all-reduces for small tensors on CUDA, fused with the
    next norm where possible (every rank decides the same way: all of them have each path or
    none)."""
    if not tp.enabled or device.type != "cuda":
        return tp
    mode = os.environ.get(ALL_REDUCE_ENV, "fused")
    if mode not in ALL_REDUCE_MODES:
        raise ValueError(f"{ALL_REDUCE_ENV}={mode!r}: expected one of {ALL_REDUCE_MODES}")
    if mode == "nccl":
        return tp
    peer = PeerAllReduce.create(dist.group.WORLD, device, dtype)
    if not tp.min_int(int(peer is not None), device):
        logger.info("tensor parallelism: NCCL all-reduces (no peer-to-peer symmetric memory)")
        return tp
    fused = PeerReduceNorm.create(dist.group.WORLD, device, dtype) if mode == "fused" else None
    if not tp.min_int(int(fused is not None), device):
        fused = None
    return dataclasses.replace(tp, peer=peer, fused=fused)

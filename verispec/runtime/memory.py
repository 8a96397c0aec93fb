"""Memory planning: how many KV blocks the pool gets (docs/design.md §13).

On CUDA (vLLM's ``gpu_memory_utilization``): after the weights are loaded, the largest eager step
runs once on a pool of a few blocks to measure its activation memory; the KV pool gets
``utilization x total - (memory in use) - (that peak)``. The CUDA graphs captured afterwards take
from the rest (``1 - utilization``). On CPU the pool is ``kv_cache_memory`` bytes (default: enough
for ``max_num_seqs`` requests at full length, at most ``DEFAULT_CPU_KV_BYTES``, and at least one).
Either way the pool must hold one request of ``max_model_len``: any other combination of flags
is refused at start with a message naming them and what would fit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from verispec.models.parallel import SINGLE, TensorParallel

GiB = 1 << 30
DEFAULT_CPU_KV_BYTES = 1 * GiB
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": GiB, "t": 1000**4, "tb": 1000**4,
          "tib": 1 << 40}


def parse_bytes(value, name: str = "kv_cache_memory") -> int:
    """An int of bytes, or a string such as ``"4GiB"``, ``"512MiB"``, ``"2e9"``; ValueError
    naming ``name`` and the value otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of bytes such as 4GiB, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{name} must be a number of bytes such as 4GiB or 512MiB, got "
                             f"{value!r}")
        number = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"{name} must be a number of bytes such as 4GiB, got {value!r}")
    if number < 1:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return number


def check_utilization(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class KVPlan:
    """The pool chosen at start-up."""

    num_blocks: int  # including the scratch block
    block_size: int
    bytes_per_block: int  # K and V of every cache sharing the blocks (target and proposer)
    max_model_len: int
    max_num_seqs: int

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_full_length_requests(self) -> int:
        """Requests of ``max_model_len`` tokens the pool holds at once."""
        return (self.num_blocks - 1) // -(-self.max_model_len // self.block_size)

    def summary(self) -> str:
        return (f"KV cache: {self.num_blocks - 1} blocks of {self.block_size} tokens = "
                f"{self.num_tokens} tokens, {self.nbytes / GiB:.2f} GiB; "
                f"{self.max_full_length_requests} requests of max_model_len="
                f"{self.max_model_len} fit at once (max_num_seqs={self.max_num_seqs})")


def blocks_for_bytes(kv_bytes: int, bytes_per_block: int) -> int:
    """Blocks (with the scratch block) that ``kv_bytes`` holds."""
    return kv_bytes // bytes_per_block


def check_plan(num_blocks: int, block_size: int, max_model_len: int, source: str) -> None:
    """ValueError when the pool cannot hold one request of ``max_model_len`` tokens."""
    need = -(-max_model_len // block_size)
    if num_blocks - 1 < need:
        fits = max(0, (num_blocks - 1) * block_size)
        raise ValueError(
            f"max_model_len={max_model_len} needs {need} KV blocks of {block_size} tokens, but "
            f"{source} gives the pool {max(0, num_blocks - 1)} blocks ({fits} tokens): lower "
            f"max_model_len to at most {fits}, or give the KV cache more memory")


def plan_kv_pool(runner, *, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 verify_rows: int, captured_query_counts: list[int], utilization: float,
                 kv_bytes: int | None, tp: TensorParallel = SINGLE) -> KVPlan:
    """Size the KV pool of ``runner`` (a ``ModelRunner``; its proposer's caches are already on
    its block tables) and allocate it for every cache on the tables: ``kv_bytes`` when given; on
    CPU the default; on CUDA what ``utilization`` of the GPU leaves after the weights, the
    largest step (``max_num_batched_tokens`` tokens, ``verify_rows`` rows of logits) and the
    CUDA graphs' outputs. Every rank of a tensor-parallel engine takes the smallest rank's pool.
    A ValueError naming the flag when no pool can work."""
    tables = runner.kv_cache.block_tables
    per_block = sum(cache.block_nbytes for cache in tables.caches)
    full = max_num_seqs * tables.max_blocks + 1  # more blocks could never be used
    if kv_bytes is not None:
        source = f"kv_cache_memory={kv_bytes}"
        num_blocks = blocks_for_bytes(kv_bytes, per_block)
    elif runner.device.type == "cpu":
        one = -(-max_model_len // tables.block_size) + 1
        num_blocks = min(full, max(one, blocks_for_bytes(DEFAULT_CPU_KV_BYTES, per_block)))
        source = "the default kv_cache_memory"
    else:
        peak = runner.profile_peak_memory(max_num_batched_tokens, verify_rows)
        graphs = runner.graph_output_bytes(captured_query_counts)
        free, total = torch.cuda.mem_get_info(runner.device)
        kv_bytes = int(utilization * total) - (total - free) - peak - graphs
        if kv_bytes < per_block * 2:
            raise ValueError(
                f"gpu_memory_utilization={utilization} leaves no memory for the KV cache: "
                f"{(total - free) / GiB:.1f} GiB in use (weights), {peak / GiB:.1f} GiB for a "
                f"step of max_num_batched_tokens={max_num_batched_tokens} and "
                f"{graphs / GiB:.1f} GiB for the CUDA graphs' outputs exceed {utilization} x "
                f"{total / GiB:.1f} GiB; raise gpu_memory_utilization or lower "
                "max_num_batched_tokens / max_num_seqs")
        num_blocks = blocks_for_bytes(kv_bytes, per_block)
        source = f"gpu_memory_utilization={utilization}"
    num_blocks = tp.min_int(num_blocks, runner.device)  # every rank holds the same pool
    check_plan(num_blocks, tables.block_size, max_model_len, source)
    num_blocks = min(num_blocks, full)
    try:
        tables.resize_pool(num_blocks)
    except torch.OutOfMemoryError:
        raise ValueError(
            f"the KV pool of {num_blocks} blocks ({num_blocks * per_block / GiB:.1f} GiB) does "
            "not fit in memory; lower kv_cache_memory or gpu_memory_utilization") from None
    return KVPlan(num_blocks, tables.block_size, per_block, max_model_len, max_num_seqs)

"""The engine's arguments (``LLM``'s parameters, documented there): their defaults and the
checks that refuse a bad value at construction with one error naming the field."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from verispec.config import SpeculativeConfig
from verispec.log import warn_once
from verispec.models.loader import parse_dtype
from verispec.runtime import memory
from verispec.runtime.kv_cache import DEFAULT_BLOCK_SIZE
from verispec.runtime.state_cache import is_hybrid

logger = logging.getLogger("verispec")

DEFAULT_MAX_NUM_SEQS = {"cuda": 256, "cpu": 8}
# Tokens one step may compute (bounds a step's activation memory). With chunked prefill the
# decodes of running requests and the prefill chunks share it, so it also bounds how long a
# long prompt stalls the running streams; without, it bounds a prefill step (more prompts wait
# for the next step; a longer single prompt still runs alone).
DEFAULT_MAX_NUM_BATCHED_TOKENS = {True: 2048, False: 8192}  # by enable_chunked_prefill
# None: a GGUF on the CPU keeps its quantised weights (models.loader.quantized_gguf: ~3x fewer
# bytes a decode step reads than bfloat16); anything else runs in bfloat16, which halves the
# bytes of float32 (docs/design.md §11). Exactness tests pin float32.
DEFAULT_DTYPE = None
SYNTHETIC_WARNING = (
    "synthetic acceptance (rejection_sample_method='synthetic'): drafts are accepted at the "
    "configured rates whatever the model says, so the output text does not follow the model; "
    "use it to benchmark speed at a chosen acceptance length, not to generate text")


def check_device(device: Any) -> torch.device:
    """The torch device for ``device``: ``"cpu"`` or ``"cuda[:i]"`` that exists here; a
    ValueError naming the value otherwise (refused at construction, not at the first step)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}: verispec runs on "
                         "CPUs and CUDA GPUs")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r}, but CUDA is not available here (torch "
                f"{torch.__version__}{' is a CPU-only build' if torch.version.cuda is None else ''}"
                "); use device='cpu'")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}, but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
        if parsed.index is None:
            parsed = torch.device("cuda", torch.cuda.current_device())
    return parsed


def feature(name: str, value: bool | None, config) -> bool:
    """Prefix caching and chunked prefill: on unless turned off; a hybrid (recurrent) model
    keeps one state per request, not per block or per chunk, so they are off there (asking
    for them is an error)."""
    hybrid = is_hybrid(config)
    if value and hybrid:
        raise ValueError(f"{name}=True: this model ({config.model_type}) has recurrent layers, "
                         "whose state is kept per request, not per KV block; leave it unset")
    return not hybrid if value is None else value


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass
class EngineArgs:
    """``LLM``'s arguments, checked, with the defaults that depend on the device filled in:
    ``device`` a ``torch.device``, ``max_num_seqs`` an int, ``kv_cache_memory`` bytes (or None),
    ``speculative_config`` a ``SpeculativeConfig`` (or None). A bad value is a ValueError
    naming the field."""

    model: str | None = None
    dtype: str | torch.dtype | None = DEFAULT_DTYPE
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    speculative_config: SpeculativeConfig | dict | None = None
    device: str | torch.device = "cpu"
    enforce_eager: bool = False
    batch_invariant: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | str | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    prefill_attention_budget: int | None = None
    tensor_parallel_size: int = 1
    load_format: str = "auto"
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.dtype is not None:
            parse_dtype(self.dtype)
        for name in ("enforce_eager", "batch_invariant", "enable_prefix_caching",
                     "enable_chunked_prefill", "async_scheduling"):
            flag = getattr(self, name)
            if not isinstance(flag, bool) and not (
                    flag is None and name in ("enable_prefix_caching", "enable_chunked_prefill",
                                              "async_scheduling")):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        self.device = check_device(self.device)
        if self.max_num_seqs is None:
            self.max_num_seqs = DEFAULT_MAX_NUM_SEQS[self.device.type]
        for name in ("max_num_seqs", "block_size"):
            check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "max_num_batched_tokens", "prefill_attention_budget"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        memory.check_utilization(self.gpu_memory_utilization)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = memory.parse_bytes(self.kv_cache_memory)
        self.speculative_config = self._speculative_config(self.speculative_config)
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError("async_scheduling=True runs plain decoding: not with a "
                             "speculative_config")

    def _speculative_config(self, config: Any) -> SpeculativeConfig | None:
        if isinstance(config, dict):
            config = (None if config.get("method") == "none"
                      else SpeculativeConfig.from_dict(config))
        elif config is not None and not isinstance(config, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a SpeculativeConfig, a dict or None, "
                             f"got {config!r}")
        if config is not None and config.is_tree:
            # token trees run in one process (docs/design.md §16); the SpeculativeDecoder
            # checks the models (attention-only target and draft)
            if self.tensor_parallel_size > 1:
                raise ValueError(f"{config.tree_key}: token trees do not run with tensor "
                                 "parallelism yet")
        if config is not None and config.is_synthetic:
            warn_once(logger, "synthetic", SYNTHETIC_WARNING)
        return config

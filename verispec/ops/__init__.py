"""Kernels with one signature per op: a torch twin (reference, CPU) and Triton (GPU).

The functions here dispatch on the device of their first tensor argument through the backend
registry (``verispec.ops.backend``); the choice is made once per device type.
"""

from __future__ import annotations

import torch

from verispec.ops import staging
from verispec.ops.backend import (
    Backend,
    few_rows_on_one_thread,
    get_backend,
    register_backend,
)
from verispec.ops.philox import ACCEPT_STREAM, DRAFT_STREAM, RESIDUAL_STREAM, SAMPLE_STREAM
from verispec.ops.rejection import PLACEHOLDER_TOKEN_ID, num_output_tokens


def to_device(data, device: torch.device | str, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """Host data (a numpy array, a list, a CPU tensor) on ``device``. To a CUDA device the copy
    goes through pinned memory and does not wait (``ops.staging``)."""
    tensor = torch.as_tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type == "cuda":
        return tensor.to(device)
    return staging.to_cuda(tensor, device)


def rejection_sample(target_logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Verify drafts; see ``verispec.ops.rejection.rejection_sample`` for the contract."""
    return get_backend(target_logits.device).rejection_sample(target_logits, *args, **kwargs)


def apply_penalties(logits: torch.Tensor, *args, **kwargs) -> None:
    """A captured step's penalties, in place: ``verispec.ops.options.apply_penalties``."""
    get_backend(logits.device).apply_penalties(logits, *args, **kwargs)


def apply_token_bitmask(logits: torch.Tensor, *args, **kwargs) -> None:
    """A grammar's token masks, in place: ``verispec.ops.options.apply_token_bitmask``."""
    get_backend(logits.device).apply_token_bitmask(logits, *args, **kwargs)


def sample(logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Sample one token per row; see ``verispec.ops.sampling.sample``."""
    return get_backend(logits.device).sample(logits, *args, **kwargs)


def sample_draft(logits: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft sampler; see ``verispec.ops.sampling.sample_draft``."""
    return get_backend(logits.device).sample_draft(logits, *args, **kwargs)


def processed_probs(logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The processed distribution p; see ``verispec.ops.sampling.processed_probs``."""
    return get_backend(logits.device).processed_probs(logits, *args, **kwargs)


__all__ = [
    "ACCEPT_STREAM",
    "DRAFT_STREAM",
    "PLACEHOLDER_TOKEN_ID",
    "RESIDUAL_STREAM",
    "SAMPLE_STREAM",
    "Backend",
    "apply_penalties",
    "apply_token_bitmask",
    "few_rows_on_one_thread",
    "get_backend",
    "num_output_tokens",
    "processed_probs",
    "register_backend",
    "rejection_sample",
    "sample",
    "sample_draft",
    "to_device",
]

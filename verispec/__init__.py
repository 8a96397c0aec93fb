"""verispec: fast, exact speculative decoding for PyTorch."""

from verispec.config import (
    SpeculativeConfig,
    acceptance_length_to_rates,
    unconditional_to_conditional_rates,
)
from verispec.engine import LLM, RequestOutput
from verispec.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "acceptance_length_to_rates",
    "unconditional_to_conditional_rates",
]

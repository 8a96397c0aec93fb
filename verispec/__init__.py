"""verispec: fast, exact speculative decoding for PyTorch."""

# First, before anything imports torch: how OpenMP threads wait, and one heap arena for every
# thread (see verispec.cpu_threads).
from verispec.cpu_threads import set_wait_policy, share_one_heap
from verispec.log import configure_logging

set_wait_policy()
share_one_heap()
configure_logging()

from verispec.config import (  # noqa: E402
    SpeculativeConfig,
    acceptance_length_to_rates,
    unconditional_to_conditional_rates,
)
from verispec.engine import LLM, CompletionOutput, RequestOutput  # noqa: E402
from verispec.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
    "acceptance_length_to_rates",
    "unconditional_to_conditional_rates",
]
